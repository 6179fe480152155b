#!/usr/bin/env python3
"""Targets and drafters on separate GPUs, through the start_training.sh that ctl renders.

Two steps, because the GPU machine has no ctl installed (DIR must be at the same absolute path on both):

    python3 bench/payload/multi_gpu.py --render .ctl/gpu      # here: ctl deploys one `local` container per split
    python3 bench/payload/multi_gpu.py --run .ctl/gpu         # on the GPU machine (carry .ctl/gpu there)

--render writes DIR/inventory.yaml with one `local`-transport container per GPU split (SPLITS below: the same
`gpus: {target: [...], drafter: [...]}` map a Proxmox container has) and runs `ctl deploy` for them, so each
DIR/<split>/root/start_training.sh is ctl's own rendering: CUDA_VISIBLE_DEVICES, --gpus rank map, NCCL_NVLS_ENABLE=0
and the other multicast switches, the compile cache path. --run first measures the target's forward alone on one
GPU (the ratio's baseline, same run), then runs `CTL_RUN=<split> bash DIR/<split>/root/start_training.sh` for every
split whose GPUs exist, each with a cold compile cache, and prints the first-step time, end-to-end tok/s, per-role
batch rates and queue depth per split; JSON to $OUT/multi_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# name: (target GPUs, drafter GPUs, GPUs needed, train_args overrides); run in this order
SPLITS = {
    "s1p1": ([0], [1], 2, {}),                # one role per GPU: hidden states over CUDA IPC between GPUs
    "s1p1-gloo": ([0], [1], 2, {"transport": "gloo"}),  # only when s1p1 failed: the host-copy transport
    "s2p2-shared": ([0, 1], [0, 1], 2, {}),   # a target and a drafter on each GPU; drafters all-reduce over NCCL
    "s1p1-shared": ([0], [0], 1, {}),         # both roles on GPU 0: the one-GPU figure, in this same run
}
TRAIN_ARGS = {"model": "1b", "steps": 60, "seq-len": 2048, "batch-size": 4, "num-anchors": 64,
              "drafter-layers": 5, "log-every": 5, "queue-size": 4, "compile": True, "transport": "ipc"}


def render(d: Path) -> None:
    d = d.resolve()
    d.mkdir(parents=True, exist_ok=True)
    lines = ["# written by bench/payload/multi_gpu.py --render", "containers:"]
    for name, (tg, dg, _, over) in SPLITS.items():
        lines += [f"  {name}:", "    transport: local", f"    root: {name}",
                  f"    gpus: {{target: {tg}, drafter: {dg}}}",
                  "    vars:", "      python: python3",
                  f"      train_args: {json.dumps({**TRAIN_ARGS, **over})}"]
    lines += ["payload:"]
    for name in ("dflash_model.py", "dflash_data.py", "dflash_eval.py", "dflash_ckpt.py", "dflash_dist.py",
                 "train_dflash_pipeline.py", "warmup_compile.py"):  # every module the pipeline imports
        lines.append(f"  - {{src: {ROOT / 'remote_payload' / name}, dest: /root/{name}}}")
    lines.append(f"  - {{template: {ROOT / 'templates/start_training.sh.j2'}, dest: /root/start_training.sh, "
                 "mode: \"0755\"}")
    lines.append('runs: {series: fresh, session: dflash, log: "/workspace/train_stdout_{run}.log", '
                 'dir: "/workspace/runs/{run}"}')
    inv = d / "inventory.yaml"
    inv.write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, "-m", "controller", "-i", str(inv), "deploy", *SPLITS, "--allow-dirty"],
                   cwd=ROOT, check=True)


def steady(run_dir: Path) -> dict:
    f = run_dir / "metrics.jsonl"
    if not f.exists():
        return {}
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    st = recs[1:] or recs
    if not st:
        return {}
    tok = sorted(r["tok_s"] for r in st)
    return {"windows": len(st), "tok_s_median": round(tok[len(tok) // 2]),
            "tok_s_range": [round(tok[0]), round(tok[-1])], "tgt_bps": st[-1]["tgt_bps"],
            "dft_bps": st[-1]["dft_bps"], "q_hs": [r["q_hs"] for r in st]}


def run(d: Path, out: Path) -> None:
    import torch

    n_gpu = torch.cuda.device_count()
    results: list[dict] = [{"gpus": n_gpu, "names": [torch.cuda.get_device_name(i) for i in range(n_gpu)],
                            "torch": torch.__version__}]
    base = subprocess.run([sys.executable, str(ROOT / "bench/payload/gpu_bench.py"), "--case", "target", "--model",
                           "1b", "--b", "4", "--s", "2048", "--reps", "10"], capture_output=True, text=True,
                          timeout=120)
    for line in base.stdout.splitlines():
        if line.startswith("RESULT "):
            results.append({"case": "target-alone", **json.loads(line[7:])})
    print(json.dumps(results[-1]), flush=True)
    ok: set[str] = set()
    for name, (_tg, _dg, need, _over) in SPLITS.items():
        if need > n_gpu:
            results.append({"case": name, "skipped": f"needs {need} GPUs, {n_gpu} here"})
            continue
        if name == "s1p1-gloo" and "s1p1" in ok:
            continue
        script = d / name / "root" / "start_training.sh"
        env = {**os.environ, "CTL_RUN": name}
        t = time.time()
        p = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=240)
        rec = {"case": name, "rc": p.returncode, "wall_s": round(time.time() - t, 1)}
        for line in p.stdout.splitlines():
            if line.startswith("first step done"):
                rec["first_step_s"] = float(line.split()[3].rstrip("s"))
        rec.update(steady(d / name / "workspace" / "runs" / name))
        metrics = [ln for ln in p.stdout.splitlines() if "step=" in ln]
        rec["last_lines"] = metrics[-3:]
        if p.returncode != 0:
            rec["err_tail"] = p.stderr.strip().splitlines()[-8:]
        (out / f"{name}.log").write_text(p.stdout[-200_000:] + "\n--- stderr\n" + p.stderr[-100_000:])
        results.append(rec)
        if p.returncode == 0:
            ok.add(name)
        print(json.dumps(rec), flush=True)
    (out / "multi_gpu.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--render", type=Path, metavar="DIR")
    g.add_argument("--run", type=Path, metavar="DIR")
    a = ap.parse_args()
    if a.render:
        render(a.render)
    else:
        out = Path(os.environ.get("OUT", "/tmp/multi-gpu"))
        out.mkdir(parents=True, exist_ok=True)
        run(a.run.resolve(), out)


if __name__ == "__main__":
    main()
