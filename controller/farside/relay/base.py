"""The relay's start: json through its C scanner and encoder, and children started with posix_spawn (Proc)."""

import os
import threading
import time

# the interpreter's own sha256 (the staying agents' sources are known by it, agents.py): hashlib would load OpenSSL
# (~9 ms of every session's start) for 90 KB
try:
    from _sha256 import sha256
except ImportError:
    try:
        from _sha2 import sha256  # Python 3.12+
    except ImportError:
        from hashlib import sha256  # noqa: F401

# json and subprocess are what a relay would import beyond its own needs (re, enum, locale, selectors: ~17 ms of
# CPU of every session's start, before its hello): the documents ctl sends are read with json's own C scanner, the
# relay's few answers written with json's C encoder, and children started with os.posix_spawn. json itself is
# loaded only to say what is wrong with a document the scanner refuses; subprocess only on a Python without
# posix_spawn (before 3.8).


class _Decoder:
    """What _json's scanner reads of json's decoder: json's defaults."""

    def __init__(self):
        self.strict, self.object_hook, self.object_pairs_hook = True, None, None
        self.parse_float, self.parse_int = float, int
        self.parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


def _no_default(o):
    raise TypeError("Object of type %s is not JSON serializable" % o.__class__.__name__)


try:
    import _json

    _scan = _json.make_scanner(_Decoder())
    _encode = _json.make_encoder(None, _no_default, _json.encode_basestring_ascii, None, ": ", ", ", False, False,
                                 True)
except (ImportError, AttributeError, TypeError):
    _scan = _encode = None


def loads(text):
    """json.loads(text)."""
    if _scan is not None:
        try:
            obj, end = _scan(text, 0)
        except Exception:  # json.loads says what is wrong, in its words
            end = -1
        if end == len(text):
            return obj
    import json

    return json.loads(text)


def dumps(obj):
    """json.dumps(obj) of the relay's own answers (dicts and lists of strings, numbers, booleans and None)."""
    if _encode is None:
        import json

        return json.dumps(obj)
    return "".join(_encode(obj, 0))


if hasattr(os, "posix_spawn"):
    try:
        import _signal

        # what Python ignores and subprocess gives back to a child at their default (restore_signals)
        _SIGDEF = tuple(getattr(_signal, n) for n in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(_signal, n))
        _SIGKILL = _signal.SIGKILL
    except ImportError:
        _SIGDEF, _SIGKILL = (), 9

    class TimeoutExpired(Exception):
        """wait(timeout) ran out."""

    def _spawn(argv, env, actions):
        """posix_spawn argv[0] looked up as subprocess does (env's PATH; the first error that is not a missing
        file or directory, else FileNotFoundError)."""
        name = argv[0]
        tries = [name] if os.path.dirname(name) else [os.path.join(d, name) for d in os.get_exec_path(env)]
        first = missing = None
        for path in tries:
            try:
                return os.posix_spawn(path, argv, env, file_actions=actions, setsigdef=_SIGDEF)
            except (FileNotFoundError, NotADirectoryError) as e:
                missing = e
            except OSError as e:
                first = first or e
        raise first or missing or FileNotFoundError(2, "No such file or directory", name)

    class Proc:
        """subprocess.Popen(argv, stdin=PIPE, stdout=PIPE, stderr=PIPE, close_fds=True, env=env), as far as the
        relay uses it. Every descriptor Python opens is closed on exec, so the child gets its three pipes and
        what the relay inherited from sshd (its standard streams, which the pipes replace)."""

        def __init__(self, argv, env=None):
            pipes = [os.pipe() for _ in range(3)]
            theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
            try:
                self.pid = _spawn(argv, os.environ if env is None else env,
                                  [(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in enumerate(theirs)])
            except BaseException:
                for fd in (pipes[0][1], pipes[1][0], pipes[2][0]):
                    os.close(fd)
                raise
            finally:
                for fd in theirs:
                    os.close(fd)
            self.stdin = open(pipes[0][1], "wb")
            self.stdout = open(pipes[1][0], "rb")
            self.stderr = open(pipes[2][0], "rb")
            self.returncode = None
            self._reaping = threading.Lock()  # one waitpid at a time: a second would reap nothing, or another's

        def _reap(self, flags):
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped already, by no one of ours: as subprocess says then
                self.returncode = 0
                return
            if pid == self.pid:
                self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

        def poll(self):
            if self.returncode is None and self._reaping.acquire(False):
                try:
                    if self.returncode is None:
                        self._reap(os.WNOHANG)
                finally:
                    self._reaping.release()
            return self.returncode

        def wait(self, timeout=None):
            if timeout is None:
                with self._reaping:
                    while self.returncode is None:
                        self._reap(0)
                return self.returncode
            deadline, pause = time.monotonic() + timeout, 0.0005
            while self.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutExpired()
                pause = min(pause * 2, left, 0.05)
                time.sleep(pause)
            return self.returncode

        def kill(self):
            if self.poll() is None:
                try:
                    os.kill(self.pid, _SIGKILL)
                except ProcessLookupError:
                    pass
else:  # Python 3.6 and 3.7
    import subprocess
    from subprocess import TimeoutExpired

    def Proc(argv, env=None):
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                close_fds=True, env=env)
