"""`ctl env ...` on the local Proxmox host: a real venv inside a real LXC container (its /usr is the host's),
dist-info written by hand to replay the seeds' drift (SGLang added, torch cu130 -> cu128), probed through pct."""

from __future__ import annotations

import json

import pytest

from controller.errors import ExitCode
from tests.conftest import add_dist, install_torch
from tests.integration.conftest import PveEnv, container_venv

pytestmark = pytest.mark.pvehost


def test_check_lock_diff_and_launch_records(pve_env: PveEnv) -> None:
    inside, venv = container_venv(pve_env)
    # the venv works inside the container: its interpreter is the container's /usr/bin/python3
    out = pve_env.host.ssh("pve1", "pct", "exec", "200", "--", f"{inside}/bin/python", "-c",
                           "import sys; print(sys.prefix)")
    assert out.returncode == 0 and out.stdout.decode().strip() == inside
    lock = pve_env.dir / "env" / "ct200.lock"
    pve_env.write(containers={"ct200": {"vars": {"venv": inside}}})

    r = pve_env.ctl("env", "check", "ct200")
    assert r.returncode == ExitCode.INPUT and "ct200: no lock configured" in r.stderr

    probe = json.loads(pve_env.ctl("env", "probe", "ct200", "--json", check=True).stdout)
    assert probe["torch"]["version"] == "2.11.0+cu130" and len(probe["nvidia_smi"]["gpus"]) == 8
    text = pve_env.ctl("env", "probe", "ct200", check=True).stdout
    assert "2.11.0+cu130 (CUDA tag cu130" in text and "8: 0:" in text

    pve_env.ctl("env", "lock", "ct200", "-o", str(lock), check=True)
    assert "torch==2.11.0+cu130" in lock.read_text()
    pve_env.write(containers={"ct200": {"vars": {"venv": inside}, "lock": "env/ct200.lock"}})
    r = pve_env.ctl("env", "check", "ct200")
    assert r.returncode == 0 and "matches" in r.stdout, r.stdout + r.stderr

    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    r = pve_env.ctl("launch", "ct200", "--run", "fresh1", "-f")
    assert r.returncode == 0, r.stdout + r.stderr

    # the seeds' drift: SGLang into the training venv, torch swapped to the cu128 build
    add_dist(venv, "sglang", "0.5.5")
    install_torch(venv, "2.11.0+cu128", "12.8")
    r = pve_env.ctl("env", "check", "ct200")
    assert r.returncode == ExitCode.ENV_MISMATCH, r.stdout + r.stderr
    assert "sglang: 0.5.5 installed, not in the lock" in r.stdout
    assert "torch: locked 2.11.0+cu130, found 2.11.0+cu128 (build tag cu130 -> cu128)" in r.stdout

    live = pve_env.ctl("env", "diff", "fresh1", "ct200")
    assert live.returncode == 1
    assert "+ sglang 0.5.5" in live.stdout and "~ torch 2.11.0+cu130 -> 2.11.0+cu128" in live.stdout

    # a launch over the drifted venv records the new probe; ctl diff names the change
    pve_env.write(containers={"ct200": {"vars": {"venv": inside}}})  # no lock: launch is allowed
    r = pve_env.ctl("launch", "ct200", "--run", "fresh2", "-f")
    assert r.returncode == 0, r.stdout + r.stderr
    d = pve_env.ctl("diff", "fresh1", "fresh2")
    assert d.returncode == 1
    assert "+ sglang 0.5.5" in d.stdout and "build tag cu130 -> cu128" in d.stdout, d.stdout
    runs = {x["name"]: x for x in json.loads(pve_env.ctl("runs", "--json", check=True).stdout)}
    assert runs["fresh1"]["env_fingerprint"] != runs["fresh2"]["env_fingerprint"]
    assert runs["fresh1"]["env_fingerprint"] == probe["fingerprint"]
    assert pve_env.ctl("env", "diff", "fresh2", "ct200").returncode == 0

    # locking the new state makes it the reference; an existing lock is never overwritten silently
    r = pve_env.ctl("env", "lock", "ct200", "-o", str(lock))
    assert r.returncode == ExitCode.CLOBBER
    pve_env.ctl("env", "lock", "ct200", "-o", str(lock), "--force", check=True)
    pve_env.write(containers={"ct200": {"vars": {"venv": inside}, "lock": "env/ct200.lock"}})
    assert pve_env.ctl("env", "check", "ct200").returncode == 0


def test_sync_without_uv_is_a_clear_error_and_changes_nothing(pve_env: PveEnv) -> None:
    inside, venv = container_venv(pve_env, 201)
    lock = pve_env.dir / "env" / "ct201.lock"
    pve_env.write(containers={"ct201": {"vars": {"venv": inside}}})
    pve_env.ctl("env", "lock", "ct201", "-o", str(lock), check=True)
    pve_env.write(containers={"ct201": {"vars": {"venv": inside}, "lock": "env/ct201.lock"}})
    add_dist(venv, "flashinfer-python", "0.5.2")
    dry = pve_env.ctl("env", "sync", "ct201", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "take a snapshot first: ctl snapshot ct201 pre-sync-" in dry.stdout
    assert "pct exec 201 -- uv venv --python" in dry.stdout and "uv is not installed in ct201" in dry.stdout
    r = pve_env.ctl("env", "sync", "ct201", "--yes")
    assert r.returncode == ExitCode.FAILURE
    assert "ct201: uv is not installed in the container (looked for uv, /root/.local/bin/uv" in r.stderr
    assert venv.is_dir() and not venv.is_symlink()
    assert not list(venv.parent.glob("venv-*"))
