"""Checkpoints of the drafter's training: full (resumable) and the older weights-only files.

Full checkpoint, RUN_DIR/checkpoints/step_N/ (written into a temporary directory, renamed into place):
  drafter.pt        {"format", "step", "drafter": state_dict, "config": DrafterConfig dict, "provenance"}
                    (the same keys as the weights-only file, so readers of either need nothing else)
  train_state.pt    {"optimizer", "scheduler", "step", "rng", "data", "args"}
  manifest.json     {"format", "step", "files": {name: {"sha256", "bytes"}}, "provenance", "data", "time"},
                    written last: a directory without it is incomplete and refused. "data" (the data position,
                    as in train_state.pt) is here too, so a target process reads where to resume without
                    loading the optimizer.
RNG: the lead drafter's states. Every drafter holds the same ones (same seed, the same work on every drafter:
the randomness of a batch, its rows and anchors, is drawn on the targets from the samples' own indices), so on
resume every drafter of every node restores these.
RUN_DIR/checkpoints/manifest.json indexes them (step, dir, files) for the controller.

Weights-only (before full checkpoints): RUN_DIR/checkpoints/step_N.pt {"step", "drafter", "config", "args"},
hashed in the index only. `load_weights` reads both; `load_full` only the full kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import torch

FORMAT = "dflash-checkpoint/1"
WEIGHTS, STATE, MANIFEST = "drafter.pt", "train_state.pt", "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, said in one line."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ rng


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() saved. RNG states are CPU byte tensors whatever map_location the checkpoint was
    loaded with (a drafter on cuda:N loads it onto its GPU, and torch refuses a CUDA tensor as a state)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        states = [s.cpu() for s in state["cuda"][: torch.cuda.device_count()]]
        torch.cuda.set_rng_state_all(states)


# ----------------------------------------------------------------------------------------------- save


def save_full(root: Path, step: int, drafter, optimizer, *, scheduler: dict, data: dict, args: dict,
              provenance: dict) -> Path:
    """Write checkpoints/step_N/ atomically; returns its path. The index is updated after the rename."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save({"format": FORMAT, "step": step, "drafter": drafter.state_dict(), "config": drafter.c.to_dict(),
                "provenance": provenance}, tmp / WEIGHTS)
    torch.save({"format": FORMAT, "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler,
                "rng": rng_state(), "data": data, "args": args}, tmp / STATE)
    files = {}
    for name in (WEIGHTS, STATE):
        files[name] = {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
    manifest = {"format": FORMAT, "step": step, "files": files, "provenance": provenance, "data": data,
                "time": time.time()}
    with open(tmp / MANIFEST, "w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step again (a resumed run that stopped where it started): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _index(root, step, final.name, files)
    return final


def _index(root: Path, step: int, name: str, files: dict) -> None:
    index = root / MANIFEST
    entries = json.loads(index.read_text())["checkpoints"] if index.exists() else []
    entries = [e for e in entries if e["step"] != step]
    entries.append({"step": step, "dir": name, "files": files})
    tmp = index.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"checkpoints": sorted(entries, key=lambda e: e["step"])}, indent=1) + "\n")
    os.replace(tmp, index)


# ----------------------------------------------------------------------------------------------- load


def resolve(path: str) -> Path:
    """A checkpoint directory (step_N/), a weights-only step_N.pt, or a directory holding step_N/ entries
    (a run's checkpoints/ or the run directory itself: its newest step_N/)."""
    p = Path(path)
    if p.is_file() or ((p / MANIFEST).is_file() and _STEP_DIR.search(p.name)):
        return p
    if not p.exists():
        raise CheckpointError(f"checkpoint {path}: no such file or directory")
    if _STEP_DIR.search(p.name):
        return p  # a step directory without its manifest: verify() says so
    for base in (p, p / "checkpoints"):
        steps = [(int(m.group(1)), d) for d in base.glob("step_*") if d.is_dir()
                 and (m := _STEP_DIR.search(d.name))]
        if steps:
            return max(steps)[1]
    raise CheckpointError(f"checkpoint {path}: no step_N checkpoint directory in it")


def verify(ckpt: Path) -> dict:
    """The manifest of a full checkpoint whose files all match their sha256; CheckpointError otherwise."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {ckpt}: no {MANIFEST} (incomplete or not a full checkpoint); refused")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: unreadable {MANIFEST} ({type(e).__name__}); refused") from None
    for name in (WEIGHTS, STATE):
        if name not in files:
            raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} lists no {name}; refused")
    for name, entry in files.items():
        f = ckpt / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {ckpt}: {name} is missing; refused")
        digest = sha256_file(f)
        if digest != entry["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt}: {name} sha256 {digest[:12]} does not match the manifest's "
                                  f"{entry['sha256'][:12]}; refused")
    manifest["step"] = step
    return manifest


def read_manifest(ckpt: Path) -> dict:
    """A full checkpoint's manifest, unverified (cheap: no hashing): step (int), files, data (None when the
    checkpoint predates it), provenance."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {ckpt}: no {MANIFEST} (incomplete or not a full checkpoint); refused")
    try:
        manifest = json.loads(mpath.read_text())
        manifest["step"] = int(manifest["step"])
        manifest.setdefault("data", None)
        dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: unreadable {MANIFEST} ({type(e).__name__}); refused") from None
    return manifest


def read_manifest_step(ckpt: Path) -> int:
    """The step a full checkpoint resumes from, from its manifest alone (cheap: no hashing)."""
    return read_manifest(ckpt)["step"]


def load_full(ckpt: Path, map_location="cpu", verified: bool = False) -> tuple[dict, dict]:
    """(drafter.pt contents, train_state.pt contents) of a verified full checkpoint."""
    if not verified:
        verify(ckpt)
    weights = torch.load(ckpt / WEIGHTS, map_location=map_location, weights_only=False)
    state = torch.load(ckpt / STATE, map_location=map_location, weights_only=False)
    return weights, state


def load_weights(path: str) -> tuple[dict, dict, dict]:
    """(state_dict, config dict, meta) from a full checkpoint (verified) or a weights-only step_N.pt.

    meta: step, provenance (full checkpoints), args (weights-only ones), sha256 of what was read."""
    p = resolve(path)
    if p.is_dir():
        manifest = verify(p)
        w = torch.load(p / WEIGHTS, map_location="cpu", weights_only=False)
        meta = {"step": w["step"], "provenance": w.get("provenance") or {}, "kind": "full",
                "sha256": manifest["files"][WEIGHTS]["sha256"], "path": str(p)}
        return w["drafter"], w["config"], meta
    try:
        w = torch.load(p, map_location="cpu", weights_only=False)
        sd, cfg = w["drafter"], w["config"]
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(f"checkpoint {p}: not a drafter checkpoint ({type(e).__name__}: {e})") from None
    meta = {"step": w.get("step"), "provenance": w.get("provenance") or {}, "args": w.get("args") or {},
            "kind": "weights-only", "sha256": sha256_file(p), "path": str(p)}
    return sd, cfg, meta
