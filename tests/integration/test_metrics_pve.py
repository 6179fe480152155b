"""Metrics over the local Proxmox test host: a 4.6K run against a 12.8K baseline in CT 200 through real SSH
and the simulated `pct exec`, judged SLOW; a second pull moves only a header; the log stops -> STALLED."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from controller.errors import ExitCode
from tests.pvehost import PveHost

pytestmark = pytest.mark.pvehost

REPO = Path(__file__).resolve().parents[2]
START = """\
#!/usr/bin/env bash
set -euo pipefail
exec python3 {{ payload["emit_metrics.py"] }} --no-preamble --jitter 0 $(cat /root/{{ tag }}/args/$CTL_RUN)
"""


def test_slow_against_baseline_incremental_pull_and_stall_over_pct(pvehost: PveHost, tmp_path: Path) -> None:
    tag = "m" + uuid.uuid4().hex[:8]
    shutil.copy(REPO / "tests" / "fakepayload" / "emit_metrics.py", tmp_path / "emit_metrics.py")
    (tmp_path / "start_training.sh.j2").write_text(START)
    inv = pvehost.write_inventory(
        tmp_path / "inventory.yaml",
        payload=[{"src": "emit_metrics.py", "dest": f"/root/{tag}/emit_metrics.py"},
                 {"template": "start_training.sh.j2", "dest": f"/root/{tag}/start_training.sh", "mode": "0755"}],
        vars={"tag": tag},
        runs={"series": "fresh", "session": tag, "log": f"/workspace/{tag}/train_stdout_{{run}}.log",
              "dir": f"/workspace/{tag}/runs/{{run}}"},
    )
    pvehost.start(200)
    pvehost.set_gpus(200, count=8)
    env = dict(os.environ, CTL_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=str(REPO))
    args_dir = pvehost.rootfs(200) / "root" / tag / "args"

    def ctl(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "controller.launch.main", "-i", str(inv), *a], capture_output=True,
                              text=True, timeout=60, env=env)

    def launch(run: str, args: str, *extra: str) -> None:
        args_dir.mkdir(parents=True, exist_ok=True)
        (args_dir / run).write_text(args)
        r = ctl("launch", "ct200", "--run", run, *extra)
        assert r.returncode == 0, r.stdout + r.stderr

    def status(*a: str) -> tuple[int, dict[str, Any]]:
        r = ctl("--json", "status", "ct200", *a)
        assert r.returncode in (0, 21, 22), r.stderr
        return r.returncode, json.loads(r.stdout)[0]

    assert ctl("deploy", "ct200", "--allow-dirty").returncode == 0
    launch("fresh1", "--tok-s 12800 --steps 10 --interval 0.02", "-f")
    assert ctl("mark-good", "fresh1").returncode == 0
    # 0.4 s a step: the verdict must come within the first steady window however slow each `ctl status` is.
    launch("fresh2", "--tok-s 4600 --steps 100 --interval 0.4 --stall-after 40")
    try:
        deadline = time.monotonic() + 30
        while True:
            rc, row = status("--stall-after", "1h")
            if row["verdict"] != "warmup" or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert row["verdict"] == "slow" and rc == ExitCode.SLOW, row
        assert row["ratio"] == pytest.approx(4.6 / 12.8, abs=0.01) and row["baseline"] == "ct200/fresh1"
        assert row["step"] <= 3 + 20
        # The payload stops printing after step 40 but stays alive: STALLED once the log is quiet.
        deadline = time.monotonic() + 40
        while status("--stall-after", "1h")[1]["step"] < 40 and time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(1.2)
        rc, row = status("--stall-after", "1s")
        assert rc == ExitCode.STALLED and row["verdict"] == "stalled", row
        # Incremental: the log no longer grows, so a pull moves a header and no log bytes.
        doc = json.loads(ctl("--json", "metrics", "pull", "fresh2").stdout)
        assert doc["fetched"] == 0 and doc["offset"] == doc["size"] and doc["wire_out"] < 2048
    finally:
        ctl("stop", "fresh2", "--grace", "1")
