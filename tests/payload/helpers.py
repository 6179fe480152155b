"""The payload's trainer run as the tests run it: torchrun on this CPU, one thread per rank."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "remote_payload" / "train_dflash_pipeline.py"


def torchrun(out: Path, *flags: str, targets: int = 1, drafters: int = 1, env=None, timeout=150):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={targets + drafters}",
           str(SCRIPT), "--targets", str(targets), "--drafters", str(drafters), "--device", "cpu", "--model", "tiny",
           "--out", str(out), *flags]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_CPU_THREADS": "1", "PYTHONFAULTHANDLER": "1",
         **(env or {})}  # xdist runs several
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # A hang: each rank (torchrun starts them in sessions of their own) prints its threads' stacks on SIGABRT
        # (faulthandler), so the failure shows where it waited.
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                ranks = [int(x) for x in f.read().split()]
        except OSError:
            ranks = []
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(3)
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun {' '.join(flags)}: not done after {timeout}s; its ranks' stacks:\n"
                             f"{stderr[-20000:]}\n--- stdout ---\n{stdout[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
