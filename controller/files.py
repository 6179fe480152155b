"""Files on the operator's machine: a file's sha256, read in blocks, and a directory put in place of another in
one rename. Used by the transfers that check what arrived (pct push, cache pulls, exports)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file, read 1 MiB at a time (a checkpoint or a cache tarball is GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def replace_dir(src: Path, dest: Path) -> bool:
    """Rename `src` to `dest`; an existing `dest` (the caller's --force) is moved aside first and removed only once
    `src` is in place, so `dest` is never missing nor half-written. Whether one was replaced."""
    old = None
    if dest.exists() or dest.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".ctl-old", dir=dest.parent))
        os.replace(dest, old / dest.name)
    os.replace(src, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return old is not None
