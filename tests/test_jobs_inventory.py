"""Jobs (one run across several containers): the inventory shape, its errors (one line naming file, line and
key), each node's start script as the shipped template renders it, and `ctl deploy JOB` / `--check` on two
`local` containers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.core.render import context, render
from controller.errors import ExitCode
from controller.inventory import load
from tests.conftest import inventory_error as error_of
from tests.conftest import write_inventory as write

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "templates" / "start_training.sh.j2"

GOOD = """\
hosts:
  pve1: {address: 192.0.2.1}
  pve2: {address: 192.0.2.2}
containers:
  ct200:
    host: pve1
    vmid: 200
    address: 192.0.2.12
    gpus: {target: [0, 1], drafter: [2]}
    nccl: {socket_ifname: "=eth0", ib_disable: true}
  ct300:
    host: pve2
    vmid: 300
    address: 192.0.2.13
    gpus: {target: [4, 5], drafter: [6]}
  solo:
    host: pve2
    vmid: 301
    gpus: {target: [0, 1], drafter: [2]}
groups:
  all: [ct200, ct300, solo]
jobs:
  pair:
    nodes: [ct200, ct300]
    rdzv_port: 29411
    nccl: {p2p_disable: true, ib_disable: false}
payload:
  - {src: a.py, dest: /root/train_dflash_pipeline.py}
  - {template: start.j2, dest: /root/start_training.sh, mode: "0755"}
"""


def rendered(tmp_path: Path, text: str, ct: str) -> str:
    inv = load(write(tmp_path, text))
    return render(TEMPLATE, context(inv, inv.container(ct))).decode()


def test_a_job_names_its_nodes_in_order(tmp_path: Path) -> None:
    inv = load(write(tmp_path, GOOD))
    job = inv.job("pair")
    assert [c.name for c in job.nodes] == ["ct200", "ct300"]
    assert job.rdzv_endpoint == "192.0.2.12:29411" and job.master_addr == "192.0.2.12" and job.nnodes == 2
    assert [c.name for c in inv.select(["pair"])] == ["ct200", "ct300"]  # deploy/ping/status take a job too
    assert [c.name for c in inv.select(["pair", "all"])] == ["ct200", "ct300", "solo"]
    assert inv.job_of("ct300") is not None and inv.job_of("ct300").rank("ct300") == 1  # type: ignore[union-attr]
    assert inv.job_of("solo") is None
    assert inv.model.jobs["pair"].nproc_per_node == "auto" and inv.model.jobs["pair"].preflight_timeout == 10


@pytest.mark.parametrize(("change", "expected"), [
    (("nodes: [ct200, ct300]", "nodes: [ct200, ct999]"),
     "INV:24: jobs.pair.nodes[1]: unknown container 'ct999' (containers: ct200, ct300, solo)"),
    (("    address: 192.0.2.13\n", ""),
     "INV:11: containers.ct300: ct300 is a node of job 'pair' and needs `address:`, where the other nodes "
     "reach it"),
    (("address: 192.0.2.13", "address: 'x; rm -rf /'"),
     "INV:14: containers.ct300.address: 'x; rm -rf /' is not a host name or an IP address"),
    (("target: [4, 5], drafter: [6]", "target: [4], drafter: [6]"),
     "INV:24: jobs.pair.nodes[1]: ct300 has 1 target(s) and 1 drafter(s), ct200 has 2 and 1: every node of a "
     "job runs the same command, so give them the same GPU split"),
    (("  pair:\n", "  all:\n"), "INV:23: jobs.all: a job may not share a container's or a group's name"),
    (("rdzv_port: 29411", "rdzv_port: 0"), "INV:25: jobs.pair.rdzv_port: must be >= 1, not 0"),
    (("rdzv_port: 29411", "rdzv_port: 29411\n    nproc_per_node: 0"),
     "INV:26: jobs.pair.nproc_per_node: must be at least 1, or 'auto'"),
    (("rdzv_port: 29411", "rdzv_port: 29411\n    nproc_per_node: all"),
     "INV:26: jobs.pair.nproc_per_node: must be an integer or 'auto', not 'all'"),
    (('socket_ifname: "=eth0"', 'socket_ifname: "eth0; reboot"'),
     "INV:10: containers.ct200.nccl.socket_ifname: 'eth0; reboot' is not an interface list such as 'eth0', "
     "'=eth0', '^docker,lo'"),
    (("nodes: [ct200, ct300]", "nodes: []"), "INV:24: jobs.pair.nodes: must have at least 1 item(s)"),
])
def test_bad_jobs_are_one_line_naming_file_line_and_key(tmp_path: Path, change: tuple[str, str],
                                                         expected: str) -> None:
    text = GOOD.replace(*change)
    assert text != GOOD
    assert error_of(tmp_path, text) == expected


def test_a_container_is_a_node_of_one_job(tmp_path: Path) -> None:
    text = GOOD.replace("payload:", "  other:\n    nodes: [ct300]\npayload:")
    assert error_of(tmp_path, text) == ("INV:28: jobs.other.nodes[0]: ct300 is already a node of job 'pair'; a "
                                        "container is a node of one job (its start script is rendered for it)")


def test_a_lone_container_renders_exactly_as_before(tmp_path: Path) -> None:
    out = rendered(tmp_path, GOOD, "solo")
    assert "exec python3 -m torch.distributed.run --standalone --nproc-per-node=3 \\\n" in out
    assert "rdzv" not in out and "NCCL_SOCKET_IFNAME" not in out and "CTL_NODE_RANK" not in out
    assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0


def test_each_node_renders_its_place_in_the_rendezvous(tmp_path: Path) -> None:
    node0, node1 = rendered(tmp_path, GOOD, "ct200"), rendered(tmp_path, GOOD, "ct300")
    for out in (node0, node1):
        assert "--nnodes=2 --nproc-per-node=3 \\\n  --rdzv-backend=c10d --rdzv-endpoint=192.0.2.12:29411 " \
               '--rdzv-id="$RUN" \\\n' in out
        assert "--standalone" not in out
        assert "export NCCL_P2P_DISABLE=1\n" in out  # the job's default
        assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0
    assert "--rdzv-conf=is_host=1 --local-addr=192.0.2.12 --max-restarts=0" in node0
    assert "--rdzv-conf=is_host=0 --local-addr=192.0.2.13 --max-restarts=0" in node1
    assert "export CTL_NODE_RANK=0 CTL_NNODES=2" in node0 and "export CTL_NODE_RANK=1 CTL_NNODES=2" in node1
    # the container's own nccl keys win over the job's; gloo (CPU) gets the interface too
    assert ("export GLOO_SOCKET_IFNAME==eth0\nexport NCCL_IB_DISABLE=1\nexport NCCL_P2P_DISABLE=1\n"
            "export NCCL_SOCKET_IFNAME==eth0\n") in node0
    assert "NCCL_SOCKET_IFNAME" not in node1 and "export NCCL_IB_DISABLE=0\n" in node1
    # the same training arguments on every node (torchrun runs one command everywhere)
    tail0, tail1 = node0.split("--max-restarts=0")[1], node1.split("--max-restarts=0")[1]
    assert tail0 == tail1


def test_a_one_node_job_is_standalone_and_ipv6_endpoints_are_bracketed(tmp_path: Path) -> None:
    one = GOOD.replace("nodes: [ct200, ct300]", "nodes: [ct200]")
    out = rendered(tmp_path, one, "ct200")
    assert "--standalone --nproc-per-node=3" in out and "rdzv" not in out
    v6 = GOOD.replace("address: 192.0.2.12", "address: 'fd00::12'").replace("rdzv_port: 29411",
                                                                            "rdzv_port: 29411\n    nproc_per_node: 1")
    out = rendered(tmp_path, v6, "ct300")
    assert "--rdzv-endpoint='[fd00::12]:29411'" in out and "--nproc-per-node=1 " in out


# --- ctl deploy JOB on two `local` containers -----------------------------------------------------------

START = """\
#!/usr/bin/env bash
# node {{ job.node_rank }} of {{ job.nnodes }}, rendezvous {{ job.rdzv_endpoint }}
exec python3 {{ root }}{{ payload["a.py"] }}
"""


def _ctl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CTL_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "controller", "-i", str(tmp_path / "inventory.yaml"), *args],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)


def test_deploy_a_job_renders_every_node_and_check_names_the_drifted_one(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("print('hello')\n")
    (tmp_path / "start.j2").write_text(START)
    doc = {
        "containers": {n: {"transport": "local", "root": f"roots/{n}", "address": "127.0.0.1"} for n in ("n0", "n1")},
        "jobs": {"duo": {"nodes": ["n0", "n1"], "rdzv_port": 29499}},
        "payload": [{"src": "a.py", "dest": "/root/a.py"},
                    {"template": "start.j2", "dest": "/root/start_training.sh", "mode": "0755"}],
    }
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(doc))
    for n in ("n0", "n1"):
        (tmp_path / "roots" / n).mkdir(parents=True)
    r = _ctl(tmp_path, "deploy", "duo", "--allow-dirty")
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines() if line.strip()] == ["n0", "n1"]
    starts = [(tmp_path / "roots" / n / "root" / "start_training.sh").read_text() for n in ("n0", "n1")]
    assert "# node 0 of 2, rendezvous 127.0.0.1:29499" in starts[0]
    assert "# node 1 of 2, rendezvous 127.0.0.1:29499" in starts[1]
    same = [(tmp_path / "roots" / n / "root" / "a.py").read_bytes() for n in ("n0", "n1")]
    assert same[0] == same[1] == b"print('hello')\n"
    assert _ctl(tmp_path, "deploy", "duo", "--check").returncode == 0
    (tmp_path / "roots" / "n1" / "root" / "a.py").write_text("print('edited by hand')\n")
    r = _ctl(tmp_path, "deploy", "duo", "--check")
    assert r.returncode == int(ExitCode.DRIFT)
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["n0", "no", "drift"]
    assert lines[1].startswith("n1") and "DRIFT in 1 file(s)" in lines[1] and "/root/a.py" in lines[2]
    shutil.rmtree(tmp_path / "roots")
