#!/usr/bin/env python3
"""A fake trainer with real checkpoints, for the fault soak (bench/chaos.py, tests/integration/test_chaos_pve.py).

Stdlib only (it runs in test containers with python3 alone). It prints the pipeline's metric line every
--interval seconds and, every --ckpt-every steps, writes a full checkpoint in the payload's format
(remote_payload/dflash_ckpt.py): RUN_DIR/checkpoints/step_N/ with drafter.pt and train_state.pt (--ckpt-bytes
of seeded bytes each, written in chunks, so a kill or a full disk leaves a partial file), manifest.json of
their sha256s written last, in a temporary directory renamed into place, then the index
RUN_DIR/checkpoints/manifest.json.

With CTL_RESUME_FROM it verifies that checkpoint's manifest (every sha256) and continues from its step
(`resumed from step N (PATH)`); a checkpoint that does not verify is refused (exit 2), as the real one does.

Every line it prints is also appended to CTL_LOG.copy, beside the log: the soak compares the two, so a log
that lost bytes written before a fault is seen.

A file RUN_DIR/crash-now makes it print the cuda-oom crash text and exit 1 (a crash with a signature, on
demand); a checkpoint that cannot be written (ENOSPC) ends it with a traceback and exit 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

OOM = [
    "Traceback (most recent call last):",
    '  File "/root/train_dflash_pipeline.py", line 388, in target_loop',
    "    out = target(input_ids, output_hidden_states=True)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total capacity of "
    "139.72 GiB of which 1.06 GiB is free.",
]
FORMAT = "dflash-checkpoint/1"
FILES = ("drafter.pt", "train_state.pt")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(ckpt: Path) -> int:
    """The step of a checkpoint whose manifest is there and whose files match it; ValueError otherwise."""
    try:
        manifest = json.loads((ckpt / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {ckpt}: no readable manifest.json ({type(e).__name__}); refused") from None
    for name in FILES:
        entry = manifest.get("files", {}).get(name)
        if entry is None or not (ckpt / name).is_file() or sha256(ckpt / name) != entry.get("sha256"):
            raise ValueError(f"checkpoint {ckpt}: {name} does not match its manifest; refused")
    return int(manifest["step"])


def write_checkpoint(root: Path, step: int, size: int, rng: random.Random) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    files = {}
    for name in FILES:
        with open(tmp / name, "wb") as f:
            left = size
            while left > 0:
                n = min(left, 1 << 16)
                f.write(rng.randbytes(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
        files[name] = {"sha256": sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
    with open(tmp / "manifest.json", "w") as f:
        f.write(json.dumps({"format": FORMAT, "step": step, "files": files, "provenance": {}, "data": {},
                            "time": time.time()}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    final = root / f"step_{step}"
    os.replace(tmp, final)
    index = root / "manifest.json"
    entries = json.loads(index.read_text())["checkpoints"] if index.exists() else []
    entries = [e for e in entries if e["step"] != step] + [{"step": step, "dir": final.name, "files": files}]
    itmp = root / f"manifest.json.tmp-{os.getpid()}"
    itmp.write_text(json.dumps({"checkpoints": sorted(entries, key=lambda e: e["step"])}) + "\n")
    os.replace(itmp, index)
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--ckpt-bytes", type=int, default=256 << 10)
    args = ap.parse_args(argv)
    run_dir = Path(os.environ.get("CTL_RUN_DIR", "."))
    log = os.environ.get("CTL_LOG")
    copy = open(log + ".copy", "a") if log else None  # noqa: SIM115 (open for the process's life)

    def say(line: str) -> None:
        print(line, flush=True)
        if copy is not None:
            copy.write(line + "\n")
            copy.flush()

    start = 0
    resume = os.environ.get("CTL_RESUME_FROM")
    if resume:
        try:
            start = verify(Path(resume))
        except ValueError as e:
            say(str(e))
            return 2
        say(f"resumed from step {start} ({resume})")
    rng = random.Random(os.getpid())
    loss = 11.5
    for step in range(start + 1, args.steps + 1):
        if (run_dir / "crash-now").exists():
            for line in OOM:
                say(line)
            return 1
        loss = max(0.5, loss * 0.995 - 0.01)
        say(f"[{step // 60}m] step={step} loss={loss:.4f} lr=3.0e-04 tgt=0.33b/s dft=0.33b/s (12.8Ktok/s) "
            f"q_hs=[1, 2, 0] | ETA=5.0d")
        if step % args.ckpt_every == 0:
            try:
                write_checkpoint(run_dir / "checkpoints", step, args.ckpt_bytes, rng)
            except OSError:
                for line in traceback.format_exc().splitlines():
                    say(line)
                return 1
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
