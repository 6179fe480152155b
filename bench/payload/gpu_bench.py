#!/usr/bin/env python3
"""Payload measurements on one GPU, every variant in one call: JSON per case under $OUT, a table at the end.

    PYTHONUNBUFFERED=1 python3 bench/payload/gpu_bench.py --phase 1   # smoke, target alone, drafter micro
    PYTHONUNBUFFERED=1 python3 bench/payload/gpu_bench.py --phase 2   # pipeline: cold/warm compile, transports
    PYTHONUNBUFFERED=1 python3 bench/payload/gpu_bench.py --phase 9   # anchor-built mask vs the previous code
    PYTHONUNBUFFERED=1 python3 bench/payload/gpu_bench.py --phase 10  # RESULTS.md's figures for issue 19

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


def pipeline(name, flags, timeout, env=None, fresh_cache=True, script=PIPE):
    n = 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(script),
           "--targets", "1", "--drafters", "1", "--device", "cuda", "--gpus", "0,0", "--out", str(RUNS / name),
           *flags]
    with GpuMemory() as mem:
        rec = run(name, cmd, timeout, env, fresh_cache)
    rec["gpu_peak_mib"] = mem.peak_total
    rec["proc_peak_mib"] = sorted(mem.peak_proc.values(), reverse=True)
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
                 mode: str = "layers", fused: bool = True, profile: bool = False, mask: str = "anchors",
                 syncs: bool = False) -> None:
    """One drafter training step (fwd + bwd + AdamW) at the run's shapes, compiled (`mode`: layers or flex alone)
    or eager. With `cache`: load the portable cache first when the file exists, else save it after the first step.
    With `profile`: the CUDA kernels of two steps, grouped, to the log. `mask`: the block mask built from the
    anchors (today's) or by create_block_mask over the dense mask ("dense": the previous builder, compiled up to
    16M elements, eager above, as it was). With `syncs`: host syncs in the step (profiler + sync debug mode)."""
    import torch

    sys.path.insert(0, str(ROOT / "remote_payload"))
    import dflash_model as dm
    import train_dflash_pipeline as tp

    if mask == "dense":
        def previous(anchors, ctx_len, block_size, device=None):
            elements = anchors.shape[0] * anchors.shape[1] * block_size * (ctx_len + anchors.shape[1] * block_size)
            return dm.dflash_mask_dense(anchors, ctx_len, block_size, device, compiled and elements <= 16 * 2**20)

        dm.dflash_mask = previous
    torch.cuda.reset_peak_memory_stats()
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
    loss0 = step(0)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    loss0 = float(loss0.detach())
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
    peak = torch.cuda.max_memory_allocated()  # before the mask timings (the dense builder's temporaries)
    t = time.perf_counter()
    for i in range(reps):  # as the pipeline's drafter did until now: the host waits for each step's end
        step(i)
        torch.cuda.synchronize()
    dt_synced = (time.perf_counter() - t) / reps
    mask_ms = {}
    builders = {"step's": dm.dflash_mask}
    if mask != "dense":
        builders["dense_eager"] = dm.dflash_mask_dense
    for name, build in builders.items():
        build(batches[0][3], s, 16)
        torch.cuda.synchronize()
        t = time.perf_counter()
        k = 10 if name != "dense_eager" else 3
        for i in range(k):
            build(batches[i % 3][3], s, 16)
        torch.cuda.synchronize()
        mask_ms[name] = round((time.perf_counter() - t) * 1e3 / k, 2)
    sync_report = host_syncs(step) if syncs else None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as pr:
            for i in range(2):
                step(i)
            torch.cuda.synchronize()
        print(pr.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
    print("RESULT " + json.dumps({"cache": loaded, "cache_counters": hits, "compiled": compiled, "mask": mask,
                                  "loss0": loss0, "syncs": sync_report,
                                  "mode": mode if compiled else "eager", "fused_adamw": fused, "mask_ms": mask_ms,
                                  "drafter_params_m": round(dm.param_count(d) / 1e6, 1),
                                  "batch": b, "seq": s, "anchors": n, "first_step_s": round(first, 1),
                                  "ms_per_step": round(dt * 1e3, 1), "tok_s": round(b * s / dt, 1),
                                  "ms_per_step_synced": round(dt_synced * 1e3, 1),
                                  "peak_gib": round(peak / 2**30, 1)}))


SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "cudaMemcpyAsync", "cudaMalloc", "cudaFree", "aten::item", "aten::_local_scalar_dense", "aten::nonzero",
            "aten::is_nonzero", "aten::masked_select", "aten::repeat_interleave")


def host_syncs(step) -> dict:
    """Host syncs in two drafter steps: the profiler's CPU-side CUDA runtime calls and aten ops that wait for the
    GPU, plus the Python lines torch.cuda's sync debug mode flags; GPU busy time against wall time."""
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
        for i in range(2):
            step(i)
        torch.cuda.synchronize()  # the profile's own, counted once below
    wall = (time.perf_counter() - t) / 2
    ev = pr.key_averages()
    found = {e.key: e.count for e in ev if any(e.key == k or e.key.startswith(k + "(") for k in SYNC_OPS)}
    gpu_us = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    try:
        print(ev.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=80))
    except Exception as e:  # the table is for the log only
        print(f"profile table: {e}")
    lines: dict[str, int] = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(0)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{Path(w.filename).name}:{w.lineno}"
            lines[key] = lines.get(key, 0) + 1
    return {"profiler_calls_2_steps": found, "debug_mode_lines_1_step": lines,
            "gpu_busy_ms_per_step": round(gpu_us / 2e3, 2), "wall_ms_per_step_profiled": round(wall * 1e3, 2)}


def case_targets(model: str, s: int, batches: list[int], reps: int) -> None:
    """The target role's work alone (forward + hidden states of the drafter's layers, concatenated), eager then
    with its decoder layers compiled (the pipeline's --compile-target), at each batch size, in one process."""
    import torch

    sys.path.insert(0, str(ROOT / "remote_payload"))
    import train_dflash_pipeline as tp

    dev = torch.device("cuda", 0)
    m = tp.build_target(model, dev, 0)
    layers = tp.hs_layers(m.config, 5)
    tp.truncate_target(m, max(layers))
    out: dict = {"layers_run": len(m.model.layers), "seq": s}

    def timed(b):
        ids = torch.randint(2, m.config.vocab_size - 2, (b, s), device=dev)

        def step():
            with torch.no_grad():
                o = m.model(input_ids=ids, output_hidden_states=True, use_cache=False)
                return torch.cat([o.hidden_states[i + 1] for i in layers], dim=-1)

        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / reps
        return {"ms_per_batch": round(dt * 1e3, 2), "tok_s": round(b * s / dt, 1), "first_call_s": round(first, 1)}

    for b in batches:
        out[f"eager_b{b}"] = timed(b)
        print(f"eager b{b}: {out[f'eager_b{b}']}", flush=True)
    tp.compile_target_layers(m)
    for b in batches:
        out[f"compiled_b{b}"] = timed(b)
        print(f"compiled b{b}: {out[f'compiled_b{b}']}", flush=True)
    out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print("RESULT " + json.dumps(out))


def case_maskcheck() -> None:
    """On the GPU: the anchor-built BlockMask against create_block_mask over the dense mask, all eight tile tables
    equal, at small shapes and at the runs' (4 x 2048 / 64 anchors, 1 x 2048 / 512 anchors); build times."""
    import torch

    sys.path.insert(0, str(ROOT / "remote_payload"))
    import dflash_model as dm

    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")
    dev = torch.device("cuda", 0)
    out = {"torch": torch.__version__, "cases": []}
    g = torch.Generator().manual_seed(0)
    for b, s, n, bs in ((2, 40, 3, 4), (3, 200, 9, 16), (1, 517, 20, 5), (4, 2048, 64, 16), (1, 2048, 512, 16),
                        (1, 3072, 512, 16)):
        anchors, _ = dm.sample_anchors(torch.ones(b, s), n, bs, g)
        anchors = anchors.to(dev)
        new, old = dm.dflash_mask(anchors, s, bs), dm.dflash_mask_dense(anchors, s, bs)
        equal = all(torch.equal(getattr(new, f), getattr(old, f)) for f in fields)
        times = {}
        for name, build in (("anchors", dm.dflash_mask), ("dense_eager", dm.dflash_mask_dense)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                build(anchors, s, bs)
            torch.cuda.synchronize()
            times[name] = round((time.perf_counter() - t) * 200, 3)
        out["cases"].append({"b": b, "s": s, "n": n, "bs": bs, "equal": equal, "ms": times})
        print(out["cases"][-1], flush=True)
    print("RESULT " + json.dumps(out))


def case_startup(model: str, b: int, s: int) -> None:
    """Where a pipeline's time to first step goes, one piece at a time in one process (the compile cache as the
    caller's TORCHINDUCTOR_CACHE_DIR leaves it): imports, building the target, its embedding to the host (what
    share_frozen sends), the first compiled target forward."""
    t0 = time.perf_counter()
    marks = {}
    import torch

    marks["import_torch"] = time.perf_counter() - t0
    import transformers  # noqa: F401

    marks["import_transformers"] = time.perf_counter() - t0 - sum(marks.values())
    sys.path.insert(0, str(ROOT / "remote_payload"))
    import train_dflash_pipeline as tp

    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)
    marks["cuda_init"] = time.perf_counter() - t0 - sum(marks.values())

    def mark(name, fn):
        t = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        marks[name] = time.perf_counter() - t
        return r

    m = mark("build_target", lambda: tp.build_target(model, dev, 0))
    mark("embedding_to_host", lambda: m.get_input_embeddings().weight.detach().to("cpu").contiguous())
    layers = tp.hs_layers(m.config, 5)
    tp.truncate_target(m, max(layers))
    tp.compile_target_layers(m)
    ids = torch.randint(2, m.config.vocab_size - 2, (b, s), device=dev)
    with torch.no_grad():
        mark("first_compiled_forward", lambda: m.model(input_ids=ids, output_hidden_states=True, use_cache=False))
    print("RESULT " + json.dumps({k: round(v, 2) for k, v in marks.items()}))


class GpuMemory:
    """Samples nvidia-smi once a second while a case runs: the GPU's and each process's peak memory (MiB)."""

    def __init__(self):
        import threading

        self.peak_total, self.peak_proc, self.stop = 0, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _q(self, what: str) -> list[list[str]]:
        try:
            r = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10)
            return [[x.strip() for x in ln.split(",")] for ln in r.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.SubprocessError):
            return []

    def _run(self):
        while not self.stop.wait(1.0):
            for row in self._q("gpu=memory.used"):
                self.peak_total = max(self.peak_total, int(row[0]))
            for pid, used in self._q("compute-apps=pid,used_memory"):
                if used.isdigit():
                    self.peak_proc[pid] = max(self.peak_proc.get(pid, 0), int(used))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


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


def phase9() -> None:
    """Block masks built from the anchors: the target alone (eager and compiled, 4 x 2048 and 1 x 2048), the
    drafter step at 64 and 512 anchors (cold and warm compile cache, host syncs, the previous mask builder side
    by side), the pipeline at 64 and 512 anchors, today's code and the previous (BASELINE_DIR) in turn."""
    py, me = sys.executable, str(Path(__file__).resolve())
    shared = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="ind-shared-")}
    run("env", [py, "-c", "import torch, transformers, triton; print('RESULT ' + __import__('json').dumps({"
                "'torch': torch.__version__, 'transformers': transformers.__version__, 'triton': triton.__version__,"
                "'gpu': torch.cuda.get_device_name(0)}))"], 60)
    run("maskcheck", [py, me, "--case", "maskcheck"], 60)
    run("targets-1b", [py, me, "--case", "targets", "--model", "1b", "--s", "2048", "--reps", "10"], 150, shared,
        False)
    micro = [py, me, "--case", "drafter", "--model", "1b", "--s", "2048", "--reps", "10", "--compiled"]
    run("drafter-n64-b4-cold", [*micro, "--b", "4", "--n", "64", "--syncs"], 120, shared, False)
    run("drafter-n512-b1-cold", [*micro, "--b", "1", "--n", "512", "--syncs"], 120, shared, False)
    run("drafter-n512-b1-warm", [*micro, "--b", "1", "--n", "512"], 90, shared, False)
    run("drafter-n512-b1-prevmask", [*micro, "--b", "1", "--n", "512", "--mask", "dense"], 120, shared, False)
    base = ["--model", "1b", "--seq-len", "2048", "--log-every", "5", "--queue-size", "4", "--transport", "ipc",
            "--compile", "--steps", "40"]
    prev = Path(os.environ.get("BASELINE_DIR", ROOT / "baseline")) / "train_dflash_pipeline.py"
    shapes = {64: [*base, "--num-anchors", "64", "--batch-size", "4"],
              512: [*base, "--num-anchors", "512", "--batch-size", "1"]}
    for n, flags in shapes.items():
        pipeline(f"pipe-n{n}", flags, 120, shared, False)
    for n, flags in shapes.items():
        if prev.exists():
            pipeline(f"pipe-n{n}-previous", flags, 120, shared, False, script=prev)


def phase10() -> None:
    """The figures for bench/RESULTS.md, every ratio within this one call: the target alone (eager, compiled), the
    drafter step (cold and warm cache, with and without a host wait per step), the pipeline at 64 and 512 anchors
    (warm, then 512 anchors cold), and where the pipeline's start-up goes."""
    py, me = sys.executable, str(Path(__file__).resolve())
    shared = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="ind-shared-")}
    run("env", [py, "-c", "import torch, transformers, triton; print('RESULT ' + __import__('json').dumps({"
                "'torch': torch.__version__, 'transformers': transformers.__version__, 'triton': triton.__version__,"
                "'gpu': torch.cuda.get_device_name(0)}))"], 60)
    run("targets-1b", [py, me, "--case", "targets", "--model", "1b", "--s", "2048", "--reps", "20"], 150, shared,
        False)
    micro = [py, me, "--case", "drafter", "--model", "1b", "--s", "2048", "--reps", "10", "--compiled"]
    run("drafter-n64-b4-cold", [*micro, "--b", "4", "--n", "64"], 120, shared, False)
    run("drafter-n512-b1-cold", [*micro, "--b", "1", "--n", "512"], 120, shared, False)
    run("drafter-n512-b1-warm", [*micro, "--b", "1", "--n", "512"], 90, shared, False)
    run("startup-target-warm", [py, me, "--case", "startup", "--model", "1b", "--b", "1", "--s", "2048"], 90, shared,
        False)
    base = ["--model", "1b", "--seq-len", "2048", "--log-every", "5", "--queue-size", "4", "--transport", "ipc",
            "--compile", "--steps", "60"]
    n64 = [*base, "--num-anchors", "64", "--batch-size", "4"]
    n512 = [*base, "--num-anchors", "512", "--batch-size", "1"]
    pipeline("pipe-n64-warm", n64, 120, shared, False)
    pipeline("pipe-n512-warm", n512, 120, shared, False)
    pipeline("pipe-n512-cold", n512, 150)


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
    ap.add_argument("--mask", default="anchors", choices=["anchors", "dense"])
    ap.add_argument("--syncs", action="store_true")
    a = ap.parse_args()
    if a.case == "target":
        return case_target(a.model, a.b, a.s, a.reps, a.compiled)
    if a.case == "targets":
        return case_targets(a.model, a.s, [4, 1], a.reps)
    if a.case == "maskcheck":
        return case_maskcheck()
    if a.case == "startup":
        return case_startup(a.model, a.b, a.s)
    if a.case == "drafter":
        return case_drafter(a.model, a.b, a.s, a.n, a.compiled, a.reps, a.cache, a.mode, not a.no_fused, a.profile,
                            a.mask, a.syncs)
    OUT.mkdir(parents=True, exist_ok=True)
    PHASE["n"] = a.phase
    {1: phase1, 2: phase2, 3: phase3, 4: phase4, 5: phase5, 6: phase6, 7: phase7, 8: phase8, 9: phase9,
     10: phase10}[a.phase]()
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
