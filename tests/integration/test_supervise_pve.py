"""`ctl supervise` against the local Proxmox host: a host whose sshd stops answering is UNREACHABLE, never a
crash and never restarted; when it answers again the run's real state is read and reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.integration.conftest import PveEnv, sshd_sessions

pytestmark = pytest.mark.pvehost


def supervise(env: PveEnv) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "controller", "-i", str(env.inventory), "supervise", "--once", "--restart",
           "on-failure", "--backoff", "1s"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env.env)


def test_a_silent_host_is_unreachable_never_restarted_and_back_to_ok(pve_env: PveEnv) -> None:
    doc = dict(pve_env.base_extra)
    doc["vars"] = {**doc["vars"], "steps": 100000, "interval": 0.2}
    pve_env.host.write_inventory(pve_env.inventory, **doc, hosts={"pve1": {"timeout": 3, "connect_timeout": 3}})
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    pve_env.ctl("launch", "ct200", "--run", "s1", check=True)
    listener = int((pve_env.host.base / "pve1" / "sshd.pid").read_text())
    try:
        assert supervise(pve_env).returncode == 0
        # The host goes silent: new connections are never answered, nor is the persistent session's own.
        frozen = [listener, *sshd_sessions(pve_env, "pve1")]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            r = supervise(pve_env)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "-> UNREACHABLE" in r.stdout and "not a crash, not restarted" in r.stdout, r.stdout
        back = supervise(pve_env)
        assert "UNREACHABLE -> " in back.stdout and "CRASHED" not in back.stdout, back.stdout
        evs = json.loads(pve_env.ctl("--json", "events", "s1", check=True).stdout)
        assert [e["to"] for e in evs if e["kind"] == "verdict"][-2:][0] == "unreachable"
        assert not any(e["kind"] == "restart" for e in evs)
        runs = json.loads(pve_env.ctl("--json", "runs", check=True).stdout)
        assert [(x["name"], x["state"]) for x in runs] == [("s1", "running")]
    finally:
        pve_env.ctl("stop", "s1", "--grace", "1")
