"""The user's command server: ctl imported once, forked for each command line (served.py is the client, and says
why and what the wire is).

Started by a command that found none (`python -P -c BOOT SOCKET KEY IDLE SYS.PATH...`, in a session of its own,
stdin and stdout /dev/null, stderr `cmd-KEY.log` beside the socket). It takes the socket's lock (one server per
key), imports what commands use (PRELOAD) while it records which environment variables those imports read, and
listens on `cmd-KEY.sock` (0600, in the user's 0700 socket directory; a peer of another uid is dropped). It is
never threaded, so each fork is a clean copy.

For each command: the request and the client's descriptors arrive; the server checks the key, that every
variable its imports read has the same value in the command's environment, and, reading the client's /proc by
the pid the kernel gives (SO_PEERCRED), that the client's namespaces, cgroup, capabilities, NoNewPrivs, seccomp,
groups and niceness are the server's own (the key is the client's word; a sandboxed client must not get its
command forked outside its sandbox); else "refuse", and the client runs the command itself. Then it forks,
answers "pid N", and lets the child start on the client's "go", however late (a client that gave up in the
meantime never has its command run twice). The child makes a process group of its own (the client signals that
group), takes the client's descriptors as 0, 1, 2 and its directory, its
environment (and TZ), umask and argv, fresh standard streams, the client's signal dispositions, and returns out
of the server's loop to run `ctl` as a started process would, to its normal exit (atexit, threads, exit
status). The server kills it if the client goes away (as the command would have gone with the client), and
sends its exit status when it ends. It starts with no descriptor of its starter's but 0, 1, 2, every signal at
its default, and none blocked.

It exits after IDLE seconds without a command, on `ctl mux stop` or SIGTERM (after its running commands end),
or when a newer one took its socket.
"""

from __future__ import annotations

import contextlib
import os
import sys

from controller.launch.served import FAILED
from controller.transport.mux.spare import context_refusal, proc_context

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

# Modules most commands use: each is a module a forked command does not import again.
PRELOAD = ("controller.commands.deploy", "controller.commands.runs", "controller.commands.monitor",
           "controller.commands.fanout", "controller.commands.launcher", "controller.commands.reconcile",
           "controller.commands.preflight", "controller.commands.pins", "controller.commands.envprobe",
           "controller.commands.environment", "controller.transport.pool", "controller.transport.pct",
           "controller.transport.mux.client", "controller.registry", "controller.inventory", "controller.launch.early",
           "controller.launch.complete", "controller.launch.coerce", "controller.launch.compspec",
           "controller.cli.names", "controller.core.envlock", "controller.core.render", "controller.commands.supervise",
           "controller.commands.notify", "jinja2", "yaml", "sqlite3", "platformdirs", "rich.console", "rich.table")
#: Seconds a client has to send its whole request once connected (it sends it in one write), and to take an answer.
REQUEST_WAIT = 5.0


def _dispositions(ignored: set[int]) -> None:
    """A forked command's signal actions, set before it may start: never the server's (its SIGTERM handler would
    stop the server from the child, its wake-up fd is the server's), but each as the client was started: the
    signals the client passes on at their defaults (SIGINT: Python's KeyboardInterrupt), except those the client
    was started ignoring (nohup's SIGHUP), which stay ignored."""
    import signal

    from controller.launch.served import FORWARDED

    signal.set_wakeup_fd(-1)
    for n in (getattr(signal, name) for name in FORWARDED):
        signal.signal(n, signal.SIG_IGN if n in ignored else
                      signal.default_int_handler if n == signal.SIGINT else signal.SIG_DFL)


def _preload() -> set[str]:
    """Import PRELOAD and every cli module; the names of the environment variables those imports read ("*":
    one of them read it all)."""
    import importlib

    reads: set[str] = set()
    real = os.environ

    class Recording(type(real)):  # type: ignore[misc]
        def __getitem__(self, name: str) -> str:
            reads.add(name)
            return str(super().__getitem__(name))

        def __contains__(self, name: object) -> bool:
            reads.add(str(name))
            return bool(super().__contains__(name))

        def __iter__(self) -> Any:
            reads.add("*")
            return super().__iter__()

    os.environ = Recording(real._data, real.encodekey, real.decodekey,  # type: ignore[attr-defined]  # noqa: B003
                           real.encodevalue, real.decodevalue)
    try:
        from controller.launch.main import build_all

        build_all()
        for name in PRELOAD:
            with contextlib.suppress(ImportError):  # an optional one not installed
                importlib.import_module(name)
    finally:
        os.environ = real  # noqa: B003 - the same object, put back
    return reads


def main() -> None:
    import fcntl

    from controller.launch import served

    path, key, idle = sys.argv[1], sys.argv[2], float(sys.argv[3])
    os.closerange(3, 1 << 20)  # nothing of the starter's (a lock, a pipe) may live on here, or in each command
    os.chdir("/")
    os.umask(0o077)
    lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another command started this key's server a moment ago
    if served.key(os.environ) != key:
        return _leave(path, lock)  # ctl changed since the command that started this one computed the key
    try:
        reads = _preload()
    except BaseException as e:  # a broken install: commands run in their own process, none starts us again
        if served.key(os.environ) == key:  # (not ctl changing under us: its next command starts a new key's)
            _failed(path, e)
        return _leave(path, lock)
    if served.key(os.environ) != key:
        return _leave(path, lock)  # changed while it loaded: what it imported may be half old
    import gc
    import socket

    gc.freeze()  # what was imported is never scanned again: a fork's collections do not copy its pages
    with_env = {n: os.environ.get(n) for n in reads if n != "*"}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead server's (we hold the lock)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    req = Server(listener, path, key, idle, lock, reads, with_env).serve()
    if req is None:
        return
    req.become()
    _stop_if_off()
    from controller.launch.main import run_here

    _run_and_exit(run_here)


def _stop_if_off() -> None:
    """The config file now says `persist: 0` (CTL_PERSIST=0 never reaches a server): this command is the server's
    last; it stops taking new ones."""
    import signal

    with contextlib.suppress(Exception):  # a config the command itself will refuse, in words
        from controller import settings

        if settings.persist_seconds() == 0:
            os.kill(os.getppid(), signal.SIGTERM)


def _run_and_exit(fn: Any) -> None:
    """Run fn as the interpreter runs a program, to the same exit, but leave with os._exit: a full finalization
    tears down every module and object the server imported, and in a fork each object it touches is a page copied
    (~0.1 s for a command that itself took 0.05 s). What finalization does that a command can see is done here,
    in its order (Py_FinalizeEx): wait for non-daemon threads, atexit callbacks, flush stdout and stderr (120
    when that fails)."""
    import atexit

    code = 0
    try:
        fn()
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            sys.stderr.write(f"{e.code}\n")
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -2
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()  # what the interpreter calls at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = 120 if code == 0 else code
    if code == -2:  # an uncaught Ctrl-C ends the process by SIGINT, as the interpreter does
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    os._exit(code)


def _failed(path: str, e: BaseException) -> None:
    """What stopped this server from starting, beside its socket (served.FAILED): commands of this key then run
    in their own process without starting another (each start costs ~0.5 s of CPU, and would fail alike), and
    `ctl mux status` says why. A new key (ctl mended, upgraded) or `ctl mux stop` tries again. The traceback is
    in the log."""
    import traceback

    traceback.print_exc()
    why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    with contextlib.suppress(OSError):
        fd = os.open(path + FAILED, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(why + "\n")


def _leave(path: str, lock: int) -> None:
    """Remove this key's lock and an empty log, so that a key no ctl has any more (each upgrade or edit makes one)
    leaves nothing behind but, for a server that could not start, its log and why (until `ctl mux stop`). A
    server starting for the same key in this instant may hold a lock no longer named here, and a third one then
    another: the second of two such servers takes the socket, the first sees that it is no longer its own and
    exits."""
    with contextlib.suppress(OSError):
        os.unlink(path + ".lock")
    log = path[:-len(".sock")] + ".log"
    with contextlib.suppress(OSError):
        if os.stat(log).st_size == 0:
            os.unlink(log)
    os.close(lock)


def limits_refusal(limits: object) -> str:
    """Why a client's resource limits ({"RLIMIT_NOFILE": [soft, hard], ...}) cannot be a forked command's, else
    "". Hard limits are part of the server's key (served._context): a hard limit above the server's, which only
    a process with CAP_SYS_RESOURCE could raise, is refused all the same."""
    import resource

    from controller.launch.served import rlimits

    mine = rlimits()
    if not isinstance(limits, dict) or set(limits) != set(mine) or not all(
            isinstance(x, list) and len(x) == 2 and all(type(v) is int for v in x) for x in limits.values()):
        return "a request without its resource limits"
    for name, (_, hard) in sorted(mine.items()):
        theirs = limits[name][1]
        if hard != resource.RLIM_INFINITY and (theirs == resource.RLIM_INFINITY or theirs > hard):
            return f"{name}: a hard limit above the server's"
    return ""


class Command:
    """A command this server forked: its pid, a pidfd to learn when it ends, the client's connection."""

    def __init__(self, pid: int, conn: socket.socket, go: int) -> None:
        self.pid, self.conn, self.go = pid, conn, go
        self.pidfd = os.pidfd_open(pid)
        self.buf = b""


class Pending:
    """A connection accepted whose request has not all arrived: read as poll() finds its bytes, so that a client
    that connects and then says nothing (stopped with Ctrl-Z, hung) holds back no other command."""

    def __init__(self, conn: socket.socket, deadline: float, pid: int = 0) -> None:
        self.conn, self.deadline, self.pid = conn, deadline, pid  # pid: the kernel's word (SO_PEERCRED)
        self.msg = b""
        self.fds: list[int] = []

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.conn.close()


class Request:
    """In the forked child: the command line to run and what the client passed."""

    def __init__(self, doc: dict[str, Any], fds: list[int]) -> None:
        self.doc, self.fds = doc, fds

    def become(self) -> None:
        import io

        for target, fd in zip((0, 1, 2), self.fds, strict=False):
            os.dup2(fd, target)
        os.fchdir(self.fds[3])
        for fd in self.fds:
            if fd > 2:
                os.close(fd)
        os.umask(int(self.doc["umask"]))
        import resource

        for name, (soft, hard) in self.doc["rlimits"].items():  # the client's (settable: limits_refusal)
            r = getattr(resource, name)
            if resource.getrlimit(r) != (soft, hard):
                resource.setrlimit(r, (soft, hard))
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in self.doc["env"].items()})
        import time

        time.tzset()  # the client's TZ, for the C library and the time module
        sys.argv = [str(a) for a in self.doc["argv"]]
        # Standard streams as the interpreter makes them (pylifecycle's create_stdio), for these descriptors:
        # line-buffered on a terminal, stderr always; the server's own (closefd=False) close nothing when dropped.
        unbuffered = bool(getattr(sys.stdout, "write_through", False))  # -u or PYTHONUNBUFFERED
        made: list[Any] = []
        for fd, old, name in ((0, sys.stdin, "<stdin>"), (1, sys.stdout, "<stdout>"), (2, sys.stderr, "<stderr>")):
            writing = fd != 0
            buf: Any = open(fd, "wb" if writing else "rb", buffering=0 if unbuffered and writing else -1,  # noqa: SIM115
                            closefd=False)
            raw = buf if unbuffered and writing else buf.raw
            raw.name = name
            stream: Any = io.TextIOWrapper(buf, encoding=old.encoding, errors=old.errors, newline="\n",
                                           line_buffering=not unbuffered and (raw.isatty() or fd == 2),
                                           write_through=unbuffered)
            stream.mode = "w" if writing else "r"
            made.append(stream)
        sys.stdin, sys.stdout, sys.stderr = made
        setattr(sys, "__stdin__", made[0])  # noqa: B010 - typeshed calls them final; the interpreter does not
        setattr(sys, "__stdout__", made[1])  # noqa: B010
        setattr(sys, "__stderr__", made[2])  # noqa: B010


class Server:
    def __init__(self, listener: socket.socket, path: str, key: str, idle: float, lock: int, reads: set[str],
                 with_env: dict[str, str | None]) -> None:
        import time

        self.listener, self.path, self.key, self.idle, self.lock = listener, path, key, idle, lock
        self.reads, self.with_env = reads, with_env
        self.commands: dict[int, Command] = {}
        self.pending: dict[int, Pending] = {}  # by file descriptor
        self.started = self.last = time.time()
        self.served = 0
        self.cpu = 0.0  # CPU seconds of the commands that ended (and of their children that they waited for)
        self.stopping = False
        self.ino = os.stat(path).st_ino
        self.context = proc_context(os.getpid())  # compared with each client's, read from its /proc

    def serve(self) -> Request | None:
        """Answer commands until idle or stopped: None here; a Request in each forked child."""
        import select
        import signal
        import time

        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGTERM, lambda *_: self._stop())
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.wake = (wake_r, wake_w)
        while True:
            now = time.time()
            if not self.commands and (self.stopping or (not self.pending and now - self.last >= self.idle)
                                      or not self._ours()):
                break
            # idle time counts only without commands (each one's end wakes the loop through its pidfd)
            timeout = 30.0 if self.commands or self.pending else min(self.idle - (now - self.last), 30.0)
            if self.pending:
                timeout = min(timeout, min(p.deadline for p in self.pending.values()) - now)
            poll = select.poll()  # not select(): any number of commands, whatever their descriptors' numbers
            fds = [wake_r, *(c.conn.fileno() for c in self.commands.values()),
                   *(c.pidfd for c in self.commands.values()), *self.pending]
            for fd in fds if self.stopping else [*fds, self.listener.fileno()]:
                poll.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poll.poll(max(0.0, timeout) * 1000)}
            if wake_r in ready:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            for c in list(self.commands.values()):
                try:
                    if c.pidfd in ready:
                        self._ended(c)
                    elif c.conn.fileno() in ready:
                        self._from_client(c)
                except OSError as e:  # one command's trouble (its client gone mid-write) is never the server's end
                    sys.stderr.write(f"ctl server: command {c.pid}: {e}\n")
            for fd in [fd for fd in self.pending if fd in ready]:
                req = self._read_request(self.pending[fd])
                if req is not None:
                    return req
            now = time.time()
            for fd, p in list(self.pending.items()):
                if self.stopping or now >= p.deadline:
                    del self.pending[fd]
                    p.close()
                    sys.stderr.write("ctl server: a request dropped: " + ("stopping\n" if self.stopping else
                                     f"not all of it came within {REQUEST_WAIT:.0f} s\n"))
            if not self.stopping and self.listener.fileno() in ready:
                self._accept()
        for p in self.pending.values():
            p.close()
        self._close()
        return None

    def _ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.ino
        except OSError:
            return False

    def _stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            if self._ours():
                os.unlink(self.path)  # no new client finds it
            self.listener.close()  # and one waiting to be accepted is refused at once: it runs its command itself

    def _close(self) -> None:
        if not self.stopping and self._ours():
            os.unlink(self.path)
        self.listener.close()
        _leave(self.path, self.lock)

    def _accept(self) -> None:
        import socket
        import struct
        import time

        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            conn.close()
            return
        pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            conn.close()
            return
        conn.setblocking(False)
        self.pending[conn.fileno()] = Pending(conn, time.time() + REQUEST_WAIT, pid)

    def _read_request(self, p: Pending) -> Request | None:
        """What poll() found of a pending request; once it is whole, the request answered (or, in the forked
        child, returned)."""
        import json
        import socket

        from controller.launch import served

        conn = p.conn
        try:
            more, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)  # the client's descriptors come with its first bytes
            p.fds += fds
            if not more:
                raise ValueError("request cut short")
            p.msg += more
            msg = p.msg
            if len(msg) >= 8 and int.from_bytes(msg[4:8], "big") > served.MAX_MESSAGE:
                raise ValueError("request too large")
            if len(msg) < 8 or len(msg) < 8 + int.from_bytes(msg[4:8], "big"):
                return None  # more to come
            del self.pending[conn.fileno()]
            if msg[:4] != served.MAGIC:
                raise ValueError("not a ctl request")
            doc = json.loads(msg[8:8 + int.from_bytes(msg[4:8], "big")])
            if not isinstance(doc, dict):
                raise ValueError("not a ctl request")
        except BlockingIOError:
            return None
        except (OSError, ValueError) as e:
            self.pending.pop(conn.fileno(), None)
            p.close()
            sys.stderr.write(f"ctl server: a request dropped: {e}\n")
            return None
        fds, p.fds = p.fds, []
        conn.setblocking(True)
        conn.settimeout(REQUEST_WAIT)  # its answer: a client that stopped reading holds the server no longer
        op = doc.get("op")
        if op != "run":
            for fd in fds:
                os.close(fd)
            self._answer_op(conn, op)
            return None
        why = self._refusal(doc, fds) or context_refusal(self.context, p.pid)
        if why:
            for fd in fds:
                os.close(fd)
            self._send(conn, f"refuse {why}\n")
            conn.close()
            return None
        return self._fork(conn, doc, fds)

    def _answer_op(self, conn: socket.socket, op: object) -> None:
        import json
        import time

        if op == "info":
            self._send(conn, json.dumps({"pid": os.getpid(), "started": self.started, "served": self.served,
                                         "running": len(self.commands), "idle": self.idle,
                                         "cpu_s": round(self.cpu, 4),
                                         "idle_for": round(time.time() - self.last, 1)}) + "\n")
        elif op == "stop":
            self._stop()
            self._send(conn, "stopping\n")
        conn.close()

    def _refusal(self, doc: dict[str, Any], fds: list[int]) -> str:
        if doc.get("key") != self.key:
            return "another ctl"
        if len(fds) != 4 or not isinstance(doc.get("env"), dict) or not isinstance(doc.get("argv"), list):
            return "a request without its descriptors"
        env = doc["env"]
        if "*" in self.reads:
            return "the server's imports read the whole environment"
        for name, value in self.with_env.items():
            if env.get(name) != value:
                return f"{name} differs from the server's"
        return limits_refusal(doc.get("rlimits"))

    def _fork(self, conn: socket.socket, doc: dict[str, Any], fds: list[int]) -> Request | None:
        import time

        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            _dispositions({int(n) for n in doc.get("ignored") or []})
            os.setpgid(0, 0)  # a group of its own: the client's signals reach it and what it starts, as Ctrl-C does
            os.close(go_w)
            self._drop_for_child()
            if os.read(go_r, 1) != b"g":
                os._exit(0)  # the client gave up before "go": the command runs there, not here
            os.close(go_r)
            conn.detach()  # kept open, unused: the client waits for our end as long as the command runs
            return Request(doc, fds)
        os.close(go_r)
        for fd in fds:
            os.close(fd)
        self.served += 1
        self.last = time.time()
        cmd = Command(pid, conn, go_w)
        self.commands[pid] = cmd
        conn.setblocking(False)
        if not self._send(conn, f"pid {pid}\n"):
            self._no_go(cmd)
        return None

    def _drop_for_child(self) -> None:
        """Close in the child what is the server's: its socket, lock, wake pipe, the other commands' ends."""
        self.listener.close()
        os.close(self.lock)
        for fd in self.wake:
            os.close(fd)
        for c in self.commands.values():
            c.conn.close()
            os.close(c.pidfd)
            if c.go >= 0:
                os.close(c.go)
        for p in self.pending.values():
            p.close()

    @staticmethod
    def _send(conn: socket.socket, text: str) -> bool:
        try:
            conn.sendall(text.encode())
            return True
        except OSError:
            return False

    def _from_client(self, c: Command) -> None:
        """"go" lets the command start; the end of the connection before it ends means its client is gone (the
        client signals the command's group itself)."""
        import signal

        try:
            data = c.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client went away: so does its command, as it would have gone with the client
            if c.go >= 0:
                self._no_go(c)
            else:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(c.pidfd, signal.SIGKILL)
            return
        c.buf += data
        while b"\n" in c.buf:
            line, _, c.buf = c.buf.partition(b"\n")
            if line == b"go" and c.go >= 0:
                try:
                    os.write(c.go, b"g")
                finally:
                    os.close(c.go)
                    c.go = -1

    def _no_go(self, c: Command) -> None:
        """The client gave up, or went, before its "go": the child exits unstarted."""
        if c.go >= 0:
            os.close(c.go)
            c.go = -1

    def _ended(self, c: Command) -> None:
        _, status, usage = os.wait4(c.pid, 0)
        self.cpu += usage.ru_utime + usage.ru_stime
        del self.commands[c.pid]
        os.close(c.pidfd)
        if c.go >= 0:
            os.close(c.go)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        c.conn.setblocking(True)
        c.conn.settimeout(2.0)
        self._send(c.conn, f"signal {sig}\n" if sig else f"exit {os.WEXITSTATUS(status)}\n")
        c.conn.close()
        import time

        self.last = time.time()
