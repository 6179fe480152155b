#!/usr/bin/env python3
"""Print the DFlash pipeline's metric lines at a chosen speed, for tests of `ctl tail` / `ctl metrics`.

Stdlib only: it runs inside test containers where only python3 exists. Elapsed time and ETA are
simulated from --tok-s and --tokens-per-step, so a 0.2 s interval still prints `[23m]`-style lines:

    [23m] step=14 loss=10.6894 lr=3.0e-04 tgt=0.11b/s dft=0.11b/s (4.6Ktok/s) q_hs=[0] | ETA=36.9d

Endings: normal (exit --exit, default 0), --stall-after N (stop printing after N steps, stay alive),
--crash KIND (print that crash's text, exit --exit or 1; segfault exits 139).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

CRASHES = {
    "traceback": [
        "Traceback (most recent call last):",
        '  File "/root/train_dflash_pipeline.py", line 412, in drafter_loop',
        "    loss = drafter(batch)",
        "ValueError: hidden states queue returned a tensor of the wrong shape",
    ],
    "cuda-oom": [
        "Traceback (most recent call last):",
        '  File "/root/train_dflash_pipeline.py", line 388, in target_loop',
        "    out = target(input_ids, output_hidden_states=True)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total "
        "capacity of 139.72 GiB of which 1.06 GiB is free.",
    ],
    "nccl": [
        "kpro6:1234:1301 [5] NCCL WARN Call to ibv_modify_qp failed with error Connection timed out",
        "Traceback (most recent call last):",
        '  File "/root/train_dflash_pipeline.py", line 301, in sync_grads',
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system "
        "error, NCCL version 2.27.3",
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed",
    ],
    "fx-tracing": [
        "Traceback (most recent call last):",
        '  File "/root/dflash_model.py", line 547, in forward',
        "    attn = self.self_attn(hidden, block_mask)",
        '  File "torch/_dynamo/eval_frame.py", line 829, in compile_wrapper',
        "    if is_fx_symbolic_tracing():",
        "RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function. "
        "This is not supported at the moment.",
    ],
    "segfault": ["Segmentation fault (core dumped)"],
}


def fmt_rate(value: float) -> str:
    """4600 -> 4.6K, like the pipeline."""
    for suffix, scale in (("", 1.0), ("K", 1e3), ("M", 1e6), ("G", 1e9)):
        scaled = value / scale
        text = f"{scaled:.0f}" if scale == 1.0 or scaled >= 99.95 else f"{scaled:.1f}"
        if float(text) < 1000 or suffix == "G":
            return text + suffix
    return f"{value:.0f}"


def fmt_elapsed(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes == 0:
        return f"{int(seconds)}s"
    if minutes < 60:
        return f"{minutes}m"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def fmt_eta(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    for unit, scale, limit in (("m", 60.0, 60.0), ("h", 3600.0, 24.0), ("d", 86400.0, math.inf)):
        text = f"{seconds / scale:.1f}"
        if float(text) < limit:
            return text + unit
    return "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tok-s", type=float, default=12800.0, help="steady throughput (tokens/s)")
    ap.add_argument("--steps", type=int, default=40, help="metric lines to print")
    ap.add_argument("--interval", type=float, default=0.2, help="real seconds between lines")
    ap.add_argument("--warmup-steps", type=int, default=0, help="first lines at --warmup-tok-s")
    ap.add_argument("--warmup-tok-s", type=float, default=500.0)
    ap.add_argument("--tokens-per-step", type=float, default=393216.0)
    ap.add_argument("--total-tokens", type=float, default=14.7e9, help="for the ETA")
    ap.add_argument("--load-seconds", type=float, default=300.0, help="simulated model loading time")
    ap.add_argument("--jitter", type=float, default=0.02, help="relative noise on tok/s (seeded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-after", type=int, default=None, metavar="N", help="stop printing after N steps")
    ap.add_argument("--stall-seconds", type=float, default=86400.0, help="how long a stall stays alive")
    ap.add_argument("--crash", choices=sorted(CRASHES), default=None, help="crash after the steps")
    ap.add_argument("--exit", type=int, default=None, dest="exit_code", help="exit status at the end")
    ap.add_argument("--json", action="store_true", help="JSON lines instead of the text format")
    ap.add_argument("--no-preamble", action="store_true", help="skip the loading messages")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    out = sys.stdout
    if not args.no_preamble:
        for line in ("Loading target models on GPUs [0, 1, 2, 3, 4] ...", "Drafters on GPUs [5, 6, 7]",
                     "Compiling flex_attention (first step may take minutes) ..."):
            print(line, file=out, flush=True)
    elapsed = args.load_seconds
    tokens_done = 0.0
    loss = 11.5
    for i in range(args.steps):
        if args.stall_after is not None and i >= args.stall_after:
            time.sleep(args.stall_seconds)
            return 0 if args.exit_code is None else int(args.exit_code)
        step = i + 1
        base = args.warmup_tok_s if i < args.warmup_steps else args.tok_s
        tok_s = max(1.0, base * (1.0 + rng.uniform(-args.jitter, args.jitter)))
        elapsed += args.tokens_per_step / tok_s
        tokens_done += args.tokens_per_step
        loss = max(0.5, loss * 0.995 - 0.01 + rng.uniform(-0.02, 0.02))
        bps = tok_s / args.tokens_per_step * 10.0
        eta = max(0.0, args.total_tokens - tokens_done) / tok_s
        q_hs = [rng.randint(0, 4) for _ in range(3)] if tok_s > 8000 else [0]
        if args.json:
            rec = {"step": step, "loss": round(loss, 4), "lr": 3e-4, "tgt_bps": round(bps, 3),
                   "dft_bps": round(bps, 3), "tok_s": round(tok_s, 1), "q_hs": q_hs,
                   "eta_s": round(eta, 1), "elapsed_s": round(elapsed, 1), "time": round(time.time(), 3)}
            line = json.dumps(rec)
        else:
            line = (f"[{fmt_elapsed(elapsed)}] step={step} loss={loss:.4f} lr=3.0e-04 tgt={bps:.2f}b/s "
                    f"dft={bps:.2f}b/s ({fmt_rate(tok_s)}tok/s) q_hs={q_hs} | ETA={fmt_eta(eta)}")
        print(line, file=out, flush=True)
        if args.interval > 0 and i + 1 < args.steps:
            time.sleep(args.interval)
    if args.crash:
        for line in CRASHES[args.crash]:
            print(line, file=out, flush=True)
        if args.exit_code is not None:
            return int(args.exit_code)
        return 139 if args.crash == "segfault" else 1
    return 0 if args.exit_code is None else int(args.exit_code)


if __name__ == "__main__":
    sys.exit(main())
