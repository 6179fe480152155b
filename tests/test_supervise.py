"""`ctl supervise` on the local target with real tmux, the real agent and the fake payload: verdict changes
become events, a killed trainer is relaunched from its last complete checkpoint, a stopped one is not, a
supervisor killed mid-restart never relaunches one failure twice, one lease per state directory, and the
sinks (a signed webhook checked by a real HTTP receiver, a command) get each event once."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from controller.errors import ExitCode
from tests.conftest import Env, faulthandler_env, interrupt

pytestmark = pytest.mark.skipif(subprocess.run(["which", "tmux"], capture_output=True).returncode != 0,
                                reason="tmux is not installed")

START = """\
#!/usr/bin/env bash
set -euo pipefail
echo "resume=${CTL_RESUME_FROM:-none} parent=${CTL_PARENT_RUN:-none}"
exec python3 {{ root }}{{ payload["emit_metrics.py"] }} --no-preamble $(cat {{ root }}/root/args/$CTL_RUN)
"""
LONG = "--tok-s 12800 --steps 100000 --interval 0.05 --jitter 0"


@pytest.fixture
def sup(env: Env) -> Env:
    (env.dir / "start_training.sh.j2").write_text(START)
    env.ok("deploy", "--allow-dirty")
    for run in ("fresh1", "fresh2", "fresh3", "fresh4"):
        (env.root / "root" / "args").mkdir(parents=True, exist_ok=True)
        (env.root / "root" / "args" / run).write_text(LONG)
    return env


def supervise(env: Env, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    interval = [] if "--interval" in args else ["--interval", "1s"]  # a lease lasts 3 intervals (>= 10 s)
    cmd = [sys.executable, "-m", "controller", "-i", str(env.inventory), "supervise", "--once", *interval, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=env.dir,
                          env={**env.env, "CTL_NOTIFY_RETRIES": "0.1", **(extra_env or {})})


def events(env: Env, run: str | None = None) -> list[dict[str, Any]]:
    return json.loads(env.ok("--json", "events", *([run] if run else [])))


def checkpoint(env: Env, run: str, step: int, *, complete: bool = True, bad_hash: bool = False) -> Path:
    d = env.root / "workspace" / "runs" / run / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "drafter.pt").write_bytes(f"weights {step}".encode())
    sha = hashlib.sha256(f"weights {step}".encode()).hexdigest()
    if complete:
        (d / "manifest.json").write_text(json.dumps({"step": step, "files": {
            "drafter.pt": {"sha256": "0" * 64 if bad_hash else sha}}}))
    return d


def kill_trainer(env: Env, run: str) -> None:
    pid = int((env.root / "workspace" / f"train_stdout_{run}.log.pid").read_text())
    os.killpg(pid, signal.SIGKILL)


def wait_for(cond: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_killed_run_is_relaunched_from_its_last_complete_checkpoint(sup: Env) -> None:
    sup.ok("launch", "loc", "--run", "fresh1")
    first = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert first.returncode == 0, first.stdout + first.stderr
    checkpoint(sup, "fresh1", 5)
    checkpoint(sup, "fresh1", 9, complete=False)  # written when the run died: no manifest, skipped
    checkpoint(sup, "fresh1", 7, bad_hash=True)  # a file that does not match the manifest: skipped
    kill_trainer(sup, "fresh1")
    wait_for(lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), "the exit status")
    crashed = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert "fresh1: OK -> CRASHED" in crashed.stdout or "-> CRASHED" in crashed.stdout, crashed.stdout
    evs = events(sup, "fresh1")
    verdict = [e for e in evs if e["kind"] == "verdict" and e["to"] == "crashed"]
    assert len(verdict) == 1
    ev = verdict[0]
    assert ev["exit_status"] == 137 and ev["log"].endswith("train_stdout_fresh1.log")
    assert ev["look"] == "ctl tail loc/fresh1" and ev["action"].startswith("relaunch as the next run")
    assert any("step=" in line for line in ev["last_lines"])  # what the run printed last
    time.sleep(1.2)  # the backoff
    relaunched = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert "relaunched as fresh2, resuming from step 5" in relaunched.stdout, relaunched.stdout + relaunched.stderr
    shown = json.loads(sup.ok("--json", "show", "fresh2"))
    assert shown["resumed_step"] == 5 and shown["resumed_from"].endswith("fresh1/checkpoints/step_5")
    assert shown["parent_id"] == json.loads(sup.ok("--json", "show", "fresh1"))["id"]
    log2 = sup.root / "workspace" / "train_stdout_fresh2.log"
    wait_for(lambda: log2.exists() and "resume=" in log2.read_text(), "fresh2's first line")
    assert f"resume={sup.root}/workspace/runs/fresh1/checkpoints/step_5 parent=fresh1" in log2.read_text()
    # Polling again changes nothing: one relaunch per failure.
    supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh2", "fresh1"]
    # `ctl stop` is the operator's word: STOPPED, never restarted.
    sup.ok("stop", "fresh2", "--grace", "2")
    stopped = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert "-> STOPPED" in stopped.stdout, stopped.stdout
    assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh2", "fresh1"]
    tree = sup.ok("runs", "--tree")
    assert "fresh1 (failed 137) -> fresh2 (stopped" in tree and "from step 5" in tree


@pytest.mark.parametrize("step", ["planned", "launching", "launched"])
def test_a_supervisor_killed_mid_restart_relaunches_exactly_once(sup: Env, step: str) -> None:
    sup.ok("launch", "loc", "--run", "fresh1")
    supervise(sup, "--restart", "on-failure", "--backoff", "1s")
    kill_trainer(sup, "fresh1")
    wait_for(lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), "the exit status")
    die = {"CTL_SUPERVISE_DIE_AT": step}
    first = supervise(sup, "--restart", "on-failure", "--backoff", "0.1s", extra_env=die)
    if step != "planned":  # the restart itself happens on the poll after the backoff
        time.sleep(0.2)
        first = supervise(sup, "--restart", "on-failure", "--backoff", "0.1s", extra_env=die)
    assert first.returncode == 137, first.stdout + first.stderr
    # The lease of the killed supervisor blocks a new one until it expires: a standby takes over.
    again = supervise(sup, "--restart", "on-failure", "--backoff", "0.1s", "--interval", "1s", "--standby")
    time.sleep(0.2)
    again = supervise(sup, "--restart", "on-failure", "--backoff", "0.1s", "--interval", "1s", "--standby")
    assert again.returncode == 0, again.stdout + again.stderr
    names = [r["name"] for r in json.loads(sup.ok("--json", "runs"))]
    assert names == ["fresh2", "fresh1"], names
    assert json.loads(sup.ok("--json", "show", "fresh2"))["state"] in ("running", "starting")
    restarts = [e for e in events(sup, "fresh1") if e["kind"] == "restart"]
    assert len(restarts) == 1
    sup.ctl("stop", "fresh2", "--grace", "1")


def test_restarts_end_with_gave_up(sup: Env) -> None:
    sup.ok("launch", "loc", "--run", "fresh1")
    supervise(sup, "--restart", "on-failure:1", "--backoff", "0.1s")
    for run in ("fresh1", "fresh2"):
        kill_trainer(sup, run)
        wait_for(lambda r=run: (sup.root / "workspace" / f"train_stdout_{r}.log.exit").exists(), "exit")  # type: ignore[misc]
        supervise(sup, "--restart", "on-failure:1", "--backoff", "0.1s")
        time.sleep(0.2)
        supervise(sup, "--restart", "on-failure:1", "--backoff", "0.1s")
    kinds = [e["kind"] for e in events(sup)]
    assert kinds.count("restart") == 1 and "gave_up" in kinds
    assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh2", "fresh1"]


def test_one_supervisor_per_state_directory(sup: Env) -> None:
    cmd = [sys.executable, "-m", "controller", "-i", str(sup.inventory), "supervise", "--interval", "1s"]
    holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=sup.dir,
                              env=faulthandler_env(sup.env))
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().startswith("supervising loc")
        second = supervise(sup)
        assert second.returncode == ExitCode.BUSY
        assert "another supervisor holds" in second.stderr and "--standby" in second.stderr
    finally:
        out, _err = interrupt(holder, 30)
    assert holder.returncode == 0 and "runs keep training" in out


class _Receiver(http.server.BaseHTTPRequestHandler):
    got: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    hang = 0.0

    def do_POST(self) -> None:
        n = int(self.headers["Content-Length"])
        data = self.rfile.read(n)
        time.sleep(self.hang)
        type(self).got.append((dict(self.headers), data))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _serve(hang: float) -> tuple[http.server.ThreadingHTTPServer, type[_Receiver]]:
    handler = type("R", (_Receiver,), {"got": [], "hang": hang})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, handler


def test_webhooks_are_signed_and_a_hanging_sink_delays_no_other() -> None:
    from controller.commands.notify import Deliverer
    from controller.core.supervision import Sink, verify

    good, good_h = _serve(0.0)
    slow, slow_h = _serve(5.0)
    failures: list[str] = []
    d = Deliverer([Sink.parse(f"http://127.0.0.1:{slow.server_port}/hook"),
                   Sink.parse(f"http://127.0.0.1:{good.server_port}/hook")], b"s3cret",
                  lambda s, doc, err: failures.append(err), retries=())
    try:
        d.send({"run": "loc/fresh1", "summary": "one"})
        d.send({"run": "loc/fresh1", "summary": "two"})
        wait_for(lambda: len(good_h.got) == 2, "both events at the good sink", timeout=4)
        assert len(slow_h.got) == 0  # still stuck on the first
        for headers, data in good_h.got:
            assert verify(b"s3cret", headers["X-Ctl-Timestamp"], data, headers["X-Ctl-Signature"])
            assert not verify(b"other", headers["X-Ctl-Timestamp"], data, headers["X-Ctl-Signature"])
        assert [json.loads(data)["summary"] for _h, data in good_h.got] == ["one", "two"]
    finally:
        d.close(wait_s=0)
        good.shutdown()
        slow.shutdown()


def test_a_command_sink_gets_each_transition_once_and_failures_become_events(sup: Env) -> None:
    out = sup.dir / "notified.jsonl"
    prog = sup.dir / "notify.sh"
    prog.write_text(f"#!/bin/sh\ncat >> {out}\necho >> {out}\n")
    prog.chmod(0o755)
    failing = sup.dir / "fail.sh"
    failing.write_text("#!/bin/sh\necho 'pager down' >&2\nexit 3\n")
    failing.chmod(0o755)
    (sup.root / "root" / "args" / "fresh1").write_text("--tok-s 12800 --steps 8 --interval 0.2")
    sup.ok("launch", "loc", "--run", "fresh1")
    sinks = ["--notify", f"cmd:{prog}", "--notify", f"cmd:{failing}"]
    supervise(sup, *sinks)  # first sight of a healthy run: recorded, nobody woken
    wait_for(lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), "the run's end")
    supervise(sup, *sinks)  # -> FINISHED: one notification
    supervise(sup, *sinks)  # nothing changed: nothing sent
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    assert [(e["run"], e["to"]) for e in lines] == [("loc/fresh1", "finished")]
    failed = [e for e in events(sup) if e["kind"] == "notify_failed"]
    assert failed and "pager down" in failed[0]["summary"]


def test_the_systemd_unit_runs_this_inventory(sup: Env) -> None:
    unit = sup.ok("supervise", "--unit", "--restart", "on-failure:3")
    assert "[Service]" in unit and f"-i {sup.inventory}" in unit and "supervise --restart on-failure:3" in unit
    assert "--unit" not in unit.split("ExecStart=")[1].splitlines()[0]


def test_supkill_during_reglock_a_failure_is_taken_by_one_supervisor(tmp_path: Path) -> None:
    """The soak's double relaunch: a supervisor whose poll stalled on a locked registry past its lease and the
    standby that took over both found the same planned restart; only one may move it to `launching`."""
    from controller.registry import Registry

    reg = Registry(tmp_path / "registry.sqlite3")
    other = Registry(tmp_path / "registry.sqlite3")  # the second supervisor's own connection
    try:
        run = reg.claim_run("r1", "loc")
        assert reg.plan_restart(run.id, {"verdict": "crashed", "not_before": 0}) is not None
        assert [reg.take_restart(run.id), other.take_restart(run.id)] == [True, False]
        assert reg.restart(run.id)["state"] == "launching"
    finally:
        reg.close()
        other.close()
