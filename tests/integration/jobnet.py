"""Two containers as the nodes of one job on the local Proxmox host (CT 200 on pve1, CT 300 on pve2, sharing the
host's network namespace so node 0's rendezvous is reachable from the other), with an inventory, a work directory
and `ctl` for it: the fixtures of tests/integration/test_multinode_pve.py and the tests that need a job beside it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port
from tests.pvehost import PveHost

REPO = Path(__file__).resolve().parents[2]
ADDRESS = {200: "127.0.0.12", 201: "127.0.0.11", 300: "127.0.0.13"}


@pytest.fixture(scope="module")
def shared_net(pvehost: PveHost) -> Iterator[PveHost]:
    """CT 200 and CT 300 in the host's network namespace, the venv with torch bound read-only into them."""
    if subprocess.run([sys.executable, "-c", "import torch.distributed"], capture_output=True).returncode != 0:
        pytest.skip(f"{sys.executable} has no torch (the multi-node tests run torchrun in the containers)")
    binds = sorted({sys.prefix, sys.base_prefix} - {"/usr"})
    for vmid in (200, 300):
        pvehost.set_host_network(vmid, True, binds)
    try:
        yield pvehost
    finally:
        for vmid in (200, 300):
            pvehost.set_host_network(vmid, False)


@dataclass
class Job:
    dir: Path
    host: PveHost
    tag: str
    port: int
    env: dict[str, str]

    def ctl(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "controller", "-i", str(self.dir / "inventory.yaml"), *args],
                              capture_output=True, text=True, timeout=timeout, env=self.env)

    def ok(self, *args: str) -> str:
        r = self.ctl(*args)
        assert r.returncode == 0, f"ctl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def write(self, nodes: tuple[int, ...] = (200, 300), **train_args: Any) -> None:
        cts = {f"ct{v}": {"address": ADDRESS[v], "gpus": {}, "nccl": {"socket_ifname": "lo"}} for v in ADDRESS}
        self.host.write_inventory(
            self.dir / "inventory.yaml", containers=cts,
            jobs={"pair": {"nodes": [f"ct{v}" for v in nodes], "rdzv_port": self.port, "nproc_per_node": 1,
                           "preflight_timeout": 3}},
            payload=[{"src": "allreduce.py", "dest": f"/root/{self.tag}/train_dflash_pipeline.py"},
                     {"template": "templates/start_training.sh.j2", "dest": f"/root/{self.tag}/start_training.sh",
                      "mode": "0755"}],
            vars={"python": sys.executable, "train_args": {"steps": 0, "interval": 0.2, **train_args}},
            runs={"series": "mn", "session": self.tag, "log": f"/workspace/{self.tag}/train_{{run}}.log",
                  "dir": f"/workspace/{self.tag}/runs/{{run}}"})

    def log(self, vmid: int, run: str, suffix: str = "") -> Path:
        return self.host.rootfs(vmid) / "workspace" / self.tag / f"train_{run}.log{suffix}"

    def steps(self, vmid: int, run: str) -> dict[int, tuple[float, int, int]]:
        """step -> (all-reduce result, world size, global rank) as the node's log has them."""
        out = {}
        text = self.log(vmid, run).read_text(errors="replace") if self.log(vmid, run).exists() else ""
        for m in re.finditer(r"step=(\d+) .* allreduce=([\d.]+) rank=(\d+) world=(\d+)", text):
            out[int(m.group(1))] = (float(m.group(2)), int(m.group(4)), int(m.group(3)))
        return out

    def trainers(self, vmid: int) -> list[str]:
        """This test's training processes in the container (torchrun and its workers)."""
        node = self.host.node_of(vmid).name
        ps = subprocess.run(["lxc-attach", "-P", str(self.host.lxcpath(node)), "-n", str(vmid), "--", "ps", "-eo",
                             "pid,args"], capture_output=True, text=True, timeout=30).stdout
        return [line for line in ps.splitlines() if f"/root/{self.tag}/" in line and "python" in line]

    def attach(self, vmid: int, *argv: str) -> subprocess.CompletedProcess[str]:
        node = self.host.node_of(vmid).name
        return subprocess.run(["lxc-attach", "-P", str(self.host.lxcpath(node)), "-n", str(vmid), "--", *argv],
                              capture_output=True, text=True, timeout=30)


@pytest.fixture
def job(shared_net: PveHost, tmp_path: Path) -> Iterator[Job]:
    tag = "mn" + uuid.uuid4().hex[:6]
    shutil.copy(REPO / "tests" / "fakepayload" / "allreduce.py", tmp_path / "allreduce.py")
    (tmp_path / "templates").mkdir()
    shutil.copy(REPO / "templates" / "start_training.sh.j2", tmp_path / "templates" / "start_training.sh.j2")
    env = dict(os.environ, CTL_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=str(REPO))
    j = Job(tmp_path, shared_net, tag, free_port(), env)
    j.write()
    yield j
    for vmid in (200, 201, 300):  # nothing of this test may outlive it: its trainers, by pid
        pids = [line.split()[0] for line in j.trainers(vmid)]
        if pids:
            j.attach(vmid, "kill", "-9", *pids)
