"""One client of ctl's agent per container for a whole command, on the local Proxmox host: a deploy of three
containers (two of them on one host) and a launch each speak to every container's agent through one client,
with the user's persistent sessions and without (CTL_PERSIST=0: the host relay a fan-out starts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import COUNTED, wait_for
from tests.integration.conftest import PveEnv
from tests.integration.jobnet import Job  # its fixtures (job: CT 200 and 300 as a job): conftest.py

pytestmark = pytest.mark.pvehost


def counted(pve_env: PveEnv, *args: str, persist: str | None) -> dict[str, int]:
    out = pve_env.dir / "agents.json"
    env = dict(pve_env.env, **({"CTL_PERSIST": persist} if persist is not None else {}))
    r = subprocess.run([sys.executable, "-c", COUNTED, str(out), "-i", str(pve_env.inventory), *args],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    made: dict[str, int] = json.loads(out.read_text())
    return made


@pytest.mark.parametrize("persist", [None, "0"], ids=["sessions", "no-sessions"])
def test_a_deploy_and_a_launch_make_one_agent_client_per_container(pve_env: PveEnv, persist: str | None) -> None:
    assert counted(pve_env, "deploy", "ct200", "ct201", "ct300", "--allow-dirty", persist=persist) == {
        "ct200": 1, "ct201": 1, "ct300": 1}
    assert counted(pve_env, "launch", "ct200", "--run", f"one{persist or 'x'}", persist=persist) == {"ct200": 1}
    pve_env.ctl("stop", f"one{persist or 'x'}", "--grace", "5")


def test_a_job_launch_speaks_to_each_node_through_one_agent_client(job: Job) -> None:
    """`ctl launch JOB` fans out to its nodes several times (preflight, the series, the claim, the start, the
    look after): each time the Pool gives the same transport for a node, so one client serves it throughout."""
    job.ok("deploy", "pair", "--allow-dirty")
    out = job.dir / "agents.json"
    r = subprocess.run([sys.executable, "-c", COUNTED, str(out), "-i", str(job.dir / "inventory.yaml"), "launch",
                        "pair", "--run", "one1"], capture_output=True, text=True, timeout=180, env=job.env)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    try:
        assert json.loads(out.read_text()) == {"ct200": 1, "ct300": 1}
    finally:
        job.ok("stop", "one1", "--grace", "10")
        wait_for("no trainer left", lambda: not job.trainers(200) and not job.trainers(300), timeout=30)
