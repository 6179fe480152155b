"""The command server judges its client by the client's /proc, not by the key the client computed (issue 40):
a same-uid client under another NoNewPrivs that presents the server's own key is refused, and runs its command
itself; a client in the server's context is still served. Real server, real forked clients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.served_world import CTL, World
from tests.served_world import served_world as _served_world

pytestmark = pytest.mark.skipif(not CTL.exists(), reason=f"no installed ctl script at {CTL} (pip install -e .)")

# A client that claims the server's key whatever its context (as a sandboxed process of the same user could),
# optionally after setting no_new_privs on itself; prints what served.run returned (None: not served).
CLIENT = """
import ctypes, json, sys
from controller.launch import served
k = sys.argv[1]
served.key = lambda environ, path=None: k
served.installed_command = lambda: True
if sys.argv[2] == "nnp":
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0, ctypes.get_errno()  # PR_SET_NO_NEW_PRIVS
    assert "NoNewPrivs:\\t1" in open("/proc/self/status").read()
code = served.run(["config", "path"])
print(json.dumps({"code": code}), flush=True)
"""


@pytest.fixture
def served_world(tmp_path: Path) -> Iterator[World]:
    yield from _served_world(tmp_path)


def _client(world: World, k: str, mode: str) -> tuple[int | None, str]:
    r = subprocess.run([sys.executable, "-c", CLIENT, k, mode], capture_output=True, text=True, cwd=world.tmp,
                       env=world.env, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    return json.loads(lines[-1])["code"], "\n".join(lines[:-1])


def test_a_client_under_other_no_new_privs_is_refused(served_world: World) -> None:
    world = served_world
    assert world("config", "path").returncode == 0  # runs here, and starts the server
    before = world.up()
    (sock,) = world.sockets.glob("cmd-*.sock")
    k = sock.name[len("cmd-"):-len(".sock")]
    code, out = _client(world, k, "same")  # the fallback's counterpart: a client like the server is served
    assert code == 0 and out.endswith("no-config.yaml"), out
    assert world.servers()[0]["served"] == int(before["served"]) + 2  # type: ignore[call-overload]
    code, out = _client(world, k, "nnp")
    assert code is None and out == "", out  # refused: the command would run in the client, under its NoNewPrivs
    log = "".join(p.read_text() for p in world.sockets.glob("cmd-*.log"))
    assert world.servers()[0]["served"] == int(before["served"]) + 3, log  # type: ignore[call-overload]


def test_the_server_reads_the_context_of_a_pid_itself() -> None:
    from controller.launch.server import context_refusal, proc_context

    mine = proc_context(os.getpid())
    assert mine is not None and "NoNewPrivs" in mine and "ns/mnt" in mine and "cgroup" in mine and "nice" in mine
    ready = ["sh", "-c", "echo ready; exec sleep 30"]  # "ready": setpriv has set no_new_privs and exec'd
    child = subprocess.Popen(["setpriv", "--no-new-privs", *ready], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen(ready, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and other.stdout is not None
        assert child.stdout.readline() == "ready\n" and other.stdout.readline() == "ready\n"
        assert "NoNewPrivs" in context_refusal(mine, child.pid)
        assert context_refusal(mine, other.pid) == ""
        assert context_refusal(mine, 2 ** 22 + 7) == "the client's context cannot be read"
    finally:
        child.kill()
        other.kill()
        child.wait()
        other.wait()
