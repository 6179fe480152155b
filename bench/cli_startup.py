"""`ctl --help` wall time, side by side with a bare interpreter start in the same run.

    python3 bench/cli_startup.py [--repeat 20]

The controller must stay light (never torch; fabric/paramiko/jinja2/matplotlib only inside commands):
target under 0.3 s wall on the 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def wall(argv: list[str], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "ctl --help": [sys.executable, "-m", "controller", "--help"],
        "ctl deploy --help": [sys.executable, "-m", "controller", "deploy", "--help"],
    }
    # Interleave the cases so that machine load hits them alike.
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeat):
        for name, argv in cases.items():
            samples[name] += wall(argv, 1)
    base = statistics.median(samples["python -c pass"])
    for name, vals in samples.items():
        med = statistics.median(vals)
        print(f"{name:<20} median {med * 1000:6.1f} ms  p90 {sorted(vals)[int(0.9 * len(vals))] * 1000:6.1f} ms"
              f"  ({med / base:.1f}x a bare interpreter)")
    heavy = subprocess.run([sys.executable, "-c", "import controller.cli.main, sys; "
                            "print(sorted(m for m in ('torch','fabric','paramiko','jinja2','matplotlib','proxmoxer')"
                            " if m in sys.modules))"], capture_output=True, text=True, check=True).stdout.strip()
    print(f"heavy modules loaded by `import controller.cli.main`: {heavy}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
