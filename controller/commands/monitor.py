"""Pulling a run's metrics out of its container, incrementally, and judging them against a baseline.

A training log grows to gigabytes; reading it again for every `ctl status` would move all of it over
SSH and `pct exec` each time. The registry keeps a cursor per run (byte offset, an identity of the
log file, the unfinished last line), and one agent call (`logread`) returns only the bytes after the
offset, raw, after a one-line JSON header: a second pull of an unchanged log moves a header and the
agent's source, nothing else. A log that was truncated or replaced (new inode, or its first bytes
changed) is read again from byte 0, and the result says so.

The same call reports the sha256 of the run's deployed files and of its checkpoints (a glob under
the run directory); the agent only re-hashes a file whose size or mtime changed since the last pull.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

from controller.core.metrics import (
    LogCursor,
    MetricPoint,
    RunState,
    Verdict,
    parse_line,
    steady_state,
    verdict,
)
from controller.errors import BusyError, ConnectionFailed, CtlError, InputError, RemoteCommandError
from controller.inventory import Inventory
from controller.registry import Registry, RunRecord
from controller.remote import client
from controller.transport.base import Transport

DEFAULT_CHUNK = 8 << 20  # log bytes per agent call
DEFAULT_CHECKPOINTS = "checkpoints/*.pt"  # CTL_CHECKPOINT_GLOB overrides; --checkpoints beats both


def checkpoint_glob(flag: str | None) -> str:
    """The checkpoint glob: flag > CTL_CHECKPOINT_GLOB > default; relative to the run directory."""
    g = flag or os.environ.get("CTL_CHECKPOINT_GLOB") or DEFAULT_CHECKPOINTS
    if g.startswith("/") or ".." in g.split("/") or "\0" in g or not g.strip():
        raise InputError(f"checkpoint glob {g!r} must be a relative pattern inside the run directory")
    return g


@dataclass(frozen=True)
class PullResult:
    """What one `pull` did: where the cursor went, what travelled, what it found."""

    run: str
    start: int  # cursor offset before the pull (0 after a reset)
    offset: int  # cursor offset after it
    size: int  # log size at the last call
    fetched: int  # log bytes received
    wire_in: int  # bytes sent to the container (agent source + arguments)
    wire_out: int  # bytes received from it (headers + log bytes)
    calls: int
    new_points: int
    reset: str | None  # why the log was read again from byte 0
    crash: str | None
    last: MetricPoint | None
    log_mtime: float | None  # container clock
    remote_now: float | None  # container clock at the last call
    files_changed: tuple[str, ...] = ()
    checkpoints: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "last"}
        d["files_changed"] = list(self.files_changed)
        d["last"] = self.last.record() if self.last else None
        return d


def _logread(t: Transport, args: dict[str, Any]) -> tuple[dict[str, Any], bytes, int, int]:
    argv = client.agent_argv("logread", json.dumps(args))
    stdin = client.agent_source()
    res = t.run(argv, stdin=stdin, timeout=600)
    head, sep, data = res.stdout.partition(b"\n")
    try:
        doc = json.loads(head) if sep else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        if res.returncode == 127 or "python3: not found" in res.err:
            raise CtlError(f"{t.name}: python3 is not available in the container (ctl's agent needs it)")
        raise RemoteCommandError(t.name, ["python3", "<agent>", "logread"], res.returncode, res.err,
                                 what="agent logread")
    if doc.get("ok") and len(data) != doc.get("length"):
        raise ConnectionFailed(f"{t.name}: log read cut short: {len(data)} of {doc.get('length')} bytes arrived")
    return doc, data, len(stdin) + len(argv[-1]), len(res.stdout) + len(res.stderr)


def pull(
    t: Transport, reg: Registry, run: RunRecord, *, chunk: int = DEFAULT_CHUNK,
    checkpoints: str | None = DEFAULT_CHECKPOINTS, hashes: bool = True,
) -> PullResult:
    """Fetch the log bytes after the run's cursor (looping `chunk` bytes per call until caught up),
    store the new metric points and the cursor after each call, and note crash signatures."""
    if run.log_path is None:
        raise InputError(f"run {run.ct}/{run.name} has no log path recorded")
    if chunk < 1:
        raise InputError(f"chunk must be at least 1 byte, got {chunk}")
    offset, ident, partial = reg.cursor(run.id)
    start = offset
    cursor: LogCursor | None = None
    reset: str | None = None
    fetched = wire_in = wire_out = calls = new_points = 0
    last: MetricPoint | None = None
    crash = run.crash
    header: dict[str, Any] = {}
    found: dict[str, Any] = {}
    while True:
        args: dict[str, Any] = {"root": client.root_of(t), "log": run.log_path, "offset": offset, "ident": ident,
                                "max_bytes": chunk}
        if calls == 0 and hashes:
            args.update(_hash_args(reg, run, checkpoints))
        header, data, n_in, n_out = _logread(t, args)
        calls += 1
        wire_in += n_in
        wire_out += n_out
        if not header.get("ok"):
            if header.get("code") == "missing":
                raise InputError(f"{run.ct}: log {run.log_path} of run {run.name} does not exist")
            raise CtlError(f"{run.ct}: cannot read {run.log_path}: {header.get('error')}")
        if calls == 1:
            found = header
        if header.get("reset"):
            reset, partial, start, cursor = header["reset"], b"", 0, None
        if cursor is None:
            cursor = LogCursor(offset=int(header["offset"]) - len(partial))
            cursor.feed(partial)
        entries = cursor.feed_lines(data, now=header.get("now"))
        fetched += len(data)
        new_offset = int(header["offset"]) + len(data)
        keep = new_offset - cursor.offset  # bytes of the unfinished last line
        pending = partial + data
        new_partial = pending[len(pending) - keep:] if keep else b""
        points = [e for e in entries if isinstance(e, MetricPoint)]
        if not reg.advance_cursor(run.id, (offset, ident), new_offset, header["ident"], new_partial,
                                  [p.record() for p in points]):
            raise BusyError(f"another `ctl` is pulling run {run.ct}/{run.name} right now; try again")
        offset, ident, partial = new_offset, header["ident"], new_partial
        new_points += len(points)
        last = points[-1] if points else last
        if cursor.crash and crash is None:
            crash = cursor.crash
            reg.update_run(run.id, crash=crash)
        if not data or offset >= int(header["size"]):
            break
    files_changed, ckpts = _store_hashes(reg, run, found) if hashes else ((), {})
    return PullResult(
        run=f"{run.ct}/{run.name}", start=start, offset=offset, size=int(header["size"]), fetched=fetched,
        wire_in=wire_in, wire_out=wire_out, calls=calls, new_points=new_points, reset=reset, crash=crash,
        last=last, log_mtime=header.get("mtime"), remote_now=header.get("now"), files_changed=files_changed,
        checkpoints=ckpts,
    )


def _hash_args(reg: Registry, run: RunRecord, checkpoints: str | None) -> dict[str, Any]:
    known: dict[str, list[Any]] = {}
    for kind in ("deployed", "checkpoint"):
        for path, h in reg.run_files(run.id, kind).items():
            if h is not None:
                known[path] = [h["size"], h["mtime_ns"], h["sha256"]]
    args: dict[str, Any] = {"files": sorted(run.files), "known": known}
    if checkpoints and run.run_dir:
        args["checkpoints"] = {"dir": run.run_dir, "glob": checkpoint_glob(checkpoints)}
    return args


def _store_hashes(reg: Registry, run: RunRecord, header: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, str]]:
    files: dict[str, dict[str, Any] | None] = header.get("files") or {}
    reg.set_run_files(run.id, "deployed", files)
    changed = tuple(p for p, h in sorted(files.items()) if h is None or h.get("sha256") != run.files.get(p))
    ckpts: dict[str, dict[str, Any]] = header.get("checkpoints") or {}
    if "checkpoints" in header:
        reg.set_run_files(run.id, "checkpoint", dict(ckpts))
    return changed, {p: h["sha256"] for p, h in sorted(ckpts.items())}


# --- stored points -------------------------------------------------------------------------------


def stored_points(reg: Registry, run: RunRecord) -> list[MetricPoint]:
    """The run's points from the registry, as MetricPoints (their JSON-lines form read back)."""
    out = []
    for rec in reg.points(run.id):
        p = parse_line(json.dumps(rec))
        if isinstance(p, MetricPoint):
            out.append(p)
    return out


# --- baselines -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    run: RunRecord
    source: str  # "inventory" (containers.CT.baseline) | "marked good"

    @property
    def label(self) -> str:
        return f"{self.run.ct}/{self.run.name}"


def resolve_baseline(inv: Inventory | None, reg: Registry, run: RunRecord) -> Baseline | None:
    """The container's `baseline:` in the inventory wins; else the most recent run marked good (on
    the same container first), never the run itself."""
    spec = inv.model.containers.get(run.ct) if inv is not None else None
    if spec is not None and spec.baseline:
        name = spec.baseline
        try:
            base = reg.find_run(name if "/" in name or name.startswith("#") else f"{run.ct}/{name}")
        except InputError:
            try:
                base = reg.find_run(name)
            except InputError:
                assert inv is not None
                raise InputError(f"{inv.path}: containers.{run.ct}.baseline: no run {name!r} in the registry "
                                 "(`ctl runs` lists them)") from None
        if base.id != run.id:
            return Baseline(base, "inventory")
    good = [r for r in reg.runs(None, limit=100_000) if r.good and r.id != run.id]
    same_ct = [r for r in good if r.ct == run.ct]
    pick = same_ct or good
    return Baseline(pick[0], "marked good") if pick else None


# --- judgement -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunStatus:
    """One line of `ctl status`: the run, its newest point, its tok/s history and the verdict."""

    run: RunRecord
    verdict: Verdict
    last: MetricPoint | None
    tok_s_history: tuple[float | None, ...]
    baseline: str | None
    pull: PullResult | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "ct": self.run.ct, "run": self.run.name, "state": self.run.state, "verdict": v.state.label,
            "reason": v.reason, "exit_code": int(v.exit_code), "step": v.step, "tok_s": v.tok_s,
            "baseline": self.baseline, "baseline_tok_s": v.baseline_tok_s, "ratio": v.ratio,
            "idle_s": v.idle_s, "crash": v.crash,
            "loss": self.last.loss if self.last else None, "eta_s": self.last.eta_s if self.last else None,
            "last_tok_s": self.last.tok_s if self.last else None,
            "pull": self.pull.to_json() if self.pull else None, "error": self.error,
        }


def judge(
    run: RunRecord, points: list[MetricPoint], baseline: tuple[str, float] | None, *,
    pull: PullResult | None, slow_ratio: float = 0.8, stall_after_s: float = 600.0,
) -> Verdict:
    """metrics.verdict for a registry run: ended states from the record, idle time on the container's
    clock (log mtime vs the agent's now), so a skewed operator clock cannot fake a stall."""
    exit_status = run.exit_status if run.state in ("finished", "failed") else None
    crash = run.crash or (pull.crash if pull else None)
    stopped_crash = None
    if run.state == "stopped":  # SIGINT leaves a KeyboardInterrupt traceback: the operator's, not a crash
        stopped_crash, crash = crash, None
    if run.state == "lost":
        crash = crash or "session lost"
    now = pull.remote_now if pull and pull.remote_now is not None else time.time()
    last_time = pull.log_mtime if pull else None
    if run.state not in ("starting", "running") and exit_status is None and crash is None:
        exit_status = 0  # ended without a status (should not happen): judge what it logged
    v = verdict(points, baseline_tok_s=baseline[1] if baseline else None, now=now, last_step_time=last_time,
                slow_ratio=slow_ratio, stall_after_s=stall_after_s,
                exit_status=0 if run.state == "stopped" else exit_status, crash=crash,
                baseline_name=baseline[0] if baseline else None)
    if run.state == "stopped" and v.state == RunState.FINISHED:
        v = replace(v, reason=v.reason.replace("finished", "stopped by ctl stop", 1)
                    + (f" (log shows {stopped_crash})" if stopped_crash else ""))
    return v


def baseline_rate(reg: Registry, base: Baseline | None) -> tuple[str, float] | None:
    """(label, steady-state tok/s) of the baseline's stored points; None without points."""
    if base is None:
        return None
    rate = steady_state(stored_points(reg, base.run))
    return (base.label, rate) if rate else None


def status_of(
    run: RunRecord, reg: Registry, baseline: tuple[str, float] | None, *, pull: PullResult | None,
    slow_ratio: float, stall_after_s: float, error: str | None = None,
) -> RunStatus:
    points = stored_points(reg, run)
    v = judge(run, points, baseline, pull=pull, slow_ratio=slow_ratio, stall_after_s=stall_after_s)
    last = max(points, key=lambda p: p.step) if points else None
    return RunStatus(run, v, last, tuple(p.tok_s for p in points[-20:]), baseline[0] if baseline else None,
                     pull, error)
