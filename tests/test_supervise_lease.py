"""The supervisor's lease after a crash: a supervisor killed -9 on this machine is replaced at once (its process
is gone), not after its lease expires; a live one, another machine's, or one that an older ctl named without its
process's start time is never taken over early."""

from __future__ import annotations

import socket
import subprocess
import sys

from controller.commands.supervise import holder_gone, lease_holder
from tests.conftest import LocalEnv


def test_a_holder_is_gone_only_when_its_process_is(tmp_path: object) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        alive = lease_holder(child.pid)
        assert alive.startswith(f"{socket.gethostname()}:{child.pid}:") and not holder_gone(alive)
        host, pid, start, rand = alive.split(":")
        # the same pid, started at another time: a later process that got the dead one's pid
        assert holder_gone(f"{host}:{pid}:{int(start) + 1}:{rand}")
        assert not holder_gone(f"another-{host}:{pid}:{int(start) + 1}:{rand}")  # another machine's: can't tell
        assert not holder_gone(f"{host}:{pid}:{rand}")  # an older ctl's name, without the start time
    finally:
        child.kill()
        child.wait()
    assert holder_gone(alive)


def _supervise(env: LocalEnv, *args: str) -> list[str]:
    return [sys.executable, "-m", "controller", "-i", str(env.inventory), "supervise", "--interval", "30s", *args]


def test_a_supervisor_killed_minus_9_is_replaced_at_once(env: LocalEnv) -> None:
    holder = subprocess.Popen(_supervise(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=env.dir, env=env.env)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().startswith("supervising loc")
        busy = subprocess.run(_supervise(env, "--once"), capture_output=True, text=True, timeout=120,
                              cwd=env.dir, env=env.env)
        assert busy.returncode == 9 and "another supervisor holds" in busy.stderr  # alive: never taken over
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # Its lease would last 90 s more (3 intervals): a supervisor started now (systemd's restart) takes it over.
    again = subprocess.run(_supervise(env, "--once"), capture_output=True, text=True, timeout=120, cwd=env.dir,
                           env=env.env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"took over the supervisor lease of {socket.gethostname()}:{holder.pid}:" in again.stderr
    assert "that process is gone" in again.stderr
    # It released the lease on its way out: the next one has nothing to take over.
    third = subprocess.run(_supervise(env, "--once"), capture_output=True, text=True, timeout=120, cwd=env.dir,
                           env=env.env)
    assert third.returncode == 0 and "took over" not in third.stderr, third.stderr
