"""ctl's persistent session process for one host and user: `python -m controller.transport.mux.daemon SPEC`, or a
fork of the command's spare (`... daemon --spare HELD`, spare.py) given the same SPEC.

Started by a command's MuxRelay (client.py) when it finds no session; it connects to the host (host keys
verified as always), starts ctl's host relay over one exec, listens on its Unix socket, says so on stdout
(one JSON line), and serves every later command of the user: each client's streams are renumbered onto the one
relay channel, and the relay's frames routed back to the client that owns them.

It ends:
- idle: no client connected and no stream of a live client for `idle` seconds. It first removes its socket, so
  no new client can reach it, then serves the clients already queued on it (they connected as it decided),
  and exits once they are done: a command that found the session is never cut by its idle timeout;
- stopped (`ctl mux stop`, a newer ctl replacing it, SIGTERM): the same, except that clients still running
  after the grace period get a D frame (SessionEnded) and their streams end;
- at once when its SSH connection or relay drops (D frame: ConnectionDropped / RelayExited).
Why it ended goes to its stderr (`<state>/mux/<key>.log`).

A client that goes away (its process died: a send to it fails) abandons its streams (K): the relay closes
their pipes, as the end of an SSH channel would. A client that only ended its input (shutdown) gets C for
each of its streams and the rest of their output.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from controller.errors import ConnectionFailed, CtlError, SessionEnded
from controller.transport.mux.sock import (
    PROTOCOL,
    build,
    connect,
    end_payload,
    error_doc,
    peer,
    peer_uid,
    private,
    recv_batches,
)
from controller.transport.mux.spare import context_refusal, proc_context
from controller.transport.relay import MAX_SID, HostRelay, pack
from controller.transport.ssh import SshEndpoint
from controller.transport.wire import Kind

# What a client must share with its session: namespaces, capabilities, NoNewPrivs, seccomp (not its cgroup or
# nice: commands of other terminals, in other scopes, use the same session)
SANDBOX = ("ns/", "Cap", "NoNewPrivs", "Seccomp")

STOP_GRACE = 10.0  # seconds clients still running get after SIGTERM


class _Client:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.streams: dict[int, int] = {}  # client's stream id -> relay stream id
        self.eof = False  # it ended its input (or its connection)
        self.gone = False  # a send to it failed: its process is gone; its streams are abandoned
        self.sending = 0  # batches of the relay's frames collected for it and not yet written (under map_lock)

    def send(self, kind: bytes, sid: int, data: bytes = b"") -> bool:
        return self.send_packed(pack([(kind, sid, data)]))

    def send_packed(self, frames: bytes) -> bool:
        with self.lock:
            if self.gone:
                return False
            try:
                self.sock.sendall(frames)
            except OSError:
                self.gone = True
                return False
            return True


class _Mux(HostRelay):
    """The session's end of the relay channel: frames of the relay go to the client that owns the stream."""

    def __init__(self, host: SshEndpoint, idle: int) -> None:
        super().__init__(host)
        self.idle = idle
        self.map_lock = threading.Lock()
        self.owner: dict[int, tuple[_Client, int]] = {}  # relay stream id -> (client, its stream id)
        self.clients: set[_Client] = set()
        self.last_busy = time.monotonic()
        self.ended = threading.Event()  # the relay or the SSH connection is gone: end now
        self.end_reason: ConnectionFailed | None = None
        self.stop_asked: tuple[str, float] | None = None  # (why, deadline): take no client, end when done
        self.next_gsid = 1
        self.asking: list[_Client] = []  # clients waiting for the relay's T (its staying agents), in order
        # Compared with each client's, read from its /proc: a sandboxed command of the same uid (another mount or
        # user namespace, fewer capabilities, NoNewPrivs, seccomp) is refused and connects by itself, so the
        # session's root login on the host is not lent to it
        self.context = proc_context(os.getpid())

    def _dispatch_batch(self, batch: list[tuple[bytes, int, bytes]]) -> None:
        """The relay's frames of one read, to the clients that own their streams: one write per client."""
        out: dict[_Client, list[tuple[bytes, int, bytes]]] = {}
        for kind, sid, payload in batch:
            if kind == Kind.AGENTS and sid == 0:
                with self.map_lock:
                    asker = self.asking.pop(0) if self.asking else None
                if asker is not None:
                    out.setdefault(asker, []).append((Kind.AGENTS, 0, payload))
                continue
            with self.map_lock:
                entry = self.owner.get(sid)
                if entry is None:
                    continue
                client, csid = entry
                if kind == Kind.EXIT:  # forgotten before the client reads X: it may reuse the id at once
                    del self.owner[sid]
                    client.streams.pop(csid, None)
                    self.last_busy = time.monotonic()
                if client not in out:
                    client.sending += 1  # its socket stays open until these frames are written (serve_client)
            out.setdefault(client, []).append((kind, csid, payload))
        for client, frames in out.items():
            if not client.send_packed(pack(frames)):
                self._abandon(client)
            with self.map_lock:
                client.sending -= 1
                close_now = client.eof and not client.streams and not client.sending
            if close_now:
                with contextlib.suppress(OSError):
                    client.sock.close()

    def _abandon(self, client: _Client) -> None:
        """The client's process is gone: its children see their pipes close (K), as when an SSH channel ends."""
        with self.map_lock:
            live = list(client.streams.values())
        for gsid in live:
            with contextlib.suppress(CtlError):
                self._send(Kind.ABANDON, gsid)

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

    def admit(self, sock: socket.socket) -> None:
        """A new client, counted as busy from this moment (before its thread runs)."""
        client = _Client(sock)
        with self.map_lock:
            self.clients.add(client)
            self.last_busy = time.monotonic()
        threading.Thread(target=self.serve_client, args=(client,), daemon=True).start()

    def serve_client(self, client: _Client) -> None:
        sock = client.sock
        try:
            refused = context_refusal(self.context, peer(sock)[0], SANDBOX)
            client.send(Kind.HELLO, 0, json.dumps({"mux": PROTOCOL, "build": build(), "pid": os.getpid(),
                                             "host": self.host.name, "python": self.python or "?",
                                             "connects": self.host.connects, "idle": self.idle,
                                             "relay": 3 if self.staying else 2,
                                             "hostkey": self.host.server_key,
                                             **({"refused": refused} if refused else {})}).encode())
            if refused:
                return
            for batch in recv_batches(sock):
                if not self._forward(client, batch):
                    break
        except CtlError:
            pass  # the relay channel is gone: _fail has set `ended`
        finally:
            with self.map_lock:
                client.eof = True
                live = list(client.streams.values())
                sending = client.sending  # the relay's reader closes the socket once those frames are out
                self.clients.discard(client)
                self.last_busy = time.monotonic()
            # Ended its input only (a command closing while its streams finish), or gone? A frame it ignores
            # (N) tells: the kernel refuses it when the peer closed its socket.
            if live and not client.send(Kind.NOTHING, 0):
                self._abandon(client)
            else:
                for gsid in live:  # its children see the end of their stdin, as over SSH
                    with contextlib.suppress(CtlError):
                        self._send(Kind.CLOSE, gsid)
            if not live and not sending:
                with contextlib.suppress(OSError):
                    sock.close()

    def _forward(self, client: _Client, batch: list[tuple[bytes, int, bytes]]) -> bool:
        """A client's frames of one read to the relay, renumbered, in one write (a request's start, input and
        close: one SSH packet); False at its Q (stop the session)."""
        out: list[tuple[bytes, int, bytes]] = []
        try:
            return self._collect(client, batch, out)
        finally:
            if out:  # also what came before a failure (no free stream id): those streams are registered
                self._send_frames(out)

    def _collect(self, client: _Client, batch: list[tuple[bytes, int, bytes]], out: list[tuple[bytes, int, bytes]]
                 ) -> bool:
        for kind, csid, data in batch:
            if kind == Kind.STOP:
                if out:  # what came before it goes first
                    self._send_frames(out)
                    out.clear()
                try:
                    grace = float(json.loads(data or b"{}").get("grace", STOP_GRACE))
                except (ValueError, AttributeError):
                    grace = STOP_GRACE
                self.ask_stop("stopped by `ctl mux stop`", grace)
                return False
            if kind == Kind.AGENTS and csid == 0:
                if self.staying:
                    with self.map_lock:
                        self.asking.append(client)
                    out.append((Kind.AGENTS, 0, b""))
                else:
                    client.send(Kind.AGENTS, 0, b'{"agents": []}')
                continue
            if kind in (Kind.START, Kind.AGENT):
                if csid in client.streams:
                    client.send(Kind.STDERR, csid, b"ctl mux: stream id reused\n")
                    continue
                out.append((kind, self._alloc(client, csid), data))
            elif kind in (Kind.STDIN, Kind.CLOSE, Kind.ABANDON):
                gsid = client.streams.get(csid)
                if gsid is not None:
                    out.append((kind, gsid, data))
        return True

    def ask_stop(self, why: str, grace: float) -> None:
        """Take no new client; end once the clients are done, or `grace` seconds from now (the earliest asked)."""
        deadline = time.monotonic() + max(0.0, grace)
        with self.map_lock:
            if self.stop_asked is None or deadline < self.stop_asked[1]:
                self.stop_asked = (self.stop_asked[0] if self.stop_asked else why, deadline)

    def busy(self) -> bool:
        """A client is connected, or a stream of a client that is still there runs."""
        with self.map_lock:
            return bool(self.clients) or any(not c.gone for c, _ in self.owner.values())

    def idle_for(self) -> float:
        if self.busy():
            return 0.0
        with self.map_lock:
            return time.monotonic() - self.last_busy

    def end(self) -> None:
        end = self.end_reason or SessionEnded("idle")
        with self.map_lock:
            clients = list(self.clients) + [c for c, _ in self.owner.values()]
        for c in set(clients):
            c.send(Kind.ENDED, 0, end_payload(end))
            with contextlib.suppress(OSError):
                c.sock.close()
        with contextlib.suppress(Exception):
            self.close()
        self.host.close()


def _say(doc: dict[str, Any]) -> None:
    """One line to the command that started us. It may have gone (it failed on its own, or was killed) while we
    started: the session still serves the next command, so a closed pipe is not our end."""
    try:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def _unlink_if(path: Path, ident: tuple[int, int]) -> None:
    """Remove path only while it is still the file we made (a newer session may have bound the same name)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == ident:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def serve(spec: dict[str, Any]) -> int:
    path = Path(spec["socket"])
    info = Path(spec["info"])
    try:
        private(path.parent, create=False, what="ctl's socket directory")
        private(info.parent, create=False, what="ctl's session directory")
        existing = connect(path)
    except CtlError as e:
        _say(error_doc(e))
        return 1
    if existing is not None:  # started by hand next to a live one: keep that one
        existing.close()
        _say({"ready": True, "existing": True})
        return 0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # stale: nothing listens there (the starter holds the spawn lock)
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
    old = os.umask(0o177)
    try:
        try:
            srv.bind(str(path))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            # Another session of the same key came up while we connected (the spawn lock is ctl's; a session
            # started by hand does not take it): use that one, or take the name of one that is gone.
            existing = connect(path)
            if existing is not None:
                existing.close()
                srv.close()
                mux.end()
                _say({"ready": True, "existing": True})
                return 0
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            srv.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    st = os.lstat(path)
    ident = (st.st_dev, st.st_ino)
    srv.listen(128)
    srv.settimeout(0.2)
    if isinstance(spec.get("lock_fd"), int) and spec["lock_fd"] > 2:  # never one of our standard streams
        # The starter's spawn lock, held through our start so that no second session starts beside us even
        # when the starter went away; a command waiting on it now finds us listening.
        with contextlib.suppress(OSError):
            os.close(spec["lock_fd"])
    part = info.with_name(f".{info.name}.{os.getpid()}")
    part.write_text(json.dumps({"host": ep.name, "address": ep.address, "port": ep.port, "user": ep.user,
                                "pid": os.getpid(), "idle": mux.idle, "started": time.time(), "socket": str(path),
                                "build": build()}))
    part.replace(info)
    mux.last_busy = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: mux.ask_stop("got SIGTERM", STOP_GRACE))
    _say({"ready": True})
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)

    def admit(conn: socket.socket) -> None:
        if peer_uid(conn) != os.getuid():
            conn.close()
            return
        conn.settimeout(None)
        mux.admit(conn)

    why = "idle"
    try:
        while not mux.ended.is_set():
            asked = mux.stop_asked
            if asked is None and mux.idle_for() < mux.idle:
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                admit(conn)
                continue
            # Ending: first no new client can find us, then the ones already queued are served.
            _unlink_if(path, ident)
            srv.setblocking(False)
            while True:
                try:
                    conn, _ = srv.accept()
                except (BlockingIOError, InterruptedError):
                    break
                admit(conn)
            srv.close()
            why = f"idle for {mux.idle}s" if asked is None else asked[0]
            while not mux.ended.is_set() and mux.busy():
                asked = mux.stop_asked  # a stop may come while the queued clients of an idle end run
                if asked is not None and time.monotonic() >= asked[1]:
                    why = f"{asked[0]}; ended the commands still using it"
                    break
                time.sleep(0.05)
            break
    finally:
        _unlink_if(path, ident)
        srv.close()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(info.read_text()).get("pid") == os.getpid():
                info.unlink()
        if mux.end_reason is None:
            mux.end_reason = SessionEnded(why)
        sys.stderr.write(f"ctl mux {ep.name} (pid {os.getpid()}): ending: {mux.end_reason.message}\n")
        mux.end()
    return 0


def warm() -> None:
    """What every session process does before it can connect, done by the spare before it knows its host."""
    from controller.transport.ssh import _paramiko

    _paramiko()
    build()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--spare"]:  # --spare HELD (spare.py)
        from controller.transport.mux import spare

        warm()
        sys.exit(spare.serve(serve, int(sys.argv[2])))
    sys.exit(serve(json.loads(sys.argv[1])))
