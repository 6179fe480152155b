"""The torch.compile (inductor) cache of a container: status, save, restore, warm.

In the seeds a cleaned /tmp took a warm 353 MB cache with it, and a torch build swap (cu128 <-> cu130)
silently invalidated whatever was left; throughput fell from 21.5 to 4.6 Ktok/s while every step "worked".
So: the cache lives where the inventory says (vars.compile_cache_dir), a `ctl-cache.json` marker in it says
which torch build filled it, saves are tarballs with a sidecar (sha256 + torch build) that are never
overwritten, a restore verifies the sha256, refuses another torch build unless forced, and moves the current
cache aside (kept) instead of deleting it. Nothing here deletes a cache. Warm-up runs one GPU at a time.

Each operation is one agent exec (controller/farside/agent/: cachestat, cachesave, cacherestore, cachemark), plus
one probe exec where the live torch build matters.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.commands import envprobe
from controller.core.envlock import Probe, split_local
from controller.errors import ClobberError, EnvMismatch, InputError, RemoteCommandError, VerifyError
from controller.files import file_sha256
from controller.inventory import Container, Inventory
from controller.names import check_container_path, check_name
from controller.remote.client import Agent
from controller.settings import LONG_TIMEOUT
from controller.transport.base import Transport

DEFAULT_STORE = "/workspace/.ctl-caches"
WARMUP_SCRIPT = "warmup_compile.py"
MARKER_FORMAT = "ctl-cache 1"


def torch_build(p: Probe) -> str | None:
    """'2.11.0+cu130' from torch/version.py: the version plus its CUDA build tag (what invalidates a cache)."""
    if not p.torch.version:
        return None
    base, tag = split_local(p.torch.version)
    tag = tag or p.torch.cuda_tag
    return f"{base}+{tag}" if tag else base


@dataclass(frozen=True)
class Marker:
    """Contents of ctl-cache.json: which torch build filled the cache, when, and how ctl learned it."""

    torch_build: str | None
    cuda: str | None
    time_utc: str | None
    by: str | None
    gpus: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> Marker | None:
        if not isinstance(doc, dict):
            return None
        return cls(doc.get("torch_build"), doc.get("cuda"), doc.get("time"), doc.get("by"),
                   tuple(str(g) for g in doc.get("gpus") or ()))

    @staticmethod
    def doc(p: Probe, by: str, now: float | None = None) -> dict[str, Any]:
        return {"format": MARKER_FORMAT, "torch_build": torch_build(p), "torch": p.torch.version,
                "cuda": p.torch.cuda, "cuda_tag": p.torch.cuda_tag, "by": by,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "gpus": [g.name for g in p.gpus], "host": p.hostname}


@dataclass(frozen=True)
class SavedCache:
    name: str
    bytes: int
    sha256: str | None
    torch_build: str | None
    created: str | None
    files: int | None


@dataclass(frozen=True)
class CacheStatus:
    ct: str
    dir: str
    store: str
    exists: bool
    bytes: int | None
    files: int | None
    entries: dict[str, int] = field(hash=False)
    marker: Marker | None
    saved: tuple[SavedCache, ...]

    def to_json(self) -> dict[str, Any]:
        return {"ct": self.ct, "dir": self.dir, "store": self.store, "exists": self.exists, "bytes": self.bytes,
                "files": self.files, "entries": self.entries,
                "marker": self.marker.__dict__ if self.marker else None,
                "saved": [s.__dict__ for s in self.saved]}


@dataclass(frozen=True)
class CacheSettings:
    dir: str
    store: str


def settings(inv: Inventory, ct: Container) -> CacheSettings:
    from controller.core.render import context

    env = envprobe.settings(inv, ct)
    store = context(inv, ct).get("cache_store") or DEFAULT_STORE
    store = check_container_path(str(store), f"{ct.name}: vars.cache_store")
    if store.rstrip("/") == env.cache_dir.rstrip("/") or store.startswith(env.cache_dir.rstrip("/") + "/"):
        raise InputError(f"{ct.name}: vars.cache_store {store} must not be inside the cache {env.cache_dir}")
    return CacheSettings(env.cache_dir, store)


def _call(t: Transport, verb: str, args: dict[str, Any], *, long: bool = False) -> dict[str, Any]:
    """One cache verb; `long` ones (save, restore: tarballs of GBs) get settings.LONG_TIMEOUT, not the
    request deadline."""
    return Agent.of(t).call(verb, args, timeout=LONG_TIMEOUT if long else None, check=False)


def _saved(doc: dict[str, Any]) -> SavedCache:
    side = doc.get("sidecar") or {}
    return SavedCache(doc["name"], int(doc["bytes"]), side.get("sha256"), side.get("torch_build"),
                      side.get("created"), side.get("files"))


def status(inv: Inventory, ct: Container, t: Transport) -> CacheStatus:
    s = settings(inv, ct)
    doc = _call(t, "cachestat", {"dir": s.dir, "store": s.store})
    c = doc["cache"]
    return CacheStatus(ct.name, s.dir, s.store, bool(c["exists"]), c.get("bytes"), c.get("files"),
                       dict(c.get("entries") or {}), Marker.from_json(c.get("marker")),
                       tuple(_saved(d) for d in doc.get("saved") or ()))


@dataclass(frozen=True)
class SaveResult:
    ct: str
    name: str
    path: str
    sha256: str
    bytes: int
    files: int | None
    torch_build: str | None
    local_path: str | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def save(inv: Inventory, ct: Container, t: Transport, name: str, *, local_dir: str | None = None,
         now: float | None = None) -> SaveResult:
    """Tar the cache into the store as NAME (never over an existing NAME); optionally pull a copy here."""
    check_name(name, "cache name")
    s = settings(inv, ct)
    local: Path | None = None
    if local_dir is not None:
        d = Path(local_dir)
        if d.exists() and not d.is_dir():
            raise InputError(f"--local {d} is not a directory")
        local = d / f"{name}.tar.gz"
        if local.exists() or (d / f"{name}.json").exists():
            raise ClobberError(f"{local} exists: not overwritten (pick another name or directory)")
    p = envprobe.probe(inv, ct, t)  # a cache ctl never warmed gets a marker from the live torch build
    doc = _call(t, "cachesave", {"dir": s.dir, "store": s.store, "name": name, "marker": Marker.doc(p, "save", now),
                                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}, long=True)
    if not doc.get("ok"):
        _raise(ct, t, doc)
    side = doc["sidecar"]
    path = posixpath.join(s.store, f"{name}.tar.gz")
    local_path = None
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        part = local.with_name(f".{local.name}.part")
        t.get(path, str(part))
        got = file_sha256(part)
        if got != side["sha256"]:
            part.unlink()
            raise VerifyError(f"{ct.name}: {path} arrived as sha256 {got[:12]}, saved as {side['sha256'][:12]}")
        part.replace(local)
        (local.parent / f"{name}.json").write_text(json.dumps(side, indent=2, sort_keys=True) + "\n")
        local_path = str(local)
    return SaveResult(ct.name, name, path, side["sha256"], int(side["bytes"]), side.get("files"),
                      side.get("torch_build"), local_path)


@dataclass(frozen=True)
class RestoreResult:
    ct: str
    name: str
    dir: str
    sha256: str
    aside: str | None  # where the cache that was in place went (kept, never deleted)
    files: int | None
    torch_build: str | None
    live_torch_build: str | None
    forced: bool

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def restore(inv: Inventory, ct: Container, t: Transport, name: str, *, force: bool = False,
            now: float | None = None) -> RestoreResult:
    """Verify NAME's sha256, refuse another torch build unless forced, move the current cache aside, unpack."""
    check_name(name, "cache name")
    s = settings(inv, ct)
    live = torch_build(envprobe.probe(inv, ct, t))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    doc = _call(t, "cacherestore", {"dir": s.dir, "store": s.store, "name": name, "torch_build": live,
                                    "force": force, "stamp": stamp}, long=True)
    if not doc.get("ok"):
        if doc.get("code") == "torch":
            raise EnvMismatch(f"{ct.name}: {doc.get('error')}: its kernels would not be used",
                              hint="--force restores it anyway")
        _raise(ct, t, doc)
    side = doc.get("sidecar") or {}
    return RestoreResult(ct.name, name, s.dir, doc["sha256"], doc.get("aside"), (doc.get("cache") or {}).get("files"),
                         side.get("torch_build"), live, force)


def _raise(ct: Container, t: Transport, doc: dict[str, Any]) -> None:
    raise Agent.of(t).error(doc)


# --- warm ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmStep:
    gpu: int | None
    seconds: float
    returncode: int


@dataclass(frozen=True)
class WarmResult:
    ct: str
    script: str
    dir: str
    steps: tuple[WarmStep, ...]
    marker: dict[str, Any] = field(hash=False)
    before: int | None = None
    after: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"ct": self.ct, "script": self.script, "dir": self.dir, "steps": [s.__dict__ for s in self.steps],
                "marker": self.marker, "bytes_before": self.before, "bytes_after": self.after}


def warmup_dest(inv: Inventory) -> str:
    """Where the payload puts warmup_compile.py; a clear error when the payload has none."""
    for e in inv.model.payload:
        if posixpath.basename(e.dest) == WARMUP_SCRIPT:
            return e.dest
    raise InputError(f"{inv.path}: the payload does not deploy {WARMUP_SCRIPT}, so there is nothing to warm the "
                     f"cache with: add `{{src: remote_payload/{WARMUP_SCRIPT}, dest: /root/{WARMUP_SCRIPT}}}` "
                     "and `ctl deploy`")


def warm_argv(inv: Inventory, ct: Container, t: Transport, script: str, gpu: int | None) -> list[str]:
    from controller.core.render import _cli_args, context

    env = envprobe.settings(inv, ct)
    ctx = context(inv, ct)
    python = f"{env.venv.rstrip('/')}/bin/python" if env.venv else env.python
    if python.startswith("/"):
        python = t.path(python)
    # warmup_compile.py takes the pipeline's flags (vars.train_args, as start_training.sh passes them) and
    # compiles on the drafters' GPUs; ctl gives it ONE visible GPU per invocation, so one drafter rank.
    flags = {**dict(ctx.get("train_args") or {}), **dict(ctx.get("warmup_args") or {})}
    args = ["--targets", "1", "--drafters", "1", "--device", "cuda" if gpu is not None else "cpu",
            *(shlex.split(_cli_args(flags)) if flags else []),
            "--compile-cache", t.path(posixpath.join(env.cache_dir, "artifacts.bin"))]
    envs = [f"TORCHINDUCTOR_CACHE_DIR={t.path(env.cache_dir)}", "PYTHONUNBUFFERED=1"]
    if gpu is not None:
        envs.append(f"CUDA_VISIBLE_DEVICES={gpu}")
    return ["env", *envs, python, t.path(script), *args]


def warm(inv: Inventory, ct: Container, t: Transport, *, gpus: list[int] | None = None,
         emit: Callable[[int, int, int | None, str], None] | None = None, now: float | None = None) -> WarmResult:
    """Run warmup_compile.py once per GPU, strictly one after another (concurrent compiles hang or crash in
    torch 2.11), streaming its output; then write the cache's marker with the live torch build."""
    script = warmup_dest(inv)
    s = settings(inv, ct)
    have = Agent.of(t).call("hashes", [script])
    if not (have.get("files") or {}).get(script):
        raise InputError(f"{ct.name}: {script} is not in the container: run `ctl deploy {ct.name}` first")
    order: list[int | None] = list(gpus) if gpus else list(ct.spec.gpus.drafter or ct.spec.gpus.all) or [None]
    for g in order:
        if g is not None and g not in ct.spec.gpus.all:
            raise InputError(f"{ct.name}: GPU {g} is not one of the container's GPUs {ct.spec.gpus.all}")
    before = status(inv, ct, t).bytes
    steps: list[WarmStep] = []
    for i, g in enumerate(order, 1):
        argv = warm_argv(inv, ct, t, script, g)
        t0 = time.monotonic()
        code, buf, err = -1, b"", b""
        for kind, data in t.stream(argv):
            if kind == "out":
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if emit:
                        emit(i, len(order), g, line.decode("utf-8", "replace"))
            elif kind == "err":
                err += data
                if emit:
                    for text in data.decode("utf-8", "replace").splitlines():
                        emit(i, len(order), g, text)
                err = err[-8192:]
            else:
                code = int(data)
        if buf and emit:
            emit(i, len(order), g, buf.decode("utf-8", "replace"))
        steps.append(WarmStep(g, time.monotonic() - t0, code))
        if code != 0:
            raise RemoteCommandError(t.name, argv, code, err.decode("utf-8", "replace"),
                                     what=f"warm-up on GPU {g}" if g is not None else "warm-up")
    marker = Marker.doc(envprobe.probe(inv, ct, t), "warm", now)
    doc = _call(t, "cachemark", {"dir": s.dir, "marker": marker})
    if not doc.get("ok"):
        _raise(ct, t, doc)
    after = status(inv, ct, t).bytes
    return WarmResult(ct.name, script, s.dir, tuple(steps), marker, before, after)
