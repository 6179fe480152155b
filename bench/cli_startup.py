"""`ctl --help` wall and CPU time, side by side with a bare interpreter start in the same run (CPU time, the
child's user + system, moves less than wall time on a machine other work shares).

    python3 bench/cli_startup.py [--repeat 20] [--against DIR]

--against DIR times the same commands from another checkout of ctl too (e.g. `git worktree add DIR REV`),
interleaved in the same run, so a change's effect on start-up is a ratio, not two runs' guesses.

The controller must stay light (never torch; fabric/paramiko/jinja2/matplotlib only inside commands):
target under 0.3 s wall on the 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def wall(argv: list[str], tree: str) -> tuple[float, float]:
    """One run of argv with `tree` first on the import path (its `controller` wins over an installed one):
    (wall seconds, CPU seconds)."""
    env = dict(os.environ, PYTHONPATH=tree)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, cwd=tree, env=env)
    t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return t1 - t0, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--against", default=None, help="another checkout of ctl to time side by side")
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    trees = {"": here, **({f" [{args.against}]": str(Path(args.against).resolve())} if args.against else {})}
    cases: dict[str, tuple[list[str], str]] = {"python -c pass": ([sys.executable, "-c", "pass"], here)}
    for tag, tree in trees.items():
        cases[f"ctl --help{tag}"] = ([sys.executable, "-m", "controller", "--help"], tree)
        cases[f"ctl deploy --help{tag}"] = ([sys.executable, "-m", "controller", "deploy", "--help"], tree)
        cases[f"ctl mux status{tag}"] = ([sys.executable, "-m", "controller", "mux", "status"], tree)
    # Interleave the cases so that machine load hits them alike.
    samples: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeat):
        for name, (argv, tree) in cases.items():
            w, c = wall(argv, tree)
            samples[name].append(w)
            cpu[name].append(c)
    base = statistics.median(samples["python -c pass"])
    cbase = statistics.median(cpu["python -c pass"])
    for name, vals in samples.items():
        med = statistics.median(vals)
        cmed = statistics.median(cpu[name])
        print(f"{name:<40} median {med * 1000:6.1f} ms  p90 {sorted(vals)[int(0.9 * len(vals))] * 1000:6.1f} ms"
              f"  ({med / base:.2f}x a bare interpreter)  cpu {cmed * 1000:6.1f} ms ({cmed / cbase:.2f}x)")
    heavy = subprocess.run([sys.executable, "-c", "import controller.launch.main, sys; "
                            "print(sorted(m for m in ('torch','fabric','paramiko','jinja2','matplotlib','proxmoxer')"
                            " if m in sys.modules))"], capture_output=True, text=True, check=True).stdout.strip()
    print(f"heavy modules loaded by `import controller.launch.main`: {heavy}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
