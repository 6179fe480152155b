"""Snapshots and rollbacks of a container: through the PVE API when its host has an `api:` section,
otherwise through `pct snapshot|listsnapshot|rollback|delsnapshot` over the host's SSH connection.

Both ways end in the same results and the same failures: a task's own text (`snapshot name 'x' already
used`) becomes `ApiError` (exit 30) worded the same, whichever way it travelled. A rollback discards
everything since the snapshot and stops the container, so it is refused while the registry knows a live
run on that container (checked against the container first), unless forced; the caller confirms.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from controller.errors import ApiError, BusyError, CtlError, InputError
from controller.inventory import Container, Inventory
from controller.lifecycle import Lifecycle
from controller.names import check_snapshot_name
from controller.registry import Registry, RunRecord
from controller.transport.base import Transport
from controller.transport.pool import Pool
from controller.transport.pveapi import TASK_TIMEOUT, PveApi, PveFailure, Snapshot, TaskOutcome


class Backend(Protocol):
    via: str

    def status(self, vmid: int) -> str: ...
    def list_snapshots(self, vmid: int) -> list[Snapshot]: ...
    def snapshot(self, vmid: int, name: str, description: str | None = None) -> TaskOutcome: ...
    def rollback(self, vmid: int, name: str, start: bool = False) -> TaskOutcome: ...
    def delete_snapshot(self, vmid: int, name: str) -> TaskOutcome: ...
    def describe(self, action: str, vmid: int, name: str | None = None, **params: Any) -> str: ...


# --- the pct fallback ----------------------------------------------------------------------------

# `pct listsnapshot`: "`-> NAME<pad>YYYY-MM-DD HH:MM:SS     DESCRIPTION", two spaces of indent per level.
_TREE = re.compile(r"^(?P<indent> *)`-> (?P<name>\S+)\s+(?:(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\s+)?"
                   r"(?P<desc>.*?)\s*$")


def parse_listsnapshot(text: str) -> list[Snapshot]:
    """Snapshots from pct's tree; parents from the indentation, `current` marks where the CT stands.

    snaptime is read in this machine's time zone (pct prints the host's local time)."""
    rows: list[tuple[int, str, int | None, str]] = []
    for line in text.splitlines():
        m = _TREE.match(line)
        if not m:
            continue
        when = m.group("when")
        snaptime = int(time.mktime(time.strptime(when, "%Y-%m-%d %H:%M:%S"))) if when else None
        desc = m.group("desc")
        rows.append((len(m.group("indent")) // 2, m.group("name"), snaptime,
                     "" if desc == "no-description" else desc))
    stack: list[str] = []
    here: str | None = None
    parsed: list[tuple[str, str | None, int | None, str]] = []
    for depth, name, snaptime, desc in rows:
        del stack[depth:]
        parent = stack[-1] if stack else None
        if name == "current":
            here = parent
            continue
        parsed.append((name, parent, snaptime, desc))
        stack.append(name)
    return sorted((Snapshot(name=n, description=d, snaptime=t, parent=p, current=n == here)
                   for n, p, t, d in parsed), key=lambda s: (s.snaptime or 0, s.name))


class PctSnapshots:
    """The same operations as PveApi, as `pct` commands on the host (run in the foreground: no UPID)."""

    via = "pct"

    def __init__(self, host: Transport, pct: str = "pct") -> None:
        self.host = host
        self.pct = pct

    def _run(self, what: str, *args: str) -> tuple[TaskOutcome, str]:
        argv = [self.pct, *args]
        res = self.host.run(argv, timeout=TASK_TIMEOUT)
        if res.returncode != 0:
            detail = " ".join(line.strip() for line in res.err.splitlines() if line.strip()) or (
                f"exit status {res.returncode}")
            raise PveFailure(f"{what} on {self.host.name}: pct failed: {detail}", detail=detail)
        return TaskOutcome(None, "OK", res.seconds), res.out

    def status(self, vmid: int) -> str:
        _, out = self._run(f"status of CT {vmid}", "status", str(vmid))
        m = re.search(r"^status: (\S+)", out, re.MULTILINE)
        return m.group(1) if m else "unknown"

    def list_snapshots(self, vmid: int) -> list[Snapshot]:
        _, out = self._run(f"snapshots of CT {vmid}", "listsnapshot", str(vmid))
        return parse_listsnapshot(out)

    def snapshot(self, vmid: int, name: str, description: str | None = None) -> TaskOutcome:
        extra = ["--description", description] if description else []
        return self._run(f"snapshot {name!r} of CT {vmid}", "snapshot", str(vmid), name, *extra)[0]

    def rollback(self, vmid: int, name: str, start: bool = False) -> TaskOutcome:
        extra = ["--start", "1"] if start else []
        return self._run(f"rollback of CT {vmid} to {name!r}", "rollback", str(vmid), name, *extra)[0]

    def delete_snapshot(self, vmid: int, name: str) -> TaskOutcome:
        return self._run(f"deleting snapshot {name!r} of CT {vmid}", "delsnapshot", str(vmid), name)[0]

    def describe(self, action: str, vmid: int, name: str | None = None, **params: Any) -> str:
        argv = {"snapshot": ["snapshot", str(vmid), str(name)] + (
                    ["--description", str(params["description"])] if params.get("description") else []),
                "rollback": ["rollback", str(vmid), str(name)] + (["--start", "1"] if params.get("start") else []),
                "delete": ["delsnapshot", str(vmid), str(name)]}.get(action, ["listsnapshot", str(vmid)])
        return f"ssh {self.host.name} " + self.host.script([self.pct, *argv])


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where a container's snapshots live: its Proxmox host and vmid, and the way we reach them."""

    ct: str
    label: str
    host: str
    vmid: int
    backend: Backend

    @property
    def via(self) -> str:
        return self.backend.via


@dataclass(frozen=True)
class SnapshotList:
    ct: str
    host: str
    vmid: int
    via: str
    snapshots: tuple[Snapshot, ...]

    def to_json(self) -> dict[str, Any]:
        return {"ct": self.ct, "host": self.host, "vmid": self.vmid, "via": self.via,
                "snapshots": [s.to_json() for s in self.snapshots]}


@dataclass(frozen=True)
class SnapshotResult:
    """A snapshot made, rolled back to or deleted (or, on a dry run, what would be): where, how, and the task."""

    ct: str
    host: str
    vmid: int
    via: str
    action: str  # snapshot | rollback | delete
    name: str
    exitstatus: str | None  # None for --dry-run
    upid: str | None = None
    seconds: float = 0.0
    dry_run: bool = False
    request: str | None = None  # what was (or would be) sent
    status: str | None = None  # the container's state afterwards (rollback)
    stopped_runs: tuple[str, ...] = field(default_factory=tuple)  # live runs a forced rollback ended

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["stopped_runs"] = list(self.stopped_runs)
        return doc


# --- operations ----------------------------------------------------------------------------------


def target(inv: Inventory, ct: Container, pool: Pool) -> Target:
    """The API when the host has `api:`, else pct over the host's SSH connection (opened lazily)."""
    if ct.host_name is None or ct.host is None or ct.spec.vmid is None:
        raise InputError(f"{ct.name}: snapshots need a Proxmox host and vmid in the inventory "
                         f"(transport {ct.spec.transport} has none)")
    backend: Backend
    if ct.host.api is not None:
        backend = PveApi(ct.host, base_dir=inv.base_dir)
    else:
        backend = PctSnapshots(pool.host_exec(ct.host_name), pct=ct.host.pct)
    return Target(ct.name, ct.label, ct.host_name, ct.spec.vmid, backend)


def _failed(t: Target, what: str, e: PveFailure) -> ApiError:
    return ApiError(f"{t.label}: {what} failed: {e.detail}")


def list_snapshots(t: Target) -> SnapshotList:
    try:
        snaps = t.backend.list_snapshots(t.vmid)
    except PveFailure as e:
        raise _failed(t, "listing snapshots", e) from None
    return SnapshotList(t.ct, t.host, t.vmid, t.via, tuple(snaps))


def create(t: Target, name: str, description: str | None = None, *, dry_run: bool = False) -> SnapshotResult:
    check_snapshot_name(name)
    if description and any(ord(c) < 32 for c in description):
        raise InputError("snapshot description must be one line of text (no control characters)")
    request = t.backend.describe("snapshot", t.vmid, name, description=description)
    if dry_run:
        return SnapshotResult(t.ct, t.host, t.vmid, t.via, "snapshot", name, None, dry_run=True, request=request)
    try:
        out = t.backend.snapshot(t.vmid, name, description)
    except PveFailure as e:
        raise _failed(t, f"snapshot {name!r}", e) from None
    return SnapshotResult(t.ct, t.host, t.vmid, t.via, "snapshot", name, out.exitstatus, out.upid, out.seconds,
                          request=request)


def _require(t: Target, name: str) -> None:
    snaps = list_snapshots(t).snapshots
    if not any(s.name == name for s in snaps):
        have = ", ".join(s.name for s in snaps) or "none"
        raise InputError(f"{t.label}: snapshot {name!r} does not exist (snapshots: {have})")


def live_runs(inv: Inventory, ct: Container, t: Target, pool: Pool, reg: Registry) -> list[RunRecord]:
    """Runs the registry believes live on this CT, confirmed by asking the container (reconcile.refresh)."""
    from controller.commands import reconcile

    believed = reg.live_runs(ct.key)
    if not believed:
        return []
    try:
        if t.backend.status(t.vmid) != "running":
            return []  # a stopped container runs nothing
        return reconcile.live(inv, ct, pool.container(ct), reg)
    except PveFailure as e:
        raise _failed(t, "status", e) from None
    except CtlError as e:
        names = ", ".join(r.name for r in believed)
        raise BusyError(f"{t.label}: cannot tell whether run {names} is still live ({e}); "
                        "a rollback would kill it (--force to roll back anyway)") from None


def rollback(
    inv: Inventory,
    ct: Container,
    t: Target,
    pool: Pool,
    reg: Registry,
    name: str,
    *,
    start: bool = False,
    force: bool = False,
    dry_run: bool = False,
    confirm: Callable[[str], None] | None = None,
) -> SnapshotResult:
    """Checks (name, existence, live runs), then `confirm(question)` (raises to refuse), then the rollback."""
    check_snapshot_name(name)
    request = t.backend.describe("rollback", t.vmid, name, start=start)
    _require(t, name)
    live = live_runs(inv, ct, t, pool, reg)
    if live and not force:
        names = ", ".join(r.name for r in live)
        stop = " / ".join(f"ctl stop {ct.name}/{r.name}" for r in live)
        raise BusyError(f"{t.label}: run {names} is live; rolling back would stop the container and kill it "
                        f"(stop it first: {stop}; or --force)")
    if dry_run:
        return SnapshotResult(t.ct, t.host, t.vmid, t.via, "rollback", name, None, dry_run=True, request=request,
                              stopped_runs=tuple(r.name for r in live))
    if confirm is not None:
        kills = f" and kill run {', '.join(r.name for r in live)}" if live else ""
        confirm(f"Roll {t.label} back to snapshot {name!r}? This stops it, discards every change since "
                f"the snapshot{kills}" + (" and starts it again" if start else "; it stays stopped"))
    try:
        out = t.backend.rollback(t.vmid, name, start=start)
    except PveFailure as e:
        raise _failed(t, f"rollback to {name!r}", e) from None
    for r in live:
        reg.update_run(r.id, state=Lifecycle.STOPPED, ended=time.time(),
                       note=f"container rolled back to snapshot {name!r} (--force)")
    try:
        status: str | None = t.backend.status(t.vmid)
    except CtlError:
        status = None
    return SnapshotResult(t.ct, t.host, t.vmid, t.via, "rollback", name, out.exitstatus, out.upid, out.seconds,
                          request=request, status=status, stopped_runs=tuple(r.name for r in live))


def delete(t: Target, name: str, *, dry_run: bool = False,
           confirm: Callable[[str], None] | None = None) -> SnapshotResult:
    check_snapshot_name(name)
    request = t.backend.describe("delete", t.vmid, name)
    _require(t, name)
    if dry_run:
        return SnapshotResult(t.ct, t.host, t.vmid, t.via, "delete", name, None, dry_run=True, request=request)
    if confirm is not None:
        confirm(f"Delete snapshot {name!r} of {t.label}? It cannot be rolled back to afterwards")
    try:
        out = t.backend.delete_snapshot(t.vmid, name)
    except PveFailure as e:
        raise _failed(t, f"deleting snapshot {name!r}", e) from None
    return SnapshotResult(t.ct, t.host, t.vmid, t.via, "delete", name, out.exitstatus, out.upid, out.seconds,
                          request=request)
