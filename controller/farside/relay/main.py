"""The relay's reading loop (ctl's frames, the answers of idle staying agents) and its start and end."""

import os
import select
import sys
import threading

from ..common import keep_compiled
from .agents import (
    AgentRequest,
    _Answer,
    _closing,
    _direct,
    _keep_source,
    _residents,
    _sources,
    _sources_lock,
    _uncoerce_locale,
    _workers,
)
from .base import dumps, loads
from .mux import _CHUNK, HEADER, Child, _children, _children_lock, _emit, _emit_raw, _held, _live


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
