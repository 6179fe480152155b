"""`ctl inventory discover`: GPU passthrough read from configs, a large cluster in a bounded number of requests,
and the merge into an inventory file that keeps comments, order and hand-written keys."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from controller import inventory
from controller.commands.discover import WORKERS, discover, plan, write
from controller.core.discover import Discovery, FoundCt, FoundNode, gpus_from_config
from controller.errors import ApiError, InventoryError


def test_gpus_from_dev_keys_and_mount_entries() -> None:
    doc = {"hostname": "ct200", "dev0": "/dev/nvidia0,gid=44", "dev1": "path=/dev/nvidia3", "dev2": "/dev/nvidiactl",
           "dev3": "/dev/nvidia-uvm", "mp0": "/dev/nvidia1",
           "lxc": [["lxc.cgroup2.devices.allow", "c 195:* rwm"],
                   ["lxc.mount.entry", "/dev/nvidia5 dev/nvidia5 none bind,optional,create=file"],
                   ["lxc.mount.entry", "/dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir"],
                   ["lxc.mount.entry", "/dev/nvidiactl dev/nvidiactl none bind,optional,create=file"]]}
    assert gpus_from_config(doc) == ((0, 3, 5), True)
    assert gpus_from_config({"hostname": "x", "lxc": [["lxc.net.0.type", "none"]]}) == ((), False)


class FakeCluster:
    """An in-process PVE API: counts requests per endpoint and how many configs were in flight at once."""

    url = "https://fake:8006"

    def __init__(self, nodes: int, per_node: int, gpus: int = 8, together: int = 0) -> None:
        # with `together`, the first that many config requests wait for each other: they return only when all
        # of them are in flight at once (a barrier), or fail after 30 s
        self.together = threading.Barrier(together) if together else None
        self.nodes = [f"n{i:02d}" for i in range(nodes)]
        self.cts = {100 + i * per_node + j: self.nodes[i] for i in range(nodes) for j in range(per_node)}
        self.gpus = gpus
        self.calls: dict[str, int] = {}
        self.inflight = 0
        self.max_inflight = 0
        self.lock = threading.Lock()

    def _count(self, what: str) -> None:
        with self.lock:
            self.calls[what] = self.calls.get(what, 0) + 1

    def cluster_status(self) -> list[dict[str, Any]]:
        self._count("cluster/status")
        return [{"type": "cluster", "id": "cluster", "name": "big", "nodes": len(self.nodes), "quorate": 1},
                *({"type": "node", "id": f"node/{n}", "name": n, "ip": f"10.0.0.{i + 1}", "online": 1}
                  for i, n in enumerate(self.nodes))]

    def cluster_resources(self, kind: str | None = "vm") -> list[dict[str, Any]]:
        self._count(f"cluster/resources?type={kind}")
        assert kind == "vm"
        return [{"id": f"lxc/{v}", "type": "lxc", "vmid": v, "node": n, "status": "running", "name": f"ct{v}",
                 "template": 0} for v, n in self.cts.items()]

    def lxc_config(self, node: str, vmid: int) -> dict[str, Any]:
        self._count("config")
        assert self.cts[vmid] == node
        with self.lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            first = self.calls["config"] <= (self.together.parties if self.together else 0)
        if first and self.together is not None:
            self.together.wait(30)
        with self.lock:
            self.inflight -= 1
        if vmid % 7 == 0:
            return {"hostname": f"ct{vmid}"}
        return {"hostname": f"ct{vmid}", **{f"dev{i}": f"/dev/nvidia{i}" for i in range(self.gpus)}}


def test_large_cluster_in_a_bounded_number_of_requests() -> None:
    api = FakeCluster(nodes=50, per_node=8, together=WORKERS)
    found = discover(api)
    assert len(found.containers) == 400 and len(found.nodes) == 50
    assert api.calls == {"cluster/status": 1, "cluster/resources?type=vm": 1, "config": 400}
    assert found.requests == 402 and not found.errors
    # configs are read WORKERS at a time: the first WORKERS met at the barrier (one after the other, the first would
    # have waited alone and failed), and never more were in flight
    assert api.together is not None and not api.together.broken
    assert api.max_inflight == WORKERS
    no_gpu = [c for c in found.containers if c.vmid % 7 == 0]
    assert no_gpu and all(c.gpus_seen == () for c in no_gpu)
    assert all(c.gpus_seen == tuple(range(8)) for c in found.containers if c.vmid % 7)
    assert {n.address for n in found.nodes} == {f"10.0.0.{i + 1}" for i in range(50)}


def test_a_config_that_fails_is_reported_not_fatal() -> None:
    class Flaky(FakeCluster):
        def lxc_config(self, node: str, vmid: int) -> dict[str, Any]:
            if vmid == 101:
                raise ApiError("permission denied")
            return super().lxc_config(node, vmid)

    found = discover(Flaky(nodes=1, per_node=3))
    assert [c.vmid for c in found.containers] == [100, 101, 102]
    assert found.errors == ["CT 101 on n00: permission denied"]


INVENTORY = """\
# the lab's inventory (hand-written)
hosts:
  pve1: {address: 10.0.0.1, user: root}   # node 1
  pve2:
    address: 10.0.0.2
    known_hosts: ~/.ssh/known_hosts
containers:
  # trains the drafter
  ct200: {host: pve1, vmid: 200, transport: pct, gpus: {target: [0, 1], drafter: []}, vars: {venv: /root/v}}
  ct201: {host: pve1, vmid: 201, transport: pct}
  ct202: {host: pve1, vmid: 202, transport: pct}  # gone, with runs
  ct203: {host: pve1, vmid: 203, transport: pct}  # gone, no runs
  lab: {transport: local, root: .ctl/local}
groups:
  all: [ct200, ct201, ct202, ct203]
runs: {series: fresh}
"""


def cluster() -> Discovery:
    return Discovery(
        url="https://10.0.0.1:8006",
        nodes=[FoundNode("pve1", "10.0.0.1", True), FoundNode("pve2", "10.0.0.2", True),
               FoundNode("pve3", "10.0.0.3", True)],
        containers=[FoundCt(200, "pve1", "ct200", "running", (0, 1)),
                    FoundCt(201, "pve2", "ct201", "stopped", ()),
                    FoundCt(300, "pve3", "web", "running", (0, 1, 2, 3)),
                    FoundCt(900, "pve3", "tmpl", "stopped", (), template=True)])


API = {"url": "https://10.0.0.1:8006", "token_id": "root@pam!ctl", "token_secret_env": "PVE_TOKEN",
       "ca_file": None}


def test_merge_keeps_comments_and_order_and_reports_changes(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY)
    p = plan(inv, cluster(), api_spec=API, prune=False, has_runs=lambda ct: ct == "ct202")
    kinds = sorted((c.kind, c.ct) for c in p.changes)
    assert kinds == [("added", "ct300"), ("moved", "ct201"), ("removed", "ct202"), ("removed", "ct203")]
    assert p.kept == ["ct202"] and p.dropped == ["ct203"] and p.new_hosts == ["pve3"]
    write(p)
    text = inv.read_text()
    for kept in ("# the lab's inventory (hand-written)", "# node 1", "# trains the drafter", "# gone, with runs",
                 "vars: {venv: /root/v}", "known_hosts: ~/.ssh/known_hosts", "runs: {series: fresh}"):
        assert kept in text
    assert "ct203" not in text and "template" not in text and "ct900" not in text
    assert text.index("ct200") < text.index("ct201") < text.index("ct202") < text.index("lab:") < \
        text.index("ct300")
    m = inventory.load(inv).model
    assert m.containers["ct201"].host == "pve2"
    assert m.containers["ct300"].host == "pve3" and m.containers["ct300"].gpus_seen == [0, 1, 2, 3]
    assert m.containers["ct200"].gpus_seen is None  # the split already says [0, 1]: nothing to record
    assert m.hosts["pve3"].address == "10.0.0.3" and m.hosts["pve3"].api is not None
    assert m.hosts["pve3"].api.node == "pve3"
    assert m.groups["all"] == ["ct200", "ct201", "ct202"]
    # a second pass finds nothing new but the kept container
    again = plan(inv, cluster(), api_spec=API, prune=False, has_runs=lambda ct: ct == "ct202")
    assert [(c.kind, c.ct) for c in again.changes] == [("removed", "ct202")] and again.text == text


def test_prune_drops_containers_with_runs(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY)
    p = plan(inv, cluster(), api_spec=API, prune=True, has_runs=lambda ct: True)
    write(p)
    assert sorted(p.dropped) == ["ct202", "ct203"]
    assert set(inventory.load(inv).model.containers) == {"ct200", "ct201", "ct300", "lab"}


def test_gpus_changed_against_the_split(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY)
    found = cluster()
    found.containers[0] = FoundCt(200, "pve1", "ct200", "running", (0, 1, 2))
    p = plan(inv, found, api_spec=API, prune=False, has_runs=lambda ct: False)
    gpus = [c for c in p.changes if c.kind == "gpus"]
    assert [(c.ct, c.old, c.new) for c in gpus] == [("ct200", (0, 1), (0, 1, 2))]
    write(p)
    spec = inventory.load(inv).model.containers["ct200"]
    assert spec.gpus_seen == [0, 1, 2] and spec.gpus.target == [0, 1]  # the split stays the operator's


def test_new_inventory_file(tmp_path: Path) -> None:
    inv = tmp_path / "new" / "inventory.yaml"
    p = plan(inv, cluster(), api_spec=API, prune=False, has_runs=lambda ct: False)
    write(p)
    m = inventory.load(inv).model
    assert set(m.containers) == {"ct200", "ct201", "ct300"} and set(m.hosts) == {"pve1", "pve2", "pve3"}


def test_invalid_result_leaves_the_file_alone(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY.replace("runs: {series: fresh}", "runs: {series: fresh}\nbogus: 1"))
    before = inv.read_text()
    p = plan(inv, cluster(), api_spec=API, prune=False, has_runs=lambda ct: False)
    with pytest.raises(InventoryError, match=r": bogus: unknown key$"):
        write(p)
    assert inv.read_text() == before and [f.name for f in tmp_path.iterdir()] == ["inventory.yaml"]
