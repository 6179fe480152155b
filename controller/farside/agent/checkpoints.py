"""Checkpoints: packed into and out of base64 lines (packdir, unpackdir), the newest complete one (ckptscan)."""

import os
import sys

from .base import json, shutil, tarfile
from .fs import _NOFOLLOW, Refused, _code, _describe, _opendir, _sha, _under

_PACK_LINE = 48 << 10  # raw bytes per base64 line of packdir (64 KiB a line): ctl reads lines, bounded


def packdir(args):
    """A checkpoint directory's regular files as a tar stream, base64 in lines of 64 KiB on stdout, after a JSON
    header line; the last line is the JSON answer (main writes it). Symlinks are not followed or carried. How ctl
    carries a checkpoint from the node that wrote it to the other nodes of a run, through the controller."""
    import base64
    d = _under(args.get("root", "/"), args["dir"])
    names = []
    for dirpath, dirnames, filenames in os.walk(d):
        dirnames[:] = sorted(n for n in dirnames if not os.path.islink(os.path.join(dirpath, n)))
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            if not os.path.islink(path) and os.path.isfile(path):
                names.append(os.path.relpath(path, d))
    if not names:
        return {"ok": False, "code": "missing", "error": "%s: no files (not a checkpoint directory)" % args["dir"]}
    out = sys.stdout.buffer
    out.write((json.dumps({"ok": True, "files": len(names)}) + "\n").encode())
    sent = [0]

    class Lines:
        buf = b""

        def write(self, data):
            self.buf += data
            while len(self.buf) >= _PACK_LINE:
                out.write(base64.b64encode(self.buf[:_PACK_LINE]) + b"\n")
                self.buf = self.buf[_PACK_LINE:]
            sent[0] += len(data)
            return len(data)

        def flush(self):
            if self.buf:
                out.write(base64.b64encode(self.buf) + b"\n")
                self.buf = b""

    lines = Lines()
    with tarfile.open(fileobj=lines, mode="w|") as tar:
        for n in names:
            tar.add(os.path.join(d, n), arcname=n, recursive=False)
    lines.flush()
    out.flush()
    return {"ok": True, "files": len(names), "bytes": sent[0]}


def unpackdir(args, stream):
    """A tar stream on stdin (packdir's, decoded by ctl) into a new checkpoint directory: unpacked beside it,
    checked against its manifest.json's sha256s, then renamed into place. An existing directory is never
    replaced; the parent is walked without following symlinks."""
    root = args.get("root", "/")
    parent, name = args["dir"].rstrip("/").rsplit("/", 1)
    try:
        dfd = _opendir(root, parent or "/", args.get("follow", ()), [])
    except Refused as e:
        return {"ok": False, "code": "symlink", "error": "%s: %s" % (args["dir"], e)}
    except OSError as e:
        return {"ok": False, "error": _describe(e)}
    os.close(dfd)
    dest = _under(root, args["dir"])
    if os.path.lexists(dest):
        return {"ok": False, "code": "clobber", "error": "%s already exists (never replaced)" % args["dir"]}
    tmp = os.path.join(os.path.dirname(dest), ".%s.ctl-%d" % (name, os.getpid()))
    os.mkdir(tmp, 0o700)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                parts = [p for p in m.name.split("/") if p not in ("", ".")]
                if m.name.startswith("/") or ".." in parts or not m.isfile():
                    raise ValueError("unexpected member in the checkpoint stream: %r" % m.name)
                target = os.path.join(tmp, *parts)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tar.extractfile(m)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as f:
                    shutil.copyfileobj(src, f)
        why = _ckpt_problem(tmp)
        if why is not None:
            raise ValueError("the copy does not match its manifest: %s" % why)
        os.chmod(tmp, 0o755)
        if os.path.lexists(dest):
            raise FileExistsError(dest)
        os.rename(tmp, dest)
    except (OSError, ValueError, tarfile.TarError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return {"ok": False, "code": "verify" if isinstance(e, ValueError) else _code(e), "error": _describe(e)}
    return {"ok": True, "dir": args["dir"]}


def ckptscan(args):
    """The newest complete checkpoint under the given directories, tried in order (a failed run's own, then its
    ancestors'): a step_N/ directory whose manifest.json is there and whose files match its sha256s. A
    directory without its manifest (half-written when the run died) or with a wrong hash is skipped, and
    the reply says why. With "below": only steps under it (the newest step some node could not hold was
    refused, so an older one is wanted)."""
    import re
    root = args.get("root", "/")
    below = args.get("below")
    skipped = []
    for item in args.get("dirs", []):
        base = _under(root, item["dir"])
        try:
            names = os.listdir(base)
        except OSError:
            continue
        steps = sorted(((int(m.group(1)), n) for n in names if (m := re.fullmatch(r"step_(\d+)", n))), reverse=True)
        for step, name in steps:
            if below is not None and step >= below:
                continue
            d = os.path.join(base, name)
            why = _ckpt_problem(d)
            if why is None:
                return {"ok": True, "found": {"run": item.get("run"), "dir": item["dir"] + "/" + name,
                                              "step": step}, "skipped": skipped}
            skipped.append({"dir": item["dir"] + "/" + name, "why": why})
    return {"ok": True, "found": None, "skipped": skipped}


def _ckpt_problem(d):
    try:
        with open(os.path.join(d, "manifest.json")) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest.json (written last: the checkpoint is incomplete)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return "unreadable manifest.json (%s)" % type(e).__name__
    for name, meta in files.items():
        path = os.path.join(d, name)
        if os.path.islink(path) or not os.path.isfile(path):
            return "%s is missing" % name
        if _sha(path) != meta.get("sha256"):
            return "%s does not match its sha256 in the manifest" % name
    return None
