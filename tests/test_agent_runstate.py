"""The agent's `runstate` on this machine with a real tmux: a training that has just died, seen before its
launcher wrote LOG.exit, is reported with its exit status, not as gone without one (which ctl records as
`lost` for good)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from controller import farside

agent_mod = farside.load("agent")

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def _dead_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    """A run's log whose pid file names a training that has exited; tmux sockets under tmp_path."""
    monkeypatch.setenv("TMUX_TMPDIR", str(tmp_path))
    p = subprocess.Popen(["true"])
    p.wait()
    log = tmp_path / f"train_{name}.log"
    log.write_text("step=5\n")
    (tmp_path / f"train_{name}.log.pid").write_text(f"{p.pid}\n")
    return log


def test_an_exit_status_written_just_after_the_training_died_is_reported(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    log = _dead_run(tmp_path, monkeypatch, "r1")
    # The launcher, late: its session is there, and it writes the status a second after the training ended.
    script = f"sleep 1; echo 137 > {log}.exit.tmp && mv -f {log}.exit.tmp {log}.exit; sleep 30"
    subprocess.run(["tmux", "new-session", "-d", "-s", "rs-r1", "bash", "-c", script], check=True)
    try:
        t0 = time.monotonic()
        doc = agent_mod.runstate({"runs": [{"name": "r1", "log": str(log), "session": "rs-r1"}]})
        took = time.monotonic() - t0
        st = doc["runs"][0]
        assert (st["alive"], st["exit"], st["session"]) == (False, 137, True), st
        assert "exit_mtime" in st
        assert took < agent_mod.EXIT_GRACE_S + 1
    finally:
        subprocess.run(["tmux", "kill-server"], capture_output=True)


def test_a_dead_training_whose_session_is_gone_is_answered_at_once(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    log = _dead_run(tmp_path, monkeypatch, "r2")
    t0 = time.monotonic()
    st = agent_mod.runstate({"runs": [{"name": "r2", "log": str(log), "session": "rs-r2"}]})["runs"][0]
    assert (st["alive"], st["exit"], st["session"]) == (False, None, False), st
    assert time.monotonic() - t0 < agent_mod.EXIT_GRACE_S  # no launcher is left to write a status: no wait
    assert not os.path.exists(str(log) + ".exit")


def test_a_session_whose_launcher_is_gone_is_not_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tmux's remain-on-exit keeps a session after its command ended: no launcher is left to write LOG.exit."""
    log = _dead_run(tmp_path, monkeypatch, "r3")
    subprocess.run(["tmux", "new-session", "-d", "-s", "rs-r3", "sleep 30"], check=True)  # a server to set options on
    try:
        subprocess.run(["tmux", "set-option", "-g", "remain-on-exit", "on"], check=True)
        subprocess.run(["tmux", "new-session", "-d", "-s", "rs-r3b", "true"], check=True)
        time.sleep(0.5)
        t0 = time.monotonic()
        st = agent_mod.runstate({"runs": [{"name": "r3", "log": str(log), "session": "rs-r3b"}]})["runs"][0]
        assert (st["alive"], st["exit"], st["session"]) == (False, None, True), st
        assert time.monotonic() - t0 < agent_mod.EXIT_GRACE_S
    finally:
        subprocess.run(["tmux", "kill-server"], capture_output=True)


def test_a_launcher_that_ends_between_the_reads_leaves_its_exit_status_seen(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """runstate reads LOG.exit (not there yet), then asks tmux: the launcher wrote LOG.exit and ended in between,
    its session is gone. Read in that order alone, the run would be lost for good; LOG.exit is read again once the
    launcher is known to have ended (a race a staying agent, answering within milliseconds, met in 1 of 30)."""
    log = _dead_run(tmp_path, monkeypatch, "r4")
    real = agent_mod._read_int
    first = [True]

    def late_exit(path: str) -> int | None:
        if path.endswith(".exit") and first[0]:
            first[0] = False
            (Path(path + ".tmp")).write_text("0\n")
            os.replace(path + ".tmp", path)  # written just after this read, as the launcher ends
            return None
        return real(path)

    monkeypatch.setattr(agent_mod, "_read_int", late_exit)
    st = agent_mod.runstate({"runs": [{"name": "r4", "log": str(log), "session": "rs-r4"}]})["runs"][0]
    assert (st["alive"], st["exit"], st["session"]) == (False, 0, False), st


def test_a_training_that_dies_while_it_is_checked_is_dead_not_an_impostor(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Alive at kill(0), a zombie by the time its environment is read (a zombie's environ is empty): it ended; it
    is not another process squatting on the run's pid."""
    log = _dead_run(tmp_path, monkeypatch, "r5")
    (tmp_path / "train_r5.log.exit").write_text("3\n")
    answers = iter([True, False])
    monkeypatch.setattr(agent_mod, "_pid_alive", lambda pid: next(answers))
    st = agent_mod.runstate({"runs": [{"name": "r5", "log": str(log), "session": "rs-r5"}]})["runs"][0]
    assert (st["alive"], st["exit"], st.get("impostor")) == (False, 3, None), st


def test_a_launch_as_the_tmux_server_exits_is_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tmux answers "server exited unexpectedly" when its last session ends as a new one is asked for: nothing
    started, so the agent asks again instead of failing the launch."""
    monkeypatch.setenv("TMUX_TMPDIR", str(tmp_path))
    real_tmux = shutil.which("tmux")
    assert real_tmux is not None
    shim = tmp_path / "bin" / "tmux"
    shim.parent.mkdir()
    flag = tmp_path / "failed-once"
    shim.write_text(f'#!/bin/sh\nif [ "$1" = new-session ] && [ ! -e {flag} ]; then : > {flag}\n'
                    f'  echo "server exited unexpectedly" >&2; exit 1; fi\nexec {real_tmux} "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:{os.environ['PATH']}")
    log = tmp_path / "train_r6.log"
    try:
        doc = agent_mod.launch({"log": str(log), "session": "rs-r6", "record": {},
                                "script": f"echo $$ > {log}.pid; sleep 30"})
        assert doc["ok"] and doc["pid"], doc
        assert flag.exists()  # the first ask did fail
    finally:
        subprocess.run([real_tmux, "kill-server"], capture_output=True)


def test_tmux_is_asked_only_where_its_answer_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll of a live training (what `ctl status` and each tick of `ctl supervise` send) starts no tmux: a
    client process per run, ~3 ms of CPU in the container. A training gone without an exit status, and a run
    still starting, are asked about as before."""
    monkeypatch.setenv("TMUX_TMPDIR", str(tmp_path))
    real_tmux = shutil.which("tmux")
    asked = tmp_path / "asked"
    shim = tmp_path / "bin" / "tmux"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\necho "$1" >> {asked}\nexec {real_tmux} "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:{os.environ['PATH']}")
    log = tmp_path / "train_r7.log"
    log.write_text("step=1\n")
    training = subprocess.Popen(["sleep", "30"], env={**os.environ, "CTL_RUN": "r7"})
    try:
        (tmp_path / "train_r7.log.pid").write_text(f"{training.pid}\n")
        run = {"name": "r7", "log": str(log), "session": "rs-r7"}
        st = agent_mod.runstate({"runs": [run]})["runs"][0]
        assert (st["alive"], st["exit"], "session" in st) == (True, None, False), st
        assert not asked.exists()
        st = agent_mod.runstate({"runs": [{**run, "record": True}]})["runs"][0]  # a starting run's reconciling
        assert (st["alive"], st["session"]) == (True, False), st
        assert asked.read_text().split() == ["has-session"]
    finally:
        training.kill()
        training.wait()
    st = agent_mod.runstate({"runs": [run]})["runs"][0]
    assert (st["alive"], st["exit"], st["session"]) == (False, None, False), st
    assert asked.read_text().split() == ["has-session", "has-session"]
