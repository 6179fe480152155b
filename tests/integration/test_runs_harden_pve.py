"""Runs whose launch answer was lost, and pid files that name another process, on the local Proxmox host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.errors import ExitCode
from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost

# In the container, ahead of the real tmux on pct's PATH (/sbin comes first): `new-session` starts the session,
# then holds the agent's answer, so the test can cut ctl off after the run started and before it heard so.
_SLOW_TMUX = """#!/bin/sh
/usr/bin/tmux "$@"
rc=$?
if [ "$1" = new-session ]; then sleep 20; fi
exit $rc
"""


def _deployed(env: PveEnv) -> None:
    env.write(vars={**env.base_extra["vars"], "steps": 100000, "interval": 0.2})
    env.ctl("deploy", "ct200", "--allow-dirty", check=True)


def _log(env: PveEnv, run: str) -> Path:
    return env.host.rootfs(200) / "workspace" / env.tag / f"train_stdout_{run}.log"


def _run(env: PveEnv, name: str) -> dict[str, object]:
    runs = json.loads(env.ctl("runs", "--json", check=True).stdout)
    mine = [r for r in runs if r["name"] == name]
    assert len(mine) == 1, runs
    return mine[0]


def _in_ct(env: PveEnv, *argv: str) -> subprocess.CompletedProcess[bytes]:
    return env.host.ssh("pve1", "pct", "exec", "200", "--", *argv)


@pytest.fixture
def slow_tmux(pve_env: PveEnv) -> Iterator[Path]:
    wrapper = pve_env.host.rootfs(200) / "sbin" / "tmux"
    wrapper.write_text(_SLOW_TMUX)
    wrapper.chmod(0o755)
    yield wrapper
    wrapper.unlink(missing_ok=True)


@pytest.mark.parametrize("cut", ["sigint", "ssh-drop"])
def test_a_run_whose_launch_answer_was_lost_stays_known(pve_env: PveEnv, slow_tmux: Path, cut: str) -> None:
    _deployed(pve_env)
    log = _log(pve_env, "cut1")
    proc = subprocess.Popen([sys.executable, "-m", "controller", "-i", str(pve_env.inventory), "launch", "ct200",
                             "--run", "cut1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=pve_env.env)
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{log}.pid").exists():  # tmux started the run; the agent has not answered yet
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        cut_at = time.monotonic()
        if cut == "sigint":
            proc.send_signal(signal.SIGINT)  # Ctrl-C
        else:
            listener = int((pve_env.host.base / "pve1" / "sshd.pid").read_text())
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(listener)], capture_output=True,
                                 text=True).stdout
            for pid in out.split():  # every SSH session of the host: the launch's connection drops
                os.kill(int(pid), signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The wrapper holds the answer 20 s: an exit 0 sooner than that means the cut was not seen.
    assert proc.returncode != 0, f"exit 0 {time.monotonic() - cut_at:.1f}s after the cut:\n{out}\n{err}"
    if cut == "ssh-drop":
        assert proc.returncode == ExitCode.CONNECTION, err
        assert "run cut1 may have started" in err, err
    slow_tmux.unlink()
    pid = int(Path(f"{log}.pid").read_text())
    # ctl never heard the answer, yet the run is known, seen running, and its name stays taken.
    run = _run(pve_env, "cut1")
    assert run["state"] == "running", run
    assert "reconciled from the container" in str(run["note"]) and "launch outcome unknown" in str(run["note"])
    assert run["files"] and "tmux new-session" in str(run["command"])  # filled in from LOG.ctl.json
    again = pve_env.ctl("launch", "ct200", "--run", "cut1")
    assert again.returncode == ExitCode.BUSY, again.stdout + again.stderr
    stop = pve_env.ctl("stop", "cut1", "--grace", "2")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert _run(pve_env, "cut1")["state"] == "stopped"
    assert _in_ct(pve_env, "kill", "-0", str(pid)).returncode != 0  # the training is gone


def test_a_launch_refused_by_the_agent_releases_its_claim(pve_env: PveEnv) -> None:
    """The agent answered that it started nothing: the name is free again, as after a preflight refusal."""
    _deployed(pve_env)
    log = _log(pve_env, "taken1")
    log.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{log}.ctl.json").write_text("{}")  # the record is taken (the preflight looks only at the log)
    r = pve_env.ctl("launch", "ct200", "--run", "taken1")
    assert r.returncode == ExitCode.CLOBBER, r.stdout + r.stderr
    assert json.loads(pve_env.ctl("runs", "--json", check=True).stdout) == []


def test_stop_refuses_a_pid_file_that_names_another_process(pve_env: PveEnv) -> None:
    _deployed(pve_env)
    pve_env.ctl("launch", "ct200", "--run", "imp1", check=True)
    log = _log(pve_env, "imp1")
    real = Path(f"{log}.pid").read_text()
    sleeper = int(_in_ct(pve_env, "sh", "-c", "setsid sleep 300 >/dev/null 2>&1 </dev/null & echo $!")
                  .stdout.decode().strip())
    try:
        Path(f"{log}.pid").write_text(f"{sleeper}\n")
        r = pve_env.ctl("stop", "imp1", "--grace", "2")
        assert r.returncode != 0, r.stdout + r.stderr
        assert f"names pid {sleeper} (sleep 300), which is not run imp1's training" in r.stderr, r.stderr
        assert "refusing to signal it" in r.stderr and "Traceback" not in r.stderr
        assert _in_ct(pve_env, "kill", "-0", str(sleeper)).returncode == 0  # the sleep survives
        assert _run(pve_env, "imp1")["state"] == "running"  # not taken for lost either
    finally:
        Path(f"{log}.pid").write_text(real)
        _in_ct(pve_env, "kill", str(sleeper))
    stop = pve_env.ctl("stop", "imp1", "--grace", "2")
    assert stop.returncode == 0, stop.stdout + stop.stderr
