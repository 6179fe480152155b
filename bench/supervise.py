"""Detection latency of `ctl supervise`: from kill -9 of a trainer to the CRASHED event in the registry.

    python bench/supervise.py [--trials 10] [--interval 2]

On the `local` target (real tmux, the real agent, the fake payload of tests/fakepayload): one supervisor runs
in the background polling every --interval seconds; each trial launches a run, waits until the supervisor has
seen it, kills the trainer's process group with SIGKILL and times how long until `ctl events` holds the
CRASHED event. Goal (issue "unattended runs"): median <= interval + 2 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

REPO = Path(__file__).resolve().parents[1]
START = """#!/usr/bin/env bash
exec python3 {{ root }}{{ payload["emit_metrics.py"] }} --no-preamble --tok-s 12800 --steps 100000 --interval 0.05
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--interval", type=float, default=2.0)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="ctl-bench-supervise-"))
    shutil.copy(REPO / "tests" / "fakepayload" / "emit_metrics.py", d / "emit_metrics.py")
    (d / "start.sh.j2").write_text(START)
    (d / "root").mkdir()
    (d / "inventory.yaml").write_text(yaml.safe_dump({
        "containers": {"loc": {"transport": "local", "root": str(d / "root")}},
        "payload": [{"src": "emit_metrics.py", "dest": "/root/emit_metrics.py"},
                    {"template": "start.sh.j2", "dest": "/root/start_training.sh", "mode": "0755"}],
        "runs": {"series": "b", "session": "bench", "log": "/workspace/log_{run}.log", "dir": "/workspace/r/{run}"}}))
    env = dict(os.environ, CTL_STATE_DIR=str(d / "state"), TMUX_TMPDIR=str(d), PYTHONPATH=str(REPO))

    def ctl(*a: str) -> str:
        return subprocess.run([sys.executable, "-m", "controller", "-i", str(d / "inventory.yaml"), *a], env=env,
                              capture_output=True, text=True, check=True, cwd=d).stdout

    def verdicts(run: str) -> list[str]:
        """Read in-process from the registry (a `ctl events` per check would add its own start-up to the latency)."""
        from controller.registry import Registry

        reg = Registry(d / "state" / "registry.sqlite3")
        try:
            rid = reg.find_run(f"loc/{run}").id
            return [e.get("to") or "" for e in reg.events(rid) if e["kind"] == "verdict"]
        finally:
            reg.close()

    def crashed(run: str) -> bool:
        return "crashed" in verdicts(run)

    def seen(run: str) -> bool:
        return bool(verdicts(run))

    ctl("deploy", "--allow-dirty")
    sup = subprocess.Popen([sys.executable, "-m", "controller", "-i", str(d / "inventory.yaml"), "supervise",
                            "--interval", f"{args.interval}s"], env=env, cwd=d, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    latencies = []
    try:
        for i in range(1, args.trials + 1):
            run = f"b{i}"
            ctl("launch", "loc", "--run", run)
            while not seen(run):
                time.sleep(0.2)
            pid = int((d / "root" / "workspace" / f"log_{run}.log.pid").read_text())
            t0 = time.monotonic()
            os.killpg(pid, signal.SIGKILL)
            while not crashed(run):
                time.sleep(0.05)
            latencies.append(time.monotonic() - t0)
            print(f"trial {i}: {latencies[-1]:.2f} s", flush=True)
    finally:
        sup.send_signal(signal.SIGINT)
        sup.wait(timeout=60)
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True)
        shutil.rmtree(d, ignore_errors=True)
    med = statistics.median(latencies)
    print(f"kill -9 -> CRASHED event, {len(latencies)} trials, interval {args.interval:.0f} s: median {med:.2f} s, "
          f"max {max(latencies):.2f} s; goal <= interval + 2 s = {args.interval + 2:.0f} s: "
          + ("met" if med <= args.interval + 2 else "NOT met"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
