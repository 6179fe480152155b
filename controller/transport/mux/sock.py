"""The session socket: where it lives, who may use it, and its frames (shared by client.py and daemon.py).

Place: `<state dir>/mux/<key>.sock`, the directory 0700 and owned by the user, the socket 0600; `<key>` is a
hash of host name, address, port, user, identity file, known_hosts, the relay's source and PROTOCOL, so a
changed inventory or a newer ctl gets a new session. Beside it: `<key>.json` (what `ctl mux status` shows),
`<key>.log` (the session's stderr: why it ended), `<key>.lock` (held by the live session process).

Frames: the host relay's (controller/remote/hostrelay.py): 7-byte header (kind: 1 byte, stream id: 2 bytes,
length: 4 bytes, big-endian), then the data. Stream ids are the client's own; the session renumbers them
onto its one relay channel.
  client -> session   S start (JSON argv)   I stdin data   C close that stdin
                      Q (stream 0) stop the session (`ctl mux stop`)
  session -> client   H (stream 0, on connect) hello, JSON {"mux": PROTOCOL, "pid", "host", "python", "connects"}
                      O stdout data   E stderr data   X exit status (ASCII)
                      D (stream 0) the session ended, then it closes the socket: JSON {"kind", "why"}, kind
                        one of ENDS (ConnectionDropped, RelayExited, SessionEnded)
The spawn handshake (daemon's stdout, one JSON line) reports errors the same way: {"error", "hint", "type"}.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controller.errors import (
    ConnectionDropped,
    ConnectionFailed,
    CtlError,
    HostKeyError,
    RelayExited,
    SessionEnded,
)
from controller.transport.relay import _CHUNK, HEADER, frames, relay_source
from controller.transport.ssh import SshEndpoint

PROTOCOL = 2  # in the hello and the socket's name: a client never talks to a session of another protocol
_MAX_SUN_PATH = 100  # sockaddr_un holds 108 bytes; longer paths go through /proc/self/fd/N/

# Failures that cross the socket (D frames, the spawn handshake) by type name; others arrive as CtlError.
ENDS: dict[str, type[ConnectionFailed]] = {c.__name__: c for c in (ConnectionDropped, RelayExited, SessionEnded)}
_WIRE_ERRORS: dict[str, type[CtlError]] = {"ConnectionFailed": ConnectionFailed, "HostKeyError": HostKeyError, **ENDS}


def mux_dir() -> Path:
    from controller.settings import state_dir

    return state_dir() / "mux"


def private_dir(create: bool) -> Path:
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
    """Names a session: what the connection is (inventory + relay version + PROTOCOL), never any secret."""
    ident = json.dumps([ep.name, ep.address, ep.port, ep.user, ep.identity_file, ep.known_hosts,
                        hashlib.sha256(relay_source()).hexdigest(), PROTOCOL])
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def address(path: Path, keep: list[int]) -> str:
    """path, or /proc/self/fd/N/name when path is too long for a Unix socket address (keep holds N)."""
    if len(os.fsencode(str(path))) <= _MAX_SUN_PATH:
        return str(path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    keep.append(fd)
    return f"/proc/self/fd/{fd}/{path.name}"


def connect(path: Path) -> socket.socket | None:
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
        sock.connect(address(path, fds))
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    finally:
        for fd in fds:
            os.close(fd)
    return sock


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def send_frame(sock: socket.socket, kind: bytes, sid: int, data: bytes = b"") -> None:
    sock.sendall(HEADER.pack(kind, sid, len(data)) + data)


def recv_frames(sock: socket.socket) -> Iterator[tuple[bytes, int, bytes]]:
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


def end_payload(end: ConnectionFailed) -> bytes:
    """A D frame's data: how the session ended, by type, and the reason the user reads."""
    return json.dumps({"kind": type(end).__name__, "why": end.message}).encode()


def end_from(payload: bytes) -> ConnectionFailed:
    """The failure a D frame carries (a kind not in ENDS: a dropped connection)."""
    try:
        doc = json.loads(payload)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return ConnectionDropped(payload.decode("utf-8", "replace"))
    return ENDS.get(str(doc.get("kind")), ConnectionDropped)(str(doc.get("why", "")))


def error_doc(e: CtlError) -> dict[str, Any]:
    return {"error": e.message, "hint": e.hint, "type": type(e).__name__}


def error_from(doc: dict[str, Any]) -> CtlError:
    return _WIRE_ERRORS.get(str(doc.get("type", "")), CtlError)(str(doc["error"]), hint=doc.get("hint"))
