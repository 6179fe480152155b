"""The client side of ctl's persistent host session: `MuxRelay` (a HostRelay over the session socket), and
`sessions()` / `stop()` for `ctl mux status|stop`. The frames are the relay's plus H, D, N, K and Q (sock.py).

A command that finds no session starts one, under the state directory's spawn lock for that session (so 64
commands started at once start one process, and the others wait and reuse it): a fork of the command's spare
(spare.py) when it has one, else daemon.py with a JSON spec of the connection as its argument and only the
environment it needs; the daemon answers one JSON line on its stdout
once it listens ({"ready"}), when the host cannot run the relay ({"unavailable": why}) or on failure
({"error", "hint", "type"}).

A session found is checked before use: one of another ctl build or protocol, or holding a host key that
known_hosts no longer lists (or revokes), is replaced (asked to stop, killed if it does not), and the user is
told in one line (the `warn` callback).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from controller import settings
from controller.errors import ConnectionDropped, ConnectionFailed, CtlError, DeadlineExceeded
from controller.farside.common import _pid_alive as _alive  # the agent's own test of a pid (zombies are gone)
from controller.transport.base import AgentStart
from controller.transport.mux import spare
from controller.transport.mux.sock import (
    PROTOCOL,
    build,
    check_length,
    connect,
    end_from,
    error_from,
    mux_dir,
    peer,
    private_dir,
    recv_frames,
    send_frame,
    session_key,
    socket_dir,
    still_trusted,
)
from controller.transport.mux.spare import session_env
from controller.transport.relay import HostRelay, StreamEnded, Submission, _RelayDuplex
from controller.transport.ssh import SshEndpoint
from controller.transport.wire import Kind, RelayState

ENV = settings.PERSIST

REPLACE_GRACE = 30.0  # seconds the commands of a replaced (older) session get to finish


class _Started:
    """A session process being started: its pid, the read end of its stdout (one JSON line), and the Popen when
    this command started it (a spare's fork is the spare's child: its end shows as the end of its stdout)."""

    def __init__(self, pid: int, out: Any, proc: subprocess.Popen[bytes] | None) -> None:
        self.pid, self.out, self.proc = pid, out, proc

    def wait(self, timeout: float) -> int | None:
        """Its exit status once it has exited (None for a spare's fork, or when it has not within timeout)."""
        try:
            if self.proc is not None:
                return self.proc.wait(timeout=timeout)
            deadline = time.monotonic() + timeout
            while True:  # to the end of its stdout: it has exited (or closed it), within the deadline
                ready, _, _ = select.select([self.out], [], [], max(0.0, deadline - time.monotonic()))
                if not ready or not os.read(self.out.fileno(), 65536):
                    return None
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.out.close()


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
        """Shut down first: our reader thread blocked in recv() holds the socket past close() (no FIN goes out),
        and the session would count a process that keeps running (the dashboard, a test) as a client for ever."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def exit_status_ready(self) -> bool:
        return False  # a socket has no exit status: its end reads as a dropped connection

    def recv_exit_status(self) -> int:
        return -1


class MuxRelay(HostRelay):
    """HostRelay through the user's persistent session for the host (started here when there is none)."""

    def __init__(self, host: SshEndpoint, idle: int, *, note: Callable[[str], None] | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        super().__init__(host, note=note)
        self.idle = idle
        self.warn = warn
        self.hello: dict[str, Any] = {}
        self.started_session = False  # this command started the session process (a cold session)
        self.replaced: list[str] = []  # why sessions found were replaced (what `warn` was told)
        self._path: Path | None = None
        self._info: Path | None = None

    def what(self) -> str:
        """The session process by pid (from its hello, else from what it wrote beside its socket)."""
        pid = self.hello.get("pid")
        if pid is None and self._info is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                pid = json.loads(self._info.read_text()).get("pid")
        return (f"ctl's session process for {self.host.name} (pid {pid if pid is not None else '?'}; "
                f"`ctl mux stop {self.host.name}` or kill it)")

    # --- finding, checking and starting the session ------------------------------------------------------

    def _start(self) -> None:
        meta = private_dir(create=True)
        key = session_key(self.host, meta.parent)
        path = socket_dir(create=True) / f"{key}.sock"
        check_length(path)
        self._path, self._info = path, meta / f"{key}.json"
        if not self._early_outcome(key):
            return
        why = "no hello"
        for _attempt in range(4):  # a session ending as we connected, or one replaced: connect again
            sock = connect(path)
            if sock is None:
                sock = self._spawn_once(meta, key, path)
                if sock is None:
                    return  # the host cannot run the relay: one exec per container
            chan = _SockChan(sock)
            try:
                hello = self._read_hello(chan)
            except OSError as e:
                hello, why = None, str(e)
            except DeadlineExceeded:
                sock.close()  # the session process accepts (the kernel does) but does not answer: stopped, hung
                raise
            if hello is None:
                sock.close()
                time.sleep(0.05)
                continue
            if hello.get("refused"):  # it reads this process's /proc: another context (a sandbox) goes alone
                sock.close()
                self._state = RelayState.UNAVAILABLE
                self.why_unavailable = f"ctl's session would not serve this process: {hello['refused']}"
                if self.note is not None:
                    self.note(f"{self.host.name}: {self.why_unavailable}; connecting directly")
                return
            stale = self._stale(hello)
            if stale is None:
                break
            self._replace(sock, path, *stale)
        else:
            raise ConnectionFailed(f"{self.host.name}: ctl's session at {path} did not answer ({why})",
                                   hint=f"`ctl mux stop`, or remove {path}")
        self.hello = hello
        self._came_up(chan, hello, "mux")
        if self.note is not None:
            how = "started" if self.started_session else "reused"
            self.note(f"{self.host.name}: {how} ctl's persistent session (pid {hello.get('pid')}, "
                      f"{self.idle}s idle timeout, relay python {hello.get('python')})")

    def _early_outcome(self, key: str) -> bool:
        """What the start begun for this session before the command needed it (start_early) came to, waited for:
        its error raised, the host found unable to run the relay (False), else True (connect to the session).
        The error is the one this start would have met: a host that does not answer is waited for once."""
        with _EARLY_LOCK:
            early = _EARLY.get(key)
            if early is None or early.thread is threading.current_thread():
                return True  # none begun, or this is it
            del _EARLY[key]
        wait = 2 * self._start_wait() + self.hello_timeout  # it may wait for another command's start, then start
        early.thread.join(wait)
        if early.thread.is_alive():
            raise DeadlineExceeded(f"{self.host.name}: ctl's session did not start in {wait:g}s")
        if isinstance(early.outcome, Exception):
            raise early.outcome
        if early.outcome is None or early.outcome[0] is not RelayState.UP:
            self._state = RelayState.UNAVAILABLE
            self.why_unavailable = early.outcome[1] if early.outcome is not None else "ctl's relay did not start"
            if self.note is not None:
                self.note(f"{self.host.name}: {self.why_unavailable}; falling back to one exec per container")
            return False
        self.started_session = early.outcome[1]
        return True

    def _start_wait(self) -> float:
        """Seconds a session process may take to listen: it connects (the endpoint's own connect deadline) and
        starts the relay (its hello deadline), plus its own Python start."""
        return self.host.connect_deadline() + self.hello_timeout + 10

    def _stale(self, hello: dict[str, Any]) -> tuple[str, float] | None:
        """Why the session that said `hello` must not be used, and the grace its commands get (None: use it)."""
        if hello.get("mux") != PROTOCOL or hello.get("build") != build():
            return (f"it runs another ctl (session protocol {hello.get('mux')}, build {hello.get('build', '?')}; "
                    f"this ctl: {build()})"), REPLACE_GRACE
        key = hello.get("hostkey")
        if not isinstance(key, dict) or not all(isinstance(key.get(k), str) for k in ("label", "type", "key")):
            return "it did not say which host key it verified", 0.0
        why = still_trusted(self.host.known_hosts, key["label"], key["type"], key["key"])
        if why is not None:  # nothing more goes over that connection
            return f"the host key it holds ({key['type']} for {key['label']}) is no longer trusted: {why}", 0.0
        return None

    def _replace(self, sock: socket.socket, path: Path, why: str, grace: float) -> None:
        """Stop the session at the other end of sock (its commands get `grace` seconds), wait until its socket
        is gone (SIGTERM, then SIGKILL, when it does not go), and tell the user."""
        pid, uid = peer(sock)
        line = f"{self.host.name}: replaced ctl's session process (pid {pid}): {why}"
        self.replaced.append(line)
        if self.warn is not None:
            self.warn(line)
        with contextlib.suppress(OSError):
            send_frame(sock, Kind.STOP, 0, json.dumps({"grace": grace}).encode())
        sock.close()
        ident = _ident(path)
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and uid == os.getuid() and _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if ident is None or _ident(path) != ident or (sig == signal.SIGKILL and not _alive(pid)):
                    return
                time.sleep(0.02)
        # killed, its socket left behind: the next start finds it stale (nothing listens) and removes it

    def _spawn_once(self, meta: Path, key: str, path: Path) -> socket.socket | None:
        """Under the spawn lock: the session another command started meanwhile, else a new one (None when the
        host cannot run the relay)."""
        wait = self._start_wait()
        old = os.umask(0o077)
        try:
            lock = open(meta / f"{key}.spawn", "a+")  # noqa: SIM115 - closed below
        finally:
            os.umask(old)
        try:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise DeadlineExceeded(f"{self.host.name}: another ctl command has been starting the session "
                                               f"for {wait:g}s (see {meta / (key + '.log')})") from None
                    time.sleep(0.02)
            sock = connect(path)
            if sock is not None:
                return sock
            if not self._spawn(meta, key, path, lock.fileno()):
                return None
            sock = connect(path)
            if sock is None:
                raise ConnectionFailed(f"{self.host.name}: ctl's session process started but {path} does "
                                       f"not answer (see {meta / (key + '.log')})")
            return sock
        finally:
            lock.close()

    def _spawn(self, meta: Path, key: str, path: Path, lock_fd: int) -> bool:
        """Start the session process; True once it listens, False when the host cannot run the relay. It inherits
        the spawn lock (lock_fd) and lets it go once it listens: a command that exits, or is killed, while its
        session starts never lets a second one start beside it. This command's spare (spare.py) forks it when
        it can; else it is started here."""
        ep = self.host
        log = meta / f"{key}.log"
        # Passed at 3 or above: a command started with stdin, stdout or stderr closed has its lock on that fd,
        # which the session's own standard streams would replace (the lock lost) and which it would then close.
        lock_fd = fcntl.fcntl(lock_fd, fcntl.F_DUPFD_CLOEXEC, 3)
        spec = {"name": ep.name, "address": ep.address, "port": ep.port, "user": ep.user,
                "identity_file": ep.identity_file, "known_hosts": ep.known_hosts,
                "connect_timeout": ep.connect_timeout, "idle": self.idle, "socket": str(path),
                "info": str(meta / f"{key}.json"),
                "keepalive_interval": ep.keepalive_interval, "keepalive_count": ep.keepalive_count,
                "request_timeout": ep.request_timeout}
        wait = self._start_wait()
        old = os.umask(0o077)
        try:
            with open(log, "ab") as logf:
                started = self._fork_spare(spec, meta.parent, lock_fd, logf.fileno(), wait)
                if started is None:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "controller.transport.mux.daemon", json.dumps({**spec,
                                                                                              "lock_fd": lock_fd})],
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logf,
                        cwd="/", env=session_env(os.environ, str(meta.parent)), start_new_session=True,
                        close_fds=True, pass_fds=(lock_fd,))
                    assert proc.stdout is not None
                    started = _Started(proc.pid, proc.stdout, proc)
        finally:
            os.umask(old)
            os.close(lock_fd)
        ready, _, _ = select.select([started.out], [], [], wait)
        line = started.out.readline() if ready else b""
        if not ready:
            # Its own deadlines (connect_timeout, the relay's hello) have passed: it hangs (an ssh agent that
            # never answers...). It holds the spawn lock until it listens, so it would keep every later command
            # from starting a session; it is ours and nobody will use it: it goes, with what it started.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started.pid, signal.SIGKILL)
            started.wait(5)
            raise DeadlineExceeded(f"{ep.name}: ctl's session process (pid {started.pid}) did not say it "
                                   f"listens in {wait:g}s and was ended (see {log})")
        try:
            doc = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:
            doc = {}
        if doc.get("ready"):
            started.out.close()
            self.started_session = not doc.get("existing", False)
            return True
        rc = started.wait(30)
        if doc.get("unavailable"):
            self._state = RelayState.UNAVAILABLE
            self.why_unavailable = str(doc["unavailable"])
            if self.note is not None:
                self.note(f"{ep.name}: {doc['unavailable']}; falling back to one exec per container")
            return False
        if "error" in doc:
            raise error_from(doc)
        raise ConnectionFailed(f"{ep.name}: ctl's session process exited {rc if rc is not None else ''}"
                               f"{' ' if rc is not None else ''}before it listened (see {log})")

    @staticmethod
    def _fork_spare(spec: dict[str, Any], state: Path, lock_fd: int, log_fd: int, wait: float) -> _Started | None:
        """The session process forked by this command's spare, or None (no spare, or it could not take it)."""
        found = spare.take()
        if found is None:
            return None
        r, w = os.pipe()
        try:
            pid = found.hand({**spec, "state": str(state)}, lock_fd, log_fd, w, wait)
        finally:
            os.close(w)
        if pid is None:
            os.close(r)
            return None
        return _Started(pid, os.fdopen(r, "rb"), None)

    # --- frames and streams -----------------------------------------------------------------------------

    def _dispatch_batch(self, batch: list[tuple[bytes, int, bytes]]) -> None:
        for i, (kind, sid, payload) in enumerate(batch):
            if sid == 0 and kind == Kind.ENDED:  # the session ended: what came before it is delivered, then the end
                super()._dispatch_batch(batch[:i])
                self._fail(end_from(payload))
                return
        super()._dispatch_batch(batch)

    def _fail(self, end: ConnectionFailed) -> None:
        if isinstance(end, ConnectionDropped) and "ctl's session" not in end.message:
            end = ConnectionDropped(f"{end.message} (ctl's session process, pid {self.hello.get('pid')}, ended; "
                                    "the next ctl command starts a new one)")
        super()._fail(end)

    def may_keep_sources(self) -> bool:
        return self.staying and not self.started_session  # a session earlier commands used

    def _reconnect_if_ended(self) -> None:
        """After the session ended, connect to a new one. Not from the reader thread of the ended one (a callback
        asking the next request): replacing the session waits for that thread to end; its request fails."""
        if threading.current_thread() is self._reader:
            return
        with self._lock:
            with self._cond:
                ended = self._dead is not None
                if ended:
                    self._streams = {}
            if not ended:
                return
            old, self._chan = self._chan, None
            self.closing = True
            if old is not None:
                with contextlib.suppress(OSError):
                    old.close()
            if self._reader is not None:
                self._reader.join(timeout=5)
            self.closing = False
            with self._cond:
                self._dead = None
            self._state = RelayState.NEW
            self.started_session = False
            with self._cond:
                self.sources_sent.clear()  # a new session: a new relay
                self.sources_missing.clear()
            self._start()
            if self._state is not RelayState.UP:
                raise ConnectionFailed(f"{self.host.name}: ctl's session ended and no new one could start")

    def open(self, argv: Sequence[str], *, agent: AgentStart | None = None,
             max_output: int | None = None, stdin: bytes | None = None,
             on_done: StreamEnded | None = None, handle: Submission | None = None) -> _RelayDuplex:
        """Like HostRelay.open; after the session ended, connect to a new one first, as a direct SshEndpoint
        opens a new connection for the next exec after a drop (streams of the old one keep their error). A
        session that ends before this request reached it (its socket refused the start) is replaced and the
        request sent once more: nothing of it ran."""
        self._reconnect_if_ended()
        try:
            return super().open(argv, agent=agent, max_output=max_output, stdin=stdin, on_done=on_done,
                                handle=handle)
        except ConnectionFailed as e:
            with self._cond:
                gone = self._dead is not None
            if not gone:
                raise
            if self.note is not None:
                self.note(f"{self.host.name}: {e.message}; the request did not reach it: sending it again")
        self._reconnect_if_ended()
        return super().open(argv, agent=agent, max_output=max_output, stdin=stdin, on_done=on_done, handle=handle)

    def close(self) -> None:
        chan = self._chan
        if chan is None:
            return
        self.closing = True
        with self._cond:
            live = any(not st.abandoned and st.code is None and st.dead is None for st in self._streams.values())
        if live:  # like a direct exec: end our input and let the children finish
            super().close()
            return
        chan.close()  # nothing running: the session stays for the next command
        self._chan = None


class _Early:
    """A session start begun in the background (start_early); `outcome`, once the thread ends: (RelayState.UP,
    whether it started the session process), (RelayState.UNAVAILABLE, why), or the exception it met (of any type:
    the command raises it as its own start would have; the thread prints nothing)."""

    def __init__(self, ep: SshEndpoint, idle: int, warn: Callable[[str], None] | None) -> None:
        self.ep, self.idle, self.warn = ep, idle, warn
        self.outcome: tuple[RelayState, Any] | Exception | None = None
        self.thread = threading.Thread(target=self._run, name=f"early-{ep.name}", daemon=True)

    def _run(self) -> None:
        relay = MuxRelay(self.ep, self.idle, warn=self.warn)
        try:
            up = relay.available()
            self.outcome = ((RelayState.UP, relay.started_session) if up
                            else (RelayState.UNAVAILABLE, relay.why_unavailable))
        except Exception as e:  # the command raises it (_early_outcome)
            self.outcome = e
        finally:
            relay.close()  # the session stays; the command connects to it again


_EARLY: dict[str, _Early] = {}  # session key -> the start begun for it; the command's MuxRelay takes it
_EARLY_LOCK = threading.Lock()


def start_early(ep: SshEndpoint, idle: int, *, warn: Callable[[str], None] | None = None) -> bool:
    """Begin starting the persistent session for ep in a background thread, so that it comes up while the command
    is still loading; the command's MuxRelay for ep waits for it and meets its outcome, as if it had started it
    itself. Nothing is begun when a socket for the session exists (a session that runs: the command connects to
    it, and checks it, as always) or one was begun already. True when one was begun."""
    key = session_key(ep)
    try:
        if (socket_dir(create=False) / f"{key}.sock").exists():
            return False
    except FileNotFoundError:
        pass  # no socket directory yet: no session
    except CtlError:
        return False  # a directory ctl refuses: the command says so
    with _EARLY_LOCK:
        if key in _EARLY:
            return False
        early = _EARLY[key] = _Early(ep, idle, warn)
    early.thread.start()
    return True


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def sessions(state: Path | None = None) -> list[dict[str, Any]]:
    """The sessions of the state directory (CTL_STATE_DIR's unless given; for `ctl mux status`): the info each
    wrote, and whether it answers."""
    d = mux_dir() if state is None else state / "mux"
    if not d.is_dir():
        return []
    out = []
    for info in sorted(d.glob("*.json")):
        try:
            doc = json.loads(info.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("socket"), str):
            continue
        try:
            sock = connect(Path(doc["socket"]))
        except ConnectionFailed:
            sock = None
        doc["live"] = sock is not None
        if sock is not None:
            doc["agents"] = _agents(sock)
            sock.close()
        out.append(doc)
    return out


def _agents(sock: socket.socket) -> list[dict[str, Any]] | None:
    """The staying agents the session's relay keeps ({"argv", "pid", "requests", "busy", "via": what started it:
    lxc-attach or pct} each, checked), or None
    when it does not say within 2 s."""
    try:
        sock.settimeout(2.0)
        send_frame(sock, Kind.AGENTS, 0)
        for kind, sid, data in recv_frames(sock):
            if kind == Kind.AGENTS and sid == 0:
                doc = json.loads(data)
                break
        else:
            return None
    except (OSError, ValueError, ConnectionFailed):
        return None
    agents = doc.get("agents") if isinstance(doc, dict) else None
    if not isinstance(agents, list):
        return None
    return [{"argv": [str(a) for a in a["argv"]], "pid": int(a["pid"]), "requests": int(a["requests"]),
             "busy": a.get("busy") is True, "via": str(a.get("via", ""))[:40]}
            for a in agents if isinstance(a, dict) and isinstance(a.get("argv"), list)
            and all(isinstance(a.get(k), int) for k in ("pid", "requests"))]


def stop(host: str | None = None, timeout: float = 10.0, grace: float = 0.0,
         state: Path | None = None) -> list[dict[str, Any]]:
    """Ask every live session of the state directory (or those of `host`) to stop, giving the commands still
    using it `grace` seconds; wait until each process is gone (up to grace + timeout). Returns them."""
    stopped = []
    for doc in sessions(state):
        if not doc["live"] or (host is not None and doc.get("host") != host):
            continue
        sock = connect(Path(doc["socket"]))
        if sock is None:
            continue
        pid = peer(sock)[0]
        with contextlib.suppress(OSError):
            send_frame(sock, Kind.STOP, 0, json.dumps({"grace": grace}).encode())
            sock.settimeout(timeout)
            for _ in recv_frames(sock):  # until the session closes us
                pass
        sock.close()
        deadline = time.monotonic() + grace + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped.append(doc)
    return stopped
