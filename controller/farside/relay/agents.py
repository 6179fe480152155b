"""Staying agents (A requests): one per container and agent source, started through lxc-attach or pct,
kept while the relay lives, and the exec a request falls back to."""

import os
import queue
import select
import threading
import time

from .base import Proc, TimeoutExpired, dumps, sha256
from .mux import _CHUNK, HEADER, Child, _children, _children_lock, _emit_raw, _live, _nofile, _ready

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
