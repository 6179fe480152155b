"""A session process started before ctl knows which host it will serve: the spare.

A cold command that connects spends its first ~0.12 s reading its line and its inventory, and only then starts
the session process of each host it reaches; that process then spends ~0.15 s of CPU importing paramiko and
ctl's relay before its TCP connect can begin. So `ctl` starts one spare process first thing, from the verb
alone, when the command is of a kind that connects and no session of the user is up: it does those imports
while the command reads its inventory. Each session the command then starts is a fork of the spare (no Python
start, nothing imported again), handed its spec, its spawn lock, its log and the pipe of its one ready line
over a socketpair (SCM_RIGHTS): what a session process started by the command gets, in a session of its own,
with umask 077, stdin /dev/null, no other descriptor of the command's, and `/` as its directory (the spare
runs `python -P`: nothing is imported from the directory ctl was started in). Two differences: `ps` shows
the spare's command line, and warnings printed while the spare imports go nowhere (it has no log yet).

One spare per user at a time (a lock in the socket directory): a burst of cold commands starts one, and the
others start their sessions as before. The spare holds nothing of a host until it is handed a spec. It goes
when the command closes its end (the command needs no session: `release`, or the command exited), or after
SPARE_WAIT seconds without a spec. A spec it cannot take (the spare died, or did not answer in HAND_WAIT
seconds) leaves the command to start the session process as before; the spare changes when a session starts,
never whether or how.

This module is imported before the command's own modules: only os, sys and, once a spare is started, fcntl,
socket and threading.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    import threading
    from collections.abc import Callable, Mapping
    from typing import Any

SPARE_WAIT = 30.0  # seconds a spare waits for its first spec (then, for each next one) before it exits
HAND_WAIT = 10.0  # seconds a command waits for the spare to fork a session (its imports take ~0.2 s)
LOCK_FD = 3  # where the spare holds the user's spare lock (spare.lock in the socket directory)
MAX_SPEC = 64 * 1024  # bytes of one spec message

# The session outlives the command that starts it and serves every later one, so it gets only what it uses:
# paths and locale, the ssh agent, the user's identity and home (ssh_config, keys, a ProxyCommand), and
# where the Python packages are. Never the starter's secrets (API tokens...). The state directory the starter
# resolved comes with each spec (so both agree on the session's files whatever the XDG variables say).
SESSION_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "SSH_AUTH_SOCK",
                         "PYTHONPATH", "PYTHONHOME", "XDG_RUNTIME_DIR"})
STATE_VAR = "CTL_STATE_DIR"  # settings.STATE_DIR, without importing settings


def session_env(environ: Mapping[str, str], state: str | None = None) -> dict[str, str]:
    """The session process's environment: what it needs out of `environ`, and the state directory (given, else
    CTL_STATE_DIR when set: the spare starts before the command resolves it, and a fork sets the spec's in
    os.environ, which /proc/PID/environ does not show). The session runs `sys.executable -m controller...`:
    the interpreter of this ctl finds the same package."""
    env = {k: v for k, v in environ.items() if k in SESSION_ENV or k.startswith("LC_")}
    if state is not None:
        env[STATE_VAR] = str(state)
    elif environ.get(STATE_VAR):
        env[STATE_VAR] = environ[STATE_VAR]
    return env


def ours_alone(st: os.stat_result) -> bool:
    """A directory of this user that nobody else may enter (what sock.private requires of ctl's directories)."""
    import stat

    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def socket_place(environ: Mapping[str, str]) -> str:
    """Where the user's session sockets live: $XDG_RUNTIME_DIR/ctl when XDG_RUNTIME_DIR is a short absolute path
    to the user's own 0700 directory, else /tmp/ctl-<uid> (sock.socket_dir checks and creates it)."""
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime.startswith("/") and len(runtime) < 60:
        try:
            if ours_alone(os.stat(runtime)):
                return os.path.join(runtime, "ctl")
        except OSError:
            pass
    return f"/tmp/ctl-{os.getuid()}"


_STATUS = (b"Cap", b"NoNewPrivs", b"Seccomp", b"Groups:", b"Gid:")


def proc_context(pid: int) -> dict[str, str] | None:
    """What a process forked here would inherit from this server rather than from the process `pid`, read from
    /proc by this server (never the client's own word): its namespaces, cgroup, capabilities, no_new_privs,
    seccomp mode, groups and niceness. None when any of it cannot be read (the process is gone, or its /proc
    is closed to us: a sandbox)."""
    out: dict[str, str] = {}
    try:
        base = f"/proc/{pid}"
        for ns in sorted(os.listdir(f"{base}/ns")):
            out[f"ns/{ns}"] = os.readlink(f"{base}/ns/{ns}")
        with open(f"{base}/cgroup", "rb") as f:
            out["cgroup"] = f.read().decode(errors="replace")
        with open(f"{base}/status", "rb") as f:
            for line in f.read().splitlines():
                if line.startswith(_STATUS):
                    k, _, v = line.decode(errors="replace").partition(":")
                    out[k] = " ".join(v.split())
        with open(f"{base}/stat", "rb") as f:
            out["nice"] = f.read().rsplit(b") ", 1)[1].split()[16].decode()
    except (OSError, IndexError):
        return None
    return out


def context_refusal(mine: dict[str, str] | None, pid: int, only: tuple[str, ...] = ("",)) -> str:
    """Why the client `pid` may not be served by a process of context `mine`, else "": every difference in the
    keys starting with one of `only` (all, by default: another mount namespace, NoNewPrivs, a seccomp filter,
    another cgroup, nice...) leaves the client to do the work itself, where its sandbox holds it."""
    theirs = proc_context(pid)
    if mine is None or theirs is None:
        return "the client's context cannot be read"
    differ = sorted(k for k in set(mine) | set(theirs) if k.startswith(only) and mine.get(k) != theirs.get(k))
    return f"the client's {', '.join(differ)} differ from the server's" if differ else ""


def _sessions_up(environ: Mapping[str, str]) -> bool:
    """A socket of one of the user's sessions exists (a warm user: the command will likely find its session)."""
    try:
        return any(n.endswith(".sock") for n in os.listdir(socket_place(environ)))
    except OSError:
        return False


class Spare:
    """This command's spare process: its pid and the command's end of their socketpair. A thread waits for it, so
    a spare that went by itself (SPARE_WAIT) is no zombie under a long command; it is signalled through a pidfd,
    never by a pid that may have been reused."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        import threading

        self.pid = pid
        self.sock: socket.socket | None = sock
        self.lock: threading.Lock = threading.Lock()  # one hand-over at a time (early threads, one per host)
        self.pidfd = os.pidfd_open(pid)
        threading.Thread(target=self._reap, name="ctl-spare-reaper", daemon=True).start()

    def _reap(self) -> None:
        import contextlib

        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)

    def hand(self, spec: dict[str, object], lock_fd: int, log_fd: int, reply_fd: int, wait: float) -> int | None:
        """Have the spare fork a session process for spec, with the spawn lock, its log as stderr and reply_fd as
        stdout; its pid, or None when the spare cannot take it (gone, or no answer within `wait` seconds, at
        most HAND_WAIT): then the caller starts the session process itself, and the spare goes."""
        import json
        import select
        import socket

        with self.lock:
            sock = self.sock
            if sock is None:
                return None
            try:
                socket.send_fds(sock, [json.dumps(spec).encode()], [lock_fd, log_fd, reply_fd])
                ready, _, _ = select.select([sock], [], [], min(wait, HAND_WAIT))
                answer = sock.recv(64) if ready else b""
                pid = int(answer.decode()) if answer.strip().isdigit() else None
            except (OSError, ValueError):
                pid = None
            if pid is None:
                self._end()
            return pid

    def release(self) -> None:
        """The command needs no (more) session: the spare goes now, leaving the CPU to the command."""
        with self.lock:
            self._end()

    def _end(self) -> None:
        import contextlib
        import signal

        if self.sock is None:
            return
        self.sock.close()
        self.sock = None
        # It holds nothing yet but its imports: killed at once rather than let finish them for nothing. Its
        # children (sessions already handed over) are in sessions of their own and live on.
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        os.close(self.pidfd)


def _claim(environ: Mapping[str, str]) -> int | None:
    """The user's spare lock, taken (an fd); None when another spare holds it or the socket directory is one ctl
    refuses; -1 when there is none yet (the first command ever starts its spare without the lock)."""
    import fcntl

    d = socket_place(environ)
    try:
        st = os.lstat(d)
    except OSError:
        return -1
    if not ours_alone(st):
        return None  # sock.socket_dir refuses it, in words, when the command gets there
    try:
        fd = os.open(os.path.join(d, "spare.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


_spare: Spare | None = None


def start(environ: Mapping[str, str]) -> bool:
    """Start this command's spare unless a session of the user is up or another spare runs; True when one was
    started. Nothing that goes wrong here is the command's concern: it then starts its sessions as before."""
    global _spare
    if _spare is not None or _sessions_up(environ):
        return False
    ours = None
    try:
        claim = _claim(environ)
        if claim is None:
            return False
        import fcntl
        import socket

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        actions = [(os.POSIX_SPAWN_DUP2, theirs.fileno(), 0), (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)]
        held = -1
        if claim >= 0:
            held = fcntl.fcntl(claim, fcntl.F_DUPFD_CLOEXEC, 10)  # not LOCK_FD: a dup2 onto itself keeps CLOEXEC
            os.close(claim)
            actions.append((os.POSIX_SPAWN_DUP2, held, LOCK_FD))
        try:
            pid = os.posix_spawn(
                sys.executable, [sys.executable, "-P", "-m", "controller.transport.mux.daemon", "--spare",
                                 str(LOCK_FD if held >= 0 else -1)],
                session_env(environ), file_actions=actions, setsid=True)
        finally:
            theirs.close()
            if held >= 0:
                os.close(held)  # the spare's copy holds the lock from here on
        _spare = Spare(pid, ours)
    except Exception:  # no spare: the command starts its sessions itself
        if ours is not None:
            ours.close()
        return False
    return True


def take() -> Spare | None:
    """This command's spare, while it has one that may take a spec."""
    return _spare if _spare is not None and _spare.sock is not None else None


def release() -> None:
    if _spare is not None:
        _spare.release()


# --- the spare's side ---------------------------------------------------------------------------------------


def serve(serve_session: Callable[[dict[str, Any]], int], held: int) -> int:
    """In the spare process (`python -P -m controller.transport.mux.daemon --spare HELD`, fd 0 its end of the
    socketpair, the user's spare lock at fd `held` or -1, its imports made): fork one session process per spec
    received (serve_session(spec) in a session of its own), and answer its pid. Returns once the command closes
    its end or sends nothing for SPARE_WAIT seconds."""
    import select
    import signal
    import socket

    os.chdir("/")
    # none of the command's descriptors outlives it (the spare lock, when held, is LOCK_FD: 3)
    os.closerange(held + 1 if held >= 0 else 3, os.sysconf("SC_OPEN_MAX"))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its session processes are nobody's to wait for
    sock = socket.socket(fileno=0)
    while True:
        ready, _, _ = select.select([sock], [], [], SPARE_WAIT)
        if not ready:
            return 0
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_SPEC, 3)
        except OSError:
            return 0
        if not msg or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            return 0
        pid = os.fork()
        if pid == 0:
            lock_fd, log_fd, reply_fd = fds
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            os.umask(0o077)
            if held >= 0:
                os.close(held)  # the spare's lock is the spare's
            sock.detach()  # fd 0: replaced by /dev/null below, as a started session's stdin is
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            os.dup2(reply_fd, 1)
            os.dup2(log_fd, 2)
            os.close(reply_fd)
            os.close(log_fd)
            os._exit(_child(serve_session, msg, lock_fd))
        for fd in fds:  # the spawn lock is the child's to let go: no copy of it stays here
            os.close(fd)
        try:
            sock.send(str(pid).encode())
        except OSError:
            return 0


def _child(serve_session: Callable[[dict[str, Any]], int], msg: bytes, lock_fd: int) -> int:
    import json

    try:
        spec = json.loads(msg)
        spec["lock_fd"] = lock_fd
        if spec.get("state"):
            os.environ[STATE_VAR] = str(spec["state"])
        rc = serve_session(spec)
    except BaseException:  # a forked child never returns into the spare's loop
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return rc
