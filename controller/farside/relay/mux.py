"""Frames over the relay's stdin/stdout, and the children (S requests) whose stdin, stdout and stderr they carry."""

import os
import queue
import select
import struct
import sys
import threading

from .base import Proc

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
