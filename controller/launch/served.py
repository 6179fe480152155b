"""A command line run by the user's command server: the client's side, imported before any of ctl's own modules.

Every `ctl` command pays a Python start and ~0.15 s of CPU importing typer, the inventory's model, the transport
and the registry before it does anything; a warm `ctl deploy` that changes nothing is almost all that. So, as
Mercurial's chg does, a command that finds the user's command server (server.py: a process that imported all of
that once) hands it the command line, and the server forks a process that runs it: the client sends its argv,
environment and umask, and passes its stdin, stdout, stderr and working directory as descriptors (SCM_RIGHTS),
so the forked process reads and writes the client's own terminal, pipes and files, in the client's directory.
The client signals the command's process group itself with what it receives (Ctrl-C, SIGTERM, Ctrl-Z and fg),
and exits as the command exits.

The server is kept as persistent host sessions are (CTL_PERSIST, the config file's `persist`: 60 idle seconds
by default, 0 turns both off): a command that found none starts one as it exits (`start_server`). A server
serves only a command that would have run exactly as it does: the same interpreter, flags, sys.path, locale and
PYTHON* variables, the same groups, namespaces, cgroup, capabilities and niceness (`_context`), and ctl's files
as they are now (`key`: their sizes and mtimes, and the mtime of every sys.path directory, so an edit or a `pip
install` makes a new server, and the old one idles out), and the same value of every environment variable that
its imports read (the server checks). Anything else, a server that
does not answer within START_WAIT, a command that needs to be this process (NOT_SERVED: `attach` hands the
terminal to tmux; completion's installer looks for the shell among its parents; `supervise` without --once
runs for days, under whatever service manager, scope or limits its user gave it, where a second of start-up is
nothing), and `python -m controller` (whose sys.path starts with the working directory) run here, as before.
A signal the client was started with ignored (nohup's SIGHUP) stays ignored, in the client and in the command.

What differs in a served command: its parent process is the server (in a session of its own), and it has no
controlling terminal, only the client's descriptors; so it never opens /dev/tty. Its resource limits are the
client's (`ulimit -n` before a command holds for it): hard limits are part of the server's key, soft ones are set
in the forked command. `ctl mux status` lists the user's command servers; `ctl mux stop` stops them.

Only os and sys are imported here, and the interpreter's own C modules (_socket, _signal, _sha256/_sha2,
_json, resource): `socket` and `signal` would load enum and selectors, ~16 ms of every command's start.

Wire (one Unix stream connection per command, in the user's 0700 socket directory, spare.socket_place):
  client -> server  "CTL1" + 4-byte big-endian length + JSON {"op": "run", "key", "argv", "env", "umask",
                    "ignored": signals the client was started ignoring, "rlimits": {"RLIMIT_NOFILE": [soft, hard],
                    ...}}, with descriptors 0, 1, 2 and the working
                    directory (O_PATH) in its first message; then the line "go" (the command may start)
                    ({"op": "info"} and {"op": "stop"}, with no descriptors: `ctl mux status` and `stop`)
  server -> client  lines: "pid N" (forked, waiting for go) or "refuse WHY", then "exit N" or "signal N"
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PROTOCOL = 1
MAGIC = b"CTL1"
START_WAIT = 5.0  # seconds a server has to answer "pid" before the command runs here instead
NOT_SERVED = frozenset({"attach", "--install-completion", "--show-completion"})
SUPPORTED = hasattr(os, "O_PATH") and hasattr(os, "pidfd_open")  # Linux >= 5.3; elsewhere every command runs here
MAX_MESSAGE = 16 << 20  # bytes of one request: argv and environment
# Signals the client passes on to the command (TSTP and CONT too, see _forward); others act on the client alone.
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH", "SIGTSTP", "SIGCONT")


def _sha256() -> Any:
    try:  # the interpreter's own: hashlib would load OpenSSL (~5 ms)
        from _sha256 import sha256
    except ImportError:
        from _sha2 import sha256  # Python 3.12+
    return sha256()


def _stamp(h: Any, root: str) -> None:
    """Each .py file under root: its path, size and mtime."""
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode(errors="surrogateescape"))


def key(environ: Any, path: list[str] | None = None) -> str:
    """What a server must share with a command to run it: interpreter, flags, sys.path, the variables that shape
    the interpreter's start (PYTHON*, locale), and ctl's files and the sys.path directories as they are now."""
    h = _sha256()
    flags = [f"{n}={getattr(sys.flags, n)}" for n in dir(sys.flags)
             if not n.startswith(("_", "n_")) and n not in ("count", "index", "safe_path")]
    path = sys.path if path is None else path
    h.update(repr((PROTOCOL, sys.executable, sys.version, path, flags, sys.warnoptions,
                   sorted(sys._xoptions.items()),
                   sorted((k, v) for k, v in environ.items()
                          if k.startswith(("PYTHON", "LC_")) or k in ("LANG", "LANGUAGE")))).encode(
        errors="surrogateescape"))
    for p in path:
        try:
            h.update(b"%d\n" % os.stat(p or ".").st_mtime_ns)
        except OSError:
            h.update(b"-\n")
    h.update(_context())
    _stamp(h, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return str(h.hexdigest()[:20])


def rlimits() -> dict[str, list[int]]:
    """This process's resource limits, {"RLIMIT_NOFILE": [soft, hard], ...}: what a request carries, the hard
    ones in its key, and what the server compares them with."""
    import resource

    return {n: list(resource.getrlimit(getattr(resource, n))) for n in dir(resource) if n.startswith("RLIMIT_")}


def _context() -> bytes:
    """What a forked command inherits from the server rather than from its client, and a client could differ in:
    groups, namespaces (a toolbox, a sandbox), cgroup (a systemd unit or scope: stopping it stops the server and
    the commands it runs), capabilities, no_new_privs, seccomp, niceness and hard resource limits (which only
    CAP_SYS_RESOURCE may raise: a forked command sets the client's soft ones). A client that differs gets a server
    of its own."""
    parts = [repr((os.getgid(), os.getegid(), sorted(os.getgroups()), os.getpriority(os.PRIO_PROCESS, 0))),
             repr(sorted((n, hard) for n, (_, hard) in rlimits().items()))]
    for ns in ("mnt", "net", "pid", "user", "ipc", "uts", "cgroup"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            parts.append("-")
    for name, keep in (("/proc/self/cgroup", None), ("/proc/self/status", ("Cap", "NoNewPrivs", "Seccomp"))):
        try:
            with open(name, "rb") as f:
                text = f.read()
        except OSError:
            continue
        parts.append((text if keep is None else b"".join(
            line for line in text.splitlines(keepends=True) if line.startswith(tuple(k.encode() for k in keep))))
            .decode(errors="replace"))
    return "\0".join(parts).encode(errors="surrogateescape")


def _socket_dir(environ: Any) -> tuple[str, bool] | None:
    """The user's socket directory and whether it exists yet; None when it is not theirs alone (sock.py refuses
    it in words when a command gets there) or cannot be looked at."""
    from controller.transport.mux.spare import ours_alone, socket_place

    d = socket_place(environ)
    try:
        return (d, True) if ours_alone(os.lstat(d)) else None
    except FileNotFoundError:
        return d, False  # the user's first command: start_server makes it
    except OSError:
        return None


def place(environ: Any) -> str | None:
    """The user's socket directory when it exists and is theirs alone, else None."""
    found = _socket_dir(environ)
    return found[0] if found is not None and found[1] else None


def socket_path(directory: str, k: str) -> str:
    return os.path.join(directory, f"cmd-{k}.sock")


FAILED = ".failed"  # beside a key's socket: why its server could not start (server._failed); no new start is tried


def _persist_off(environ: Any) -> bool:
    """CTL_PERSIST turns sessions, and so the server, off. Read here without settings.py (its errors module
    imports enum, ~8 ms of every start); a value settings refuses is served, and the command says what is wrong."""
    try:
        return float(environ.get("CTL_PERSIST", "").strip() or "nan") <= 0
    except ValueError:
        return False


def installed_command() -> bool:
    """This process is the `ctl` command as installed (a script whose directory starts sys.path), not `python -m
    controller`, whose sys.path starts with the working directory: what that imports depends on where it runs."""
    script = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    pkg = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    # the interpreter puts the script's directory first, its links resolved (pipx and uv install links to it)
    return bool(script) and bool(sys.path) and sys.path[0] == os.path.dirname(script) and not script.startswith(
        pkg + os.sep)


def _verb(argv: list[str]) -> str | None:
    from controller.launch.table import verb

    return verb(argv)


# --- the client --------------------------------------------------------------------------------------------

_start: tuple[str, str] | None = None  # (socket directory, key): no server answered; start_server may start one


def _connect(path: str) -> tuple[Any, int] | None:
    """A connection to the server at path and the server's pid (the kernel's word); None when there is none."""
    import _socket

    try:
        st = os.lstat(path)
    except OSError:
        return None
    if (st.st_mode & 0o170000) != 0o140000 or st.st_uid != os.getuid():
        return None
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(START_WAIT)
    try:
        s.connect(path)
        creds = s.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        if int.from_bytes(creds[4:8], sys.byteorder) != os.getuid():
            s.close()
            return None
    except OSError:
        s.close()
        return None
    return s, int.from_bytes(creds[0:4], sys.byteorder)


def _json(obj: Any) -> str:
    """str, int, list and dict of those, as JSON, with the C encoder json itself uses (json would import re)."""
    from _json import encode_basestring_ascii as q

    if isinstance(obj, str):
        return q(obj)
    if isinstance(obj, bool) or obj is None:
        return {True: "true", False: "false", None: "null"}[obj]
    if isinstance(obj, int):
        return str(obj)
    if isinstance(obj, list):
        return "[" + ",".join(_json(x) for x in obj) + "]"
    return "{" + ",".join(f"{q(k)}:{_json(v)}" for k, v in obj.items()) + "}"


def request(doc: dict[str, Any]) -> bytes:
    body = _json(doc).encode()
    return MAGIC + len(body).to_bytes(4, "big") + body


class _Lines:
    """Lines from the server, read as they come."""

    def __init__(self, s: Any) -> None:
        self.s, self.buf = s, b""

    def next(self) -> str | None:
        while b"\n" not in self.buf:
            data = self.s.recv(4096)
            if not data:
                return None
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace")


def run(argv: list[str]) -> int | None:
    """Run `ctl ARGV` in the user's command server: its exit status (-N: killed by signal N), or None when it is
    not to be served (then it runs here, and `start_server` may start a server as it exits)."""
    global _start
    environ = os.environ
    if _persist_off(environ) or not installed_command() or not SUPPORTED:
        return None
    verb = _verb(argv)
    if NOT_SERVED & set(argv) or verb in NOT_SERVED or (verb == "supervise" and "--once" not in argv):
        return None
    found = _socket_dir(environ)
    if found is None:
        return None
    d, exists = found
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return None  # a closed standard descriptor: nothing to pass
    k = key(environ)
    path = socket_path(d, k)
    if len(os.fsencode(path)) >= 104:
        return None
    conn = _connect(path) if exists else None
    if conn is None:
        _start = (d, k)
        return None
    s, server = conn
    try:
        return _served(s, server, k, [sys.argv[0], *argv], environ)
    finally:
        s.close()


def _served(s: Any, server: int, k: str, argv: list[str], environ: Any) -> int | None:
    import _signal
    import _socket

    umask = os.umask(0o022)
    os.umask(umask)
    ignored = [n for n in (getattr(_signal, name) for name in FORWARDED) if _signal.getsignal(n) == _signal.SIG_IGN]
    msg = request({"op": "run", "key": k, "argv": argv, "env": dict(environ), "umask": umask, "ignored": ignored,
                   "rlimits": rlimits()})
    cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fds = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in (0, 1, 2, cwd))
        sent = s.sendmsg([msg], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        s.sendall(msg[sent:])
        lines = _Lines(s)
        first = lines.next()
    except OSError:
        return None  # no answer in START_WAIT, or the server went: the command runs here
    finally:
        os.close(cwd)
    if first is None or not first.startswith("pid ") or not _forked_by(int(first[4:]), server):
        return None  # refused: the command runs here, and no second server is started for it
    s.settimeout(None)
    went = _forward(int(first[4:]))
    try:
        s.sendall(b"go\n")
        went()
        last = lines.next()
    except OSError:
        last = None
    if last is not None and last.startswith(("exit ", "signal ")):
        n = int(last.split()[1])
        return n if last.startswith("exit ") else -n
    sys.stderr.write(f"ctl: error: ctl's command server (its child {first[4:]}) ended without the command's exit "
                     "status (was it killed?)\n")
    return 1


def _forked_by(pid: int, server: int) -> bool:
    """pid is a process the server forked (its parent, from /proc): the one the client will signal."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b") ", 1)[1].split()[1]) == server
    except (OSError, ValueError, IndexError):
        return False


def _forward(pid: int) -> Any:
    """Signals to the client go to the command's process group (the command and what it started, as Ctrl-C
    reaches a command in its own process and its children), sent by the client itself, so that it can stop its
    command even if the server is gone. Ctrl-Z stops the group (SIGSTOP: a group in the server's orphaned
    session would ignore SIGTSTP), then the client; fg continues both. A signal before the command may start
    waits for it. Returns the function that says it may start (after "go")."""
    import _signal

    pending: list[int] = []
    started: list[bool] = []

    def deliver(signum: int) -> None:
        try:  # noqa: SIM105 - contextlib is not on the client's path
            os.killpg(pid, _signal.SIGSTOP if signum == _signal.SIGTSTP else signum)
        except OSError:
            pass  # it ended: its exit status is on its way

    def send(signum: int, _frame: Any) -> None:
        if not started:
            pending.append(signum)
            return
        deliver(signum)
        if signum == _signal.SIGTSTP:
            _signal.signal(_signal.SIGTSTP, _signal.SIG_DFL)
            os.kill(os.getpid(), _signal.SIGTSTP)  # stops here; SIGCONT resumes below
            _signal.signal(_signal.SIGTSTP, send)

    def go() -> None:
        started.append(True)
        while pending:
            send(pending.pop(0), None)

    for name in FORWARDED:
        n = getattr(_signal, name)
        if _signal.getsignal(n) != _signal.SIG_IGN:  # ignored (nohup): the command ignores it too (server.py)
            _signal.signal(n, send)
    return go


def exit_as(code: int) -> None:
    """Leave as the served command left: its exit status, or killed by the same signal."""
    if code < 0:
        import _signal

        sys.stdout.flush()
        _signal.signal(-code, _signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    sys.exit(code)


# --- starting and listing servers ----------------------------------------------------------------------------

# What a server's environment keeps of its starter's (each command's own environment reaches the process that
# runs it; the server itself holds no secret): paths, identity, locale and the interpreter's variables.
SERVER_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TMPDIR", "XDG_RUNTIME_DIR",
                        "TYPER_USE_RICH"})
BOOT = "import sys; sys.path[:] = sys.argv[4:]; from controller.launch.server import main; main()"


def server_env(environ: Any) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k in SERVER_ENV or k.startswith(("PYTHON", "LC_"))}


def start_server(argv: list[str]) -> None:
    """After a command that found no server: start one for the next commands, unless sessions are off (CTL_PERSIST
    or the config file's `persist: 0`) or the command was `ctl mux ...`. Never fails the command."""
    if _start is None or _verb(argv) in (None, "mux") or "--help" in argv:
        return
    import contextlib

    try:
        from controller import settings

        seconds = settings.persist_seconds()
        idle = settings.DEFAULT_PERSIST if seconds is None else seconds
        if idle <= 0:
            return
        d, k = _start
        import signal
        import subprocess

        from controller.transport.mux.spare import ours_alone

        os.close(os.pidfd_open(os.getpid()))  # a kernel (or seccomp) without pidfds: no server, every command here

        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
        if not ours_alone(os.lstat(d)) or os.path.lexists(socket_path(d, k) + FAILED):
            return
        log = os.open(os.path.join(d, f"cmd-{k}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW |
                      os.O_CLOEXEC, 0o600)
        try:
            # the interpreter's flags as this one's (-s, -E, -X ...: part of the key), default signal actions and
            # no blocked signal (whatever this command was started with), and no descriptor but 0, 1, 2 (the
            # server closes the rest first thing)
            flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
            os.posix_spawn(sys.executable, [sys.executable, *flags, "-P", "-c", BOOT, socket_path(d, k), k,
                                            str(idle), *sys.path],
                           server_env(os.environ), setsid=True, setsigmask=(),
                           setsigdef=[n for n in signal.valid_signals() if n not in (signal.SIGKILL, signal.SIGSTOP)],
                           file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                         (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                                         (os.POSIX_SPAWN_DUP2, log, 2)])
        finally:
            os.close(log)
    except Exception:  # the next command runs here as this one did
        return


def _ask(path: str, doc: dict[str, Any]) -> str | None:
    found = _connect(path)
    if found is None:
        return None
    s = found[0]
    try:
        s.sendall(request(doc))
        return _Lines(s).next()
    except OSError:
        return None
    finally:
        s.close()


def servers(environ: Any = None) -> list[dict[str, Any]]:
    """The user's live command servers: what each says of itself ({"pid", "started", "served", "running", "idle",
    "idle_for", "cpu_s", "socket"})."""
    import json

    d = place(os.environ if environ is None else environ)
    if d is None:
        return []
    found = []
    for name in sorted(os.listdir(d)):
        if name.startswith("cmd-") and name.endswith(".sock"):
            said = _ask(os.path.join(d, name), {"op": "info"})
            if said and said.startswith("{"):
                found.append({**json.loads(said), "socket": os.path.join(d, name)})
    return found


def failed_servers(environ: Any = None) -> list[dict[str, str]]:
    """This ctl's command server (its key), when it could not start ({"key", "why", "log"}): its commands run
    in a process of their own. Another key's (another ctl, this one before an upgrade) is not listed."""
    env = os.environ if environ is None else environ
    d = place(env)
    if d is None:
        return []
    k = key(env)
    try:
        with open(socket_path(d, k) + FAILED, "rb") as f:
            why = f.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return []
    return [{"key": k, "why": why, "log": os.path.join(d, f"cmd-{k}.log")}]


def stop_servers() -> list[dict[str, Any]]:
    """Stop the user's command servers: each takes no new command, and exits once the commands it runs end. A
    server that could not start is forgotten, so that the next command tries again."""
    stopped = []
    for doc in servers():
        if _ask(doc["socket"], {"op": "stop"}) is not None:
            if doc["pid"] == os.getppid():
                doc["running"] -= 1  # this `ctl mux stop` is one of them
            stopped.append(doc)
    import contextlib

    d = place(os.environ)
    for name in os.listdir(d) if d is not None else ():
        if name.startswith("cmd-") and name.endswith(".sock" + FAILED):  # every key's: any may be tried again
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, name))  # type: ignore[arg-type]
    return stopped
