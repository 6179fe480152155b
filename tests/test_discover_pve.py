"""`ctl inventory discover` against the test host's HTTPS API (tests/pvehost/api.py): two nodes, CT 201 moved to
pve2 (its config now lives there), GPUs passed through as devN keys (CT 200) and raw mount entries (CT 300), CT
301 without GPUs; --diff, then --write through the `api:` of an inventory host, then up to date."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from controller import inventory
from controller.registry import Registry
from tests.pvehost import PveHost

pytestmark = pytest.mark.pvehost
REPO = Path(__file__).resolve().parent.parent


def _insert(conf: Path, lines: list[str]) -> None:
    """Add lines to the current section (before any [snapshot] section), as pct set would."""
    text = conf.read_text().splitlines()
    cut = next((i for i, ln in enumerate(text) if ln.startswith("[")), len(text))
    conf.write_text("\n".join([*text[:cut], *lines, *text[cut:]]) + "\n")


@pytest.fixture
def cluster(pvehost: PveHost) -> Iterator[PveHost]:
    saved = {v: pvehost.conf_path(v).read_text() for v in (200, 201, 300, 301)}
    moved = pvehost.node_dir("pve2") / "etc-pve" / "nodes" / "pve2" / "lxc" / "201.conf"
    try:
        _insert(pvehost.conf_path(200), ["dev0: /dev/nvidia0,gid=44", "dev1: /dev/nvidia1", "dev2: /dev/nvidiactl"])
        _insert(pvehost.conf_path(300), [f"lxc.mount.entry: /dev/nvidia{i} dev/nvidia{i} none bind,optional,"
                                         "create=file" for i in (2, 3)]
                + ["lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file"])
        os.replace(pvehost.conf_path(201), moved)  # "migrated": pve2 owns CT 201 now
        yield pvehost
    finally:
        if moved.exists():
            os.replace(moved, pvehost.conf_path(201))
        for v, text in saved.items():
            pvehost.conf_path(v).write_text(text)


def ctl(tmp: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controller.launch.main", "-i", str(tmp / "inventory.yaml"), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_cluster_endpoints_are_faithful(cluster: PveHost) -> None:
    s = requests.Session()
    s.verify = str(cluster.api_ca)
    s.trust_env = False
    s.headers["Authorization"] = f"PVEAPIToken=root@pam!ctl={cluster.api_token[1]}"
    base = f"{cluster.api_url}/api2/json"
    vms = s.get(f"{base}/cluster/resources", params={"type": "vm"}, timeout=10).json()["data"]
    assert {(c["id"], c["node"]) for c in vms} == {("lxc/200", "pve1"), ("lxc/201", "pve2"), ("lxc/300", "pve2"),
                                                   ("lxc/301", "pve2")}
    assert all(c["type"] == "lxc" and c["status"] in ("running", "stopped") and "ip" not in c for c in vms)
    everything = s.get(f"{base}/cluster/resources", timeout=10).json()["data"]
    assert {c["id"] for c in everything if c["type"] == "node"} == {"node/pve1", "node/pve2"}
    st = s.get(f"{base}/cluster/status", timeout=10).json()["data"]
    assert {(n["name"], n["ip"]) for n in st if n["type"] == "node"} == {("pve1", "127.0.0.2"), ("pve2", "127.0.0.3")}
    r = s.get(f"{base}/cluster/resources", params={"type": "lxc"}, timeout=10)
    assert r.status_code == 400 and "type" in r.json()["errors"]
    conf = s.get(f"{base}/nodes/pve2/lxc/300/config", timeout=10).json()["data"]
    assert ["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"] in conf["lxc"]


def test_discover_diff_write(cluster: PveHost, tmp_path: Path) -> None:
    env = {"CTL_TEST_PVE_TOKEN": cluster.api_token[1], "CTL_STATE_DIR": str(tmp_path / "state")}
    inv = tmp_path / "inventory.yaml"
    cluster.write_inventory(inv, hosts={"pve1": {"api": cluster.api_spec("pve1", secret_env="CTL_TEST_PVE_TOKEN")}},
                            containers={"ct250": {"host": "pve1", "vmid": 250, "transport": "pct"},
                                        "ct251": {"host": "pve2", "vmid": 251, "transport": "pct"}})
    inv.write_text("# written by hand, kept by discover\n" + inv.read_text())
    Registry(tmp_path / "state" / "registry.sqlite3").claim_run("r1", "ct251")

    r = ctl(tmp_path, env, "--json", "inventory", "discover", "--api", cluster.api_url, "--token-id",
            "root@pam!ctl", "--token-env", "CTL_TEST_PVE_TOKEN", "--ca", str(cluster.api_ca), "--diff")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["requests"] == 2 + 4 and not doc["errors"]
    seen = {c["vmid"]: (c["node"], c["gpus_seen"]) for c in doc["containers"]}
    assert seen == {200: ("pve1", [0, 1]), 201: ("pve2", []), 300: ("pve2", [2, 3]), 301: ("pve2", [])}
    got = {(c["kind"], c["ct"], json.dumps(c["old"]), json.dumps(c["new"])) for c in doc["changes"]}
    every = json.dumps([0, 1, 2, 3, 4, 5, 6, 7])
    assert got == {("moved", "ct201", '"pve1"', '"pve2"'), ("gpus", "ct200", every, "[0, 1]"),
                   ("gpus", "ct201", every, "[]"), ("gpus", "ct300", every, "[2, 3]"), ("gpus", "ct301", every, "[]"),
                   ("removed", "ct250", '"pve1"', "null"), ("removed", "ct251", '"pve2"', "null")}
    assert inv.read_text().startswith("# written by hand")  # --diff writes nothing
    assert "ct201" in r.stdout and inventory.load(inv).model.containers["ct201"].host == "pve1"

    r = ctl(tmp_path, env, "inventory", "discover", "--host", "pve1", "--write")
    assert r.returncode == 0, r.stderr
    assert "~ ct201 (vmid 201) moved: pve1 -> pve2" in r.stdout
    assert "ct251 is no longer in the cluster but has runs in the registry: kept" in r.stderr
    text = inv.read_text()
    assert text.startswith("# written by hand, kept by discover\n")
    m = inventory.load(inv).model
    assert m.containers["ct201"].host == "pve2" and m.containers["ct200"].gpus_seen == [0, 1]
    assert m.containers["ct200"].gpus.target == [0, 1, 2, 3, 4]  # the split stays the operator's
    assert m.containers["ct301"].gpus_seen == [] and "ct250" not in m.containers and "ct251" in m.containers
    assert m.containers["ct301"].transport == "ssh"  # hand-written keys kept

    r = ctl(tmp_path, env, "inventory", "discover", "--host", "pve1", "--diff")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "- ct251 (vmid 251 on pve2: no longer in the cluster)"
    r = ctl(tmp_path, env, "inventory", "discover", "--host", "pve1", "--write", "--prune")
    assert r.returncode == 0 and "ct251" not in inventory.load(inv).model.containers


@pytest.fixture
def with_vms_and_templates(cluster: PveHost) -> Iterator[PveHost]:
    """Beside the containers: a QEMU VM on pve1, a QEMU template on pve2, and an LXC template on pve1 (a config
    with `template: 1` and no container behind it: a template never runs)."""
    made = [cluster.node_dir("pve1") / "etc-pve" / "nodes" / "pve1" / "qemu-server" / "150.conf",
            cluster.node_dir("pve2") / "etc-pve" / "nodes" / "pve2" / "qemu-server" / "9000.conf",
            cluster.node_dir("pve1") / "etc-pve" / "nodes" / "pve1" / "lxc" / "260.conf"]
    texts = ["boot: order=scsi0\ncores: 4\nmemory: 8192\nname: winvm\nscsi0: local-lvm:vm-150-disk-0,size=32G\n",
             "cores: 2\nmemory: 2048\nname: debian-tmpl\ntemplate: 1\n",
             "arch: amd64\ncores: 2\nhostname: tmpl260\nmemory: 1024\nostype: debian\ntemplate: 1\n"]
    try:
        for f, text in zip(made, texts, strict=True):
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        yield cluster
    finally:
        for f in made:
            f.unlink(missing_ok=True)


def test_discover_leaves_out_qemu_guests_and_templates(with_vms_and_templates: PveHost, tmp_path: Path) -> None:
    cluster = with_vms_and_templates
    s = requests.Session()
    s.verify = str(cluster.api_ca)
    s.trust_env = False
    s.headers["Authorization"] = f"PVEAPIToken=root@pam!ctl={cluster.api_token[1]}"
    vms = s.get(f"{cluster.api_url}/api2/json/cluster/resources", params={"type": "vm"}, timeout=10).json()["data"]
    # the stand-in lists them as PVE does: the guests of both kinds, templates flagged
    assert {(c["id"], c["type"], c["node"], c["name"], c["template"]) for c in vms
            if c["vmid"] in (150, 9000, 260)} == {("qemu/150", "qemu", "pve1", "winvm", 0),
                                                   ("qemu/9000", "qemu", "pve2", "debian-tmpl", 1),
                                                   ("lxc/260", "lxc", "pve1", "tmpl260", 1)}

    env = {"CTL_TEST_PVE_TOKEN": cluster.api_token[1], "CTL_STATE_DIR": str(tmp_path / "state")}
    inv = tmp_path / "inventory.yaml"
    cluster.write_inventory(inv, hosts={"pve1": {"api": cluster.api_spec("pve1", secret_env="CTL_TEST_PVE_TOKEN")}})
    r = ctl(tmp_path, env, "--json", "inventory", "discover", "--host", "pve1", "--diff")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["requests"] == 2 + 4 and not doc["errors"]  # no config asked for a VM or a template
    assert {c["vmid"] for c in doc["containers"] if not c.get("template")} == {200, 201, 300, 301}
    assert not [c for c in doc["changes"] if c["vmid"] in (150, 9000, 260)], doc["changes"]
    r = ctl(tmp_path, env, "inventory", "discover", "--host", "pve1", "--write")
    assert r.returncode == 0, r.stderr
    m = inventory.load(inv).model
    assert not {c.vmid for c in m.containers.values()} & {150, 9000, 260}
    assert {c.vmid for c in m.containers.values()} == {200, 201, 300, 301}
