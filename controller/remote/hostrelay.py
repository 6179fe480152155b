"""ctl's host relay: runs ON a Proxmox host (stdlib only, Python >= 3.6), one per host and command.

The controller never imports this module. It sends its source over the stdin of ONE SSH exec
(`python3 -I -S -c BOOT N`, like the agent), and the relay then starts, for each container of that
host, the exact argv ctl would otherwise have sent through its own exec (`pct exec VMID -- python3
... agent ...`), concurrently, with no shell. Their stdin, stdout, stderr and exit status travel as
frames over the relay's own stdin/stdout, so every container's conversation with its agent is the
same as over a direct exec, while the host's login shell and the SSH channel are paid once.

Frame: 7-byte header (kind: 1 byte, stream id: 2 bytes, length: 4 bytes, big-endian), then the data.
  controller -> relay  S start (data: JSON argv)   I stdin data   C close that stdin
                       K abandon: close its stdin and stop reading its output (its next write fails, as
                         when an SSH channel closes under a command); its X frame still comes
  relay -> controller  H hello (stream 0, JSON)    O stdout data  E stderr data  X exit status (ASCII)
A child that cannot be started answers E (the reason) and X 127, as a shell would. A stream id is
forgotten before its X frame goes out, so the controller may reuse it as soon as it has read that X (ids
are 16 bits: a long-lived session wraps around them). End of the
relay's stdin (ctl is done, or the connection dropped) closes every child's stdin; the relay waits
for the children (an agent that sees its stdin end leaves every old file whole) and exits.
"""

import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading

HEADER = struct.Struct(">cHI")
_CHUNK = 1 << 16
_out_lock = threading.Lock()
_broken = []  # set once our stdout is gone: keep draining children, stop writing
_children = {}  # stream id -> Child, while its process runs (until just before its X frame)
_live = set()  # every Child whose X frame is not out yet: the relay waits for them before it exits
_children_lock = threading.Lock()


def _emit(kind, sid, data=b""):
    if _broken:
        return
    with _out_lock:
        try:
            out = sys.stdout.buffer
            out.write(HEADER.pack(kind, sid, len(data)) + data)
            out.flush()
        except (OSError, ValueError):
            _broken.append(True)


def _read_exact(stream, n):
    buf = b""
    while len(buf) < n:
        b = stream.read(n - len(buf))
        if not b:
            return None
        buf += b
    return buf


class Child:
    def __init__(self, sid, argv):
        self.sid = sid
        self.inbox = queue.Queue(maxsize=256)  # bounded: a slow reader holds the relay back, not its memory
        self.threads = []
        self.closed = False
        self.abandoned = False  # K: the controller stopped reading; our read ends close, the child's writes fail
        self._close_lock = threading.Lock()
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, close_fds=True)
        except OSError as e:
            self.proc = None
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
                ready = select.select([fd], [], [], 0.5)[0]
                b = os.read(fd, _CHUNK) if ready else None
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


def main():
    stdin = sys.stdin.buffer
    _emit(b"H", 0, json.dumps({"relay": 2, "pid": os.getpid(), "python": sys.version.split()[0]}).encode())
    while True:
        head = _read_exact(stdin, HEADER.size)
        if head is None:
            break
        kind, sid, n = HEADER.unpack(head)
        data = _read_exact(stdin, n) if n else b""
        if data is None:
            break
        with _children_lock:
            child = _children.get(sid)
        if kind == b"S":
            if child is not None:
                _emit(b"E", sid, b"ctl relay: stream id reused\n")
                continue
            Child(sid, [str(a) for a in json.loads(data.decode())])
        elif kind == b"I" and child is not None:
            child.send(data)
        elif kind == b"C" and child is not None:
            child.close_stdin()
        elif kind == b"K" and child is not None:
            child.abandon()
    with _children_lock:
        left = list(_live)
    for c in left:
        c.close_stdin()
    for c in left:
        c.join()
    return 0


if __name__ == "__main__":
    # Under BOOT (python3 -c BOOT N) argv is ["-c", N].
    sys.exit(main())
