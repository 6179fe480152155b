#!/usr/bin/env python3
"""Payload measurements on one GPU, every variant in one call: JSON per case under $OUT, a table at the end.

    PYTHONUNBUFFERED=1 python3 bench/payload/gpu_bench.py --phase 1   # smoke, target alone, drafter micro
    PYTHONUNBUFFERED=1 python3 bench/payload/gpu_bench.py --phase 2   # pipeline: cold/warm compile, transports

Each case runs in its own subprocess with its own TORCHINDUCTOR_CACHE_DIR (fresh unless stated) and a
time limit, so one failure or hang costs only that case. Internal modes (--case ...) do the in-process work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PIPE = ROOT / "remote_payload" / "train_dflash_pipeline.py"
OUT = Path(os.environ.get("OUT", "/tmp/payload-bench"))  # only a few files come back: one log, one JSON
RUNS = Path(tempfile.mkdtemp(prefix="payload-runs-"))  # run dirs, checkpoints, cache files: not under $OUT
PHASE = {"n": 0}
DEADLINE = time.time() + float(os.environ.get("BENCH_BUDGET_S", "560"))
RESULTS: list[dict] = []


def run(name: str, cmd: list[str], timeout: float, env: dict | None = None, fresh_cache: bool = True) -> dict:
    left = DEADLINE - time.time()
    if left < 20:
        rec = {"case": name, "skipped": "out of time"}
        RESULTS.append(rec)
        return rec
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "DFLASH_TRACEBACK": "1", **(env or {})}
    if fresh_cache:
        e["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"ind-{name}-")
    t = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(timeout, left - 10), env=e, cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as x:
        rc, out, err = "timeout", (x.stdout or b"").decode() if isinstance(x.stdout, bytes) else (x.stdout or ""), \
            (x.stderr or b"").decode() if isinstance(x.stderr, bytes) else (x.stderr or "")
    with open(OUT / f"logs_phase{PHASE['n']}.txt", "a") as f:
        f.write(f"\n===== {name}\n$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err[-20000:]}\n")
    rec = {"case": name, "rc": rc, "wall_s": round(time.time() - t, 1)}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            rec.update(json.loads(line[7:]))
        elif line.startswith("first step done"):
            rec["first_step_s"] = float(line.split()[3].rstrip("s"))
        elif line.startswith("compile cache: wrote") or line.startswith("warmup: wrote"):
            rec["cache_note"] = line
    metrics = [ln for ln in out.splitlines() if ln.startswith("[") and "step=" in ln]
    if metrics:
        rec["last_lines"] = metrics[-3:]
    if rc != 0:
        rec["err_tail"] = err.strip().splitlines()[-6:]
    RESULTS.append(rec)
    print(json.dumps(rec), flush=True)
    return rec


def pipeline(name, flags, timeout, env=None, fresh_cache=True):
    n = 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(PIPE),
           "--targets", "1", "--drafters", "1", "--device", "cuda", "--gpus", "0,0", "--out", str(RUNS / name),
           *flags]
    rec = run(name, cmd, timeout, env, fresh_cache)
    mfile = RUNS / name / "metrics.jsonl"
    if mfile.exists():
        recs = [json.loads(x) for x in mfile.read_text().splitlines()]
        steady = recs[1:] or recs
        if steady:
            rec["tok_s_steady"] = round(sorted(r["tok_s"] for r in steady)[len(steady) // 2], 1)
            rec["q_hs_steady"] = [r["q_hs"] for r in steady]
            rec["tgt_bps"] = steady[-1]["tgt_bps"]
            rec["dft_bps"] = steady[-1]["dft_bps"]
    return rec


# ------------------------------------------------------------------------------------- in-process cases


def case_target(model: str, b: int, s: int, reps: int, compiled: bool = False) -> None:
    """The target role's work alone: forward with hidden states, the drafter's layers concatenated
    (`compiled`: its decoder layers compiled, as the pipeline's --compile-target)."""
    import torch

    sys.path.insert(0, str(ROOT / "remote_payload"))
    import train_dflash_pipeline as tp

    dev = torch.device("cuda", 0)
    if model == "ref183":  # the brief's scale reference: 24 layers, hidden 2048, untied, 1.83B
        from transformers import AutoModelForCausalLM, Qwen3Config

        cfg = Qwen3Config(**{**tp.ONE_B, "num_hidden_layers": 24, "tie_word_embeddings": False})
        torch.manual_seed(0)
        with torch.device(dev):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    else:
        m = tp.build_target(model, dev, 0)
    params = sum(p.numel() for p in m.parameters())
    layers = tp.hs_layers(m.config, 5)
    full_layers = len(m.model.layers)
    if model != "ref183":
        tp.truncate_target(m, max(layers))
    if compiled:
        tp.compile_target_layers(m)
    ids = torch.randint(2, m.config.vocab_size - 2, (b, s), device=dev)

    def step():
        with torch.no_grad():
            o = m.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            return torch.cat([o.hidden_states[i + 1] for i in layers], dim=-1)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / reps
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print("RESULT " + json.dumps({"compiled": compiled, "params_b": round(params / 1e9, 3),
                                  "layers_run": len(m.model.layers),
                                  "layers_total": full_layers, "batch": b, "seq": s, "ms_per_batch": round(dt * 1e3, 2),
                                  "tok_s": round(b * s / dt, 1), "peak_gib": peak}))


def case_drafter(model: str, b: int, s: int, n: int, compiled: bool, reps: int, cache: str | None = None,
                 mode: str = "layers", fused: bool = True, profile: bool = False) -> None:
    """One drafter training step (fwd + bwd + AdamW) at the run's shapes, compiled (`mode`: layers or flex alone)
    or eager. With `cache`: load the portable cache first when the file exists, else save it after the first step.
    With `profile`: the CUDA kernels of two steps, grouped, to the log."""
    import torch

    sys.path.insert(0, str(ROOT / "remote_payload"))
    import dflash_model as dm
    import train_dflash_pipeline as tp

    dev = torch.device("cuda", 0)
    cfg = tp.target_config(model)
    dc = dm.DrafterConfig.from_target(cfg, 5, 16)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=dev, dtype=torch.bfloat16)
    head.requires_grad_(False)
    d = dm.DFlashDrafter(dc, embed, head, compiled=compiled, compile_mode=mode).to(dev).train()
    opt = torch.optim.AdamW(d.parameters(), lr=1e-4, fused=fused)
    batches = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(2, cfg.vocab_size - 2, (b, s), generator=g)
        anchors, keep = dm.sample_anchors(torch.ones_like(ids), n, 16, g)
        hs = torch.randn(b, s, len(dc.target_layers) * dc.hidden_size, generator=g).to(dev, torch.bfloat16)
        batches.append((hs, ids.to(dev), torch.ones_like(ids).to(dev), anchors.to(dev), keep.to(dev)))

    def step(i):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = d.loss(*batches[i % 3])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    loaded = tp.load_compile_cache(cache) if cache else "none"
    t = time.perf_counter()
    step(0)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    if cache and loaded == "none":
        tp.save_compile_cache(cache)
    from torch._dynamo.utils import counters

    hits = {k: v for k, v in counters["inductor"].items() if "cache" in k}
    hits.update({f"aot_{k}": v for k, v in counters["aot_autograd"].items() if "cache" in k})
    for i in range(2):
        step(i + 1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(reps):
        step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / reps
    mask_ms = {}
    for mc in (False, True):
        dm.dflash_mask(batches[0][3], s, 16, dev, mc)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(10):
            dm.dflash_mask(batches[i % 3][3], s, 16, dev, mc)
        torch.cuda.synchronize()
        mask_ms["compiled" if mc else "eager"] = round((time.perf_counter() - t) * 100, 2)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as pr:
            for i in range(2):
                step(i)
            torch.cuda.synchronize()
        print(pr.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
    print("RESULT " + json.dumps({"cache": loaded, "cache_counters": hits, "compiled": compiled,
                                  "mode": mode if compiled else "eager", "fused_adamw": fused, "mask_ms": mask_ms,
                                  "drafter_params_m": round(dm.param_count(d) / 1e6, 1),
                                  "batch": b, "seq": s, "anchors": n, "first_step_s": round(first, 1),
                                  "ms_per_step": round(dt * 1e3, 1), "tok_s": round(b * s / dt, 1),
                                  "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}))


# ---------------------------------------------------------------------------------------------- phases


def phase1() -> None:
    py = sys.executable
    me = str(Path(__file__).resolve())
    run("env", [py, "-c", "import torch, transformers, triton; print('RESULT ' + __import__('json').dumps({"
                "'torch': torch.__version__, 'transformers': transformers.__version__, 'triton': triton.__version__,"
                "'gpu': torch.cuda.get_device_name(0)}))"], 60)
    tiny = ["--model", "tiny", "--steps", "30", "--seq-len", "256", "--batch-size", "4", "--num-anchors", "32",
            "--log-every", "10"]
    pipeline("tiny-ipc-compile", [*tiny, "--compile", "--transport", "ipc"], 150)
    pipeline("tiny-gloo-eager", [*tiny, "--no-compile", "--transport", "gloo"], 60)
    run("target-1b", [py, me, "--case", "target", "--model", "1b", "--b", "4", "--s", "2048", "--reps", "10"], 90)
    run("target-ref183", [py, me, "--case", "target", "--model", "ref183", "--b", "16", "--s", "2048",
                          "--reps", "5"], 90)
    for n in (64, 512):
        b = 4 if n == 64 else 1
        for compiled in (True, False):
            run(f"drafter-1b-n{n}-{'compiled' if compiled else 'eager'}",
                [py, me, "--case", "drafter", "--model", "1b", "--b", str(b), "--s", "2048", "--n", str(n),
                 "--reps", "5", *(["--compiled"] if compiled else [])], 150)


def phase2() -> None:
    cache = RUNS / "compile_cache.bin"
    base = ["--model", "1b", "--seq-len", "2048", "--batch-size", "4", "--num-anchors", "64", "--log-every", "5",
            "--queue-size", "4"]
    py = sys.executable
    warm = ["--compile", "--compile-cache", str(cache)]
    run("warmup-cold", [py, str(ROOT / "remote_payload" / "warmup_compile.py"), *base, "--device", "cuda",
                        "--gpus", "0,0", *warm], 200)
    pipeline("pipe-1b-warm-ipc", [*base, "--steps", "40", *warm, "--transport", "ipc"], 200)
    pipeline("pipe-1b-cold-ipc", [*base, "--steps", "15", "--compile", "--compile-cache",
                                  str(RUNS / "cold_cache.bin"), "--transport", "ipc"], 200)
    pipeline("pipe-1b-warm-gloo", [*base, "--steps", "30", *warm, "--transport", "gloo"], 150)
    pipeline("pipe-1b-eager-ipc", [*base, "--steps", "20", "--no-compile", "--transport", "ipc"], 120)
    fewer = [x if x != "64" else "16" for x in base]
    pipeline("pipe-1b-n16-ipc", [*fewer, "--steps", "40", "--compile", "--transport", "ipc"], 120)
    spec = ["--model", "1b", "--seq-len", "2048", "--batch-size", "1", "--num-anchors", "512", "--log-every", "5",
            "--queue-size", "4"]
    pipeline("pipe-1b-n512-b1-ipc", [*spec, "--steps", "40", "--compile", "--transport", "ipc"], 120)


def phase3() -> None:
    """Does the portable cache hit? The same drafter step in two fresh processes with fresh inductor dirs."""
    py, me = sys.executable, str(Path(__file__).resolve())
    cache = str(RUNS / "micro_cache.bin")
    for name in ("micro-cold-save", "micro-warm-load"):
        run(name, [py, me, "--case", "drafter", "--model", "1b", "--b", "4", "--s", "2048", "--n", "64", "--reps", "3",
                   "--compiled", "--cache", cache], 120)


def phase4() -> None:
    """The drafter step after regional compilation, side by side with the first version, then the pipeline."""
    py, me = sys.executable, str(Path(__file__).resolve())
    run("target-1b", [py, me, "--case", "target", "--model", "1b", "--b", "4", "--s", "2048", "--reps", "10"], 90)
    micro = [py, me, "--case", "drafter", "--model", "1b", "--b", "4", "--s", "2048", "--reps", "5", "--compiled"]
    run("drafter-n64-flex-foreach", [*micro, "--n", "64", "--mode", "flex", "--no-fused"], 120)
    run("drafter-n64-layers-fused", [*micro, "--n", "64", "--mode", "layers", "--profile"], 150)
    run("drafter-n64-flex-fused-profile", [*micro, "--n", "64", "--mode", "flex", "--profile"], 120)
    for n in (32, 16):
        run(f"drafter-n{n}-layers-fused", [*micro, "--n", str(n), "--mode", "layers"], 120)


def phase6() -> None:
    """The block mask compiled too (phase 4's layers mode built it eagerly each step)."""
    py, me = sys.executable, str(Path(__file__).resolve())
    micro = [py, me, "--case", "drafter", "--model", "1b", "--b", "4", "--s", "2048", "--reps", "10", "--compiled"]
    for n in (64, 32, 16):
        run(f"drafter-n{n}-layers-maskc", [*micro, "--n", str(n), "--mode", "layers"], 120)


def phase7() -> None:
    """The target's layers compiled too: the target alone both ways, then the pipeline with both compiled."""
    py, me = sys.executable, str(Path(__file__).resolve())
    tgt = [py, me, "--case", "target", "--model", "1b", "--b", "4", "--s", "2048", "--reps", "10"]
    run("target-1b-eager", tgt, 90)
    run("target-1b-compiled", [*tgt, "--compiled"], 150)
    base = ["--model", "1b", "--seq-len", "2048", "--batch-size", "4", "--log-every", "5", "--queue-size", "4",
            "--transport", "ipc", "--compile", "--compile-target"]
    for n in (64, 16):
        pipeline(f"pipe-1b-n{n}-both-compiled", [*base, "--num-anchors", str(n), "--steps", "60"], 170)


def phase8() -> None:
    """SpecForge's (and the seeds') 512 anchors per sequence, 1 x 2048: first pass vs regions, then the pipeline."""
    py, me = sys.executable, str(Path(__file__).resolve())
    run("target-1b-b1", [py, me, "--case", "target", "--model", "1b", "--b", "1", "--s", "2048", "--reps", "10"], 90)
    micro = [py, me, "--case", "drafter", "--model", "1b", "--b", "1", "--s", "2048", "--n", "512", "--reps", "5",
             "--compiled"]
    run("drafter-n512-flex", [*micro, "--mode", "flex"], 120)
    run("drafter-n512-layers", [*micro, "--mode", "layers"], 150)
    pipeline("pipe-1b-n512-b1-both-compiled", ["--model", "1b", "--seq-len", "2048", "--batch-size", "1",
                                               "--num-anchors", "512", "--log-every", "5", "--queue-size", "4",
                                               "--transport", "ipc", "--compile", "--steps", "40"], 150)


def phase5() -> None:
    """The pipeline with the regionally compiled drafter: cold vs warm start, and the anchor count."""
    py = sys.executable
    cache = RUNS / "compile_cache.bin"
    base = ["--model", "1b", "--seq-len", "2048", "--batch-size", "4", "--log-every", "5", "--queue-size", "4",
            "--transport", "ipc", "--compile"]
    run("target-1b", [py, str(Path(__file__).resolve()), "--case", "target", "--model", "1b", "--b", "4", "--s",
                      "2048", "--reps", "10"], 90)
    run("warmup-layers", [py, str(ROOT / "remote_payload" / "warmup_compile.py"), *base, "--num-anchors", "64",
                          "--device", "cuda", "--gpus", "0,0", "--compile-cache", str(cache)], 150)
    pipeline("pipe-1b-n64-layers-warm", [*base, "--num-anchors", "64", "--steps", "40", "--compile-cache",
                                         str(cache)], 150)
    pipeline("pipe-1b-n64-layers-cold", [*base, "--num-anchors", "64", "--steps", "15", "--compile-cache",
                                         str(RUNS / "cold.bin")], 150)
    for n in (32, 16):
        pipeline(f"pipe-1b-n{n}-layers", [*base, "--num-anchors", str(n), "--steps", "40"], 120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", type=int)
    ap.add_argument("--case")
    ap.add_argument("--model", default="1b")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--s", type=int, default=2048)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--mode", default="layers", choices=["layers", "flex"])
    ap.add_argument("--no-fused", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.case == "target":
        return case_target(a.model, a.b, a.s, a.reps, a.compiled)
    if a.case == "drafter":
        return case_drafter(a.model, a.b, a.s, a.n, a.compiled, a.reps, a.cache, a.mode, not a.no_fused, a.profile)
    OUT.mkdir(parents=True, exist_ok=True)
    PHASE["n"] = a.phase
    {1: phase1, 2: phase2, 3: phase3, 4: phase4, 5: phase5, 6: phase6, 7: phase7, 8: phase8}[a.phase]()
    (OUT / f"results_phase{a.phase}.json").write_text(json.dumps(RESULTS, indent=1))
    print("\n=== summary")
    for r in RESULTS:
        keep = {k: v for k, v in r.items() if k not in ("last_lines", "err_tail", "q_hs_steady")}
        print(json.dumps(keep))
        for k in ("last_lines", "err_tail"):
            for ln in r.get(k, []):
                print(f"    {ln}")


if __name__ == "__main__":
    main()
