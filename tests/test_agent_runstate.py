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

from controller.remote import agent as agent_mod

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
