"""Helpers for end-to-end tests: a per-test inventory for the local Proxmox host, a `ctl` runner and a venv
inside a container. Helpers shared with the unit tests are in tests/conftest.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import GOOD, add_dist, end_sessions, install_torch
from tests.integration.jobnet import job, shared_net  # noqa: F401 (fixtures: CT 200 and CT 300 as the nodes of a job)
from tests.pvehost import PveHost

# --------------------------------------------------------------------------------------------
# A per-test inventory on the local Proxmox host (`pve_env`), the fake payload as its start script

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "tests" / "fakepayload" / "emit_metrics.py"

START_TEMPLATE = """\
#!/usr/bin/env bash
# test start script: the fake payload prints the seeds' log format
set -euo pipefail
echo "ctl run: $CTL_RUN in $CTL_RUN_DIR"
exec python3 {{ payload["emit_metrics.py"] }} --tok-s {{ tok_s }} --steps {{ steps }} --interval {{ interval }} \
  {{ extra }}
"""


@dataclass
class PveEnv:
    dir: Path
    inventory: Path
    state: Path
    tag: str
    host: PveHost
    env: dict[str, str]

    def ctl(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([sys.executable, "-m", "controller", "-i", str(self.inventory), *args],
                           capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and r.returncode != 0:
            raise AssertionError(f"ctl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def write(self, **extra: Any) -> None:
        doc = dict(self.base_extra)
        doc.update(extra)
        self.host.write_inventory(self.inventory, **doc)

    base_extra: dict[str, Any] = None  # type: ignore[assignment]


@pytest.fixture
def pve_env(pvehost: PveHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PveEnv]:
    """An inventory with a fake-payload start script; runs log under a per-test directory. ctl runs and the Pools
    a test makes share the test's state directory, whose persistent sessions end with the test."""
    tag = "t" + uuid.uuid4().hex[:8]
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "start_training.sh.j2").write_text(START_TEMPLATE)
    shutil.copy(FAKE, tmp_path / "emit_metrics.py")
    state = tmp_path / "state"
    monkeypatch.setenv("CTL_STATE_DIR", str(state))
    monkeypatch.delenv("CTL_PERSIST", raising=False)  # the default (sessions on) unless a test says otherwise
    env = dict(os.environ, CTL_STATE_DIR=str(state), PYTHONPATH=str(REPO))
    e = PveEnv(tmp_path, tmp_path / "inventory.yaml", state, tag, pvehost, env)
    e.base_extra = {
        "payload": [
            {"src": "emit_metrics.py", "dest": f"/root/{tag}/emit_metrics.py"},
            {"template": "templates/start_training.sh.j2", "dest": f"/root/{tag}/start_training.sh", "mode": "0755"},
        ],
        "vars": {"tok_s": 12800, "steps": 6, "interval": 0.05, "extra": "--no-preamble"},
        "runs": {"series": "fresh", "session": tag, "log": f"/workspace/{tag}/train_stdout_{{run}}.log",
                 "dir": f"/workspace/{tag}/runs/{{run}}"},
    }
    e.write()
    for vmid in (200, 201, 300):
        pvehost.set_gpus(vmid, count=8)
    try:
        yield e
    finally:
        end_sessions(state)
    for vmid in (200, 201, 300):  # leave the shared containers as the fixture found them
        pvehost.clear_gpus(vmid)
        if not pvehost.running(vmid):
            pvehost.start(vmid)
    pvehost.ssh("pve2", "pct", "exec", "300", "--", "sh", "-c", "rm -f /workspace/small/* /workspace/small/.[!.]*")


@pytest.fixture
def rootfs(pvehost: PveHost) -> Callable[[int], Path]:
    return pvehost.rootfs


# --------------------------------------------------------------------------------------------
# What a node's sshd is serving (connection reuse, leaks)


def children(pid: int) -> list[int]:
    """The processes whose parent is pid (scanned: /proc/PID/task/*/children needs a kernel option)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def sshd_sessions(env: PveEnv, node: str) -> set[int]:
    """PIDs of the SSH sessions a test-host node's sshd is serving now (its listener's children)."""
    listener = int((env.host.base / node / "sshd.pid").read_text().strip())
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(listener)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


# --------------------------------------------------------------------------------------------
# A venv inside a container: the host's python3, the seeds' good packages as dist-info (no real installs)


def container_venv(env: PveEnv, vmid: int = 200) -> tuple[str, Path]:
    """A --without-pip venv made from the host's python3 inside the container's private /root."""
    inside = f"/root/{env.tag}/venv"
    host_path = env.host.rootfs(vmid) / inside.lstrip("/")
    host_path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(host_path)], check=True)
    install_torch(host_path)
    for name, version in GOOD.items():
        add_dist(host_path, name, version)
    env.host.own_as_ct_root(vmid, host_path.parent, tree=True)  # as if made in the container (unprivileged too)
    return inside, host_path
