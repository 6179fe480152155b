"""`ctl --help` wall time, side by side with a bare interpreter start in the same run.

    python3 bench/cli_startup.py [--repeat 20] [--against DIR]

--against DIR times the same commands from another checkout of ctl too (e.g. `git worktree add DIR REV`),
interleaved in the same run, so a change's effect on start-up is a ratio, not two runs' guesses.

The controller must stay light (never torch; fabric/paramiko/jinja2/matplotlib only inside commands):
target under 0.3 s wall on the 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def wall(argv: list[str], tree: str) -> float:
    """One run of argv with `tree` first on the import path (its `controller` wins over an installed one)."""
    env = dict(os.environ, PYTHONPATH=tree)
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, cwd=tree, env=env)
    return time.perf_counter() - t0


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
    # Interleave the cases so that machine load hits them alike.
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeat):
        for name, (argv, tree) in cases.items():
            samples[name].append(wall(argv, tree))
    base = statistics.median(samples["python -c pass"])
    for name, vals in samples.items():
        med = statistics.median(vals)
        print(f"{name:<40} median {med * 1000:6.1f} ms  p90 {sorted(vals)[int(0.9 * len(vals))] * 1000:6.1f} ms"
              f"  ({med / base:.1f}x a bare interpreter)")
    heavy = subprocess.run([sys.executable, "-c", "import controller.cli.main, sys; "
                            "print(sorted(m for m in ('torch','fabric','paramiko','jinja2','matplotlib','proxmoxer')"
                            " if m in sys.modules))"], capture_output=True, text=True, check=True).stdout.strip()
    print(f"heavy modules loaded by `import controller.cli.main`: {heavy}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
