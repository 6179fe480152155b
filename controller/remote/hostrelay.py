"""ctl's host relay: runs ON a Proxmox host (stdlib only, Python >= 3.6), one per host and command.

The controller never imports this module. It sends its source over the stdin of ONE SSH exec
(`python3 -I -S -c BOOT N`, like the agent), and the relay then starts, for each container of that
host, the exact argv ctl would otherwise have sent through its own exec (`pct exec VMID -- python3
... agent ...`), concurrently, with no shell. Their stdin, stdout, stderr and exit status travel as
frames over the relay's own stdin/stdout, so every container's conversation with its agent is the
same as over a direct exec, while the host's login shell and the SSH channel are paid once.

Frame: 7-byte header (kind: 1 byte, stream id: 2 bytes, length: 4 bytes, big-endian), then the data.
  controller -> relay  S start (data: JSON argv)   I stdin data   C close that stdin
                       T (stream 0) what staying agents it keeps (answered by T, JSON {"agents": [...]})
                       A start an agent request (data: JSON {"argv", "at", "n", "retry", "sha"}): like S for
                         the argv `PREFIX... python3 -I -S -c BOOT N VERB ARGS` (argv[at] is VERB), whose stdin
                         starts with the agent's n-byte source; answered by a staying agent (below). With n 0,
                         the source is the one of that sha256 the relay kept from an earlier request; when it
                         has none it answers U, then X, and ctl sends the request again with its source
                       K abandon: close its stdin and stop reading its output (its next write fails, as
                         when an SSH channel closes under a command); its X frame still comes
  relay -> controller  H hello (stream 0, JSON)    O stdout data  E stderr data  X exit status (ASCII)
                       U (before X) that agent request's source is not kept here
A child that cannot be started answers E (the reason) and X 127, as a shell would. A stream id is
forgotten before its X frame goes out, so the controller may reuse it as soon as it has read that X (ids
are 16 bits: a long-lived session wraps around them). End of the
relay's stdin (ctl is done, or the connection dropped) closes every child's stdin; the relay waits
for the children (an agent that sees its stdin end leaves every old file whole) and exits.

Staying agents. An A request runs in a process that stays: `PREFIX... python3 -I -S -c BOOT N serve`
(agent.py's serve()), one per container and agent source (its sha256), kept while the relay lives, so a
request costs neither `pct exec`, nor a python3 start, nor a compile of the agent. The answer is the O, E
and X frames the exec would have given. When PREFIX is Proxmox's own `pct exec VMID --`, the staying agent
starts the way pct would start it once it found the container running (pve-container's pct.pm: `lxc-attach
-n VMID --keep-env -- ...` with PATH reset and SSL_CERT_FILE/SSL_CERT_DIR dropped), without pct itself: pct
is a Perl program that loads PVE's modules, several hundred milliseconds a start on a real host, paid once
per container and session. When that attach does not say hello (a stopped container, a host whose LXC is not
at its default lxcpath), the agent starts through pct as before, so pct's checks and refusals stay pct's.
The relay falls back to the exec itself when a staying agent cannot
start (pct's refusal then reaches ctl as it always did), when its input is large (that exec starts as soon as
the input passes RESIDENT_MAX_INPUT, so the relay never holds more), when RESIDENT_PER_KEY of them are busy or
the relay keeps as many as its descriptors allow, and, for a request marked "retry" (a verb that only reads),
when one ended before answering. Such an exec, and any S exec in a container (`pct exec VMID -- ...`), attaches
directly while a staying agent of that container that came in through lxc-attach is alive (the container is
running: pct would only find that again). A K ends the staying agent answering that stream, even one that stopped
reading (its writes never block).
"""

import os
import queue
import select
import struct
import sys
import threading
import time

try:  # the interpreter's own sha256: hashlib would load OpenSSL (~9 ms of every session's start) for 90 KB
    from _sha256 import sha256
except ImportError:
    try:
        from _sha2 import sha256  # Python 3.12+
    except ImportError:
        from hashlib import sha256

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


HEADER = struct.Struct(">cHI")
_CHUNK = 1 << 16
_out_lock = threading.Lock()
_broken = []  # set once our stdout is gone: keep draining children, stop writing
_children = {}  # stream id -> Child, while its process runs (until just before its X frame)
_live = set()  # every Child whose X frame is not out yet: the relay waits for them before it exits
_children_lock = threading.Lock()
# Frames a thread holds back until it is done with what woke it (the reading loop: the answers of one poll() go
# out in one write, so sshd sends them as one packet and ctl's session decrypts and routes one, not one each).
_held = {}

RESIDENT_MAX_INPUT = 8 << 20  # a request with more input (an apply's tar) runs as its own exec
RESIDENT_PER_KEY = 4  # staying agents per container and source; when all are busy a request runs as an exec
RESIDENT_TOTAL = 512  # staying agents per relay, and at most one per 8 descriptors the relay may open (below)
RESIDENT_HELLO_S = 30.0  # a staying agent that has not said hello by then is given up (the request runs as an exec)
RESIDENT_EXIT_S = 2.0  # a start whose stdout ended is waited for this long to exit (then: a refusal, not a hang)
RESIDENT_MAX_FRAME = 1 << 30  # a reply frame claiming more is not the agent: that agent is ended
# A staying agent no request took for this long ends: one of another ctl build's source (after an upgrade, under a
# supervisor that keeps the session up), one of a container nobody asks any more. Looked at when a request takes
# an agent, at most every RESIDENT_SWEEP_S; CTL_AGENT_IDLE_S in the relay's environment sets it (tests).
RESIDENT_IDLE_S = 600.0
RESIDENT_SWEEP_S = 30.0
PVE_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"  # the PATH pct sets before it runs lxc-attach
PVE_PCTS = ("/usr/sbin/pct", "/sbin/pct")  # where Proxmox installs pct (a bare `pct` must resolve to one of them)
_no_lxc_attach = []  # set once lxc-attach is not on PVE_PATH: every staying agent starts through pct


def _nofile():
    """The relay's limit of open descriptors (each staying agent holds three of them while it stays)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1024
    return soft if soft >= 0 else 1 << 20  # RLIM_INFINITY


def _ready(fd, events, timeout):
    """Whether fd is ready (POLLIN or POLLOUT; its end or an error count as ready) within timeout seconds. poll,
    not select: a relay holding many staying agents has descriptors past select's 1024."""
    p = select.poll()
    p.register(fd, events)
    return bool(p.poll(int(timeout * 1000)))


def _emit(kind, sid, data=b""):
    _emit_raw(HEADER.pack(kind, sid, len(data)) + data)


def _emit_raw(frames):
    """Frames already packed, in one write: an answer's O, E and X leave together (sshd does not set TCP_NODELAY
    on a session without a terminal: frames written apart could each wait for the controller's delayed ACK)."""
    held = _held.get(threading.get_ident()) if _held else None
    if held is not None:
        held.append(frames)
        return
    if _broken:
        return
    with _out_lock:
        try:
            out = sys.stdout.buffer
            out.write(frames)
            out.flush()
        except (OSError, ValueError):
            _broken.append(True)


class Child:
    def __init__(self, sid, argv, replaces=None, env=None):
        self.sid = sid
        self.inbox = queue.Queue(maxsize=256)  # bounded: a slow reader holds the relay back, not its memory
        self.threads = []
        self.closed = False
        self.abandoned = False  # K: the controller stopped reading; our read ends close, the child's writes fail
        self._close_lock = threading.Lock()
        try:
            self.proc = Proc(argv, env)
        except OSError as e:
            self.proc = None
            if replaces is not None:  # the agent request whose id this was: forgotten before X, as every id
                with _children_lock:
                    if _children.get(sid) is replaces:
                        del _children[sid]
            _emit(b"E", sid, ("ctl relay: cannot start %s: %s\n" % (argv[0] if argv else "?", e.strerror or e))
                  .encode())
            _emit(b"X", sid, b"127")
            return
        with _children_lock:
            _children[sid] = self  # before any thread runs: _finish forgets it
            _live.add(self)
        err = threading.Thread(target=self._pump, args=(self.proc.stderr, b"E"))
        out = threading.Thread(target=self._finish, args=(err,))
        writer = threading.Thread(target=self._write)
        self.threads = [err, out, writer]
        for t in self.threads:
            t.daemon = True
            t.start()

    def _pump(self, pipe, kind):
        fd = pipe.fileno()
        while not self.abandoned:
            try:
                b = os.read(fd, _CHUNK) if _ready(fd, select.POLLIN, 0.5) else None
            except (OSError, ValueError):
                b = b""
            if b is None:
                continue
            if not b:
                break
            _emit(kind, self.sid, b)
        pipe.close()

    def _finish(self, err_thread):
        self._pump(self.proc.stdout, b"O")
        err_thread.join()
        rc = self.proc.wait()
        self.close_stdin()  # the writer thread ends even when the controller never closes this stdin
        with _children_lock:
            _children.pop(self.sid, None)  # forgotten BEFORE X: the controller may reuse the id once it reads X
        _emit(b"X", self.sid, str(128 - rc if rc < 0 else rc).encode())
        with _children_lock:
            _live.discard(self)

    def _write(self):
        stdin = self.proc.stdin
        broken = False
        while True:
            data = self.inbox.get()
            if data is None:
                break
            if broken:
                continue
            try:
                stdin.write(data)
                stdin.flush()
            except OSError:
                broken = True  # the child stopped reading (it exited): drop the rest of its input
        try:
            stdin.close()
        except OSError:
            pass

    def send(self, data):
        if self.proc is not None:
            self.inbox.put(data)

    def close_stdin(self):
        with self._close_lock:
            if self.proc is None or self.closed:
                return
            self.closed = True
        self.inbox.put(None)

    def abandon(self):
        self.abandoned = True
        self.close_stdin()

    def join(self):
        for t in self.threads:
            t.join()


def attach_argv(argv, environ):
    """`pct exec VMID [--keep-env 0|1] -- CMD...` as pct runs it once it found the container running: (lxc-attach
    argv, its environment), or None for any other line. pct.pm's exec: `lxc-attach -n VMID --keep-env|--clear-env
    -- CMD` with PATH reset and SSL_CERT_FILE/SSL_CERT_DIR dropped; keep-env defaults to 1. Only where pct is
    Proxmox's own (_proxmox_pct); a pct that is anything else is always run as given."""
    if len(argv) < 5 or argv[1] != "exec" or "--" not in argv or not _proxmox_pct(argv[0], environ):
        return None
    dash = argv.index("--")
    vmid, opts = argv[2], argv[3:dash]
    if not (3 <= len(vmid) <= 9 and vmid[0] != "0" and all("0" <= c <= "9" for c in vmid)) or dash == len(argv) - 1:
        return None
    if opts not in ([], ["--keep-env", "1"], ["--keep-env", "0"]):
        return None
    keep = opts != ["--keep-env", "0"]
    env = dict(environ)
    env["PATH"] = PVE_PATH
    env.pop("SSL_CERT_FILE", None)
    env.pop("SSL_CERT_DIR", None)
    return ["lxc-attach", "-n", vmid, "--keep-env" if keep else "--clear-env", "--", *argv[dash + 1:]], env


def _proxmox_pct(name, environ):
    """Whether `name` (an argv[0]) runs Proxmox's own pct here, as root: /usr/sbin/pct itself, or a bare `pct`
    that PATH finds there (a site's wrapper earlier on PATH, an audit or sudo one, is never bypassed; nor is an
    inventory's `pct:` of its own); lxc-attach needs root (as a user it would look for that user's containers)."""
    if os.geteuid() != 0:
        return False
    if name != "pct":
        return name in PVE_PCTS
    found = _pct_found.get(environ.get("PATH", ""))
    if found is None:
        found = ""
        for d in environ.get("PATH", "").split(":"):
            p = os.path.join(d or ".", "pct")
            if os.path.isfile(p) and os.access(p, os.X_OK):
                found = os.path.realpath(p)
                break
        _pct_found[environ.get("PATH", "")] = found
    return found in PVE_PCTS


_pct_found = {}  # PATH -> the pct it finds (realpath), "" for none


def _uncoerce_locale():
    """Python's locale coercion (PEP 538) set LC_CTYPE in this relay's environment when the session's locale
    was C; every child (pct, lxc-attach, and through them the agents and what they launch) gets the session's
    LC_CTYPE as it was: the one /proc/self/environ (the environment this process started with) holds."""
    try:
        with open("/proc/self/environ", "rb") as f:
            start = f.read().split(b"\0")
    except OSError:
        return
    for kv in start:
        if kv.startswith(b"LC_CTYPE="):
            os.environ["LC_CTYPE"] = os.fsdecode(kv[len(b"LC_CTYPE="):])
            return
    os.environ.pop("LC_CTYPE", None)


class StartFailed(Exception):
    """A staying agent did not say hello (pct refused, no python3, no answer in RESIDENT_HELLO_S); `ended`: its
    process had exited (a refusal), not been given up on."""

    def __init__(self, why, ended):
        super().__init__(why)
        self.ended = ended


class Resident:
    """A staying agent: `PREFIX... python3 -I -S -c BOOT N serve` with the agent's source sent once."""

    def __init__(self, key, argv, source, stop, env=None):
        self.key = key
        self.via = argv[0]
        self.requests = 0
        self.busy = True
        self.idle_since = time.monotonic()  # when it was last given back (set then)
        self.proc = Proc(argv, env)
        # Its own stderr is /dev/null after the hello; what pct or lxc-attach say (a refusal before it starts)
        # is kept, last 4 KiB, and drained so that they never block on a full pipe.
        self.err = b""
        self._err_thread = threading.Thread(target=self._drain_err)
        self._err_thread.daemon = True
        self._err_thread.start()
        deadline = time.monotonic() + RESIDENT_HELLO_S

        def late():
            return stop() or time.monotonic() > deadline

        # A pct that hangs never takes the source: the write gives up with the hello (and at a K).
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._out = bytearray()  # what was read of its stdout and not yet taken
        self._write(source, late)  # when it fails, no hello below says so
        head = self._read(HEADER.size, late)
        kind, _sid, n = HEADER.unpack(head) if head is not None else (None, 0, 0)
        hello = self._read(n, late) if kind == b"H" and n < 4096 else None
        if hello is None:
            if not late():  # its stdout ended: it is exiting (a refusal), though poll() may not see it yet
                try:
                    self.proc.wait(timeout=RESIDENT_EXIT_S)
                except TimeoutExpired:
                    pass
            ended = self.proc.poll() is not None
            self.kill()
            raise StartFailed(self.why(), ended)

    def _drain_err(self):
        try:
            for chunk in iter(lambda: os.read(self.proc.stderr.fileno(), 4096), b""):
                self.err = (self.err + chunk)[-4096:]
        except (OSError, ValueError):
            pass

    def why(self):
        """What pct, lxc-attach or python3 said on stderr, once it ended (empty while it runs)."""
        if self.proc.poll() is not None:
            self._err_thread.join(1)
        return self.err

    def _read(self, n, stop):
        """n bytes of its stdout; None at its end, or once stop() is true (checked every half second)."""
        buf = self._out
        while len(buf) < n:
            if not self._more(stop):
                return None
        got = bytes(buf[:n])
        del buf[:n]
        return got

    def _more(self, stop):
        """What its stdout has, added to self._out, waiting only when nothing is (an answer's frames come in one
        write); False at its end, on an error, or once stop() is true (checked every half second)."""
        fd = self.proc.stdout.fileno()
        while not stop():
            try:
                b = os.read(fd, _CHUNK)
            except BlockingIOError:
                try:
                    _ready(fd, select.POLLIN, 0.5)
                except (OSError, ValueError):
                    return False
                continue
            except (OSError, ValueError):
                return False
            if not b:
                return False
            self._out += b
            return True
        return False

    def _write(self, data, stop):
        """All of data to its stdin (non-blocking); False once it ended or stop() is true (checked every half
        second): a staying agent that stopped reading (a frozen container) never holds a request past its K."""
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            if stop():
                return False
            try:
                view = view[os.write(fd, view[:_CHUNK]):]  # a request fits the pipe: no poll before it
            except BlockingIOError:
                try:
                    _ready(fd, select.POLLOUT, 0.5)
                except (OSError, ValueError):
                    return False
            except (OSError, ValueError):
                return False
        return True

    def alive(self):
        return self.proc.poll() is None

    def frame(self, argv, data):
        """The R frame of one request (counted as sent to it)."""
        body = dumps(argv).encode() + b"\n" + data
        self.requests += 1
        return HEADER.pack(b"R", 0, len(body)) + body

    def request(self, argv, data, emit, stop):
        """Send one request; its answer goes to emit(kind, data) as O/E frames of at most _CHUNK bytes.
        Returns (exit status, delivered, answered): status None when the agent ended, broke the protocol or
        stop() turned true before its X frame; delivered False when the request never reached it; answered
        True once any of its output went to emit."""
        # The agent runs nothing before its whole request arrived: a write cut short delivered nothing.
        if not self._write(self.frame(argv, data), stop):
            self.kill()
            return None, False, False
        return self.answer(_Answer(emit), stop)

    def answer(self, a, stop):
        """Read the rest of answer `a` (request()'s result), waiting as _read does."""
        while not a.feed(self._out) and self._more(stop):
            pass
        if a.code is None:
            self.kill()
        return a.code, True, a.answered

    def end(self):
        """Close its stdin: it exits at the end of its current request (at once when idle)."""
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass

    def kill(self):
        """It can no longer be trusted with a request (stuck, ended, off protocol): end it and its pct exec.
        The agent inside, if it still runs a verb, meets a closed pipe at its next write."""
        self.end()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Answer:
    """A staying agent's answer read as it comes: its O and E frames go to emit in pieces of at most _CHUNK bytes,
    its X ends it. feed() takes what arrived; True once it ended: `code` is then its exit status, or None when the
    agent broke the protocol (a frame kind or size no agent sends, a status that is not a number)."""

    def __init__(self, emit):
        self.emit = emit
        self.kind = None  # of the O or E frame being read
        self.left = 0  # its bytes still to come
        self.answered = False  # some of its output went to emit
        self.code = None
        self.done = False

    def feed(self, buf):
        while not self.done:
            if self.left:
                if not buf:
                    return False
                chunk = bytes(buf[:min(self.left, _CHUNK)])
                del buf[:len(chunk)]
                self.left -= len(chunk)
                self.answered = True
                self.emit(self.kind, chunk)
                continue
            if len(buf) < HEADER.size:
                return False
            kind, _sid, n = HEADER.unpack_from(buf)
            if kind == b"X":
                if n > 16:
                    self.done = True
                    break
                if len(buf) < HEADER.size + n:
                    return False
                code = bytes(buf[HEADER.size:HEADER.size + n])
                del buf[:HEADER.size + n]
                self.done = True
                try:
                    self.code = int(code)  # what the agent says: not trusted to be a number
                except ValueError:
                    pass
                break
            if kind not in (b"O", b"E") or n > RESIDENT_MAX_FRAME:
                self.done = True
                break
            del buf[:HEADER.size]
            self.kind, self.left = kind, n
        return True


class _Residents:
    def __init__(self):
        self.lock = threading.Lock()
        self.idle = {}  # key -> [Resident]
        self.count = {}  # key -> live residents (idle or busy)
        self.total = 0
        self.kept = set()  # every started Resident not yet forgotten (for T)
        # Past this, requests run as execs: staying agents never take the descriptors an exec needs.
        self.cap = min(RESIDENT_TOTAL, _nofile() // 8)
        try:
            self.idle_s = max(0.0, float(os.environ.get("CTL_AGENT_IDLE_S", RESIDENT_IDLE_S)))
        except ValueError:
            self.idle_s = RESIDENT_IDLE_S
        self.swept = time.monotonic()

    def take_idle(self, key):
        """An idle staying agent for key, marked busy; or None."""
        with self.lock:
            r, old = self._idle(key), self._sweep()
        _retire(old)
        return r

    def _sweep(self):
        """The idle staying agents no request took for idle_s, forgotten (under the lock): the caller ends them
        (_retire) once it has let the lock go. Busy ones are never in an idle pool."""
        now = time.monotonic()
        if now - self.swept < min(RESIDENT_SWEEP_S, self.idle_s):
            return []
        self.swept = now
        old = []
        for key, pool in list(self.idle.items()):
            stale = [r for r in pool if now - r.idle_since >= self.idle_s]
            if not stale:
                continue
            pool[:] = [r for r in pool if now - r.idle_since < self.idle_s]
            if not pool:
                del self.idle[key]
            for r in stale:
                self._forget(r)
            old += stale
        return old

    def _idle(self, key):
        pool = self.idle.get(key, [])
        while pool:
            r = pool.pop()
            if r.alive():
                r.busy = True
                return r
            self._forget(r)
        return None

    def take(self, key):
        """An idle staying agent for key, marked busy; or None, and whether one may be started."""
        with self.lock:
            old = self._sweep()
            r, may_start = self._idle(key), False
            if r is None and self.count.get(key, 0) < RESIDENT_PER_KEY and self.total < self.cap:
                self.count[key] = self.count.get(key, 0) + 1  # held for the one about to start
                self.total += 1
                may_start = True
        _retire(old)
        return r, may_start

    def add(self, r):
        with self.lock:
            self.kept.add(r)

    def attached(self, container):
        """A live staying agent that lxc-attach started in `container` (its argv's first 3 words: pct exec VMID)."""
        with self.lock:
            return any(r.key[0][:3] == container and r.via == "lxc-attach" and r.alive() for r in self.kept)

    def stats(self):
        with self.lock:
            return {"agents": [{"argv": list(r.key[0]), "pid": r.proc.pid, "requests": r.requests, "busy": r.busy,
                                "via": r.via} for r in self.kept if r.alive()]}

    def _forget(self, r_or_key):
        if isinstance(r_or_key, Resident):
            self.kept.discard(r_or_key)
        key = r_or_key.key if isinstance(r_or_key, Resident) else r_or_key
        self.count[key] = self.count.get(key, 1) - 1
        self.total -= 1

    def give_back(self, r, healthy):
        with self.lock:
            r.busy = False
            if healthy and r.alive() and not _closing:
                r.idle_since = time.monotonic()
                self.idle.setdefault(r.key, []).append(r)
                return
            self._forget(r)
        r.end()

    def unreserve(self, key):
        with self.lock:
            self._forget(key)

    def close(self):
        with self.lock:
            left = [r for pool in self.idle.values() for r in pool]
            self.idle.clear()
        for r in left:
            r.end()
        for r in left:
            try:
                r.proc.wait(timeout=5)
            except TimeoutExpired:
                r.kill()


def _direct(argv):
    """(argv, env) to run `pct exec VMID -- ...` with: attached directly when a staying agent of that container
    came in through lxc-attach and lives (pct found the container running then, and it has not stopped since: the
    agent would have died with it), as pct would attach after its own check, without pct's start (a Perl program,
    several hundred ms on a Proxmox host); else argv itself."""
    if not _no_lxc_attach and len(argv) > 3 and _residents.attached(tuple(argv[:3])):
        direct = attach_argv(argv, os.environ)
        if direct is not None:
            return direct
    return argv, None


def _start_resident(key, argv, source, stop):
    """A staying agent for argv: attached directly when argv is pct's exec (attach_argv), else, or when that
    does not say hello, through argv itself."""
    direct = None if _no_lxc_attach else attach_argv(argv, os.environ)
    if direct is not None:
        try:
            return Resident(key, direct[0], source, stop, env=direct[1])
        except FileNotFoundError:
            _no_lxc_attach.append(True)
        except StartFailed as e:
            if stop() or not e.ended:
                raise  # abandoned, or an attach that hung until RESIDENT_HELLO_S: pct would wait as long again
        except OSError:
            if stop():
                raise
    return Resident(key, argv, source, stop)


_residents = _Residents()


def _retire(old):
    """End staying agents swept as idle: their stdin closes (an idle agent exits at once) and a worker reaps them,
    killing one that has not exited within RESIDENT_EXIT_S."""
    if not old:
        return
    for r in old:
        r.end()

    def reap():
        deadline = time.monotonic() + RESIDENT_EXIT_S
        for r in old:  # as close() ends the idle ones
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutExpired:
                r.kill()

    _workers.run(reap)


_sources = {}  # sha256 -> agent source, the newest SOURCES_KEPT (requests may omit a source kept here)
_sources_lock = threading.Lock()
SOURCES_KEPT = 8


def _keep_source(source, digest=None):
    """Keep source under its sha256 (the newest SOURCES_KEPT); `digest` when it is already known: a source taken
    from the kept ones is not hashed again, or a staying agent's every request would hash 90 KB."""
    if digest is None:
        digest = sha256(source).hexdigest()
    with _sources_lock:
        _sources.pop(digest, None)
        _sources[digest] = source
        while len(_sources) > SOURCES_KEPT:
            del _sources[next(iter(_sources))]
    return digest
_closing = []  # set once the relay's input ended: staying agents are ended, not kept


class AgentRequest:
    """Stream of an A frame: its input is gathered until C, then answered by a staying agent (or an exec). Input
    past what a staying agent takes goes to its exec at once, as it comes: the relay never holds more of it."""

    def __init__(self, sid, spec):
        self.sid = sid
        self.argv = [str(a) for a in spec["argv"]]
        self.at = int(spec["at"])
        self.n = int(spec["n"])
        self.retry = bool(spec.get("retry"))
        self.sha = str(spec.get("sha") or "")
        self.kept = False  # its source is kept under self.sha (left out of the request, or kept at close_stdin)
        if not (0 < self.at < len(self.argv)) or self.n < 0:
            raise ValueError("bad agent request")
        self.buf = bytearray()
        self.closed = False
        self.abandoned = False
        self.lost = False  # its source was left out and is not kept here: its input is dropped, U at C
        self.handoff = None  # the Child its exec runs in, once it took our id
        self.waiting = None  # the _Loop reading its answer (see _Loop.take), while it does
        self._lock = threading.Lock()  # abandoned and handoff: a K never falls between them
        # Held from close_stdin until the request was answered: join() waits on it. A lock, not an Event: an Event
        # is a Condition built in Python, ~5 us of the relay's reading loop per request.
        self.answered = None
        self.pending = []  # frames of the answer not written yet (_emit)
        self.pending_n = 0
        with _children_lock:
            _children[sid] = self
            _live.add(self)

    def send(self, data):
        if self.closed or self.lost:
            return
        self.buf += data
        if len(self.buf) > min(self.n, RESIDENT_MAX_INPUT) + RESIDENT_MAX_INPUT:
            if self._with_source():
                self._exec(close=False)  # from now on our id, and so the rest of the input, is the exec's
            else:
                self.lost, self.buf = True, bytearray()

    def close_stdin(self, loop=None):
        """Its input is all here: answered by the relay's reading loop when `loop` can (_Loop.take), else by a
        worker."""
        if self.closed:
            return
        self.closed = True
        if self.n and not self.kept and not self.lost and len(self.buf) >= self.n:
            # Kept now, in the reading loop, not when a worker answers: ctl sends the source with the first of
            # the requests it has in flight together and leaves it out of the others, which the loop reads next.
            self.sha, self.kept = _keep_source(bytes(self.buf[:self.n])), True
        self.answered = threading.Lock()
        self.answered.acquire()
        if loop is None or not loop.take(self):
            _workers.run(self._run)

    def abandon(self):
        """K: the controller stopped reading. A request still gathering its input never runs; one being answered
        is cut, and its staying agent ended (it may be stuck in that request); one whose exec took over (the
        reader had looked the id up just before) reaches that exec."""
        with self._lock:
            self.abandoned = True
            child = self.handoff
        if child is not None:
            child.abandon()
        elif self.waiting is not None:  # K and the loop are both the reading thread's: no race
            self.waiting.cancel(self)
        elif not self.closed:
            self.close_stdin()

    def _emit(self, kind, data):
        """Kept until the answer ends (or 64 KiB are waiting), so that a small answer leaves in one write."""
        if self.abandoned:
            return
        self.pending.append(HEADER.pack(kind, self.sid, len(data)) + data)
        self.pending_n += len(data)
        if self.pending_n >= _CHUNK:
            self._flush()

    def _flush(self, last=b""):
        """What _emit kept (dropped once abandoned), then `last` (the X frame), in one write."""
        pending, self.pending, self.pending_n = self.pending, [], 0
        frames = (b"" if self.abandoned else b"".join(pending)) + last
        if frames:
            _emit_raw(frames)

    def _with_source(self):
        """The kept source in front of the input of a request that left it out; False when none is kept."""
        if self.n == 0 and self.sha:
            with _sources_lock:
                kept = _sources.get(self.sha)
            if kept is None:
                return False
            self.buf[0:0] = kept
            self.n = len(kept)
            self.kept = True
        return True

    def _exec(self, close=True):
        """The request as its own exec, exactly as an S frame would have run it (with close, its input is all
        here; without, the rest comes to the exec as I frames)."""
        self._flush()  # nothing is kept by now; were anything, it would go before the exec's output
        argv, env = _direct(self.argv)
        child = Child(self.sid, argv, replaces=self, env=env)  # takes our id: a K from now on reaches it
        with self._lock:
            self.handoff = child
            abandoned = self.abandoned
        with _children_lock:
            _live.discard(self)
        if abandoned:
            child.abandon()
            return
        for pos in range(0, len(self.buf), _CHUNK):
            child.send(bytes(self.buf[pos:pos + _CHUNK]))
        self.buf = bytearray()
        if close:
            child.close_stdin()

    def _run(self, work=None):
        try:
            (work or self._answer)()
        except Exception as e:  # whatever went wrong, the stream gets its X (unless its exec has the id)
            self._failed(e)
        finally:
            self.answered.release()

    def _failed(self, e):
        with self._lock:
            handed = self.handoff is not None
        if not handed:
            self._emit(b"E", ("ctl relay: agent request failed: %r\n" % (e,)).encode())
            self._done(255)

    def _ended(self, r, code, delivered, answered):
        """After staying agent r's try: its X sent (True), or False when the request is to run again (the agent
        had ended before it: a request that never reached it, or one for a verb that only reads)."""
        _residents.give_back(r, code is not None)
        if code is not None:
            self._done(code)
            return True
        if self.abandoned:
            self._done(255)
            return True
        if answered or (delivered and not self.retry):
            said = r.why().strip()[-200:]
            self._emit(b"E", b"ctl relay: ctl's agent ended before it answered" +
                       (b" (" + said + b")" if said else b"") + b"\n")
            self._done(255)
            return True
        return False

    def _answer(self, attempts=2):
        if self.abandoned:
            return self._done(255)
        if self.lost or not self._with_source():
            self._emit(b"U", b"")
            return self._done(254)
        if self.n == 0 or len(self.buf) < self.n:  # no source to start a staying agent with: as S would run it
            return self._exec()
        source, data = bytes(self.buf[:self.n]), bytes(self.buf[self.n:])
        key = (tuple(self.argv[:self.at]), _keep_source(source, self.sha if self.kept else None))
        for _attempt in range(attempts):
            r, may_start = _residents.take(key)
            if r is None and may_start:
                try:
                    r = _start_resident(key, [*self.argv[:self.at], "serve"], source, lambda: self.abandoned)
                except (StartFailed, OSError):
                    _residents.unreserve(key)
                    # pct's own refusal (a stopped CT) reaches ctl as from the exec
                    return self._done(255) if self.abandoned else self._exec()
                _residents.add(r)
            if r is None:
                return self._exec()
            if self._ended(r, *r.request(self.argv[self.at:], data, self._emit, lambda: self.abandoned)):
                return None
            # It had ended before this request (the container restarted): a request that never reached it, or
            # one for a verb that only reads, runs again.
        return self._exec()

    def _rest(self, r, frame, sent):
        """In a worker: the rest of a request the loop began (frame[sent:] still to write), then its answer."""
        stop = lambda: self.abandoned  # noqa: E731
        if not r._write(frame[sent:], stop):
            r.kill()
            done = self._ended(r, None, False, False)
        else:
            done = self._ended(r, *r.answer(_Answer(self._emit), stop))
        if not done:
            self._answer(attempts=1)

    def _broke(self, r, a):
        """In a worker: staying agent r ended, or broke the protocol, before it finished answer `a`."""
        r.kill()
        if not self._ended(r, None, True, a.answered):
            self._answer(attempts=1)

    def _follow(self, r, a):
        """In a worker: the rest of answer `a` the loop was reading when the relay's input ended."""
        if not self._ended(r, *r.answer(a, lambda: self.abandoned)):
            self._answer(attempts=1)

    def _done(self, code):
        with _children_lock:
            _children.pop(self.sid, None)  # forgotten BEFORE X, as for a Child
        x = str(code).encode()
        self._flush(HEADER.pack(b"X", self.sid, len(x)) + x)
        with _children_lock:
            _live.discard(self)

    def join(self):
        if self.answered is not None:
            with self.answered:
                pass


class _Workers:
    """The threads that answer agent requests, kept for the next ones: a thread started per request cost the
    relay's reading loop ~0.13 ms of CPU each. A request never waits for another: it goes to a worker that is
    idle, else to a new one; past WORKERS_IDLE idle ones, a worker that finishes ends."""

    def __init__(self):
        self.lock = threading.Lock()
        self.idle = 0  # workers waiting on (or about to wait on) self.jobs
        self.jobs = queue.SimpleQueue() if hasattr(queue, "SimpleQueue") else queue.Queue()

    def run(self, job):
        with self.lock:
            spare = self.idle > 0
            if spare:
                self.idle -= 1
        if spare:
            self.jobs.put(job)  # exactly one idle worker was counted for it
            return
        t = threading.Thread(target=self._loop, args=(job,))
        t.daemon = True
        t.start()

    def _loop(self, job):
        while True:
            job()
            with self.lock:
                if self.idle >= WORKERS_IDLE:
                    return
                self.idle += 1
            job = self.jobs.get()


WORKERS_IDLE = 64
_workers = _Workers()


COMPILED_KEEP = 4  # compiled relays kept in /run/ctl (one per ctl version met), newest first


def keep_compiled(entry):
    """Keep the code BOOT just compiled (entry: (path, code), set by BOOT only when it compiled) for the next
    session's start; best effort, never in the way. The directory must be ours alone; the file is written under a
    temporary name and renamed; relays beyond the newest COMPILED_KEEP, and temporary names an hour old, go."""
    if not entry:
        return
    import marshal

    path, code = entry
    d, name = os.path.split(path)
    try:
        os.makedirs(d, 0o700, exist_ok=True)
        st = os.lstat(d)
        if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return
        part = "%s.%d.tmp" % (path, os.getpid())
        with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
            f.write(marshal.dumps(code))
        os.rename(part, path)
        prefix = name.split("-")[0] + "-"
        mine = [(e.stat(follow_symlinks=False).st_mtime, e.name, e.path) for e in os.scandir(d)
                if e.name.startswith(prefix)]
        done = sorted((m for m in mine if not m[1].endswith(".tmp")), reverse=True)[COMPILED_KEEP:]
        for _, _, p in done + [m for m in mine if m[1].endswith(".tmp") and time.time() - m[0] > 3600]:
            os.unlink(p)
    except (OSError, ValueError):
        pass


class _Loop:
    """The relay's reading thread: ctl's frames from stdin, and the answers of the staying agents it asked itself.

    A request whose staying agent is idle, whose source is kept and whose frame fits a pipe is written to that
    agent here, and its answer read here as poll() finds it: no thread is woken for it. Before this, a worker
    thread took every request; a request then cost the relay ~8 thread switches, ~2 now. What needs waiting
    (starting an agent, a write that does not fit, an exec) is a worker's, as before."""

    INLINE_MAX = 1 << 15  # a request frame written here (an idle agent's pipe holds 64 KiB; some hosts give 4)

    def __init__(self):
        self.poll = select.poll()
        self.poll.register(0, select.POLLIN)
        self.buf = bytearray()
        self.waiting = {}  # fd of a staying agent's stdout -> (request, that agent, its _Answer)

    def run(self, stdin):
        """Until the end of stdin; then every answer still being read goes to a worker."""
        os.set_blocking(0, False)
        # ctl sends no frame before our hello, so nothing is left in sys.stdin's buffer from BOOT's read of our
        # source; were anything, it comes first.
        try:
            self.buf += stdin.read1(_CHUNK) or b""
        except (BlockingIOError, OSError, ValueError):
            pass
        self.frames()
        me = threading.get_ident()
        while True:
            events = self.poll.poll()
            _held[me] = []
            try:
                for fd, _ev in events:
                    if fd == 0:
                        try:
                            data = os.read(0, _CHUNK)
                        except BlockingIOError:
                            continue
                        except OSError:
                            data = b""
                        if not data:
                            self.release()
                            return self.hand_over()
                        self.buf += data
                        self.frames()
                    elif fd in self.waiting:
                        self.read_answer(fd)
            finally:
                self.release()

    @staticmethod
    def release():
        """What this thread held back, written now (before a stream it wrote for goes to a worker, which writes
        as it goes: that stream's frames stay in order)."""
        held = _held.pop(threading.get_ident(), None)
        if held:
            _emit_raw(b"".join(held))

    def frames(self):
        buf = self.buf
        while len(buf) >= HEADER.size:
            kind, sid, n = HEADER.unpack_from(buf)
            if len(buf) < HEADER.size + n:
                return
            data = bytes(buf[HEADER.size:HEADER.size + n])
            del buf[:HEADER.size + n]
            self.dispatch(kind, sid, data)

    def dispatch(self, kind, sid, data):
        with _children_lock:
            child = _children.get(sid)
        if kind == b"S":
            if child is not None:
                _emit(b"E", sid, b"ctl relay: stream id reused\n")
                return
            argv, env = _direct([str(a) for a in loads(data.decode())])
            Child(sid, argv, env=env)
        elif kind == b"T" and sid == 0:
            _emit(b"T", 0, dumps(_residents.stats()).encode())
        elif kind == b"A":
            if child is not None:
                _emit(b"E", sid, b"ctl relay: stream id reused\n")
                return
            try:
                AgentRequest(sid, loads(data.decode()))
            except (ValueError, KeyError, TypeError, AttributeError):
                _emit(b"E", sid, b"ctl relay: malformed agent request\n")
                _emit(b"X", sid, b"2")
        elif kind == b"I" and child is not None:
            child.send(data)
        elif kind == b"C" and child is not None:
            if isinstance(child, AgentRequest):
                child.close_stdin(self)
            else:
                child.close_stdin()
        elif kind == b"K" and child is not None:
            child.abandon()

    def take(self, req):
        """Begin req here (True), or leave it to a worker (False: nothing of it was sent)."""
        if req.abandoned or req.lost or req.n != 0 or not req.sha or len(req.buf) > self.INLINE_MAX:
            return False
        with _sources_lock:
            kept = _sources.get(req.sha)
        if kept is None:
            return False
        r = _residents.take_idle((tuple(req.argv[:req.at]), req.sha))
        if r is None:
            return False
        _keep_source(kept, req.sha)  # the newest again, as a worker's request would make it
        frame = r.frame(req.argv[req.at:], bytes(req.buf))
        try:
            sent = os.write(r.proc.stdin.fileno(), frame)
        except BlockingIOError:
            sent = 0
        except (OSError, ValueError):  # it ended before this request: a worker asks another
            r.kill()
            _residents.give_back(r, False)
            return False
        if sent < len(frame):  # a pipe that does not hold it: a worker writes the rest and waits for the answer
            _workers.run(lambda: req._run(lambda: req._rest(r, frame, sent)))
            return True
        fd = r.proc.stdout.fileno()
        a = _Answer(req._emit)
        req.waiting = self
        self.waiting[fd] = (req, r, a)
        self.poll.register(fd, select.POLLIN)
        if r._out:  # what an earlier read brought past that answer's X
            self.read_answer(fd, fresh=False)
        return True

    def _drop(self, fd):
        req, r, a = self.waiting.pop(fd)
        self.poll.unregister(fd)
        req.waiting = None
        return req, r, a

    def read_answer(self, fd, fresh=True):
        """What the agent at fd wrote (fresh: read it now; else what is in its buffer already)."""
        req, r, a = self.waiting[fd]
        try:
            b = True
            if fresh:
                try:
                    b = os.read(fd, _CHUNK)
                except BlockingIOError:
                    return
                except (OSError, ValueError):
                    b = b""
                r._out += b
            if not a.feed(r._out) and b:
                return
        except Exception as e:  # as in a worker's _run: whatever went wrong, the stream gets its X
            self._drop(fd)
            r.kill()
            _residents.give_back(r, False)
            self._finish(req, e)
            return
        self._drop(fd)
        if a.code is None:  # it ended or broke the protocol: ending it and reading why may wait, so a worker does
            self.release()  # what this loop wrote of the answer goes first
            _workers.run(lambda: req._run(lambda: req._broke(r, a)))
            return
        try:
            done = req._ended(r, a.code, True, a.answered)
        except Exception as e:
            return self._finish(req, e)
        if done:
            req.answered.release()
        else:
            _workers.run(lambda: req._run(lambda: req._answer(attempts=1)))

    @staticmethod
    def _finish(req, e):
        try:
            req._failed(e)
        finally:
            req.answered.release()

    def cancel(self, req):
        """K for a request answered here: its agent is ended (it may be stuck in it), its X goes out."""
        for fd, (q, r, _a) in list(self.waiting.items()):
            if q is req:
                self._drop(fd)
                r.kill()
                _residents.give_back(r, False)
                req._done(255)
                req.answered.release()

    def hand_over(self):
        """The relay's input ended: answers still being read here are read to their end by workers."""
        for fd in list(self.waiting):
            req, r, a = self._drop(fd)
            _workers.run(lambda req=req, r=r, a=a: req._run(lambda: req._follow(r, a)))


def main():
    _uncoerce_locale()
    _emit(b"H", 0, dumps({"relay": 3, "pid": os.getpid(), "python": sys.version.split()[0]}).encode())
    keep_compiled(globals().pop("__ctl_compiled__", None))  # after the hello: ctl is not kept waiting
    _Loop().run(sys.stdin.buffer)
    _closing.append(True)
    with _children_lock:
        left = list(_live)
    for c in left:
        if isinstance(c, AgentRequest) and not c.closed:
            c.abandon()  # its input may be cut: it never runs
        else:
            c.close_stdin()
    for c in left:
        c.join()
    # An _exec fallback may have registered a Child while we waited.
    with _children_lock:
        late = [c for c in _live if c not in left]
    for c in late:
        c.close_stdin()
        c.join()
    _residents.close()
    return 0


if __name__ == "__main__":
    # Under BOOT (python3 -c BOOT N) argv is ["-c", N].
    sys.exit(main())
