#!/usr/bin/env python3
"""A small real distributed payload for the multi-node controller tests: torchrun (c10d rendezvous) starts it on
every node, it joins the gloo process group from torchrun's standard environment and all-reduces each step.

Every rank contributes rank + 1, so every rank must print the same sum, world * (world + 1) / 2, on every node:

    [0m] step=3 loss=1.0000 (1.0Ktok/s) allreduce=3.0 rank=1 world=2 group_rank=1

It accepts (and ignores) the arguments the shipped start_training.sh passes to the pipeline. `--steps` steps
`--interval` seconds apart, then `done steps=N` and exit 0; `--steps 0` runs until it is stopped. With
`--ckpt-every K`, global rank 0 alone writes `OUT/checkpoints/step_N/` as the pipeline does (state.json, then
manifest.json with its sha256, the directory renamed into place); `--resume DIR` makes every node check its own
copy against the manifest (exit 2 without one) and continue from its step: `resumed from step N`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path


def checkpoint(out: str, step: int) -> None:
    final = Path(out) / "checkpoints" / f"step_{step}"
    tmp = final.with_name(f".{final.name}.tmp")
    tmp.mkdir(parents=True)
    state = json.dumps({"step": step}).encode()
    (tmp / "state.json").write_bytes(state)
    (tmp / "manifest.json").write_text(json.dumps(
        {"step": step, "files": {"state.json": {"sha256": hashlib.sha256(state).hexdigest()}}}))
    tmp.rename(final)


def resume_step(path: str) -> int:
    """This node's own copy of the checkpoint, checked against its manifest; its step."""
    d = Path(path)
    manifest = json.loads((d / "manifest.json").read_text())
    for name, meta in manifest["files"].items():
        if hashlib.sha256((d / name).read_bytes()).hexdigest() != meta["sha256"]:
            raise ValueError(f"{d / name} does not match its manifest")
    return int(manifest["step"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--out", default=".")
    args, _ignored = ap.parse_known_args()
    start = 0
    if args.resume:
        try:
            start = resume_step(args.resume)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --resume {args.resume}: {e}", file=sys.stderr, flush=True)
            return 2

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group_rank = os.environ.get("GROUP_RANK", "?")
    print(f"joined: rank={rank} world={world} group_rank={group_rank} master={os.environ.get('MASTER_ADDR')}",
          flush=True)
    step = start
    if start and rank == 0:
        print(f"resumed from step {start} ({args.resume})", flush=True)
    while args.steps <= 0 or step < args.steps:
        step += 1
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"[0m] step={step} loss={1.0 / step:.4f} (1.0Ktok/s) allreduce={t.item():.1f} rank={rank} "
                  f"world={world} group_rank={group_rank}", flush=True)
        if rank == 0 and args.ckpt_every and step % args.ckpt_every == 0:
            checkpoint(args.out, step)
        time.sleep(args.interval)
    dist.barrier()
    print(f"done steps={step}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
