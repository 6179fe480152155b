"""`ctl inventory discover`: read a PVE cluster through its API and merge what it holds into the inventory.

Requests: GET /cluster/status (nodes and their addresses), GET /cluster/resources?type=vm (every guest of every
node, in one request), then one GET .../lxc/VMID/config per container (not templates), a few at a time. So a
cluster of N containers costs N + 2 requests, whatever its number of nodes.

Writing goes through ruamel.yaml's round trip: comments, key order, flow style and hand-written keys survive;
only the keys discovery owns change (`host` of a moved container, `gpus_seen`, new hosts and containers). The
result is validated as an inventory before it replaces the file (atomically).
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from controller.core.discover import (
    Change,
    Discovery,
    FoundCt,
    FoundNode,
    changes,
    containers_from_resources,
    gpus_from_config,
    nodes_from_status,
)
from controller.errors import CtlError, InputError

if TYPE_CHECKING:
    from controller.inventory import ApiSpec

WORKERS = 8  # config requests in flight at once: enough to hide latency, few enough for pveproxy's workers


class ClusterApi(Protocol):
    url: str

    def cluster_status(self) -> list[dict[str, Any]]: ...

    def cluster_resources(self, kind: str | None = "vm") -> list[dict[str, Any]]: ...

    def lxc_config(self, node: str, vmid: int) -> dict[str, Any]: ...


def discover(api: ClusterApi, *, workers: int = WORKERS) -> Discovery:
    nodes = nodes_from_status(api.cluster_status())
    found = containers_from_resources(api.cluster_resources("vm"))
    names = {n.name for n in nodes}
    for c in found:  # a node that /cluster/status did not list (standalone answers only its own entry)
        if c.node not in names:
            nodes.append(FoundNode(c.node, None, True))
            names.add(c.node)
    wanted = [c for c in found if not c.template]
    errors: list[str] = []

    def one(c: FoundCt) -> FoundCt:
        try:
            doc = api.lxc_config(c.node, c.vmid)
        except CtlError as e:
            errors.append(f"CT {c.vmid} on {c.node}: {e}")
            return c
        gpus, cgroup = gpus_from_config(doc)
        return FoundCt(c.vmid, c.node, c.name, c.status, gpus, cgroup, c.template)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(wanted) or 1))) as pool:
        done = {c.vmid: c for c in pool.map(one, wanted)}
    cts = [done.get(c.vmid, c) for c in found]
    return Discovery(url=api.url, nodes=sorted(nodes, key=lambda n: n.name), containers=cts,
                     requests=2 + len(wanted), errors=sorted(errors))


# --- merging into the inventory file ----------------------------------------------------------------


@dataclass
class Plan:
    path: Path
    text: str  # the inventory as it would be written
    changes: list[Change]
    kept: list[str] = field(default_factory=list)  # removed from the cluster, kept (runs in the registry)
    dropped: list[str] = field(default_factory=list)
    new_hosts: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "changes": [c.to_json() for c in self.changes], "kept": self.kept,
                "dropped": self.dropped, "new_hosts": self.new_hosts}


def discover_via(spec: ApiSpec, base_dir: Path) -> tuple[Discovery, str | None]:
    """Discovery through the API `spec` names (a relative CA file is read from base_dir), and the CA file the
    client trusted (first contact may have pinned one)."""
    from controller.transport.pveapi import PveApi

    client = PveApi(spec, base_dir=base_dir)
    return discover(client), client.ca_file


def _yaml(text: str = "") -> Any:
    """A round-trip YAML that writes block sequences the way the file already does (`- x` under its key, as
    PyYAML writes them, or indented by two) and never folds a long line."""
    import re

    from ruamel.yaml import YAML

    y = YAML()
    y.preserve_quotes = True
    y.width = 4096
    if re.search(r"^( *)[^ \n#][^\n]*:\n\1  - ", text, re.MULTILINE):
        y.indent(mapping=2, sequence=4, offset=2)
    else:
        y.indent(mapping=2, sequence=2, offset=0)
    return y


def _flow_map(items: dict[str, Any]) -> Any:
    from ruamel.yaml.comments import CommentedMap

    m = CommentedMap(items)
    m.fa.set_flow_style()
    return m


def _flow_seq(items: list[Any]) -> Any:
    from ruamel.yaml.comments import CommentedSeq

    s = CommentedSeq(items)
    s.fa.set_flow_style()
    return s


def plan(path: Path, found: Discovery, *, api_spec: dict[str, Any] | None, prune: bool,
         has_runs: Callable[[str], bool]) -> Plan:
    """The inventory at `path` (may not exist yet) with the cluster merged in.

    api_spec: the `api:` section new hosts get (url, token_id, token_secret_env, ca_file; `node` is filled in).
    A container gone from the cluster is dropped, unless it has runs in the registry: then only `prune` drops it.
    """
    from ruamel.yaml.comments import CommentedMap

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    y = _yaml(text)
    try:
        doc = y.load(text) if text.strip() else None
    except Exception as e:  # ruamel's errors have no common public base beyond YAMLError
        raise InputError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if doc is None:
        doc = CommentedMap()
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a mapping with 'hosts' and 'containers'")
    plain = _plain(doc)
    todo, node_host = changes(plain, found)
    if doc.get("hosts") is None:
        doc["hosts"] = CommentedMap()
    if doc.get("containers") is None:
        doc["containers"] = CommentedMap()
    hosts, cts = doc["hosts"], doc["containers"]
    out = Plan(path=path, text="", changes=todo)
    by_vmid = {c.vmid: c for c in found.containers}
    needed = {ch.new for ch in todo if ch.kind in ("added", "moved")}
    for n in found.nodes:
        h = node_host[n.name]
        if h in hosts or h not in needed:
            continue
        entry = CommentedMap({"address": n.address or n.name})
        if api_spec is not None:
            entry["api"] = _flow_map({k: v for k, v in {**api_spec, "node": n.name}.items() if v is not None})
        hosts[h] = entry
        out.new_hosts.append(h)
    for ch in todo:
        if ch.kind == "added":
            c = by_vmid[ch.vmid]
            cts[ch.ct] = _flow_map({"host": ch.new, "vmid": ch.vmid, "transport": "pct",
                                    "gpus_seen": _flow_seq(list(c.gpus_seen))})
        elif ch.kind == "moved":
            cts[ch.ct]["host"] = ch.new
        elif ch.kind == "gpus":
            cts[ch.ct]["gpus_seen"] = _flow_seq(list(ch.new))
        elif ch.kind == "removed":
            if has_runs(ch.ct) and not prune:
                out.kept.append(ch.ct)
                continue
            del cts[ch.ct]
            for members in (doc.get("groups") or {}).values():
                while isinstance(members, list) and ch.ct in members:
                    members.remove(ch.ct)
            out.dropped.append(ch.ct)
    buf = io.StringIO()
    y.dump(doc, buf)
    out.text = buf.getvalue()
    return out


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


def write(p: Plan) -> None:
    """Validate the merged text as an inventory, then replace the file atomically (its mode kept)."""
    from controller import inventory

    path = p.path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(p.text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        inventory.load(tmp)  # an InventoryError here names the temporary file's line: nothing replaced
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
