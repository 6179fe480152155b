#!/usr/bin/env python3
"""A small real distributed payload for the multi-node controller tests: torchrun (c10d rendezvous) starts it on
every node, it joins the gloo process group from torchrun's standard environment and all-reduces each step.

Every rank contributes rank + 1, so every rank must print the same sum, world * (world + 1) / 2, on every node:

    [0m] step=3 loss=1.0000 (1.0Ktok/s) allreduce=3.0 rank=1 world=2 group_rank=1

It accepts (and ignores) the arguments the shipped start_training.sh passes to the pipeline. `--steps` steps
`--interval` seconds apart, then `done steps=N` and exit 0; `--steps 0` runs until it is stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.2)
    args, _ignored = ap.parse_known_args()

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group_rank = os.environ.get("GROUP_RANK", "?")
    print(f"joined: rank={rank} world={world} group_rank={group_rank} master={os.environ.get('MASTER_ADDR')}",
          flush=True)
    step = 0
    while args.steps <= 0 or step < args.steps:
        step += 1
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"[0m] step={step} loss={1.0 / step:.4f} (1.0Ktok/s) allreduce={t.item():.1f} rank={rank} "
                  f"world={world} group_rank={group_rank}", flush=True)
        time.sleep(args.interval)
    dist.barrier()
    print(f"done steps={step}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
