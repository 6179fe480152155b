"""`ctl store status|prune`: the content-addressed store of each container (/var/lib/ctl/objects).

Every deploy keeps the old and new version of each file it replaces there (so `ctl deploy --rollback` works),
and nothing removes them on its own. `prune` keeps, per destination, the newest `store_keep` versions (the
inventory, default 5) named by the container's deploy records, the version the last deploy of each
destination replaced (its rollback), every version a recorded run used (the registry's runs' files), and
anything written in the last hour (a deploy in flight); everything else is deleted, and only by `prune`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controller.commands.fanout import Outcome, fanout
from controller.commands.pins import STORE
from controller.inventory import Container
from controller.registry import Registry
from controller.remote.client import Agent
from controller.transport.base import Transport
from controller.transport.pool import Pool

RECENT_S = 3600  # objects younger than this are never pruned: a deploy may be storing them right now


@dataclass(frozen=True)
class DestUsage:
    dest: str
    versions: int  # objects of the store that are versions of this destination
    bytes: int


@dataclass(frozen=True)
class StoreReport:
    """What the store holds and (for prune) what goes; `deleted` is empty on a dry run."""

    ct: str
    objects: int
    bytes: int
    dests: tuple[DestUsage, ...]
    unreferenced: int  # objects no deploy record names (failed deploys, temporary copies)
    keep: int = 0
    delete: tuple[str, ...] = ()
    delete_bytes: int = 0
    deleted: tuple[str, ...] = ()
    dry_run: bool = False
    reasons: dict[str, str] = field(default_factory=dict)  # kept object -> why (newest, rollback, run, recent)

    def to_json(self) -> dict[str, Any]:
        return {"ct": self.ct, "ok": True, "objects": self.objects, "bytes": self.bytes,
                "dests": [d.__dict__ for d in self.dests], "unreferenced": self.unreferenced, "keep": self.keep,
                "delete": list(self.delete), "delete_bytes": self.delete_bytes, "deleted": list(self.deleted),
                "dry_run": self.dry_run}


def _versions(deploys: list[dict[str, Any]]) -> dict[str, list[str]]:
    """dest -> its versions in the store's records, newest first (each deploy: the new, then the one it replaced)."""
    out: dict[str, list[str]] = {}
    for rec in sorted(deploys, key=lambda r: float(r.get("time") or 0), reverse=True):
        for f in rec.get("files", []):
            seen = out.setdefault(str(f.get("dest")), [])
            for sha in (f.get("sha256"), f.get("previous")):
                if sha and sha not in seen:
                    seen.append(sha)
    return out


def plan(listing: dict[str, Any], keep_n: int, used_by_runs: set[str]) -> tuple[dict[str, str], list[str]]:
    """(kept object -> why, objects to delete) for one store listing. Pure: the decisions, no I/O."""
    objects: dict[str, dict[str, Any]] = listing.get("objects", {})
    now = float(listing.get("now") or 0)
    deploys = listing.get("deploys", [])
    keep: dict[str, str] = {}
    for _dest, versions in _versions(deploys).items():
        for sha in versions[:keep_n]:
            keep.setdefault(sha, "newest")
    latest: dict[str, dict[str, Any]] = {}
    for rec in sorted(deploys, key=lambda r: float(r.get("time") or 0)):
        for f in rec.get("files", []):
            latest[str(f.get("dest"))] = f
    for f in latest.values():
        if f.get("previous"):
            keep.setdefault(f["previous"], "rollback")
    for sha in used_by_runs:
        keep.setdefault(sha, "run")
    for sha, doc in objects.items():
        if now - float(doc.get("mtime") or 0) < RECENT_S:
            keep.setdefault(sha, "recent")
    delete = sorted(sha for sha in objects if sha not in keep)
    temps = listing.get("temps", {})
    delete += sorted(n for n, doc in temps.items() if now - float(doc.get("mtime") or 0) >= RECENT_S)
    return {sha: why for sha, why in keep.items() if sha in objects}, delete


def _report(ct: Container, listing: dict[str, Any]) -> StoreReport:
    objects: dict[str, dict[str, Any]] = listing.get("objects", {})
    versions = _versions(listing.get("deploys", []))
    dests = tuple(DestUsage(d, sum(1 for s in v if s in objects), sum(objects[s]["bytes"] for s in v if s in objects))
                  for d, v in sorted(versions.items()))
    named = {s for v in versions.values() for s in v}
    return StoreReport(ct.name, len(objects), sum(int(o["bytes"]) for o in objects.values()), dests,
                       sum(1 for s in objects if s not in named) + len(listing.get("temps", {})))


def _listing(t: Transport) -> dict[str, Any]:
    return Agent.of(t).call("storelist", {"store": t.path(STORE)})


def status(ct: Container, t: Transport) -> StoreReport:
    return _report(ct, _listing(t))


def used_by_runs(reg: Registry | None, ct: str) -> set[str]:
    """Every file hash a recorded run of this container used (its record's `files`)."""
    if reg is None:
        return set()
    return {sha for r in reg.runs(ct, limit=1_000_000) for sha in r.files.values() if sha}


def prune(ct: Container, t: Transport, reg: Registry | None, *, dry_run: bool = False) -> StoreReport:
    listing = _listing(t)
    base = _report(ct, listing)
    keep, delete = plan(listing, ct.spec.store_keep, used_by_runs(reg, ct.key))
    sizes = {**listing.get("temps", {}), **listing.get("objects", {})}
    deleted: tuple[str, ...] = ()
    if delete and not dry_run:
        agent = Agent.of(t)
        deleted = tuple(agent.need(agent.call("storeprune", {"store": t.path(STORE), "objects": delete}), "deleted"))
    return StoreReport(base.ct, base.objects, base.bytes, base.dests, base.unreferenced, len(keep), tuple(delete),
                       sum(int(sizes[n]["bytes"]) for n in delete), deleted, dry_run, keep)


def status_all(pool: Pool, cts: list[Container]) -> list[Outcome[StoreReport]]:
    return fanout(pool, cts, status)


def prune_all(pool: Pool, cts: list[Container], reg: Registry | None, *, dry_run: bool = False
              ) -> list[Outcome[StoreReport]]:
    return fanout(pool, cts, lambda ct, t: prune(ct, t, reg, dry_run=dry_run))
