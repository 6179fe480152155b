"""`ctl env ...`: probe a container, check it against its lock, write a lock, diff two states, sync a venv.

The seeds' failure was silent drift (SGLang in the training venv, torch swapped cu128 <-> cu130, the compile
cache deleted). The probe (envprobe.py) runs controller/farside/probe_env.py inside the container in ONE exec;
its JSON goes to envlock (pure logic) to check, diff, lock or plan a sync.
A sync builds a NEW venv beside the old one, verifies it with the probe and only then switches the symlink;
the old venv is kept.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.commands.envprobe import container_lock, probe, run_probe, settings
from controller.core import envlock
from controller.core.envlock import Change, Finding, Lock, Probe
from controller.errors import ClobberError, CtlError, EnvMismatch, InputError
from controller.inventory import Container, Inventory
from controller.names import check_snapshot_name
from controller.remote.client import Agent
from controller.settings import LONG_TIMEOUT
from controller.transport.base import Transport

# Where uv usually is: PATH, then the installer's defaults (pct exec's PATH has no ~/.local/bin).
UV_CANDIDATES = ("uv", "/root/.local/bin/uv", "/root/.cargo/bin/uv", "/usr/local/bin/uv")


# --- lock / check --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    ct: str
    lock_path: str
    findings: tuple[Finding, ...]
    fingerprint: str
    lock_fingerprint: str | None

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {"ct": self.ct, "lock": self.lock_path, "ok": self.ok, "fingerprint": self.fingerprint,
                "lock_fingerprint": self.lock_fingerprint,
                "findings": [{"kind": f.kind, "name": f.name, "locked": f.locked, "found": f.found,
                              "message": f.message} for f in self.findings]}


def _venv_probed(inv: Inventory, ct: Container, p: Probe) -> Probe:
    """A probe that found no venv because the inventory names none gets ctl's words, not the probe's."""
    if "venv" in p.errors and settings(inv, ct).venv is None:
        raise InputError(f"{ct.name}: no venv to pin or check: set `vars.venv` for {ct.name} in {inv.path} "
                         "(the venv the training uses)")
    return p


def check(inv: Inventory, ct: Container, t: Transport, lock_override: str | None = None) -> CheckResult:
    lock = container_lock(inv, ct, lock_override)  # before the probe: a missing lock costs no round trip
    p = _venv_probed(inv, ct, probe(inv, ct, t))
    return CheckResult(ct.name, lock.path or "?", tuple(envlock.check(lock, p)), p.fingerprint, lock.fingerprint)


@dataclass(frozen=True)
class LockWritten:
    path: str
    pins: int
    replaced: bool
    fingerprint: str


def write_lock(inv: Inventory, ct: Container, t: Transport, out: str, *, force: bool = False) -> LockWritten:
    """Pin what the container's venv holds now; an existing file is replaced only with force."""
    dest = Path(out)
    if dest.is_dir():
        raise InputError(f"{dest} is a directory: give the lock file's path (e.g. env/{ct.name}.lock)")
    existed = dest.exists()
    if existed and not force:
        raise ClobberError(f"{dest} exists: not overwritten (pass --force to replace it)")
    p = _venv_probed(inv, ct, probe(inv, ct, t))
    lock = Lock.from_probe(p, source=ct.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.ctl-tmp")
    tmp.write_text(lock.render(), encoding="utf-8")
    tmp.replace(dest)
    return LockWritten(str(dest), len(lock.pins), existed, p.fingerprint)


# --- diff ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvDiff:
    a: str
    b: str
    fingerprints: tuple[str | None, str | None]
    changes: tuple[Change, ...]

    @property
    def same(self) -> bool:
        return not self.changes

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "fingerprints": list(self.fingerprints), "same": self.same,
                "changes": [{"kind": c.kind, "subject": c.subject, "before": c.before, "after": c.after,
                             "message": c.message} for c in self.changes]}


def resolve_side(inv: Inventory, reg: Any, ref: str, live: Callable[[Container], Probe]) -> tuple[str, Probe]:
    """A container name means a live probe; anything else is a run (NAME, CT/NAME, #ID) with its recorded probe."""
    if ref in inv.model.containers:
        ct = inv.container(ref)
        return f"{ct.name} (live)", live(ct)
    rec = reg.find_run(ref)
    label = f"{rec.ct}/{rec.name}"
    if not rec.env:
        raise InputError(f"run {label} has no environment recorded (it was launched before ctl recorded probes)")
    return label, Probe.from_json(json.dumps(rec.env), f"run {label}")


def diff(inv: Inventory, reg: Any, ref_a: str, ref_b: str, live: Callable[[Container], Probe]) -> EnvDiff:
    la, pa = resolve_side(inv, reg, ref_a, live)
    lb, pb = resolve_side(inv, reg, ref_b, live)
    return EnvDiff(la, lb, (pa.fingerprint, pb.fingerprint), tuple(envlock.diff_probes(pa, pb)))


# --- sync ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncStep:
    what: str
    argv: tuple[str, ...] | None  # None: done by ctl's agent (the line says what)
    line: str


@dataclass(frozen=True)
class SyncResult:
    ct: str
    venv: str
    new_venv: str
    old_target: str | None  # what the venv path pointed at (or was) before: kept, never deleted
    kept_as: str | None  # where a real venv directory was moved before the symlink took its place
    lock_path: str
    snapshot_hint: str
    steps: tuple[SyncStep, ...]
    uv: str | None
    applied: bool
    findings: tuple[Finding, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"ct": self.ct, "venv": self.venv, "new_venv": self.new_venv, "old_target": self.old_target,
                "kept_as": self.kept_as, "lock": self.lock_path, "snapshot_hint": self.snapshot_hint,
                "uv": self.uv, "applied": self.applied,
                "steps": [{"what": s.what, "argv": list(s.argv) if s.argv else None, "line": s.line}
                          for s in self.steps]}


def snapshot_hint(ct: Container, day: str) -> str:
    name = check_snapshot_name(f"pre-sync-{day}")
    return f"take a snapshot first: ctl snapshot {ct.name} {name}"


def sync(
    inv: Inventory, ct: Container, t: Transport, *, dry_run: bool = False, python: str | None = None,
    uv: str | None = None, lock_override: str | None = None, now: float | None = None,
) -> SyncResult:
    """Build `<venv>-<stamp>` from the lock with uv, verify it with the probe, then point `<venv>` at it."""
    s = settings(inv, ct)
    if s.venv is None:
        raise InputError(f"{ct.name}: vars.venv is not set in {inv.path}: no venv to sync")
    lock = container_lock(inv, ct, lock_override)
    if uv is not None and not uv.startswith("/") and uv != "uv":
        raise InputError(f"--uv {uv!r} must be an absolute path inside the container")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    venv = s.venv.rstrip("/")
    new = f"{venv}-{stamp}"
    lock_in_ct = f"{new}.lock"
    kept_as = f"{venv}-orig-{stamp}"
    candidates = [uv] if uv else list(UV_CANDIDATES)
    agent = Agent.of(t)
    facts = agent.call("envfacts", {"venv": venv, "uv": candidates, "paths": [new, lock_in_ct, kept_as]})
    if facts.get("taken"):
        raise ClobberError(f"{ct.name}: {', '.join(facts['taken'])} already exists: not touched (retry in a second)")
    found_uv = facts.get("uv")
    if not found_uv and not dry_run:
        looked = uv or ", ".join(UV_CANDIDATES)
        raise CtlError(
            f"{ct.name}: uv is not installed in the container (looked for {looked}); `ctl env sync` builds the "
            "new venv with uv: install it there (e.g. `pip install uv`) or pass --uv PATH"
        )
    # an absolute candidate is a container path (mapped for `local`); a name found on PATH is used as found
    uv_cmd = t.path(found_uv) if found_uv and found_uv in candidates and found_uv.startswith("/") else (
        found_uv or uv or "uv")
    plan = envlock.sync_plan(lock, t.path(venv), t.path(new), python, lock_path=t.path(lock_in_ct), uv=uv_cmd)
    is_dir = bool(facts.get("venv_exists")) and not facts.get("venv_is_symlink")
    old_target = facts.get("venv_target") or (venv if facts.get("venv_exists") else None)
    steps: list[SyncStep] = []

    def step(what: str, argv: tuple[str, ...] | list[str] | None, line: str | None = None) -> None:
        steps.append(SyncStep(what, tuple(argv) if argv else None, line or t.script(list(argv or ()))))

    for c in plan.guard:
        step("guard", c)
    step("lock", None, f"(ctl agent writefile) {lock_in_ct}  <- {lock.path}")
    for c in plan.build:
        step("build", c)
    step("verify", None, f"(probe_env.py over stdin) --venv {new}; ctl checks it against {lock.path}")
    aside = ("mv", "-T", t.path(venv), t.path(kept_as))
    if is_dir:
        step("keep", aside)
    for c in plan.switch:
        step("switch", c)
    result = SyncResult(ct.name, venv, new, old_target, kept_as if is_dir else None, lock_in_ct,
                        snapshot_hint(ct, stamp[:8]), tuple(steps), found_uv, False)
    if dry_run:
        return result

    for c in plan.guard:
        t.check(list(c), what="sync guard")
    agent.call("writefile", {"path": lock_in_ct}, payload=lock.render().encode())
    for c in plan.build:
        t.check(list(c), what="building the new venv", timeout=LONG_TIMEOUT)  # uv downloads GBs of wheels
    new_probe = Probe.from_json(json.dumps(run_probe(t, venv=new, cache_dir=s.cache_dir)), f"{ct.name}:{new}")
    findings = envlock.check(lock, new_probe)
    if findings:
        shown = "; ".join(f.message for f in findings[:5])
        raise EnvMismatch(f"{ct.name}: the new venv {new} does not match {lock.path}: {shown}; nothing switched "
                          f"({venv} is untouched, {new} is kept for inspection)")
    if is_dir:
        t.check(list(aside), what="keeping the old venv directory")
    for c in plan.switch:
        t.check(list(c), what="switching the venv symlink")
    return SyncResult(result.ct, venv, new, old_target, result.kept_as, lock_in_ct, result.snapshot_hint,
                      result.steps, found_uv, True)
