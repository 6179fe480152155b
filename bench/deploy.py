"""Deploy benchmark: ctl against the seeds' way, side by side in one run, on the local Proxmox host.

The seeds' way (shared/seeds/): one `scp` of the files to the host, then `ssh host "pct push ..."`
per file, then an md5sum check through `pct exec`. ctl: `ctl deploy CT` (a whole CLI process each
time, start-up included). Cases: the two payload scripts + start_training.sh when all changed, when
none changed, and ten containers on two hosts against one. "Nothing changed" is also timed with a
persistent host session (CTL_PERSIST=60, controller/transport/mux/): cold (the session is stopped
first, so that run starts it) and warm (the next run reuses it).

    sudo python3 bench/deploy.py [--repeat 5] [--out bench/results/deploy.json]

Needs root, LXC and sshd (like the integration tests). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.pvehost import NodeSpec, PveHost, find_free_port, missing_prerequisites  # noqa: E402

FILES = ["remote_payload/dflash_model.py", "remote_payload/train_dflash_pipeline.py"]
TEMPLATE = "templates/start_training.sh.j2"


def timed(argv: list[str], env: dict[str, str] | None = None, check: bool = True) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if check and r.returncode != 0:
        raise SystemExit(f"bench: {shlex.join(argv)[:200]} exited {r.returncode}: {r.stderr[-500:]}")
    return dt


def seeds_way(host: PveHost, node: str, vmid: int, files: list[Path], tag: str) -> float:
    """scp to the host's /tmp, one ssh + pct push per file, then one ssh + md5sum inside the CT."""
    ssh = host.ssh_argv(node)
    addr, port, _ = host.hosts[node]
    key = ssh[ssh.index("-i") + 1]
    opts = ["-F", "/dev/null", "-i", key, "-o", f"UserKnownHostsFile={host.known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-P", str(port)]
    t0 = time.perf_counter()
    timed(["scp", "-q", *opts, *map(str, files), f"root@{addr}:/tmp/"])
    for f in files:
        dest = f"/root/{tag}/{f.name}"
        timed([*ssh, "--", f"pct push {vmid} /tmp/{f.name} {dest}"])
    timed([*ssh, "--", f"pct exec {vmid} -- md5sum " + " ".join(f"/root/{tag}/{f.name}" for f in files)])
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "deploy.json"))
    args = ap.parse_args()
    why = missing_prerequisites()
    if why:
        print(f"bench: needs the local Proxmox host: {why}", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="ctl-bench-"))
    nodes = (NodeSpec("pve1", "127.0.0.2", (200, 201, 202, 203, 204)),
             NodeSpec("pve2", "127.0.0.3", (300, 301, 302, 303, 304)))
    port = find_free_port(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    host = PveHost(base=base, port=port, nodes=nodes, ct_ssh_vmid=None, small_tmpfs={}).up()
    try:
        return run(host, base, args)
    finally:
        # never leave a session behind: stop them (they live under this run's state dir)
        subprocess.run([sys.executable, "-m", "controller", "mux", "stop"], capture_output=True,
                       env=dict(os.environ, CTL_STATE_DIR=str(base / "state"), PYTHONPATH=str(REPO)))
        host.down()


def run(host: PveHost, base: Path, args: argparse.Namespace) -> int:
    work = base / "work"
    (work / "templates").mkdir(parents=True)
    (work / "remote_payload").mkdir()
    srcs = []
    for f in FILES:
        (work / f).write_bytes((REPO / f).read_bytes())
        srcs.append(work / f)
    (work / TEMPLATE).write_text((REPO / TEMPLATE).read_text())
    tag = "bench"
    payload = [{"src": f, "dest": f"/root/{tag}/{Path(f).name}"} for f in FILES]
    payload.append({"template": TEMPLATE, "dest": f"/root/{tag}/start_training.sh", "mode": "0755"})
    inv = host.write_inventory(work / "inventory.yaml", payload=payload)
    env = dict(os.environ, CTL_STATE_DIR=str(base / "state"), PYTHONPATH=str(REPO))
    # An installed ctl runs from compiled bytecode (pip compiles it; a checkout writes __pycache__ on its
    # first run). A PYTHONDONTWRITEBYTECODE inherited from the calling shell would make every timed run
    # recompile ctl's own sources (~35 ms on 2 cores); the warm-up deploy below writes them once.
    if env.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        print("bench: PYTHONDONTWRITEBYTECODE ignored for ctl (its bytecode is written by the warm-up run)")
    ctl = [sys.executable, "-m", "controller", "-i", str(inv)]
    # The seeds' way pushes the rendered script too: render it once the way ctl does.
    rendered = work / "start_training.sh"
    subprocess.run([*ctl, "deploy", "ct201", "--allow-dirty"], check=True, capture_output=True, env=env)
    rendered.write_bytes((host.rootfs(201) / "root" / tag / "start_training.sh").read_bytes())
    seeds_files = [*srcs, rendered]
    host.ssh("pve1", "pct", "exec", "200", "--", "mkdir", "-p", f"/root/{tag}")  # the seeds' /root existed

    def touch_all() -> None:
        for f in srcs:
            f.write_bytes(f.read_bytes() + b"\n# bump\n")

    results: dict[str, list[float]] = {k: [] for k in
                                       ("seeds_all_changed", "ctl_all_changed", "seeds_none_changed",
                                        "ctl_none_changed", "ctl_none_changed_persist_cold",
                                        "ctl_none_changed_persist_warm", "ctl_one_ct", "ctl_ten_cts")}
    persist_env = dict(env, CTL_PERSIST="60")
    all_cts = [f"ct{v}" for n in host.nodes for v in n.vmids]
    for _ in range(args.repeat):
        touch_all()
        results["seeds_all_changed"].append(seeds_way(host, "pve1", 200, seeds_files, tag))
        results["ctl_all_changed"].append(timed([*ctl, "deploy", "ct200", "--allow-dirty"], env))
        # none changed: the seeds have no way to know, so they copy and check again
        results["seeds_none_changed"].append(seeds_way(host, "pve1", 200, seeds_files, tag))
        results["ctl_none_changed"].append(timed([*ctl, "deploy", "ct200", "--allow-dirty"], env))
        # the same with a persistent host session: stopped first (untimed), so the cold run starts it
        subprocess.run([*ctl, "mux", "stop"], check=True, capture_output=True, env=persist_env)
        results["ctl_none_changed_persist_cold"].append(timed([*ctl, "deploy", "ct200", "--allow-dirty"],
                                                              persist_env))
        results["ctl_none_changed_persist_warm"].append(timed([*ctl, "deploy", "ct200", "--allow-dirty"],
                                                              persist_env))
        touch_all()
        results["ctl_one_ct"].append(timed([*ctl, "deploy", "ct300", "--allow-dirty"], env))
        results["ctl_ten_cts"].append(timed([*ctl, "deploy", *all_cts, "--allow-dirty"], env))
    med = {k: statistics.median(v) for k, v in results.items()}
    ratios = {
        "all_changed_speedup": med["seeds_all_changed"] / med["ctl_all_changed"],
        "none_changed_speedup": med["seeds_none_changed"] / med["ctl_none_changed"],
        "none_changed_persist_warm_speedup": med["seeds_none_changed"] / med["ctl_none_changed_persist_warm"],
        "none_changed_persist_cold_speedup": med["seeds_none_changed"] / med["ctl_none_changed_persist_cold"],
        "ten_over_one": med["ctl_ten_cts"] / med["ctl_one_ct"],
    }
    print(f"{'case':<30} {'median s':>9}   (n={args.repeat})")
    for k, v in med.items():
        print(f"{k:<30} {v:9.3f}")
    print(f"all changed:  ctl is {ratios['all_changed_speedup']:.2f}x faster than the seeds' way (target >= 2)")
    print(f"none changed: ctl is {ratios['none_changed_speedup']:.2f}x faster than the seeds' way (target >= 4)")
    print(f"none changed, CTL_PERSIST=60: ctl is {ratios['none_changed_persist_warm_speedup']:.2f}x faster with "
          f"the session warm, {ratios['none_changed_persist_cold_speedup']:.2f}x on the run that starts it")
    print(f"ten containers take {ratios['ten_over_one']:.2f}x the time of one (target < 2)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"median_s": med, "ratios": ratios, "samples": results,
                               "repeat": args.repeat, "cpus": os.cpu_count()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
