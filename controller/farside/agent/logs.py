"""Logs: their tail (tailinfo), their bytes from an offset (logread), and the glob checkpoint scans use."""

import os
import stat
import sys
import time

from .base import _small_sha256, glob, hashlib, json, re
from .fs import _describe, _sha, _under

# A log's tail as `ctl tail` shows it: at most TAIL_WINDOW bytes are read from the end, lines end at \n, \r\n
# or \r (tqdm redraws with \r), each is cut to LINE_CAP bytes. The same rules as controller/core/loglines.py
# (the agent is stdlib only and imports nothing of ctl).
TAIL_WINDOW = 1 << 20
TAIL_CHUNK = 1 << 16  # read back from the end this much at a time, until the last N lines are in
LINE_CAP = 4096


def _tail_lines(data, partial_first, ends=None):
    """Lines of `data` (no separators), the unfinished last one included, each cut to LINE_CAP bytes; an
    empty line ended by a bare \r (a progress bar's redraw) is left out. With `partial_first`, the first
    line started before `data` did: only its last LINE_CAP bytes are kept, marked. `ends`, when given, gets
    each line's end offset in `data`."""
    out = []
    pos = 0
    seps = [*re.finditer(b"\r\n|\r|\n", data), None]
    for m in seps:
        seg = data[pos:m.start()] if m is not None else data[pos:]
        if m is None and not seg:
            break
        if seg or m is None or m.group() != b"\r":
            if pos == 0 and partial_first:
                seg = b"[cut: started before the last %d bytes] ... " % len(data) + seg[-LINE_CAP:]
            elif len(seg) > LINE_CAP:
                seg = seg[:LINE_CAP] + b" ... [cut: %d bytes]" % (len(seg) - LINE_CAP)
            out.append(seg)
            if ends is not None:
                ends.append(m.end() if m is not None else len(data))
        if m is not None:
            pos = m.end()
    return out


def tailinfo(args):
    """Size of the log and its last N lines, from at most its last TAIL_WINDOW bytes (never the whole file:
    a log whose last line is a long run of progress updates is read once, and answers a bounded reply)."""
    path = _under(args.get("root", "/"), args["log"])
    n = int(args.get("lines", 20))
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start, data, at_line = _tail_read(f, size, n)
    except OSError as e:
        return {"ok": False, "error": _describe(e)}
    ends = []
    partial = start > 0 and not at_line and not data.startswith((b"\n", b"\r"))
    lines = _tail_lines(data, partial, ends) if n > 0 else []
    if start > 0 and len(lines) > n:
        lines, ends = lines[1:], ends[1:]  # the partial first line is only shown when fewer than N lines follow it
    lines, ends = (lines[-n:], ends[-n:]) if n > 0 else ([], [])
    text = b"".join(line + b"\n" for line in lines)
    out = {"ok": True, "size": size, "text": text.decode("utf-8", "replace")}
    if args.get("times"):
        out["times"] = _line_times(path, [start + e for e in ends])
    return out


def _tail_read(f, size, n):
    """(start, data, at_line) of the last TAIL_WINDOW bytes of f that hold its last n lines: read back from the
    end TAIL_CHUNK at a time, and cut just after a \n once n more \n follow it (a \n always ends a line that
    _tail_lines keeps, and the lines after it are split the same whatever precedes it); the whole window when
    fewer lines are in it (at_line False: its first line may have begun before it). A 1 GiB log's last 20
    lines cost one small read, not the split of 1 MiB."""
    limit = max(0, size - TAIL_WINDOW)
    if n <= 0:
        return size, b"", True
    pos, data = size, b""
    while pos > limit:
        step = min(TAIL_CHUNK, pos - limit)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
        if data.count(b"\n") > n:
            cut = data.index(b"\n") + 1
            return pos + cut, data[cut:], True
    return pos, data, False


def _line_times(log, ends):
    """When each line (by its end offset) reached the log, from LOG.times, the launcher's samples of the log's
    size (one line "SIZE EPOCH" whenever it grew, every half second): the first sample at or past a line's end.
    Only the samples from the end back to the first line are read. None where there are no samples."""
    if not ends:
        return []
    samples = []
    try:
        if not stat.S_ISREG(os.lstat(log + ".times").st_mode):  # the container's file: no FIFO, device, symlink
            return [None] * len(ends)
        with open(log + ".times", "rb") as f:
            pos = f.seek(0, 2)
            tail = b""
            while pos > 0 and len(tail) < 4 * TAIL_WINDOW:  # the container's file: read a bounded part
                step = min(pos, 1 << 16)
                pos -= step
                f.seek(pos)
                tail = f.read(step) + tail
                rows = tail.split(b"\n", 2)
                if pos > 0 and len(rows) > 2:  # rows[0] may be cut; rows[1] is whole: before the first line?
                    try:
                        if int(rows[1].split()[0]) < ends[0]:
                            break
                    except (IndexError, ValueError):
                        pass
            for row in tail.splitlines()[1 if pos > 0 else 0:]:
                parts = row.split()
                if len(parts) == 2:
                    try:
                        samples.append((int(parts[0]), float(parts[1].replace(b",", b"."))))  # locale radix
                    except ValueError:
                        pass
    except OSError:
        return [None] * len(ends)
    try:
        mtime = os.stat(log).st_mtime
    except OSError:
        mtime = None
    out = []
    i = 0
    for end in ends:
        while i < len(samples) and samples[i][0] < end:
            i += 1
        out.append(samples[i][1] if i < len(samples) else mtime)  # written since the last sample
    return out


_HEAD = 4096  # bytes of the log's start that identify it (with the inode) across pulls


def _head_sha(f, n):
    f.seek(0)
    data = f.read(n)  # at most _HEAD bytes: no file's worth of hashing, so not worth OpenSSL's load
    return (_small_sha256(data) if _small_sha256 is not None else hashlib.sha256(data)).hexdigest()[:16]


def _wild(name, pat):
    """fnmatch.fnmatchcase(name, pat) for a pattern of literal characters, `*` and `?` (no `[...]`)."""
    n = p = 0
    star, mark = -1, 0
    while n < len(name):
        if p < len(pat) and pat[p] == "*":
            star, mark = p, n
            p += 1
        elif p < len(pat) and (pat[p] == "?" or pat[p] == name[n]):
            n += 1
            p += 1
        elif star >= 0:  # let the last `*` take one more character
            p, mark = star + 1, mark + 1
            n = mark
        else:
            return False
    while p < len(pat) and pat[p] == "*":
        p += 1
    return p == len(pat)


def _names(d, dirs_only):
    """glob's listing of d: the names in it (only directories, symlinks followed, with dirs_only); none on error."""
    out = []
    try:
        with os.scandir(d) as it:
            for e in it:
                try:
                    if not dirs_only or e.is_dir():
                        out.append(e.name)
                except OSError:
                    pass
    except OSError:
        pass
    return out


def _below(d, dirs_only):
    """glob's `**` under d: every name below it, at any depth, hidden ones neither listed nor entered."""
    for x in _names(d, dirs_only):
        if x[0] != ".":
            yield x
            for y in _below(os.path.join(d, x), dirs_only):
                yield os.path.join(x, y)


def _glob(base, pattern):
    """The paths of glob.glob(os.path.join(glob.escape(base), pattern), recursive=True), in any order, without
    importing glob (re, fnmatch, enum...: ~8 ms of every agent start that scans a run's checkpoints) when the
    pattern is made of names, `**`, `*` and `?`; any other pattern goes to glob itself."""
    parts = pattern.split("/")
    if "[" in pattern or any(part in ("", ".", "..") for part in parts):
        return glob.glob(os.path.join(glob.escape(base), pattern), recursive=True)
    found = [base]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        reached = []
        for d in found:
            if part == "**":
                reached.append(os.path.join(d, ""))  # none at all: d/, as glob says it (no file matches it)
                reached.extend(os.path.join(d, x) for x in _below(d, not last))
            elif "*" in part or "?" in part:
                hidden = part[0] == "."  # a name starting with a dot matches only a pattern that does
                reached.extend(os.path.join(d, x) for x in _names(d, not last)
                               if (hidden or x[0] != ".") and _wild(x, part))
            elif not last or os.path.lexists(os.path.join(d, part)):
                reached.append(os.path.join(d, part))
        found = reached
    return found


def _hash_known(path, known):
    """sha256/size/mtime_ns of a file, reusing `known` [size, mtime_ns, sha] when size and mtime match."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    same = known and known[0] == st.st_size and known[1] == st.st_mtime_ns and known[2]
    sha = known[2] if same else _sha(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}


def _logread(args):
    """(header, bytes) of `logread`: the header says where the bytes start ("offset": 0 again, with "reset"
    saying why, when the log was truncated or replaced since `ident`), the log's size, mtime and new ident
    (inode + hash of its first bytes), the agent's clock, and optionally the hashes of files and of
    checkpoints (a hash is only recomputed when a file's size or mtime differs from what the caller already
    knows). At most "max_bytes" log bytes."""
    root = args.get("root", "/")
    path = _under(root, args["log"])
    offset = int(args.get("offset", 0))
    out = {"ok": True, "now": time.time()}
    data = b""
    try:
        f = open(path, "rb")
    except OSError as e:
        out = {"ok": False, "error": _describe(e), "code": "missing" if isinstance(e, FileNotFoundError) else "io"}
        f = None
    if f is not None:
        with f:
            st = os.fstat(f.fileno())
            reset = None
            old = (args.get("ident") or "").split(":")
            if len(old) == 3 and old[0] != str(st.st_ino):
                reset = "replaced (new inode)"
            elif st.st_size < offset:
                reset = "truncated (size %d < offset %d)" % (st.st_size, offset)
            elif len(old) == 3 and (st.st_size < int(old[1]) or _head_sha(f, int(old[1])) != old[2]):
                reset = "rewritten (its first bytes changed)"
            if reset is not None:
                offset = 0
            n = min(st.st_size, _HEAD)
            out.update({"size": st.st_size, "mtime": st.st_mtime, "offset": offset, "reset": reset,
                        "ident": "%d:%d:%s" % (st.st_ino, n, _head_sha(f, n))})
            f.seek(offset)
            data = f.read(max(0, min(int(args.get("max_bytes", 8 << 20)), st.st_size - offset)))
    known = args.get("known", {})
    if args.get("files"):
        out["files"] = {p: _hash_known(_under(root, p), known.get(p)) for p in args["files"]}
    ck = args.get("checkpoints")
    if ck:
        base = _under(root, ck["dir"])
        found = {}
        for p in sorted(_glob(base, ck["glob"])):
            rel = os.path.relpath(p, base)
            h = _hash_known(p, known.get(rel))
            if h is not None:
                found[rel] = h
        out["checkpoints"] = found
    out["length"] = len(data)
    return out, data


def logread(args):
    """Bytes of a log from an offset: one JSON header line (see _logread), then exactly `length` raw bytes."""
    out, data = _logread(args)
    sys.stdout.buffer.write(json.dumps(out).encode() + b"\n" + data)
    sys.stdout.flush()
    return 0 if out.get("ok") else 1
