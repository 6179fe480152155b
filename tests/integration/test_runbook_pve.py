"""A short runbook over the local Proxmox host: deploy into CT 200 through real sshd and the simulated `pct`,
launch the next run of the series in real tmux, watch it until step N, mark it good; then a dry run that
changes nothing. The whole runbook stays well under 30 s."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost

RUNBOOK = """\
name: pve-relaunch
vars: {ct: ct200, n: 10}
steps:
  - deploy: {containers: ["{{ ct }}"], allow_dirty: true}
  - launch: {ct: "{{ ct }}", run: null}
  - watch: {run: "{{ run }}", until_step: "{{ n }}", for: 25s, every: 0.5s}
    on:
      CRASHED: [{fail: "{{ run }} crashed"}]
  - mark-good: {run: "{{ run }}"}
"""


def test_deploy_launch_watch_mark_good_over_pct(pve_env: PveEnv) -> None:
    pve_env.write(vars={**pve_env.base_extra["vars"], "steps": 40, "interval": 0.05})
    rb = pve_env.dir / "pve.yaml"
    rb.write_text(RUNBOOK)
    assert pve_env.ctl("runbook", "check", str(rb), check=True).stdout.startswith(f"{rb}: ok: runbook pve-relaunch")

    # the watch ends on the run's progress, not on its 25 s limit: its line says which ("watched for 25s" when it
    # ran out), no clock needed (how fast it went is for bench/)
    r = pve_env.ctl("runbook", "run", str(rb), check=True)
    lines = r.stdout.splitlines()[1:]
    assert [ln.split()[0] for ln in lines[:4]] == ["steps[0]", "steps[1]", "steps[2]", "steps[3]"], r.stdout
    assert "deploy ct200" in lines[0] and "deployed 2 of 2 files, verified" in lines[0]
    assert "launch ct200" in lines[1] and "fresh1: tmux session" in lines[1]
    assert "watch fresh1" in lines[2] and ("reached step" in lines[2] or "run ended (finished)" in lines[2])
    assert "watched for" not in lines[2], lines[2]
    assert "mark-good fresh1" in lines[3] and "marked good" in lines[3]
    assert lines[-1] == "runbook pve-relaunch: ok (4 steps)"

    runs = json.loads(pve_env.ctl("--json", "runs", check=True).stdout)
    assert [(x["ct"], x["name"], x["good"]) for x in runs] == [("ct200", "fresh1", True)]
    hist = json.loads(pve_env.ctl("--json", "runbook", "history", check=True).stdout)
    assert len(hist) == 1 and hist[0]["outcome"] == "ok" and hist[0]["exit_code"] == 0

    # A dry run names the next run of the series and changes nothing: no run, no history, files as they are.
    r = pve_env.ctl("runbook", "run", str(rb), "--dry-run", "--var", "n=3", check=True)
    assert "up to date" in r.stdout or "would change 0 of 2 files" in r.stdout
    assert "would launch fresh2 on ct200" in r.stdout and "would watch fresh2 until step 3 or 25s" in r.stdout
    assert len(json.loads(pve_env.ctl("--json", "runs", "--no-refresh", check=True).stdout)) == 1
    assert len(json.loads(pve_env.ctl("--json", "runbook", "history", check=True).stdout)) == 1
