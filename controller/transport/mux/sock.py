"""The session socket: where it lives, who may use it, its frames (the wire protocol), and the checks a client
makes of the session it finds (shared by client.py and daemon.py).

Places. The socket lives in a short per-user directory, `$XDG_RUNTIME_DIR/ctl` (when that is the user's own
0700 directory) or `/tmp/ctl-<uid>`: a Unix socket's path must fit in 104 bytes (macOS; 108 on Linux), and a
state directory can be longer than that. The directory is created 0700 and used only while it is a directory
(not a symlink) owned by the user with no access for others: another user's directory, or one others may
enter, is refused with one line, never used. The socket is `<key>.sock`, 0600; `<key>` is a hash of the state
directory and the connection (host name, address, port, user, identity file, known_hosts), so each state
directory has its own sessions and a changed inventory gets a new one. Beside the state, in `<state dir>/mux/`
(0700): `<key>.json` (what `ctl mux status` shows), `<key>.log` (the session's stderr: why it ended),
`<key>.spawn` (held by the one command that starts the session; the others wait, then reuse it).

The key holds no version: a newer ctl finds a session of an older one at the same path, reads its hello, and
replaces it (BUILD or PROTOCOL differ), as it does a session whose host key known_hosts no longer lists.

Frames: the host relay's (controller/farside/relay/): 7-byte header (kind: 1 byte, stream id: 2 bytes,
length: 4 bytes, big-endian), then the data. Stream ids are the client's own; the session renumbers them
onto its one relay channel.
  client -> session   S start (JSON argv)   I stdin data   C close that stdin   K abandon that stream
                      Q (stream 0) stop the session: JSON {"grace": seconds} (`ctl mux stop`); it takes no new
                        client and ends once its clients are done, or after grace seconds
  session -> client   H (stream 0, on connect) hello, JSON {"mux": PROTOCOL, "build": BUILD, "pid", "host",
                        "python", "connects", "idle", "hostkey": {"label", "type", "key"}}
                      O stdout data   E stderr data   X exit status (ASCII)
                      D (stream 0) the session ended, then it closes the socket: JSON {"kind", "why"}, kind
                        one of ENDS (ConnectionDropped, RelayExited, SessionEnded)
The spawn handshake (daemon's stdout, one JSON line) reports errors the same way: {"error", "hint", "type"}.
Each kind's name in ctl's code: transport/wire.py (Kind).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import json
import os
import re
import socket
import stat
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from controller.errors import (
    ConnectionDropped,
    ConnectionFailed,
    CtlError,
    DeadlineExceeded,
    HostKeyError,
    RelayExited,
    SessionEnded,
)
from controller.transport.mux.spare import ours_alone, socket_place
from controller.transport.relay import _CHUNK, HEADER, frame_batches, relay_source
from controller.transport.ssh import SshEndpoint

PROTOCOL = 3  # in the hello: a client replaces a session that speaks another protocol
MAX_SUN_PATH = 104  # the smallest sockaddr_un path limit ctl may meet (macOS: 104 bytes, Linux: 108)

# Failures that cross the socket (D frames, the spawn handshake) by type name; others arrive as CtlError.
ENDS: dict[str, type[ConnectionFailed]] = {c.__name__: c for c in (ConnectionDropped, RelayExited, SessionEnded)}
# the errors a session process may meet as it starts, rebuilt by type on the command's side (their exit codes)
_WIRE_ERRORS: dict[str, type[CtlError]] = {"ConnectionFailed": ConnectionFailed, "DeadlineExceeded": DeadlineExceeded,
                                           "HostKeyError": HostKeyError, **ENDS}


@functools.lru_cache(maxsize=1)
def build() -> str:
    """What this ctl's session and relay are made of: a session built from other sources is replaced."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256(relay_source())
    for f in (here / "daemon.py", here / "sock.py", here.parent / "relay.py", here.parent / "ssh.py"):
        h.update(f.read_bytes())
    return f"{PROTOCOL}-{h.hexdigest()[:16]}"


# --- places ----------------------------------------------------------------------------------------------


def mux_dir() -> Path:
    """Where the sessions of this state directory keep their info, logs and spawn locks."""
    from controller.settings import state_dir

    return state_dir() / "mux"


def _refuse(d: Path, st: os.stat_result, what: str) -> ConnectionFailed:
    kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else
            "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory")
    return ConnectionFailed(
        f"refusing {what} {d}: it must be a directory owned by uid {os.getuid()} with mode 0700 "
        f"(found {kind}, owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); another user's is never used",
        hint=f"remove it (rm -r {d}) and the next command recreates it, or turn sessions off with CTL_PERSIST=0")


def private(d: Path, *, create: bool, what: str, parents: bool = False) -> Path:
    """d as a directory only we may enter: created 0700 when asked; refused when it is a symlink, not ours, or
    open to others."""
    if create:
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700, parents=parents)
    st = os.lstat(d)
    if not ours_alone(st):
        raise _refuse(d, st, what)
    return d


def private_dir(create: bool) -> Path:
    """The state directory's `mux/` (info, logs, spawn locks), 0700."""
    return private(mux_dir(), create=create, what="ctl's session directory", parents=True)


def socket_dir(create: bool) -> Path:
    """The short per-user directory of the sockets: $XDG_RUNTIME_DIR/ctl when XDG_RUNTIME_DIR is our own 0700
    directory, else /tmp/ctl-<uid> (spare.socket_place)."""
    return private(Path(socket_place(os.environ)), create=create, what="ctl's socket directory")


_SQUAT_WARNED: set[str] = set()


def squatted(warn: Callable[[str], None] | None = None) -> bool:
    """Whether the socket directory exists but is not ours alone (another user made /tmp/ctl-<uid> first: cron,
    sudo or ssh without pam_systemd leave XDG_RUNTIME_DIR unset). Then the command connects directly, without
    persistent sessions, and says so once per process: a squatter must not stop every command, and its
    directory is never used."""
    d = socket_place(os.environ)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    if ours_alone(st):
        return False
    if d not in _SQUAT_WARNED and warn is not None:
        _SQUAT_WARNED.add(d)
        why = _refuse(Path(d), st, "ctl's socket directory").message.split(";")[0]
        warn(f"{why}; persistent sessions are off, connecting directly (remove it, or set XDG_RUNTIME_DIR to a "
             "directory of yours)")
    return True


def session_key(ep: SshEndpoint, state: Path | None = None) -> str:
    """Names a session: this state directory and what the connection is, never any secret."""
    if state is None:
        state = mux_dir().parent
    ident = json.dumps([os.path.abspath(state), ep.name, ep.address, ep.port, ep.user, ep.identity_file,
                        ep.known_hosts])
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def check_length(path: Path) -> None:
    if len(os.fsencode(str(path))) >= MAX_SUN_PATH:
        raise ConnectionFailed(f"ctl's session socket {path} is longer than a Unix socket path may be "
                               f"({MAX_SUN_PATH} bytes)", hint="set XDG_RUNTIME_DIR to a short directory of yours, "
                                                               "or CTL_PERSIST=0")


# --- the socket --------------------------------------------------------------------------------------------


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
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    return sock


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (the kernel's word, SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def peer_uid(sock: socket.socket) -> int:
    return peer(sock)[1]


def send_frame(sock: socket.socket, kind: bytes, sid: int, data: bytes = b"") -> None:
    sock.sendall(HEADER.pack(kind, sid, len(data)) + data)


def recv_frames(sock: socket.socket) -> Iterator[tuple[bytes, int, bytes]]:
    """Yield (kind, sid, data) until the peer ends the connection (or it breaks)."""
    for batch in recv_batches(sock):
        yield from batch


def recv_batches(sock: socket.socket) -> Iterator[list[tuple[bytes, int, bytes]]]:
    """The frames of each read, as lists, until the peer ends the connection (or it breaks)."""

    def chunks() -> Iterator[bytes]:
        while True:
            try:
                data = sock.recv(_CHUNK)
            except OSError:
                return
            if not data:
                return
            yield data

    return frame_batches(chunks())


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


# --- known_hosts, without paramiko --------------------------------------------------------------------------


def _glob(label: str, pattern: str) -> bool:
    """OpenSSH's host patterns: `*` and `?` are the only wildcards (`[host]:port` is literal)."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, label, re.IGNORECASE) is not None


def _names(field: str, label: str) -> bool:
    """Whether a known_hosts host field (patterns with `!` negation, or one `|1|salt|hash`) names label."""
    if field.startswith("|1|"):
        try:
            _, _, salt, digest = field.split("|", 3)
            mac = hmac.new(base64.b64decode(salt), label.encode(), hashlib.sha1).digest()
            return hmac.compare_digest(mac, base64.b64decode(digest))
        except (ValueError, binascii.Error):
            return False
    hit = False
    for p in field.split(","):
        neg = p.startswith("!")
        if _glob(label, p[1:] if neg else p):
            if neg:
                return False
            hit = True
    return hit


def still_trusted(known_hosts: str, label: str, key_type: str, key: str) -> str | None:
    """None when known_hosts still lists this key for label (and does not revoke it); else why not, in words."""
    try:
        with open(known_hosts) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        return f"known_hosts {known_hosts} cannot be read ({e})"
    listed = False
    for line in lines:
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if fields[0] == "@revoked":
            if len(fields) >= 4 and fields[2] == key_type and fields[3] == key:
                return f"{known_hosts} revokes it"
            continue
        if fields[0].startswith("@") or len(fields) < 3:
            continue
        if fields[1] == key_type and fields[2] == key and _names(fields[0], label):
            listed = True
    return None if listed else f"{known_hosts} no longer lists it for {label}"
