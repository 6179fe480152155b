"""Write the documentation's images from the code, not by hand:

    python scripts/docs_images.py            # both
    python scripts/docs_images.py plot       # docs/plot.png: `ctl plot`'s drawing of three runs
    python scripts/docs_images.py dashboard  # docs/dashboard.png: the dashboard test's screenshot

The plot is drawn by controller/core/plot.py from log lines in the training's own format, parsed by
controller/core/metrics.py as `ctl metrics pull` parses them: the seeds' three runs (21.5K, then 12.8K, then the bad
day's 4.6K tok/s against the 12.8K baseline). The screenshot is the one tests/test_dashboard.py takes of a live run
at 0.36x its baseline in headless Chromium (it needs tmux and chromium: scripts/setup.sh installs both).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PLOT = REPO / "docs" / "plot.png"
DASHBOARD = REPO / "docs" / "dashboard.png"


def log_lines(tok_s: float, steps: int, seed: int) -> str:
    """A run's log as the payload writes it: the compile warm-up's slow first steps, then a steady rate."""
    rng = random.Random(seed)  # fixed: the same image every time
    loss, out = 11.5, []
    for i in range(1, steps + 1):
        loss = max(0.5, loss * (0.985 + 0.004 * seed) - 0.005 + rng.uniform(-0.03, 0.03))
        rate = (600.0 if i <= 3 else tok_s) * (1 + rng.uniform(-0.03, 0.03))
        minutes = i - 1
        out.append(f"[{minutes}m] step={i} loss={loss:.4f} lr=3.0e-04 ({rate / 1000:.1f}Ktok/s) q_hs=[0] | ETA=1.0d")
    return "\n".join(out) + "\n"


def plot() -> None:
    from controller.core.metrics import parse_lines, points_of
    from controller.core.plot import plot_runs

    runs = {name: points_of(parse_lines(log_lines(rate, steps, seed)))
            for name, rate, steps, seed in (("fresh4", 21500, 60, 1), ("fresh5", 12800, 50, 2),
                                            ("fresh6", 4600, 30, 3))}
    plot_runs(runs, PLOT, ("fresh5", 12800.0), overwrite=True)
    print(f"wrote {PLOT.relative_to(REPO)}")


def dashboard() -> None:
    env = {**os.environ, "CTL_DASHBOARD_SCREENSHOT": str(DASHBOARD)}
    before = DASHBOARD.stat().st_mtime_ns if DASHBOARD.exists() else None
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_dashboard.py",
                        "-k", "live_runs"], cwd=REPO, env=env)
    if r.returncode != 0 or not DASHBOARD.exists() or DASHBOARD.stat().st_mtime_ns == before:
        sys.exit("docs_images: the dashboard test did not write a screenshot (it skips without tmux or chromium)")
    print(f"wrote {DASHBOARD.relative_to(REPO)}")


if __name__ == "__main__":
    which = sys.argv[1:] or ["plot", "dashboard"]
    for name in which:
        {"plot": plot, "dashboard": dashboard}[name]()
