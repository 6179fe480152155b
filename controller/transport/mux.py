"""A persistent host session (opt-in: `CTL_PERSIST=SECONDS`, or `persist:` on the host in the inventory): one
background process per host and user.

Each `ctl` command used to pay, before its agent said a word, paramiko's import, an SSH handshake, an
exec request and the host's login shell (~0.3 s). With persistence on, the first command that needs host H
starts `ctl mux` for H (this module run as a program): it opens the SSH connection (host keys verified as
always: known_hosts, RejectPolicy) and ONE long-running exec of ctl's host relay (controller/remote/hostrelay.py),
then listens on a Unix socket. Later commands connect to that socket, import no paramiko, do no
handshake, and send the relay's own frames (S start argv, I stdin, C close stdin; back O, E, X) for the
exact argv they would have run (`pct exec VMID -- python3 ... agent ...`); the mux renumbers stream ids
between its clients and the one relay channel. `MuxRelay` is the client: a `HostRelay` whose channel is the
socket, so `PctContainer` and deploy see the same Duplex as over a direct exec.

The mux exits after SECONDS with no client and no live stream, when `ctl mux stop` asks, or when its SSH
connection drops; the clients of a dropped session get a "connection dropped" error and the next command
starts a fresh session. Only the user's own processes can reach it: the socket lives in a 0700 directory
under ctl's state dir (`mux/`), its name is a hash of host name, address, port, user, identity file and
known_hosts (a changed inventory gets a new session), a socket or directory owned by anyone else is
refused, and the mux drops any peer whose uid differs from its own.

Frames mux -> client besides the relay's: H (stream 0, JSON: pid, host, relay python) on connect,
D (stream 0, the reason) before it closes a client because the session ended. Client -> mux: Q (stream 0)
asks the mux to stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from controller.errors import ConnectionFailed, CtlError, HostKeyError, InputError
from controller.transport.base import Duplex
from controller.transport.relay import _CHUNK, HEADER, HostRelay, frames, relay_source
from controller.transport.ssh import SshEndpoint

ENV = "CTL_PERSIST"
_MAX_SUN_PATH = 100  # sockaddr_un holds 108 bytes; longer paths go through /proc/self/fd/N/


def persist_seconds() -> int | None:
    """CTL_PERSIST: idle seconds a host session outlives its last client (0: no session); None when unset
    (then each host's inventory `persist:` decides)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InputError(f"{ENV}: expected whole seconds >= 0 (0 turns persistent host sessions off), got {raw!r}")
    return value


def mux_dir() -> Path:
    from controller.settings import state_dir

    return state_dir() / "mux"


def _private_dir(create: bool) -> Path:
    """The sockets' directory: created 0700; refused when another user owns it or others may enter it."""
    d = mux_dir()
    if create:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConnectionFailed(
            f"refusing ctl's session directory {d}: it must be a directory owned by uid {os.getuid()} "
            f"with mode 0700 (found owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
            hint=f"remove it (rm -r {d}); the next command recreates it", )
    return d


def session_key(ep: SshEndpoint) -> str:
    """Names a session: what the connection is (inventory + relay version), never any secret."""
    ident = json.dumps([ep.name, ep.address, ep.port, ep.user, ep.identity_file, ep.known_hosts,
                        hashlib.sha256(relay_source()).hexdigest()])
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def _address(path: Path, keep: list[int]) -> str:
    """path, or /proc/self/fd/N/name when path is too long for a Unix socket address (keep holds N)."""
    if len(os.fsencode(str(path))) <= _MAX_SUN_PATH:
        return str(path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    keep.append(fd)
    return f"/proc/self/fd/{fd}/{path.name}"


def _connect(path: Path) -> socket.socket | None:
    """A connected socket to a live session at path; None when there is none (absent or stale)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        raise ConnectionFailed(f"refusing {path}: not a socket owned by uid {os.getuid()} "
                               f"(owner {st.st_uid}); another user's session is never used",
                               hint=f"remove it (rm {path})")
    fds: list[int] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(_address(path, fds))
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    finally:
        for fd in fds:
            os.close(fd)
    return sock


def _send_frame(sock: socket.socket, kind: bytes, sid: int, data: bytes = b"") -> None:
    sock.sendall(HEADER.pack(kind, sid, len(data)) + data)


def _recv_frames(sock: socket.socket) -> Iterator[tuple[bytes, int, bytes]]:
    """Yield (kind, sid, data) until the peer ends the connection (or it breaks)."""

    def chunks() -> Iterator[bytes]:
        while True:
            try:
                data = sock.recv(_CHUNK)
            except OSError:
                return
            if not data:
                return
            yield data

    return frames(chunks())


# --- client ----------------------------------------------------------------------------------------


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
        return False

    def recv_exit_status(self) -> int:
        return -1


class MuxRelay(HostRelay):
    """HostRelay through the user's persistent session for the host (started here when there is none)."""

    def __init__(self, host: SshEndpoint, idle: int, *, note: Callable[[str], None] | None = None) -> None:
        super().__init__(host, note=note)
        self.idle = idle
        self.hello: dict[str, Any] = {}
        self.started_session = False  # this command started the mux (a cold session)

    def _start(self) -> None:
        d = _private_dir(create=True)
        path = d / f"{session_key(self.host)}.sock"
        why = "no hello"
        for _attempt in range(2):  # a session that reached its idle timeout as we connected: start another
            sock = _connect(path)
            if sock is None:
                if not self._spawn(d, path):
                    return
                sock = _connect(path)
                if sock is None:
                    raise ConnectionFailed(f"{self.host.name}: ctl's session process started but {path} does "
                                           f"not answer (see {path.with_suffix('.log')})")
            chan = _SockChan(sock)
            try:
                hello = self._read_hello(chan)
            except OSError as e:
                hello, why = None, str(e)
            if hello is not None and hello.get("mux") == 1:
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
                "connect_timeout": ep.connect_timeout, "idle": self.idle, "socket": str(path)}
        env = dict(os.environ)
        old = os.umask(0o077)
        try:
            with open(path.with_suffix(".log"), "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "controller.transport.mux", json.dumps(spec)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, cwd="/", env=env,
                    start_new_session=True, close_fds=True)
        finally:
            os.umask(old)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.stdout.close()
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
            if self.note is not None:
                self.note(f"{ep.name}: {doc['unavailable']}; falling back to one exec per container")
            return False
        if "error" in doc:
            cls = {"HostKeyError": HostKeyError, "ConnectionFailed": ConnectionFailed}.get(doc.get("type", ""),
                                                                                         CtlError)
            raise cls(doc["error"], hint=doc.get("hint"))
        raise ConnectionFailed(f"{ep.name}: ctl's session process exited {proc.returncode} before it listened "
                               f"(see {path.with_suffix('.log')})")

    def _dispatch(self, kind: bytes, sid: int, payload: bytes) -> None:
        if sid == 0 and kind == b"D":
            self._fail(payload.decode("utf-8", "replace"))
            return
        super()._dispatch(kind, sid, payload)

    def _fail(self, why: str) -> None:
        if why.startswith("SSH connection dropped") and "ctl's session" not in why:
            why = (f"{why} (ctl's session process, pid {self.hello.get('pid')}, ended; the next ctl command "
                   "starts a new one)")
        super()._fail(why)

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
        sock = _connect(info.with_suffix(".sock"))
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
        sock = _connect(Path(doc["socket"]))
        if sock is None:
            continue
        with contextlib.suppress(OSError):
            _send_frame(sock, b"Q", 0)
            sock.settimeout(timeout)
            for _ in _recv_frames(sock):  # until the mux closes us
                pass
        sock.close()
        deadline = time.monotonic() + timeout
        while Path(doc["socket"]).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped.append(doc)
    return stopped


# --- the session process ----------------------------------------------------------------------------


class _Client:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.streams: dict[int, int] = {}  # client's stream id -> relay stream id
        self.gone = False

    def send(self, kind: bytes, sid: int, data: bytes = b"") -> None:
        with self.lock:
            if self.gone and kind != b"D":
                return
            try:
                _send_frame(self.sock, kind, sid, data)
            except OSError:
                self.gone = True


class _Mux(HostRelay):
    """The session's end of the relay channel: frames of the relay go to the client that owns the stream."""

    def __init__(self, host: SshEndpoint, idle: int) -> None:
        self.why_unavailable: str | None = None
        super().__init__(host, note=self._noted)
        self.idle = idle
        self.map_lock = threading.Lock()
        self.owner: dict[int, tuple[_Client, int]] = {}  # relay stream id -> (client, its stream id)
        self.clients: set[_Client] = set()
        self.last_busy = time.monotonic()
        self.ended = threading.Event()
        self.end_reason = ""
        self.next_gsid = 1
        self.python = "?"

    def _noted(self, msg: str) -> None:
        if "falling back" in msg:
            self.why_unavailable = msg.split(": ", 1)[-1].split("; falling back")[0]
        elif "(python " in msg:
            self.python = msg.rsplit("(python ", 1)[-1].rstrip(")")

    def _dispatch(self, kind: bytes, sid: int, payload: bytes) -> None:
        with self.map_lock:
            entry = self.owner.get(sid)
            if entry is None:
                return
            client, csid = entry
            if kind == b"X":
                del self.owner[sid]
                client.streams.pop(csid, None)
                self.last_busy = time.monotonic()
            close_now = client.gone and not client.streams
        client.send(kind, csid, payload)
        if close_now:
            with contextlib.suppress(OSError):
                client.sock.close()

    def _fail(self, why: str) -> None:
        super()._fail(why)
        self.end_reason = why
        self.ended.set()

    def _alloc(self, client: _Client, csid: int) -> int:
        with self.map_lock:
            for _ in range(65535):
                gsid = self.next_gsid
                self.next_gsid = gsid % 65535 + 1
                if gsid not in self.owner:
                    self.owner[gsid] = (client, csid)
                    client.streams[csid] = gsid
                    return gsid
        raise ConnectionFailed("no free relay stream id")

    def serve_client(self, sock: socket.socket) -> None:
        client = _Client(sock)
        with self.map_lock:
            self.clients.add(client)
            self.last_busy = time.monotonic()
        try:
            client.send(b"H", 0, json.dumps({"mux": 1, "pid": os.getpid(), "host": self.host.name,
                                             "python": self.python, "connects": self.host.connects}).encode())
            for kind, csid, data in _recv_frames(sock):
                if kind == b"Q":
                    self.end_reason = "stopped by `ctl mux stop`"
                    self.ended.set()
                    break
                if kind == b"S":
                    if csid in client.streams:
                        client.send(b"E", csid, b"ctl mux: stream id reused\n")
                        continue
                    self._send(b"S", self._alloc(client, csid), data)
                elif kind in (b"I", b"C"):
                    gsid = client.streams.get(csid)
                    if gsid is not None:
                        self._send(kind, gsid, data)
        except CtlError:
            pass  # the relay channel is gone: _fail has set `ended`
        finally:
            with self.map_lock:
                client.gone = True
                live = list(client.streams.values())
                self.clients.discard(client)
                self.last_busy = time.monotonic()
            for gsid in live:  # the client left: its children see the end of their stdin, as over SSH
                with contextlib.suppress(CtlError):
                    self._send(b"C", gsid)
            if not live:
                with contextlib.suppress(OSError):
                    sock.close()

    def idle_for(self) -> float:
        with self.map_lock:
            if self.clients or self.owner:
                return 0.0
            return time.monotonic() - self.last_busy

    def end(self) -> None:
        why = self.end_reason or "idle"
        with self.map_lock:
            clients = list(self.clients)
        for c in clients:
            c.send(b"D", 0, why.encode())
            with contextlib.suppress(OSError):
                c.sock.close()
        with contextlib.suppress(Exception):
            self.close()
        self.host.close()


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def serve(spec: dict[str, Any]) -> int:
    path = Path(spec["socket"])
    d = _private_dir(create=False)
    if path.parent != d:
        _say({"error": f"socket {path} is not in {d}", "type": "ConnectionFailed"})
        return 1
    lock = open(path.with_suffix(".lock"), "a+")  # noqa: SIM115 - held for the process's life
    fcntl.flock(lock, fcntl.LOCK_EX)  # one session per key: a racing starter waits here, then reuses ours
    existing = _connect(path)
    if existing is not None:
        existing.close()
        _say({"ready": True, "existing": True})
        return 0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # stale: its process is gone (we hold the lock it held)
    ep = SshEndpoint(spec["name"], spec["address"], port=spec["port"], user=spec["user"],
                     identity_file=spec["identity_file"], known_hosts=spec["known_hosts"],
                     connect_timeout=spec["connect_timeout"])
    mux = _Mux(ep, int(spec["idle"]))
    try:
        up = mux.available()
    except CtlError as e:
        _say({"error": e.message, "hint": e.hint, "type": type(e).__name__})
        return 1
    if not up:
        _say({"unavailable": mux.why_unavailable or "ctl's relay did not start"})
        return 1
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    old = os.umask(0o177)
    try:
        srv.bind(_address(path, fds))
    finally:
        os.umask(old)
        for fd in fds:
            os.close(fd)
    os.chmod(path, 0o600)
    srv.listen(64)
    srv.settimeout(0.2)
    info = path.with_suffix(".json")
    info.write_text(json.dumps({"host": ep.name, "address": ep.address, "port": ep.port, "user": ep.user,
                                "pid": os.getpid(), "idle": mux.idle, "started": time.time()}))
    mux.last_busy = time.monotonic()
    _say({"ready": True})
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    try:
        while not mux.ended.is_set():
            if mux.idle_for() >= mux.idle:
                mux.end_reason = f"idle for {mux.idle}s"
                break
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            if _peer_uid(conn) != os.getuid():
                conn.close()
                continue
            conn.settimeout(None)
            threading.Thread(target=mux.serve_client, args=(conn,), daemon=True).start()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(info)
        srv.close()
        sys.stderr.write(f"ctl mux {ep.name} (pid {os.getpid()}): ending: {mux.end_reason or 'idle'}\n")
        mux.end()
    return 0


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
