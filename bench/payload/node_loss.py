#!/usr/bin/env python3
"""How long a 2-node run's processes outlive one node killed with SIGKILL: the payload vs torchrun alone.

    python3 bench/payload/node_loss.py [--json FILE]

Two `torchrun --nnodes 2 --nproc-per-node 2` on one c10d rendezvous (127.0.0.1). Node 0 starts first and hosts the
rendezvous store (and, as group rank 0, the workers' store). Once both train, SIGKILL goes to one node's torchrun
process group (what stopping a launcher's process group does; torchrun's workers sit in sessions of their own,
so it reaches the agent alone), and the bench times until no process of the run (two agents, four workers) is
left, up to --limit seconds. Cases, side by side:
  baseline  workers that only all-reduce in a loop over gloo: what torchrun's elastic agent does by itself
  payload   the tiny CPU DFlash pipeline (1 target + 1 drafter per node), with its watchdog
each with node 1 killed (a node that hosts nothing) and node 0 killed (the stores' host).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "remote_payload" / "train_dflash_pipeline.py"
sys.path.insert(0, str(ROOT))
from tests.payload.test_multinode import alive, children  # noqa: E402 (the same /proc reading as the test)

LOOP = """import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.zeros(1)
print("training", flush=True)
while True:
    dist.all_reduce(t)
    time.sleep(0.05)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case(kind: str, victim: int, base: Path, limit: float) -> dict:
    port = free_port()
    loop = base / "loop.py"
    base.mkdir(parents=True)
    loop.write_text(LOOP)
    target = (["--no-python", sys.executable, str(loop)] if kind == "baseline" else
              [str(SCRIPT), "--targets", "1", "--drafters", "1", "--device", "cpu", "--model", "tiny", "--out",
               "run", "--steps", "100000", "--seq-len", "64", "--batch-size", "2", "--num-anchors", "4",
               "--drafter-layers", "1", "--log-every", "1", "--timeout-s", "600"])
    procs, logs = [], []
    for i in range(2):
        cwd = base / f"node{i}"
        cwd.mkdir(parents=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "loss", *target]
        log = cwd / "torchrun.log"
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}))
        logs.append(log)
        if i == 0:  # node 0 binds the rendezvous port first: it hosts the store
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.2)
    marker = "training" if kind == "baseline" else "step=2 "
    deadline = time.monotonic() + 300
    while marker not in logs[0].read_text(errors="replace"):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            raise SystemExit(f"{kind}: the run did not start; see {base}")
        time.sleep(0.3)
    time.sleep(1)
    pids = [q for p in procs for q in (p.pid, *children(p.pid))]
    t0 = time.monotonic()
    os.killpg(procs[victim].pid, signal.SIGKILL)
    while any(alive(q) for q in pids) and time.monotonic() - t0 < limit:
        for p in procs:
            p.poll()
        time.sleep(0.05)
    took = time.monotonic() - t0
    left = [q for q in pids if alive(q)]
    for q in left:
        os.kill(q, signal.SIGKILL)
    for p in procs:
        p.poll()
    return {"case": kind, "killed": f"node {victim}", "processes": len(pids),
            "gone_s": None if left else round(took, 2), "left_after_limit": len(left)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=float, default=60.0)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        for kind in ("baseline", "payload"):
            for victim in (1, 0):
                r = case(kind, victim, Path(tmp) / f"{kind}-{victim}", a.limit)
                results.append(r)
                what = (f"every process gone after {r['gone_s']:.2f} s" if r["gone_s"] is not None else
                        f"{r['left_after_limit']} of {r['processes']} processes still running after {a.limit:g} s")
                print(f"{kind:8}  node {victim} killed: {what}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
