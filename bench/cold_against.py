"""Cold commands of two checkouts side by side: wall time, and the CPU the whole machine spent meanwhile.

    python bench/cold_against.py --against DIR [--repeat 11] [--case ping40 ...]

A cold command starts from nothing: no host session, no relay, no staying agent (`ctl mux stop` before each
run, then a pause for the processes it ended). It pays the SSH handshakes, the relays' and agents' starts, and
every stall of a new connection, which bench/speed.py's cold rows show only as one tree's ratios, and which
move with the machine's phase by more than most changes do. Here the two trees' runs alternate on the same
host, in the same minutes: run i of this tree, run i of DIR, run i+1 of this tree...

Brings up the test host as bench/speed.py does (40 containers on two nodes, 20 of them with a live run). Each
tree has its own sessions (XDG_RUNTIME_DIR) and its own copy of the registry. Commands run as `python -P -c`
(not the installed script), so no command server starts beside them. The machine's CPU is read from /proc/stat
(user, nice, system, irq, softirq) around each run: every process counts, the short-lived ones (lxc-attach,
the agents' python3 starts) included, which /proc/PID/stat (bench/process_cpu.py) cannot see.

Needs root, LXC and sshd (like the integration tests). Prints one markdown table: per case and tree, the
median wall time, its minimum, and the median machine CPU per run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CASES = {  # name -> (inventory: runs or deploy, ctl arguments)
    "ping1": ("runs", ["ping", "ct200"]),
    "ping40": ("runs", ["ping"]),
    "status20": ("runs", ["status", "live20"]),
    "deploy": ("deploy", ["deploy", "ct200", "--allow-dirty"]),
}
SETTLE_S = 0.8  # after `mux stop`: the ended sessions' and agents' exits are not the next run's CPU
RUN = "import sys; sys.argv[0] = 'ctl'; from controller.launch.main import main; sys.exit(main())"
OK = (0, 21, 22)  # status's verdicts are not this benchmark's business; a failure is


def _busy() -> float:
    """CPU seconds the machine spent so far, all cores (what /proc/stat counts as neither idle nor iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="another checkout (e.g. `git worktree add DIR REV`)")
    ap.add_argument("--repeat", type=int, default=11, help="cold runs of each case per tree (default 11)")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (repeatable)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: give at least 1")
    sys.path.insert(0, str(HERE))
    from bench import speed

    other = speed.checkout(ap, args.against)
    trees = {"this": HERE, "against": other}
    b = speed.set_up("cold")
    envs: dict[str, dict[str, str]] = {}
    try:
        invs = {"runs": str(b.inv_runs), "deploy": str(b.inv_deploy)}
        for name, tree in trees.items():
            envs[name] = speed.tree_env(b, name, tree)
            envs[name].pop("PYTHONDONTWRITEBYTECODE", None)
        got: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for case in args.case or list(CASES):
            inv, argv = CASES[case]
            speed.say(f"{case}: ctl {' '.join(argv)}, cold, {args.repeat} runs per tree")
            for _ in range(args.repeat):
                for name in trees:
                    stop = subprocess.run([sys.executable, "-P", "-c", RUN, "-i", invs[inv], "mux", "stop"],
                                          env=envs[name], capture_output=True, text=True)
                    if stop.returncode != 0:
                        raise SystemExit(f"bench: {name}: mux stop: {stop.stderr[-800:]}")
                    time.sleep(SETTLE_S)
                    c0, t0 = _busy(), time.perf_counter()
                    r = subprocess.run([sys.executable, "-P", "-c", RUN, "-i", invs[inv], *argv],
                                       env=envs[name], capture_output=True, text=True)
                    wall, cpu = time.perf_counter() - t0, _busy() - c0
                    if r.returncode not in OK:
                        raise SystemExit(f"bench: {name}: {case} exited {r.returncode}: {r.stderr[-800:]}")
                    got.setdefault(case, {}).setdefault(name, []).append((wall, cpu))
        print("| case | tree | wall ms (median) | wall ms (min) | machine CPU ms (median) |\n|---|---|---:|---:|---:|")
        for case, by_tree in got.items():
            for name, runs in by_tree.items():
                print(f"| {case} | {name if name == 'this' else other} | "
                      f"{statistics.median(w for w, _ in runs) * 1000:.0f} | {min(w for w, _ in runs) * 1000:.0f} | "
                      f"{statistics.median(c for _, c in runs) * 1000:.0f} |")
    finally:
        for env in envs.values():
            subprocess.run([sys.executable, "-P", "-c", RUN, "-i", str(b.inv_runs), "mux", "stop"],
                           capture_output=True, env=env)
        b.host.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
