"""The client side of ctl's persistent host session: `MuxRelay` (a HostRelay over the session socket), and
`sessions()` / `stop()` for `ctl mux status|stop`. The frames are the relay's plus H, D and Q (sock.py).

A command that finds no session starts one: daemon.py with a JSON spec of the connection as its argument and
only the environment it needs; the daemon answers one JSON line on its stdout once it listens ({"ready"}),
when another starter won the race ({"ready", "existing"}), when the host cannot run the relay
({"unavailable": why}) or on failure ({"error", "hint", "type"}).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from controller import settings
from controller.errors import ConnectionDropped, ConnectionFailed, DeadlineExceeded
from controller.transport.base import Duplex
from controller.transport.mux.sock import (
    PROTOCOL,
    connect,
    end_from,
    error_from,
    mux_dir,
    private_dir,
    recv_frames,
    send_frame,
    session_key,
)
from controller.transport.relay import HostRelay
from controller.transport.ssh import SshEndpoint

ENV = settings.PERSIST

# The session outlives the command that starts it and serves every later one, so it gets only what it uses:
# paths and locale, the ssh agent, the user's identity and home (ssh_config, keys, a ProxyCommand), and
# where the Python packages and the state directory are. Never the starter's secrets (API tokens...).
_SESSION_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "SSH_AUTH_SOCK",
                          "PYTHONPATH", "PYTHONHOME"})


def session_env(environ: Mapping[str, str], state: Path) -> dict[str, str]:
    """The session process's environment: what it needs out of `environ`, and the state directory the starter
    resolved (so both agree on the socket's directory whatever the XDG variables say). The session runs
    `sys.executable -m controller...`: the interpreter that runs this ctl finds the same package."""
    env = {k: v for k, v in environ.items() if k in _SESSION_ENV or k.startswith("LC_")}
    env[settings.STATE_DIR] = str(state)
    return env


class _SockChan:
    """The socket with the few channel methods HostRelay uses."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: Any) -> int:
        return self.sock.send(data)

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    def shutdown_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()

    def exit_status_ready(self) -> bool:
        return False  # a socket has no exit status: its end reads as a dropped connection

    def recv_exit_status(self) -> int:
        return -1


class MuxRelay(HostRelay):
    """HostRelay through the user's persistent session for the host (started here when there is none)."""

    def __init__(self, host: SshEndpoint, idle: int, *, note: Callable[[str], None] | None = None) -> None:
        super().__init__(host, note=note)
        self.idle = idle
        self.hello: dict[str, Any] = {}
        self.started_session = False  # this command started the session process (a cold session)
        self._path: Path | None = None

    def what(self) -> str:
        """The session process by pid (from its hello, else from what it wrote beside its socket)."""
        pid = self.hello.get("pid")
        if pid is None and self._path is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                pid = json.loads(self._path.with_suffix(".json").read_text()).get("pid")
        return (f"ctl's session process for {self.host.name} (pid {pid if pid is not None else '?'}; "
                f"`ctl mux stop {self.host.name}` or kill it)")

    def _start(self) -> None:
        d = private_dir(create=True)
        path = d / f"{session_key(self.host)}.sock"
        self._path = path
        why = "no hello"
        for _attempt in range(2):  # a session that reached its idle timeout as we connected: start another
            sock = connect(path)
            if sock is None:
                if not self._spawn(d, path):
                    return
                sock = connect(path)
                if sock is None:
                    raise ConnectionFailed(f"{self.host.name}: ctl's session process started but {path} does "
                                           f"not answer (see {path.with_suffix('.log')})")
            chan = _SockChan(sock)
            try:
                hello = self._read_hello(chan)
            except OSError as e:
                hello, why = None, str(e)
            except DeadlineExceeded:
                sock.close()  # the session process accepts (the kernel does) but does not answer: stopped, hung
                raise
            if hello is not None and hello.get("mux") == PROTOCOL:
                break
            sock.close()
            time.sleep(0.05)
        else:
            raise ConnectionFailed(f"{self.host.name}: ctl's session at {path} did not answer ({why})",
                                   hint=f"`ctl mux stop`, or remove {path}")
        self.hello = hello
        self._chan = chan
        self._state = "up"
        self._reader = threading.Thread(target=self._read_loop, name=f"mux-{self.host.name}", daemon=True)
        self._reader.start()
        if self.note is not None:
            how = "started" if self.started_session else "reused"
            self.note(f"{self.host.name}: {how} ctl's persistent session (pid {hello.get('pid')}, "
                      f"{self.idle}s idle timeout, relay python {hello.get('python')})")

    def _spawn(self, d: Path, path: Path) -> bool:
        """Start the session process; True once it listens, False when the host cannot run the relay."""
        ep = self.host
        spec = {"name": ep.name, "address": ep.address, "port": ep.port, "user": ep.user,
                "identity_file": ep.identity_file, "known_hosts": ep.known_hosts,
                "connect_timeout": ep.connect_timeout, "idle": self.idle, "socket": str(path),
                "keepalive_interval": ep.keepalive_interval, "keepalive_count": ep.keepalive_count,
                "request_timeout": ep.request_timeout}
        old = os.umask(0o077)
        try:
            with open(path.with_suffix(".log"), "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "controller.transport.mux.daemon", json.dumps(spec)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, cwd="/",
                    env=session_env(os.environ, d.parent), start_new_session=True, close_fds=True)
        finally:
            os.umask(old)
        assert proc.stdout is not None
        # It connects (connect_timeout) and starts the relay (its hello deadline) before it answers.
        wait = ep.connect_timeout + self.hello_timeout + 10
        ready, _, _ = select.select([proc.stdout], [], [], wait)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if not ready:
            raise DeadlineExceeded(f"{ep.name}: ctl's session process (pid {proc.pid}) did not say it listens "
                                   f"in {wait:g}s (see {path.with_suffix('.log')})")
        try:
            doc = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:
            doc = {}
        if doc.get("ready"):
            self.started_session = not doc.get("existing", False)
            return True
        proc.wait(timeout=30)
        if doc.get("unavailable"):
            self._state = "unavailable"
            self.why_unavailable = str(doc["unavailable"])
            if self.note is not None:
                self.note(f"{ep.name}: {doc['unavailable']}; falling back to one exec per container")
            return False
        if "error" in doc:
            raise error_from(doc)
        raise ConnectionFailed(f"{ep.name}: ctl's session process exited {proc.returncode} before it listened "
                               f"(see {path.with_suffix('.log')})")

    def _dispatch(self, kind: bytes, sid: int, payload: bytes) -> None:
        if sid == 0 and kind == b"D":
            self._fail(end_from(payload))
            return
        super()._dispatch(kind, sid, payload)

    def _fail(self, end: ConnectionFailed) -> None:
        if isinstance(end, ConnectionDropped) and "ctl's session" not in end.message:
            end = ConnectionDropped(f"{end.message} (ctl's session process, pid {self.hello.get('pid')}, ended; "
                                    "the next ctl command starts a new one)")
        super()._fail(end)

    def open(self, argv: Sequence[str]) -> Duplex:
        """Like HostRelay.open; after the session ended, connect to a new one first, as a direct SshEndpoint
        opens a new connection for the next exec after a drop (streams of the old one keep their error)."""
        with self._lock:
            with self._cond:
                ended = self._dead is not None
                if ended:
                    self._streams = {}
            if ended:
                old, self._chan = self._chan, None
                if old is not None:
                    with contextlib.suppress(OSError):
                        old.close()
                if self._reader is not None:
                    self._reader.join(timeout=5)
                with self._cond:
                    self._dead = None
                self._state = "new"
                self.started_session = False
                self._start()
                if self._state != "up":
                    raise ConnectionFailed(f"{self.host.name}: ctl's session ended and no new one could start")
        return super().open(argv)

    def close(self) -> None:
        chan = self._chan
        if chan is None:
            return
        with self._cond:
            live = bool(self._streams)
        if live:  # like a direct exec: end our input and let the children finish
            super().close()
            return
        chan.close()  # nothing running: the session stays for the next command
        self._chan = None


def sessions() -> list[dict[str, Any]]:
    """The user's sessions (for `ctl mux status`): the info each wrote, and whether it answers."""
    d = mux_dir()
    if not d.is_dir():
        return []
    out = []
    for info in sorted(d.glob("*.json")):
        try:
            doc = json.loads(info.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        sock = connect(info.with_suffix(".sock"))
        doc["live"] = sock is not None
        if sock is not None:
            sock.close()
        doc["socket"] = str(info.with_suffix(".sock"))
        out.append(doc)
    return out


def stop(host: str | None = None, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Ask every live session (or those of `host`) to stop; wait until they are gone. Returns them."""
    stopped = []
    for doc in sessions():
        if not doc["live"] or (host is not None and doc.get("host") != host):
            continue
        sock = connect(Path(doc["socket"]))
        if sock is None:
            continue
        with contextlib.suppress(OSError):
            send_frame(sock, b"Q", 0)
            sock.settimeout(timeout)
            for _ in recv_frames(sock):  # until the session closes us
                pass
        sock.close()
        deadline = time.monotonic() + timeout
        while Path(doc["socket"]).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped.append(doc)
    return stopped
