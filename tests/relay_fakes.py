"""Stand-ins around ctl's host relay, shared by its tests: a local process as the SSH host HostRelay execs on
(LocalHost), a stand-in agent for the relay's failure modes (FAKE, fake()), and a hypothesis strategy of JSON
values (what the relay's own json must read and write as json does)."""

from __future__ import annotations

import socket
import subprocess
import sys

from hypothesis import strategies as st

from controller.transport.mux.client import _SockChan
from controller.transport.relay import BOOT


class LocalChan(_SockChan):
    """The session socket's channel (the few paramiko channel methods HostRelay uses) over a socket pair whose
    other end is the relay's stdin and stdout, and the relay process's exit status."""

    def __init__(self, argv: list[str]) -> None:
        ours, theirs = socket.socketpair()
        super().__init__(ours)
        self.proc = subprocess.Popen(argv, stdin=theirs, stdout=theirs, stderr=subprocess.PIPE, close_fds=True)
        theirs.close()

    def exit_status_ready(self) -> bool:
        return self.proc.poll() is not None

    def recv_exit_status(self) -> int:
        return self.proc.wait()

    def recv_stderr_ready(self) -> bool:
        return False

    def recv_stderr(self, n: int) -> bytes:
        return b""


class LocalHost:
    """What HostRelay needs of an SshEndpoint: a name and an exec channel (here: a local process)."""

    name = "local"
    request_timeout: float | None = 60.0  # the deadline an SshEndpoint would give each request

    def __init__(self) -> None:
        self.chans: list[LocalChan] = []

    def exec_channel(self, argv: list[str]) -> LocalChan:
        chan = LocalChan(argv)
        self.chans.append(chan)
        return chan

    def close(self) -> None:
        pass

    def _why(self) -> str:
        return ""  # an SshEndpoint's reason for a dropped connection (its keepalive's); none here


# --------------------------------------------------------------------------------------------
# A stand-in agent for the failure modes: one-shot it answers {"via": "exec"}; under `serve` it does MODE.
FAKE = br'''
import json, os, struct, sys, time
F = struct.Struct(">cHI")
MODE = sys.argv[3] if len(sys.argv) > 3 else ""
def put(k, d=b""):
    os.write(1, F.pack(k, 0, len(d)) + d)
def take(n):
    b = b""
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            sys.exit(0)
        b += c
    return b
if sys.argv[2] != "serve":
    sys.stdout.write(json.dumps({"ok": True, "via": "exec", "pid": os.getpid()}))
    sys.exit(0)
put(b"H", b"{}")
if MODE == "deaf":  # said hello, then never reads again
    time.sleep(3600)
pipe = None
if MODE == "small-pipe":  # its stdin holds one page: a request of more reaches it in several writes
    import fcntl
    fcntl.fcntl(0, 1031, 4096)  # F_SETPIPE_SZ
    pipe = fcntl.fcntl(0, 1032)  # F_GETPIPE_SZ
count = 0
while True:
    k, _, n = F.unpack(take(F.size))
    body = take(n)
    count += 1
    mode = (MODE[6:] if count > 1 else "") if MODE.startswith("later-") else MODE  # later-M: M from the 2nd on
    if mode == "die":
        os._exit(3)
    if mode == "hang":
        time.sleep(3600)
    if mode == "slow":
        time.sleep(1.5)
    if mode.startswith("gate:"):  # arrives (a file named after its pid in DIR), then waits for DIR/go (60 s at most)
        gate = mode[len("gate:"):]
        open(os.path.join(gate, str(os.getpid())), "w").close()
        for _ in range(6000):
            if os.path.exists(os.path.join(gate, "go")):
                break
            time.sleep(0.01)
    if mode == "minus":  # an exit status that only looks like a number
        put(b"X", b"--5")
        continue
    if mode == "lie":
        put(b"O", b'{"ok": tr')
        put(b"Z", b"?")
        continue
    if mode == "big":  # one frame of more than the relay reads at once
        put(b"O", b"x" * 300000)
    put(b"O", json.dumps({"ok": True, "via": "serve", "pid": os.getpid(), "got": len(body), "pipe": pipe}).encode())
    put(b"E")
    put(b"X", b"0")
'''


def fake(mode: str) -> list[str]:
    """A request to the fake agent. MODE rides in the prefix (`sh -c 'exec "$0" "$@" MODE'`), so the staying
    agent the relay starts from that prefix (`... N serve`) gets it too."""
    return ["sh", "-c", f'exec "$0" "$@" {mode}', sys.executable, "-I", "-S", "-c", BOOT, str(len(FAKE)), "verb"]


FAKE_AT = 9  # fake(): sh -c SCRIPT python -I -S -c BOOT N VERB


# JSON documents of any shape (what json.dumps accepts and json.loads gives back)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30)
