"""ctl's persistent session process for one host: `python -m controller.transport.mux.daemon SPEC_JSON`.

Started by client.py, never by hand. It holds the SSH connection and one exec of the host relay, listens
on the socket (sock.py: place, permissions, frames) and maps each client's stream ids onto the relay's.
It answers one JSON line on stdout (client.py says which), then writes nothing there; its stderr is
`<key>.log`, where it says why it ended ("ending: idle for 60s").

It ends (each client still connected gets a D frame saying how, then its socket closes):
  SessionEnded       idle for SECONDS with no client and no stream; or a Q frame (`ctl mux stop`)
  ConnectionDropped  its SSH connection went away
  RelayExited        the host relay exited by itself
A client that leaves closes the stdin of its streams, as the end of an SSH exec would.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from controller.errors import ConnectionFailed, CtlError, SessionEnded
from controller.transport.mux.sock import (
    PROTOCOL,
    address,
    connect,
    end_payload,
    error_doc,
    peer_uid,
    private_dir,
    recv_frames,
    send_frame,
)
from controller.transport.relay import MAX_SID, HostRelay
from controller.transport.ssh import SshEndpoint


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
                send_frame(self.sock, kind, sid, data)
            except OSError:
                self.gone = True


class _Mux(HostRelay):
    """The session's end of the relay channel: frames of the relay go to the client that owns the stream."""

    def __init__(self, host: SshEndpoint, idle: int) -> None:
        super().__init__(host)
        self.idle = idle
        self.map_lock = threading.Lock()
        self.owner: dict[int, tuple[_Client, int]] = {}  # relay stream id -> (client, its stream id)
        self.clients: set[_Client] = set()
        self.last_busy = time.monotonic()
        self.ended = threading.Event()
        self.end_reason: ConnectionFailed | None = None
        self.next_gsid = 1

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

    def _fail(self, end: ConnectionFailed) -> None:
        super()._fail(end)
        self.end_reason = end
        self.ended.set()

    def _alloc(self, client: _Client, csid: int) -> int:
        with self.map_lock:
            for _ in range(MAX_SID):
                gsid = self.next_gsid
                self.next_gsid = gsid % MAX_SID + 1
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
            client.send(b"H", 0, json.dumps({"mux": PROTOCOL, "pid": os.getpid(), "host": self.host.name,
                                             "python": self.python or "?",
                                             "connects": self.host.connects}).encode())
            for kind, csid, data in recv_frames(sock):
                if kind == b"Q":
                    self.end_reason = SessionEnded("stopped by `ctl mux stop`")
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
        end = self.end_reason or SessionEnded("idle")
        with self.map_lock:
            clients = list(self.clients)
        for c in clients:
            c.send(b"D", 0, end_payload(end))
            with contextlib.suppress(OSError):
                c.sock.close()
        with contextlib.suppress(Exception):
            self.close()
        self.host.close()


def _say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def serve(spec: dict[str, Any]) -> int:
    path = Path(spec["socket"])
    d = private_dir(create=False)
    if path.parent != d:
        _say({"error": f"socket {path} is not in {d}", "type": "ConnectionFailed"})
        return 1
    lock = open(path.with_suffix(".lock"), "a+")  # noqa: SIM115 - held for the process's life
    fcntl.flock(lock, fcntl.LOCK_EX)  # one session per key: a racing starter waits here, then reuses ours
    existing = connect(path)
    if existing is not None:
        existing.close()
        _say({"ready": True, "existing": True})
        return 0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # stale: its process is gone (we hold the lock it held)
    ep = SshEndpoint(spec["name"], spec["address"], port=spec["port"], user=spec["user"],
                     identity_file=spec["identity_file"], known_hosts=spec["known_hosts"],
                     connect_timeout=spec["connect_timeout"],
                     keepalive_interval=spec.get("keepalive_interval", 0.0),
                     keepalive_count=spec.get("keepalive_count", 3), request_timeout=spec.get("request_timeout"))
    mux = _Mux(ep, int(spec["idle"]))
    try:
        up = mux.available()
    except CtlError as e:
        _say(error_doc(e))
        return 1
    if not up:
        _say({"unavailable": mux.why_unavailable or "ctl's relay did not start"})
        return 1
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    old = os.umask(0o177)
    try:
        srv.bind(address(path, fds))
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
                mux.end_reason = SessionEnded(f"idle for {mux.idle}s")
                break
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            if peer_uid(conn) != os.getuid():
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
        why = mux.end_reason.message if mux.end_reason is not None else "idle"
        sys.stderr.write(f"ctl mux {ep.name} (pid {os.getpid()}): ending: {why}\n")
        mux.end()
    return 0


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
