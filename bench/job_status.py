"""`ctl status` of a run across two containers with weeks of history: job_status reading each node's newest
steps (monitor._job_points) against decoding every stored point, side by side on one real SQLite registry.

    python bench/job_status.py [--points 30000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controller.commands import monitor  # noqa: E402
from controller.core.metrics import parse_line  # noqa: E402
from controller.registry import Registry  # noqa: E402

LINE = "[23m] step=%d loss=10.6894 lr=3.0e-04 tgt=0.11b/s dft=0.11b/s (4.6Ktok/s) q_hs=[0] | ETA=36.9d"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=30_000, help="points per node (default 30,000: 36 days at 100 s)")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reg = Registry(Path(tmp) / "r.sqlite3")
        run, members = reg.claim_job_run("j1", "pair", [("ct200", "pve1"), ("ct300", "pve2")], session="s",
                                         log_path="/l", run_dir="/d")
        recs = [p.record() for p in (parse_line(LINE % i) for i in range(1, a.points + 1)) if p is not None]
        for m in members:
            reg.advance_cursor(m.id, (0, None), 1, "1:1:x", b"", recs)
        run = reg.run_by_id(run.id)
        whole_max = monitor.JOB_WHOLE_MAX
        times: dict[str, list[float]] = {"all points": [], "newest steps": []}
        verdicts = {}
        for _ in range(a.repeat):  # interleaved
            for case, limit in (("all points", 10**12), ("newest steps", whole_max)):
                monitor.JOB_WHOLE_MAX = limit
                t0 = time.perf_counter()
                st = monitor.job_status(run, reg, ("ct/b", 12800.0), {}, slow_ratio=0.8, stall_after_s=1e9)
                times[case].append(time.perf_counter() - t0)
                verdicts[case] = st.verdict.reason
        monitor.JOB_WHOLE_MAX = whole_max
    assert verdicts["all points"] == verdicts["newest steps"], verdicts
    base = statistics.median(times["all points"])
    print(f"job_status of a 2-node run, {a.points:,} points per node, medians of {a.repeat}:")
    for case, ts in times.items():
        m = statistics.median(ts)
        print(f"  {case:<13} {m * 1000:8.1f} ms  ({m / base:.3f}x)")
    print(f"  verdict (both): {verdicts['all points']}")


if __name__ == "__main__":
    main()
