#!/usr/bin/env python3
"""Tokens per second of the tiny CPU pipeline on one node vs two nodes, the same per-node batch.

    python3 bench/payload/multinode_cpu.py --cores-per-node 4 [--rounds 2] [--json FILE]

Each "node" is a `torchrun` of its own (one target + one drafter, --batch-size B each), pinned with taskset to
cores of its own: the 1-node baseline to cores 0..C-1, the 2-node run's nodes to 0..C-1 and C..2C-1, meeting
through the c10d rendezvous on 127.0.0.1 (gloo over loopback TCP for the drafters' gradient all-reduce). Rounds
alternate 1-node, 2-node runs, side by side in one invocation. tok/s is the run's own figure (node 0's
metrics.jsonl: every node's tokens), median of the windows after the first (start-up and the first steps left
out). Ideal scaling is 2.0x; what is lost is the all-reduce of the drafter's gradients once per step and
waiting for the slower node. Needs 2C cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "remote_payload" / "train_dflash_pipeline.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steady_tok_s(run: Path) -> tuple[float, int]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tok = [r["tok_s"] for r in (recs[1:] or recs)]
    return statistics.median(tok), len(tok)


def launch(nodes: int, cores: list[list[int]], flags: list[str], base: Path) -> float:
    port = free_port()
    procs = []
    for i in range(nodes):
        cwd = base / f"node{i}"
        cwd.mkdir(parents=True)
        rdzv = (["--standalone"] if nodes == 1 else
                ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", "bench"])
        cmd = ["taskset", "-c", ",".join(map(str, cores[i])), sys.executable, "-m", "torch.distributed.run", *rdzv,
               "--nproc-per-node", "2", str(SCRIPT), "--targets", "1", "--drafters", "1", "--device", "cpu",
               "--model", "tiny", "--out", "run", *flags]
        log = open(cwd / "torchrun.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append((subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"}), log))
    for p, log in procs:
        rc = p.wait(timeout=900)
        log.close()
        if rc:
            raise SystemExit(f"{nodes}-node run failed (exit {rc}): see {base}")
    lead = next(base / f"node{i}" / "run" for i in range(nodes) if (base / f"node{i}" / "run" / "metrics.jsonl")
                .exists())
    return steady_tok_s(lead)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores-per-node", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    c = a.cores_per_node
    have = sorted(os.sched_getaffinity(0))
    if len(have) < 2 * c:
        raise SystemExit(f"--cores-per-node {c} needs {2 * c} cores, {len(have)} here")
    cores = [have[:c], have[c:2 * c]]
    flags = ["--steps", str(a.steps), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
             "--num-anchors", "32", "--drafter-layers", "2", "--log-every", "5", "--queue-size", "4"]
    import torch

    runs: dict[int, list[float]] = {1: [], 2: []}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="mn-bench-") as tmp:
        for r in range(a.rounds):
            for nodes in (1, 2):
                tok = launch(nodes, cores, flags, Path(tmp) / f"r{r}-{nodes}n")
                runs[nodes].append(tok)
                print(f"round {r + 1}: {nodes} node(s): {tok:,.0f} tok/s", flush=True)
    med = {n: statistics.median(v) for n, v in runs.items()}
    result = {"torch": torch.__version__, "cores_per_node": c, "flags": flags, "tok_s": runs,
              "tok_s_median": med, "speedup_2_nodes": round(med[2] / med[1], 3),
              "scaling_efficiency": round(med[2] / med[1] / 2, 3), "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(result), flush=True)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
