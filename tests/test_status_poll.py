"""One poll of many runs costs one agent call per container (agent verb `poll`): `ctl status` and `ctl supervise`
read every run's state and new log bytes of a container in one exec. Against real components: the `local`
transport, a real tmux server, the real agent, a real SQLite registry and the fake payload; the execs are counted
at the container's transport (controller/transport/counting.py)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from controller.commands import monitor
from controller.core.metrics import RunState
from controller.errors import ConnectionFailed, CtlError, RemoteCommandError
from controller.inventory import Container, load
from controller.lifecycle import Lifecycle
from controller.registry import Registry
from controller.remote.client import MAX_REPLY, Agent, AgentReplyError
from controller.transport.base import Transport
from controller.transport.counting import Counting
from controller.transport.local import LocalContainer
from controller.transport.pool import Pool
from tests.conftest import LocalEnv

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class CountingPool(Pool):
    """The command's pool, its container transports wrapped so each container's execs are counted."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.counted: dict[str, Counting] = {}

    def container(self, ct: Container) -> Transport:
        if ct.name not in self.counted:
            self.counted[ct.name] = Counting(super().container(ct))
        return self.counted[ct.name]


@pytest.fixture
def live3(env: LocalEnv, monkeypatch: pytest.MonkeyPatch) -> LocalEnv:
    """Three live runs and a finished one in the one container `loc`; this process sees their tmux server."""
    monkeypatch.setenv("TMUX_TMPDIR", env.env["TMUX_TMPDIR"])
    monkeypatch.setenv("CTL_STATE_DIR", env.env["CTL_STATE_DIR"])
    env.launch("done1", "--tok-s 12800 --steps 5 --interval 0.01", follow=True)
    for run in ("a1", "b1", "c1"):
        env.launch(run, "--tok-s 12800 --steps 100000 --interval 0.3")
    return env


def _wait_steps(env: LocalEnv, reg: Registry, runs: list[str], n: int = 3) -> None:
    deadline = time.monotonic() + 20
    while True:
        logs = [env.root / "workspace" / f"train_stdout_{r}.log" for r in runs]
        if all(p.exists() and p.read_text().count("step=") >= n for p in logs):
            return
        assert time.monotonic() < deadline, "runs did not log in time"
        time.sleep(0.1)


def test_status_of_three_live_runs_of_one_container_is_one_agent_call(live3: LocalEnv) -> None:
    env = live3
    inv = load(str(env.inventory))
    reg = Registry()
    _wait_steps(env, reg, ["a1", "b1", "c1"])
    recs = [r for r in reg.runs("loc", limit=10) if r.state.live]
    assert sorted(r.name for r in recs) == ["a1", "b1", "c1"]
    with CountingPool(inv) as pool:
        report = monitor.statuses(inv, reg, pool, recs, slow_ratio=0.8, stall_after_s=600, checkpoints=None)
        assert pool.counted["loc"].calls == 1  # state + log bytes of all three runs
    assert [s.error for s in report.statuses] == [None, None, None], report.warnings
    assert all(s.last is not None and s.last.step >= 3 for s in report.statuses)
    assert all(s.pull is not None and s.pull.offset == s.pull.size for s in report.statuses)

    # One run's training dies: the same single call sees it ended and reads its last bytes.
    victim = next(r for r in recs if r.name == "b1")
    pid = int((env.root / "workspace" / "train_stdout_b1.log.pid").read_text())
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not (env.root / "workspace" / "train_stdout_b1.log.exit").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with CountingPool(inv) as pool:
        report = monitor.statuses(inv, reg, pool, recs, slow_ratio=0.8, stall_after_s=600, checkpoints=None)
        assert pool.counted["loc"].calls == 1
    by_name = {s.run.name: s for s in report.statuses}
    assert reg.run_by_id(victim.id).state == Lifecycle.FAILED and by_name["b1"].run.exit_status == 137
    assert by_name["b1"].verdict.state == RunState.CRASHED
    assert {by_name["a1"].run.state, by_name["c1"].run.state} == {Lifecycle.RUNNING}
    log = env.root / "workspace" / "train_stdout_b1.log"
    assert reg.cursor(victim.id)[0] == log.stat().st_size  # everything it printed before it died


def test_a_log_longer_than_the_budget_reads_on_and_the_others_are_not_starved(live3: LocalEnv) -> None:
    env = live3
    inv = load(str(env.inventory))
    reg = Registry()
    done = reg.find_run("loc/done1")
    log = env.root / "workspace" / "train_stdout_done1.log"
    with log.open("ab") as f:  # a long history nobody pulled yet
        f.write(b"".join(b"[5m] step=%d loss=9.1 (12.8Ktok/s) | ETA=1.0d\n" % s for s in range(6, 24000)))
    recs = [done, *(r for r in reg.runs("loc", limit=10) if r.state.live)]
    with CountingPool(inv) as pool:
        polled = monitor.poll_many(inv, reg, pool, recs, None, budget=256 << 10)
        calls = pool.counted["loc"].calls
    first = polled.pulls[done.id]
    assert not isinstance(first, str)
    assert first.fetched == log.stat().st_size and first.new_points == 5 + 23994 and first.offset == first.size
    # its share of the poll's 256 KiB (a quarter: four runs read), then logread calls of 256 KiB each
    assert first.calls == 1 + -(-(first.size - (64 << 10)) // (256 << 10))
    for r in recs[1:]:  # the others got their share of the same call, and it was enough
        got = polled.pulls[r.id]
        assert not isinstance(got, str) and got.calls == 1 and got.offset == got.size > 0, got
    assert calls == 1 + (first.calls - 1)



def test_a_poll_whose_run_states_are_malformed_fails_its_container_and_stores_nothing(
        live3: LocalEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's answer is checked before anything of it is recorded: states that are not the agent's make
    the container's call a failure (one line, each run's pull says it), and no state, point or cursor moves."""
    env = live3
    inv = load(str(env.inventory))
    reg = Registry()
    recs = [r for r in reg.runs("loc", limit=10) if r.state.live]
    _wait_steps(env, reg, [r.name for r in recs])
    entry = b'{"state": {"exit": "zero", "pid": null, "log_size": 5}, "read": {"ok": true, "length": 0}}'
    _agent_in(env.root, monkeypatch, b'{"ok": true, "runs": [%s], "length": 0}\n' % b", ".join([entry] * len(recs)))
    with Pool(inv) as pool:
        polled = monitor.poll_many(inv, reg, pool, recs, None)
    assert polled.failed == {"loc"} and not polled.unreachable
    assert len(polled.warnings) == 1 and polled.warnings[0].startswith("loc: state not refreshed: loc: agent "
                                                                        "runstate answered"), polled.warnings
    assert all(polled.pulls[r.id] == polled.warnings[0].split(": ", 2)[2] for r in recs), polled.pulls
    for r in recs:
        assert reg.run_by_id(r.id).state == r.state and reg.point_count(r.id) == 0 and reg.cursor(r.id)[0] == 0


def _agent_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reply: bytes) -> Agent:
    """The agent of a container whose python3 answers `reply` whatever it is asked (a foreign python3)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "reply").write_bytes(reply)
    script = bin_dir / "python3"
    script.write_text(f"#!/bin/sh\ncat >/dev/null\ncat {bin_dir / 'reply'}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return Agent(LocalContainer("ct9", tmp_path))


ASK = [{"name": "r1", "log": "/l1", "session": "s", "state": True, "read": {"offset": 0}},
       {"name": "r2", "log": "/l2", "session": "s", "state": False, "read": {"offset": 0}}]


def _poll(agent: Agent, ask: list[dict[str, Any]], max_bytes: int) -> Any:
    """A poll as ctl status sends it to one container (fanout._flow_here): read(), then poll_answer()."""
    return agent.poll_answer(ask, agent.read("poll", Agent.poll_args(ask, max_bytes)))


@pytest.mark.parametrize("reply, says, error", [
    (b'{"ok": true, "runs": [{"state": {}, "read": {"ok": true, "length": 9}}, {"state": null, "read": '
     b'{"ok": true, "length": 0}}], "length": 4}\nabcd', "claims 9 log bytes", AgentReplyError),
    (b'{"ok": true, "runs": [{"state": {}, "read": {"ok": true, "length": 2}}, {"state": null, "read": '
     b'{"ok": true, "length": 1}}], "length": 4}\nabcd', "1 log bytes belong to no run", AgentReplyError),
    (b'{"ok": true, "runs": [{"state": {}, "read": {"ok": true, "length": 0}}], "length": 0}\n', "1 answers for 2",
     AgentReplyError),
    (b'{"ok": true, "runs": [{"state": null, "read": {"length": 0}}, {"state": null, "read": {"length": 0}}], '
     b'"length": 0}\n', "malformed answer for run 'r1'", AgentReplyError),
    (b'{"ok": true, "runs": [7, 8], "length": 0}\n', "malformed answer", AgentReplyError),
    (b'{"ok": true, "runs": [{"state": {}, "read": {"length": -1}}, {"state": null, "read": {"length": 1}}], '
     b'"length": 0}\n', "claims -1 log bytes", AgentReplyError),
    (b'{"ok": true, "runs": [], "length": 5}\nabc', "cut short", ConnectionFailed),
    (b"x" * (MAX_REPLY + 100), "refused", AgentReplyError),
])
def test_a_poll_reply_that_is_not_the_agents_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         reply: bytes, says: str, error: type[CtlError]) -> None:
    agent = _agent_in(tmp_path, monkeypatch, reply)
    with pytest.raises(error) as e:  # a reply cut short is a connection's fault, any other the agent's
        _poll(agent, ASK, 10)
    assert type(e.value) is error
    assert says in str(e.value) and str(e.value).startswith("ct9") and "\n" not in str(e.value)


def test_poll_answers_states_then_each_runs_bytes_within_the_budget(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "w").mkdir(parents=True)
    (root / "w" / "a.log").write_bytes(b"A" * 100)
    (root / "w" / "b.log").write_bytes(b"B" * 100)
    agent = Agent(Counting(LocalContainer("loc", root)))
    ask = [{"name": "a", "log": "/w/a.log", "session": "x", "state": True, "read": {"offset": 10, "max_bytes": 60}},
           {"name": "b", "log": "/w/b.log", "session": "x", "state": False, "read": {"offset": 0}},
           {"name": "c", "log": "/w/none.log", "session": "x", "state": True, "read": {"offset": 0}},
           {"name": "d", "log": "/w/b.log", "session": "x", "state": True, "read": None}]
    got, _, _ = _poll(agent, ask, 80)
    assert isinstance(agent.t, Counting) and agent.t.calls == 1
    (sa, (ha, da)), (sb, (hb, db)), (sc, (hc, dc)), (sd, rd) = got  # type: ignore[misc]
    assert da == b"A" * 60 and ha["offset"] == 10 and ha["size"] == 100  # its own max_bytes
    assert db == b"B" * 20 and hb["size"] == 100  # what was left of the 80
    assert dc == b"" and hc["ok"] is False and hc["code"] == "missing"
    assert sb is None and rd is None
    assert sa["log_size"] == 100 and sa["alive"] is False and sd["log_size"] == 100 and sc["log_size"] is None


def test_the_env_probe_inside_the_agents_probe_answers_as_the_probe_alone(tmp_path: Path) -> None:
    """The launch preflight's `probe` carries probe_env.py after the agent's source and runs it; what comes back
    is the document the probe gives when run on its own. A reply not of that shape is one line."""
    agent = Agent(Counting(LocalContainer("loc", tmp_path)))
    args, payload = agent.env_probe_request(venv=None, cache_dir=None)
    doc = agent.call("probe", {"files": [], "env_probe": args}, payload=payload)
    assert isinstance(agent.t, Counting) and agent.t.calls == 1
    inside = agent.env_from_probe(doc["env_probe"])
    alone = agent.probe_env(venv=None, cache_dir=None)
    assert inside["python"]["version"] == alone["python"]["version"] and inside.keys() == alone.keys()
    for bad in (None, {"rc": "0", "stdout": "{}", "stderr": ""}, {"rc": 0, "stdout": 1, "stderr": ""}):
        with pytest.raises(AgentReplyError) as e:
            agent.env_from_probe(bad)
        assert str(e.value) == "loc: agent probe: malformed 'env_probe' in its reply"
    with pytest.raises(RemoteCommandError) as e2:
        agent.env_from_probe({"rc": 1, "stdout": "not json", "stderr": "Traceback: boom"})
    assert str(e2.value).startswith("loc") and "\n" not in str(e2.value) and "env probe" in str(e2.value)
