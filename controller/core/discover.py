"""What a Proxmox VE cluster holds, seen through its API, against what the inventory says. Pure: no I/O.

`gpus_from_config` reads GPU passthrough out of one container's config as GET .../lxc/VMID/config answers it:
`devN: /dev/nvidiaN[,options]` keys (PVE >= 8.1) and raw `lxc.mount.entry: /dev/nvidiaN dev/nvidiaN ...` lines
(under `lxc`, a list of [key, value] pairs). Only numbered nodes count: /dev/nvidiactl, nvidia-uvm, nvidia-caps
are shared by all GPUs. `lxc.cgroup2.devices.allow: c 195:* rwm` grants access but names no GPU, so it only
sets `nvidia_cgroup`. Discovery records what it sees (`gpus_seen`); the target/drafter split stays the
operator's.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

_NODE = re.compile(r"^/dev/nvidia(\d+)$")
_DEV_KEY = re.compile(r"^dev\d+$")


@dataclass(frozen=True)
class FoundNode:
    name: str
    address: str | None
    online: bool


@dataclass(frozen=True)
class FoundCt:
    vmid: int
    node: str
    name: str
    status: str
    gpus_seen: tuple[int, ...] = ()
    nvidia_cgroup: bool = False
    template: bool = False


@dataclass
class Discovery:
    url: str
    nodes: list[FoundNode]
    containers: list[FoundCt]
    requests: int = 0
    errors: list[str] = field(default_factory=list)  # configs that could not be read (the CT is still listed)

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "requests": self.requests, "errors": self.errors,
                "nodes": [asdict(n) for n in self.nodes],
                "containers": [{**asdict(c), "gpus_seen": list(c.gpus_seen)} for c in self.containers]}


def gpus_from_config(doc: dict[str, Any]) -> tuple[tuple[int, ...], bool]:
    """(GPU indices passed through, whether the nvidia cgroup rule (major 195) is present)."""
    seen: set[int] = set()
    for key, value in doc.items():
        if _DEV_KEY.fullmatch(str(key)) and isinstance(value, str):
            path = value.split(",", 1)[0].strip().removeprefix("path=")
            m = _NODE.fullmatch(path)
            if m:
                seen.add(int(m.group(1)))
    cgroup = False
    raw = doc.get("lxc") or []
    for pair in raw if isinstance(raw, list) else []:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            continue
        key, value = str(pair[0]).strip(), str(pair[1]).strip()
        if key == "lxc.mount.entry":
            src = value.split()[0] if value.split() else ""
            m = _NODE.fullmatch(src)
            if m:
                seen.add(int(m.group(1)))
        elif key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow") and re.match(r"^c\s+195:", value):
            cgroup = True
    return tuple(sorted(seen)), cgroup


def nodes_from_status(items: list[dict[str, Any]]) -> list[FoundNode]:
    """GET /cluster/status: its `node` entries carry the address (`ip`) the cluster uses."""
    out = [FoundNode(str(i.get("name")), str(i["ip"]) if i.get("ip") else None, bool(i.get("online", 1)))
           for i in items if i.get("type") == "node" and i.get("name")]
    return sorted(out, key=lambda n: n.name)


def containers_from_resources(items: list[dict[str, Any]]) -> list[FoundCt]:
    """GET /cluster/resources?type=vm: LXC guests only (qemu VMs are not ctl's), templates kept but flagged."""
    out = []
    for i in items:
        if i.get("type") != "lxc" or i.get("vmid") is None:
            continue
        out.append(FoundCt(vmid=int(i["vmid"]), node=str(i.get("node")), name=str(i.get("name") or ""),
                           status=str(i.get("status") or "unknown"), template=bool(i.get("template"))))
    return sorted(out, key=lambda c: c.vmid)


# --- against the inventory -----------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    kind: str  # added | removed | moved | gpus
    ct: str  # the inventory's name (for added: the name it would get)
    vmid: int
    old: Any = None
    new: Any = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.kind == "added":
            return f"+ {self.ct} (vmid {self.vmid} on {self.new})"
        if self.kind == "removed":
            return f"- {self.ct} (vmid {self.vmid} on {self.old}: no longer in the cluster)"
        if self.kind == "moved":
            return f"~ {self.ct} (vmid {self.vmid}) moved: {self.old} -> {self.new}"
        return f"~ {self.ct} (vmid {self.vmid}) GPUs: {list(self.old)} -> {list(self.new)}"


def host_for_node(hosts: dict[str, Any], node: FoundNode) -> str | None:
    """The inventory host that stands for a node: its `api.node`, else its name, else its address."""
    for name, h in hosts.items():
        api = h.get("api") if isinstance(h, dict) else None
        if isinstance(api, dict) and api.get("node") == node.name:
            return name
    if node.name in hosts:
        return node.name
    for name, h in hosts.items():
        if isinstance(h, dict) and node.address and h.get("address") == node.address:
            return name
    return None


def _gpus_of(spec: dict[str, Any]) -> tuple[int, ...]:
    if spec.get("gpus_seen") is not None:
        return tuple(sorted(int(i) for i in spec["gpus_seen"]))
    split = spec.get("gpus") or {}
    both = [*(split.get("target") or []), *(split.get("drafter") or [])]
    return tuple(sorted({int(i) for i in both}))


def changes(doc: dict[str, Any], found: Discovery) -> tuple[list[Change], dict[str, str]]:
    """What differs between an inventory (as plain data) and the cluster: (changes, {node: host name}).

    Containers are matched by vmid (unique in a cluster) among the inventory's containers on the cluster's hosts;
    a container on a host that is not one of the cluster's nodes is never reported removed."""
    hosts: dict[str, Any] = dict(doc.get("hosts") or {})
    cts: dict[str, Any] = dict(doc.get("containers") or {})
    node_host: dict[str, str] = {}
    for n in found.nodes:
        h = host_for_node(hosts, n)
        node_host[n.name] = h or n.name
    cluster_hosts = {h for h in node_host.values() if h in hosts}
    by_vmid: dict[int, str] = {}
    for ct_name, ct_spec in cts.items():
        if isinstance(ct_spec, dict) and ct_spec.get("vmid") is not None and ct_spec.get("host") in cluster_hosts:
            by_vmid.setdefault(int(ct_spec["vmid"]), ct_name)
    out: list[Change] = []
    present = set()
    for c in found.containers:
        if c.template:
            continue
        present.add(c.vmid)
        host = node_host.get(c.node, c.node)
        name = by_vmid.get(c.vmid)
        if name is None:
            new = f"ct{c.vmid}"
            if new in cts:
                new = f"ct{c.vmid}-{c.node}"
            out.append(Change("added", new, c.vmid, None, host))
            continue
        spec = cts[name]
        if spec.get("host") != host:
            out.append(Change("moved", name, c.vmid, spec.get("host"), host))
        if _gpus_of(spec) != c.gpus_seen:
            out.append(Change("gpus", name, c.vmid, _gpus_of(spec), c.gpus_seen))
    for vmid, name in sorted(by_vmid.items()):
        if vmid not in present:
            out.append(Change("removed", name, vmid, cts[name].get("host"), None))
    return out, node_host
