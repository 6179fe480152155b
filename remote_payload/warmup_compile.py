#!/usr/bin/env python3
"""Compile the drafter's kernels for a run's shapes, one GPU at a time, and save a portable cache file.

    python warmup_compile.py <the pipeline's own flags> --compile-cache PATH

Takes the same flags as train_dflash_pipeline.py (only model, shapes, --device/--gpus and --compile-cache
matter) and needs no target weights: the drafter is built from the target's config with placeholder
embedding/LM head of the right shapes. For each drafter GPU of a distinct kind (the cache is keyed on the GPU's
name, not its ordinal) it runs two training steps of the compiled drafter (--compile-mode), strictly one
after the other in this one process, then writes torch.compiler.save_cache_artifacts() to PATH. The pipeline
loads that file (torch.compiler.load_cache_artifacts) before its first step, so drafters that start together
never compile from scratch concurrently. Entries are valid only for the same torch/triton/CUDA build and GPU kind.

On CPU there is nothing to compile: flex_attention has no CPU backward, the pipeline trains with SDPA there;
this says so and exits 0. Exit 1 with one line on errors.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dflash_model as dm
import train_dflash_pipeline as tp


def drafter_devices(args) -> list[int]:
    """One ordinal per distinct GPU name among the drafters' GPUs."""
    ordinals = args.gpu_list[args.targets:] if args.gpu_list else list(range(min(args.drafters,
                                                                                torch.cuda.device_count())))
    seen: dict[str, int] = {}
    for o in ordinals:
        seen.setdefault(torch.cuda.get_device_name(o), o)
    return list(seen.values())


def compile_on(args, ordinal: int) -> dict:
    device = torch.device("cuda", ordinal)
    torch.cuda.set_device(device)
    cfg = tp.target_config(args.model)
    dc = dm.DrafterConfig.from_target(cfg, args.drafter_layers, args.block_size)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
    embed.requires_grad_(False)
    head.requires_grad_(False)
    drafter = dm.DFlashDrafter(dc, embed, head, compiled=True, compile_mode=args.compile_mode).to(device).train()
    b, s, n = args.batch_size, args.seq_len, args.num_anchors
    times = []
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(2, cfg.vocab_size - 1, (b, s), generator=g)
        loss_mask = torch.ones_like(ids)
        anchors, keep = dm.sample_anchors(loss_mask, n, args.block_size, g)
        hs = torch.randn(b, s, len(dc.target_layers) * dc.hidden_size, generator=g).to(device, torch.bfloat16)
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = drafter.loss(hs, ids.to(device), loss_mask.to(device), anchors.to(device), keep.to(device))
        loss.backward()
        torch.cuda.synchronize(device)
        times.append(round(time.perf_counter() - t, 2))
    return {"gpu": ordinal, "name": torch.cuda.get_device_name(ordinal), "step_s": times}


def main(argv=None) -> int:
    args = tp.build_parser().parse_args(argv)
    try:
        tp.check_args(args)
        if not args.compile_cache:
            raise tp.UsageError("--compile-cache PATH is required (where to write the cache)")
        if args.device != "cuda":
            print("warmup: skipped on cpu: flex_attention has no CPU backward, the pipeline trains with SDPA "
                  "there, so there is nothing to compile", flush=True)
            return 0
        if not torch.cuda.is_available():
            raise tp.UsageError("--device cuda, but torch sees no CUDA device")
        t0 = time.time()
        loaded = tp.load_compile_cache(args.compile_cache)
        runs = []
        for ordinal in drafter_devices(args):  # sequential on purpose: never two compiles at once
            runs.append(compile_on(args, ordinal))
            print(f"warmup: {json.dumps(runs[-1])}", flush=True)
        size = tp.save_compile_cache(args.compile_cache)
        print(f"warmup: wrote {size / 1e6:.1f} MB to {args.compile_cache} in {time.time() - t0:.1f}s "
              f"(existing cache: {loaded}; torch {torch.__version__})", flush=True)
        return 0
    except tp.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return tp.EXIT_USAGE
    except Exception as e:
        print(f"error: warmup: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return tp.EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
