"""`ctl launch JOB` wall time for jobs of 1, 2 and 4 nodes, side by side in one run, on the local Proxmox host.

The nodes are prepared in parallel (one preflight round trip per node, rendezvous check included, then the
environment probe and the start), so 4 nodes should cost little more than one (goal: <= 1.5x). Each timing is a
whole `ctl launch` process (Python start-up included) against containers on two simulated hosts (CT 200, 201 on
pve1; CT 300, 301 on pve2), all four in the host's network namespace so that every node reaches node 0's
rendezvous address. The payload is a start script that only sleeps: what is timed is ctl, not torch. Each run is
stopped (untimed) before the next; the cases are interleaved, medians reported. A single container's own launch
(`ctl launch ct200`, no job) is timed beside them for reference.

    sudo python3 bench/multinode_launch.py [--repeat 5] [--out bench/results/multinode_launch.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.pvehost import NodeSpec, PveHost, find_free_port, missing_prerequisites  # noqa: E402

START = "#!/usr/bin/env bash\necho run $CTL_RUN\nexec sleep 300\n"  # the same on every node and inventory
ADDRESS = {200: "127.0.0.12", 201: "127.0.0.14", 300: "127.0.0.13", 301: "127.0.0.15"}
JOBS = {1: [200], 2: [200, 300], 4: [200, 201, 300, 301]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "multinode_launch.json"))
    args = ap.parse_args()
    why = missing_prerequisites()
    if why:
        print(f"bench: needs the local Proxmox host: {why}", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="ctl-bench-mn-"))
    nodes = (NodeSpec("pve1", "127.0.0.2", (200, 201)), NodeSpec("pve2", "127.0.0.3", (300, 301)))
    port = find_free_port(["127.0.0.2", "127.0.0.3"])
    host = PveHost(base=base, port=port, nodes=nodes, ct_ssh_vmid=None, small_tmpfs={}).up()
    try:
        for vmid in ADDRESS:
            host.set_host_network(vmid, True)
        return run(host, base, args)
    finally:
        host.down()


def run(host: PveHost, base: Path, args: argparse.Namespace) -> int:
    work = base / "work"
    work.mkdir()
    (work / "start.j2").write_text(START)
    env = dict(os.environ, CTL_STATE_DIR=str(work / "state"), PYTHONPATH=str(REPO))
    rdzv = find_free_port(["127.0.0.12"], start=29500)
    invs = {}
    for n, vmids in [*JOBS.items(), (0, [200])]:
        # one inventory per job size: a container is a node of one job only (0: ct200 on its own, no job)
        jobs = {} if n == 0 else {"job": {"nodes": [f"ct{v}" for v in vmids], "rdzv_port": rdzv, "nproc_per_node": 1}}
        invs[n] = host.write_inventory(
            work / f"inventory{n}.yaml",
            containers={f"ct{v}": {"address": a, "gpus": {}} for v, a in ADDRESS.items()}, jobs=jobs,
            payload=[{"template": "start.j2", "dest": "/root/bench/start_training.sh", "mode": "0755"}],
            runs={"series": "b", "session": "bench", "log": "/workspace/bench/train_{run}.log",
                  "dir": "/workspace/bench/runs/{run}"})

    def ctl(n: int, *argv: str) -> float:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "controller", "-i", str(invs[n]), *argv], capture_output=True,
                           text=True, env=env)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"bench: ctl {' '.join(argv)} exited {r.returncode}: {r.stderr[-600:]}")
        return dt

    for n in (1, 2, 4, 0):
        ctl(n, "deploy", "--all", "--allow-dirty")  # every container, so each inventory's pins are in place
    times: dict[str, list[float]] = {"ct200 alone": [], "1 node": [], "2 nodes": [], "4 nodes": []}
    for i in range(args.repeat):
        for n, label in ((0, "ct200 alone"), (1, "1 node"), (2, "2 nodes"), (4, "4 nodes")):
            name = f"b{n}x{i}"
            times[label].append(ctl(n, "launch", "ct200" if n == 0 else "job", "--run", name))
            ctl(n, "stop", name if n else f"ct200/{name}", "--grace", "1")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"ctl launch, medians of {args.repeat} (whole CLI process each):")
    for k, v in med.items():
        print(f"  {k:<12} {v:6.2f} s   {v / med['1 node']:.2f}x one node   (all: "
              + ", ".join(f"{x:.2f}" for x in times[k]) + ")")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"repeat": args.repeat, "times": times, "medians": med,
                               "ratio_4_to_1": med["4 nodes"] / med["1 node"]}, indent=1))
    print(f"4 nodes / 1 node = {med['4 nodes'] / med['1 node']:.2f} (goal <= 1.5); written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
