"""What choosing the runs to look at costs as a registry's history grows: `ctl status` (each container's live
runs, else its latest), `ctl supervise` (every live run, and the runs it saw go and has not seen end), against
reading every record and filtering, as ctl did before, side by side in the same run.

    python3 bench/registry_select.py [--runs 5000] [--repeat 5]

A registry in a temporary directory gets `--runs` finished runs over 20 containers (each with a verdict event),
then 20 live ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.commands.runs import whole_runs
from controller.commands.supervise import TERMINAL
from controller.registry import Registry

CTS = [f"ct{200 + i}" for i in range(20)]


def fill(reg: Registry, n: int) -> None:
    with reg.tx() as db:
        for i in range(n):
            db.execute("INSERT INTO runs (name, ct, created, state, files, vars, env) VALUES (?,?,?,?,?,?,?)",
                       (f"old{i}", CTS[i % len(CTS)], 1000.0 + i, "finished",
                        '{"/root/start_training.sh": "' + "ab" * 32 + '", "/root/train.py": "' + "cd" * 32 + '"}',
                        '{"lr": 0.0003, "steps": 10000}', '{"PYTHONUNBUFFERED": "1"}'))
            db.execute("INSERT INTO events (run_id, time, kind, to_verdict, summary, doc) "
                       "VALUES (last_insert_rowid(), ?, 'verdict', 'finished', 'done', '{}')", (2000.0 + i,))
    for ct in CTS:
        reg.claim_run("live", ct)


def status_before(reg: Registry) -> list[int]:
    out = []
    for ct in CTS:
        mine = whole_runs(reg, reg.runs(ct, limit=50))
        live = [r for r in mine if r.state.live]
        out += [r.id for r in (live or mine[:1])]
    return out


def status_now(reg: Registry) -> list[int]:
    out = []
    for ct in CTS:
        mine = reg.latest_whole(ct, 50)
        live = [rid for rid, state in mine if state.live]
        out += [reg.run_by_id(rid).id for rid in (live or [rid for rid, _ in mine[:1]])]
    return out


def supervise_before(reg: Registry) -> set[int]:
    watching = {r.id for r in reg.runs(None, limit=10_000) if r.state.live or (
        reg.last_verdict(r.id) or "") not in TERMINAL | {""}}
    watching |= {r.id for r in reg.runs(None, limit=10_000) if r.state.live}
    return watching


def supervise_now(reg: Registry) -> set[int]:
    watching = {r.id for r in reg.live_runs()} | {rid for rid, _ in reg.unsettled_runs(TERMINAL)}
    watching |= {r.id for r in reg.live_runs()}
    return watching


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        reg = Registry(Path(d) / "registry.sqlite3")
        fill(reg, args.runs)
        pairs: dict[str, tuple[Callable[[Registry], object], Callable[[Registry], object]]] = {
            "status: choose the runs of 20 containers": (status_before, status_now),
            "supervise --once: choose the runs to watch": (supervise_before, supervise_now),
        }
        print(f"{args.runs} finished runs + 20 live, medians of {args.repeat}:")
        for label, (before, now) in pairs.items():
            if before(reg) != now(reg):
                raise SystemExit(f"bench: {label}: the two ways chose different runs")
            got: dict[str, list[float]] = {"before": [], "now": []}
            for _ in range(args.repeat):
                for name, fn in (("before", before), ("now", now)):
                    t0 = time.perf_counter()
                    fn(reg)
                    got[name].append(time.perf_counter() - t0)
            b, n = statistics.median(got["before"]), statistics.median(got["now"])
            print(f"  {label:<45} every record {b * 1e3:8.1f} ms   now {n * 1e3:7.2f} ms   ({n / b:.3f}x)")
        reg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
