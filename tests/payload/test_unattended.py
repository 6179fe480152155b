"""The unattended run, end to end on the `local` target: the real tiny DFlash pipeline (torch on CPU) under
`ctl supervise --restart on-failure`, its trainer killed with SIGKILL twice; the lineage fresh1 -> fresh2 ->
fresh3 finishes on its own, each relaunch resuming from the newest complete checkpoint, and the steps of the
three logs join into one curve."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import faulthandler_env, interrupt

REPO = Path(__file__).resolve().parents[2]
STEPS = 100

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def test_a_run_killed_twice_finishes_on_its_own(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("typer")  # ctl's own dependencies (a GPU machine may hold only the payload's)
    inv = yaml.safe_load((REPO / "inventory.yaml").read_text())
    for entry in inv["payload"]:
        src = entry.get("src") or entry.get("template")
        (tmp_path / src).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / src, tmp_path / src)
    local = dict(inv["containers"]["local"], root=str(tmp_path / "root"))
    local["vars"] = dict(local["vars"], python=sys.executable, train_args={
        "model": "tiny", "steps": STEPS, "seq-len": 64, "batch-size": 2, "num-anchors": 8, "drafter-layers": 1,
        "log-every": 5, "no-compile": True, "ckpt-every": 10})
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(
        {"containers": {"local": local}, "payload": inv["payload"], "runs": inv["runs"]}))
    env = dict(os.environ, CTL_STATE_DIR=str(tmp_path / "state"), TMUX_TMPDIR=str(tmp_path),
               CTL_NOTIFY_RETRIES="0.1", PYTHONPATH=str(REPO))

    def ctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=300)
        assert not check or r.returncode == 0, f"ctl {' '.join(args)}: {r.stdout}\n{r.stderr}"
        return r

    def log(run: str) -> Path:
        return tmp_path / "root" / "workspace" / f"train_stdout_{run}.log"

    def last_step(run: str) -> int:
        text = log(run).read_text(errors="replace") if log(run).exists() else ""
        return max((int(s) for s in re.findall(r"step=(\d+)", text)), default=0)

    def wait(cond: object, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not cond():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.5)

    def resumed_from(run: str) -> int:
        found = re.search(r"resumed from step (\d+)", log(run).read_text())
        assert found, f"{run} did not say where it resumed:\n{log(run).read_text()[:3000]}"
        return int(found.group(1))

    def kill(run: str, past: int) -> None:
        wait(lambda: last_step(run) >= past, f"{run} past step {past}")
        os.killpg(int(Path(str(log(run)) + ".pid").read_text()), signal.SIGKILL)

    ctl("deploy", "local", "--allow-dirty")
    ctl("launch", "local")
    sup = subprocess.Popen([sys.executable, "-m", "controller", "supervise", "--interval", "1s", "--restart",
                            "on-failure:3", "--backoff", "1s"], cwd=tmp_path, env=faulthandler_env(env),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        kill("fresh1", 25)
        wait(lambda: "resumed from step" in (log("fresh2").read_text() if log("fresh2").exists() else ""),
             "fresh2 resuming")
        kill("fresh2", resumed_from("fresh2") + 15)  # past its next checkpoint (every 10): fresh3 resumes later
        wait(lambda: Path(str(log("fresh3")) + ".exit").exists(), "fresh3 to finish", timeout=300)
    finally:
        out, _ = interrupt(sup, 60)
    assert "relaunched as fresh2" in out and "relaunched as fresh3" in out, out
    assert Path(str(log("fresh3")) + ".exit").read_text().strip() == "0"
    tree = ctl("runs", "--tree").stdout
    assert re.search(r"fresh1 \(failed 137\) -> fresh2 \(failed 137, from step \d+\) -> fresh3 \(finished 0, "
                     r"from step \d+\)", tree), tree
    resumed = [resumed_from("fresh2"), resumed_from("fresh3")]
    assert 0 < resumed[0] < resumed[1] < STEPS
    # One curve: each run's metric points continue where the checkpoint it resumed from left off.
    steps = {}
    for run in ("fresh1", "fresh2", "fresh3"):
        ctl("metrics", "pull", run)
        doc = json.loads(ctl("--json", "show", run).stdout)
        pts = [json.loads(x) for x in ctl("metrics", "export", run, "--format", "jsonl", "--no-pull").stdout.split(
            "\n") if x.strip()]
        steps[run] = [p["step"] for p in pts]
        assert doc["resumed_step"] in (None, *resumed)
    assert min(steps["fresh2"]) > resumed[0] and min(steps["fresh3"]) > resumed[1]
    assert max(steps["fresh3"]) == STEPS
    ctl("plot", "fresh1", "fresh2", "fresh3", "-o", str(tmp_path / "lineage.png"), "--no-baseline")
    assert (tmp_path / "lineage.png").stat().st_size > 1000
