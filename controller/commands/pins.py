"""Pins: what a container is to hold, as this checkout has it now. Every payload entry of the inventory (plain
files and rendered templates) with its sha256, size and mode, plus the git commit and dirty flag of the sources.

Shared by deploy (what to send), launch (what the preflight compares the container's files with) and the store
(where the container keeps its versions).
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.core.render import context, render
from controller.errors import InputError
from controller.inventory import Container, Inventory
from controller.names import check_container_path
from controller.settings import cache_get, cache_put, file_stamps

STORE = "/var/lib/ctl"  # inside the container: objects/<sha256>, deploys/<id>.json


@dataclass(frozen=True)
class PinnedFile:
    """One payload file as this deploy sends it: its bytes (rendered, for a template), hash, mode and source."""

    dest: str
    sha256: str
    size: int
    mode: str
    source: str
    kind: str  # file | template
    content: bytes = field(repr=False)


@dataclass(frozen=True)
class Manifest:
    """What a container is to hold after the deploy: its pinned files, and the commit they came from."""

    ct: str
    files: tuple[PinnedFile, ...]
    commit: str | None
    dirty: bool
    dirty_paths: tuple[str, ...]
    vars: dict[str, Any]

    def hashes(self) -> dict[str, str]:
        return {f.dest: f.sha256 for f in self.files}

    def rendered(self) -> dict[str, str]:
        return {f.dest: f.content.decode("utf-8", "replace") for f in self.files if f.kind == "template"}


def _git_state(paths: list[Path]) -> tuple[str | None, tuple[str, ...]]:
    """(HEAD commit, sources that differ from it). A source outside any git tree counts as dirty."""
    stamps = tuple((p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else (0, -1) for p in paths)
    return _git_state_cached(tuple(paths), stamps)


@functools.lru_cache(maxsize=8)
def _git_state_cached(
    paths: tuple[Path, ...], stamps: tuple[tuple[int, int], ...]
) -> tuple[str | None, tuple[str, ...]]:
    """Asked once for the containers of one deploy (same sources, same stamps); an edit changes the key."""
    del stamps  # part of the cache key only
    if not paths:
        return None, ()
    top_dir = paths[0].parent
    try:
        top = subprocess.run(["git", "-C", str(top_dir), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return None, tuple(str(p) for p in paths)
    if top.returncode != 0:
        return None, tuple(str(p) for p in paths)
    root_s, commit = top.stdout.split()[:2]
    root = Path(root_s)
    inside = [p for p in paths if p.resolve().is_relative_to(root)]
    outside = [str(p) for p in paths if not p.resolve().is_relative_to(root)]
    st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", *[str(p.resolve()) for p in inside]],
                        capture_output=True, text=True, check=False)
    dirty = [line[3:] for line in st.stdout.splitlines() if line.strip()]
    return commit, tuple(dirty + outside)


RENDER_CACHE_KEEP = 256  # renderings kept in STATE/render (a few KB each); the oldest go first


@functools.cache
def _renderer_id() -> bytes:
    """What a rendering depends on besides template and context: ctl's renderer (its source) and Jinja2."""
    from controller.core import render as module

    return hashlib.sha256(Path(module.__file__ or "").read_bytes()
                          + file_stamps(packages=("jinja2",))).digest()


def rendered(src: Path, ctx: dict[str, Any], name: str) -> bytes:
    """`render(src, ctx)`, kept in the state directory under the hash of everything it depends on (the template,
    the context in its own order and types, the renderer and Jinja2): a deploy or launch whose template and
    variables did not change neither imports nor runs Jinja2, a sixth of a command's start-up. Each entry holds
    the rendering's sha256 and is used only when it matches (a file cut short by a crash is rendered again).
    The cache is private (0700/0600): a rendering may hold the inventory's variables."""
    try:
        source = src.read_bytes()
    except OSError:
        return render(src, ctx, display_name=name)  # which says what is wrong with the template
    key = hashlib.sha256(b"\0".join([_renderer_id(), source, repr(ctx).encode()])).hexdigest()
    hit = cache_get("render", key)
    if hit is not None:
        return hit
    content = render(src, ctx, display_name=name)
    cache_put("render", key, content, RENDER_CACHE_KEEP)  # a read-only or full state directory: rendered again
    return content


def source_mode(src: Path) -> str:
    """The permission bits a file is deployed with when its entry gives no `mode:`: its source's own (as scp keeps
    a new file's), so a file only its owner may read here is not made readable by everyone over there. Never
    setuid, setgid or sticky."""
    return f"{src.stat().st_mode & 0o777:04o}"


def pin(inv: Inventory, ct: Container) -> Manifest:
    ctx = context(inv, ct)
    files: list[PinnedFile] = []
    sources: list[Path] = []
    for i, entry in enumerate(inv.model.payload):
        where = f"{inv.path}: payload[{i}]"
        try:
            dest = check_container_path(entry.dest, "dest", tuple(ct.spec.allowed_paths))
        except InputError as e:
            raise InputError(f"{where}: {e.message}") from None
        src = (inv.base_dir / entry.source)
        sources.append(src)
        if entry.template is not None:
            content = rendered(src, ctx, entry.source)
            kind = "template"
        else:
            try:
                content = src.read_bytes()
            except FileNotFoundError:
                raise InputError(f"{where}: source file {entry.source} not found (in {inv.base_dir})") from None
            except IsADirectoryError:
                raise InputError(f"{where}: source {entry.source} is a directory; list files one by one") from None
            kind = "file"
        mode = entry.mode if entry.mode is not None else source_mode(src)
        files.append(PinnedFile(dest, hashlib.sha256(content).hexdigest(), len(content), mode,
                                entry.source, kind, content))
    dests = [f.dest for f in files]
    dup = {d for d in dests if dests.count(d) > 1}
    if dup:
        raise InputError(f"{inv.path}: payload: destination {sorted(dup)[0]} is listed twice")
    commit, dirty = _git_state(sources)
    safe_vars = json.loads(json.dumps(ctx, default=str))
    return Manifest(ct.name, tuple(files), commit, bool(dirty), dirty, safe_vars)
