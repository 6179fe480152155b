"""The agent's verbs by name, one request (main), and a staying agent answering requests one after another
(serve, started by the host relay)."""

import io
import os
import struct
import sys

from ..common import keep_compiled
from .base import json, traceback
from .cache import cachemark, cacherestore, cachesave, cachestat, envfacts, writefile
from .checkpoints import ckptscan, packdir, unpackdir
from .deploy import apply, storelist, storeprune, sync
from .fs import hashes
from .logs import logread, tailinfo
from .runs import launch, poll, probe, runstate, stop

# The frames between the host relay and a staying agent: kind (1 byte), 0 (2 bytes), length (4 bytes), big-endian,
# then the data (the relay's own header, controller/farside/relay/mux.py).
_FRAME = struct.Struct(">cHI")
SERVE_MAX_REQUEST = 64 << 20  # the relay sends only small requests to a staying agent (RESIDENT_MAX_INPUT)


def _read_exact(fd, n):
    parts, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve():
    """Stay and answer requests over stdin/stdout instead of one process per verb (a `pct exec`, a python3 start
    and a compile of this source each).

    The relay sends nothing after the source until this hello (H, JSON), so no request byte is left in
    sys.stdin's buffer. The protocol then moves to private copies of fds 0 and 1, and fds 0, 1 and 2 become
    /dev/null: a child of a verb (tmux, nvidia-smi) that writes to its stdout or reads its stdin can never
    touch a frame. A request is R: a JSON argv line, then the verb's whole input. Its answer is O (what
    the verb wrote on stdout), E (stderr, with the traceback of an exception) and X (its exit status,
    ASCII), exactly what one `python3 -c BOOT N VERB ...` exec would have given. End of stdin: exit."""
    _STAYING.append(0)
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    hello = json.dumps({"agent": "serve", "pid": os.getpid(), "python": sys.version.split()[0]}).encode()
    _write_all(wfd, _FRAME.pack(b"H", 0, len(hello)) + hello)
    keep_compiled(globals().pop("__ctl_compiled__", None))  # after the hello: the relay is not kept waiting
    while True:
        head = _read_exact(rfd, _FRAME.size)
        if head is None:
            return 0
        kind, _sid, n = _FRAME.unpack(head)
        if kind != b"R" or n > SERVE_MAX_REQUEST:
            return 2  # not the relay speaking: stop rather than guess
        body = _read_exact(rfd, n)
        if body is None:
            return 0
        line, _, data = body.partition(b"\n")
        _STAYING[0] += 1
        out, err, rc = _serve_one(json.loads(line.decode()), data)
        # One write: the relay, woken once, reads the whole answer (three writes could wake it three times).
        _write_all(wfd, b"".join(_FRAME.pack(k, 0, len(chunk)) + chunk
                                 for k, chunk in ((b"O", out), (b"E", err), (b"X", str(rc).encode()))))


_STAYING = []  # in a staying agent (serve): [requests it took, this one included]


def hello(args):
    """Who answers. A staying agent also says how many requests it took: more than this one means it was up
    before (`ctl ping` counts this answer as one of its round trips)."""
    out = {"ok": True, "pid": os.getpid(), "python": sys.version.split()[0], "staying": bool(_STAYING)}
    if _STAYING:
        out["served"] = _STAYING[0]
    return out


def _serve_one(argv, data):
    """One request: main(argv) with stdin, stdout and stderr of its own; (stdout bytes, stderr bytes, status)."""
    if not argv or argv[0] == "serve":
        return b"", b"ctl agent: not a verb for a staying agent\n", 2
    saved = sys.stdin, sys.stdout, sys.stderr
    out, err = io.BytesIO(), io.BytesIO()
    sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace", write_through=True)
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # as one exec would: the traceback on stderr, status 1
        try:
            traceback.print_exc()  # imported on first use: may itself fail (a MemoryError, a python upgraded)
        except BaseException:
            sys.stderr.write("%s: %s\n" % (type(e).__name__, e))
        rc = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            f.flush()
        got = out.getvalue(), err.getvalue()
        sys.stdin, sys.stdout, sys.stderr = saved
    return got[0], got[1], rc


def main(argv):
    verb = argv[0]
    if verb != "serve":
        keep_compiled(globals().pop("__ctl_compiled__", None))
    if verb == "hashes":  # hashes ROOT [--follow=JSON] PATH...
        paths, follow = argv[2:], []
        if paths and paths[0].startswith("--follow="):
            follow, paths = json.loads(paths[0][len("--follow="):]), paths[1:]
        out = hashes(argv[1], paths, follow)
    elif verb == "sync":
        out = sync(argv[1], argv[2], argv[3], sys.stdin.buffer)
    elif verb == "apply":
        out = apply(argv[1], argv[2], argv[3], sys.stdin.buffer)
    elif verb == "logread":
        return logread(json.loads(argv[1]))
    elif verb == "poll":
        return poll(json.loads(argv[1]))
    elif verb in ("cachestat", "cachemark", "cachesave", "cacherestore", "envfacts"):
        out = {"cachestat": cachestat, "cachemark": cachemark, "cachesave": cachesave,
               "cacherestore": cacherestore, "envfacts": envfacts}[verb](json.loads(argv[1]))
    elif verb == "ckptscan":
        out = ckptscan(json.loads(argv[1]))
    elif verb == "packdir":
        out = packdir(json.loads(argv[1]))
    elif verb == "unpackdir":
        out = unpackdir(json.loads(argv[1]), sys.stdin.buffer)
    elif verb == "writefile":
        out = writefile(json.loads(argv[1]), sys.stdin.buffer)
    elif verb in ("storelist", "storeprune"):
        out = {"storelist": storelist, "storeprune": storeprune}[verb](json.loads(argv[1]))
    elif verb == "serve" and len(argv) == 1:
        return serve()
    elif verb in ("probe", "runstate", "launch", "stop", "tailinfo", "hello"):
        out = {"probe": probe, "runstate": runstate, "launch": launch, "stop": stop,
               "tailinfo": tailinfo, "hello": hello}[verb](json.loads(argv[1]))
    else:
        out = {"ok": False, "error": "unknown verb %r" % verb}
    sys.stdout.write(json.dumps(out))
    sys.stdout.flush()
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    # Under BOOT (python3 -c BOOT N verb ...) argv is ["-c", N, verb, ...]; as a file, [path, verb, ...].
    sys.exit(main(sys.argv[2:] if sys.argv[0] == "-c" else sys.argv[1:]))
