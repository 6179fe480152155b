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

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from controller.commands.fanout import Flow, Outcome, Read, fanout, flows
from controller.commands.reconcile import checked_states, record_states, refresh, settle, state_request
from controller.core.metrics import (
    LogCursor,
    MetricPoint,
    RunState,
    Verdict,
    combine_nodes,
    has_rate,
    median,
    point_of,
    steady_state,
    verdict,
    verdict_of_window,
    warmup_skip,
)
from controller.errors import BusyError, CtlError, ExitCode, InputError
from controller.inventory import Container, Inventory
from controller.lifecycle import Lifecycle
from controller.registry import Registry, RunRecord
from controller.remote.client import Agent, AgentReplyError
from controller.settings import DEFAULT_CHECKPOINT_GLOB, checkpoint_glob
from controller.transport.base import Transport
from controller.transport.pool import Pool

DEFAULT_CHUNK = 8 << 20  # log bytes per agent call


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


class _Pull:
    """One run's pull in steps, so that its first read can travel in a batched `poll` call with the other runs
    of its container: `args()` for the next read, `take()` for what it brought, `result()` at the end."""

    def __init__(self, reg: Registry, run: RunRecord, *, chunk: int, checkpoints: str | None, hashes: bool) -> None:
        if run.log_path is None:
            raise InputError(f"run {run.ct}/{run.name} has no log path recorded")
        if chunk < 1:
            raise InputError(f"chunk must be at least 1 byte, got {chunk}")
        self.reg, self.run, self.chunk, self.checkpoints, self.hashes = reg, run, chunk, checkpoints, hashes
        self.offset, self.ident, self.partial = reg.cursor(run.id)
        self.start = self.offset
        self.cursor: LogCursor | None = None
        self.reset: str | None = None
        self.fetched = self.wire_in = self.wire_out = self.calls = self.new_points = 0
        self.last: MetricPoint | None = None
        self.crash = run.crash
        self.header: dict[str, Any] = {}
        self.found: dict[str, Any] = {}

    def args(self, max_bytes: int | None = None) -> dict[str, Any]:
        """logread's arguments for the next read, of at most `max_bytes` (default: the chunk) log bytes; the
        hashes of files and checkpoints travel with the first."""
        args: dict[str, Any] = {"offset": self.offset, "ident": self.ident, "max_bytes": max_bytes or self.chunk}
        if self.calls == 0 and self.hashes:
            args.update(_hash_args(self.reg, self.run, self.checkpoints))
        return args

    def take(self, agent: Agent, header: dict[str, Any], data: bytes, wire_in: int, wire_out: int) -> bool:
        """Store what one read brought (points and cursor in one transaction); True while more of the log is
        waiting (its size is past what was read)."""
        run = self.run
        self.calls += 1
        self.wire_in += wire_in
        self.wire_out += wire_out
        if not header.get("ok"):
            if header.get("code") == "missing":
                raise InputError(f"{run.ct}: log {run.log_path} of run {run.name} does not exist")
            raise CtlError(f"{run.ct}: cannot read {run.log_path}: {header.get('error')}")
        _check_header(agent, header)
        self.header = header
        if self.calls == 1:
            self.found = header
        if header.get("reset"):
            self.reset, self.partial, self.start, self.cursor = header["reset"], b"", 0, None
        if self.cursor is None:
            self.cursor = LogCursor(offset=int(header["offset"]) - len(self.partial))
            self.cursor.feed(self.partial)
        cursor = self.cursor
        entries = cursor.feed_lines(data, now=header.get("now"))
        self.fetched += len(data)
        new_offset = int(header["offset"]) + len(data)
        keep = new_offset - cursor.offset  # bytes of the unfinished last line
        pending = self.partial + data
        new_partial = pending[len(pending) - keep:] if keep else b""
        points = [e for e in entries if isinstance(e, MetricPoint)]
        unchanged = (new_offset, header["ident"], new_partial) == (self.offset, self.ident, self.partial)
        # nothing new (a quiet log between two polls): no write transaction, so a supervisor's polls of idle runs
        # cost the registry nothing
        if not (unchanged and not points) and not self.reg.advance_cursor(
                run.id, (self.offset, self.ident), new_offset, header["ident"], new_partial,
                [p.record() for p in points]):
            raise BusyError(f"another `ctl` is pulling run {run.ct}/{run.name} right now; try again")
        self.offset, self.ident, self.partial = new_offset, header["ident"], new_partial
        self.new_points += len(points)
        self.last = points[-1] if points else self.last
        if cursor.crash and self.crash is None:
            self.crash = cursor.crash
            self.reg.update_run(run.id, crash=self.crash)
        return self.offset < int(header["size"])

    def finish(self, agent: Agent) -> PullResult:
        """Read on, `chunk` bytes per logread call, until caught up; then the result."""
        while True:
            header, data, n_in, n_out = agent.read("logread", {"log": self.run.log_path, **self.args()})
            if not self.take(agent, header, data, n_in, n_out) or not data:
                return self.result()

    def result(self) -> PullResult:
        run, header = self.run, self.header
        files_changed, ckpts = _store_hashes(self.reg, run, self.found) if self.hashes else ((), {})
        return PullResult(
            run=f"{run.ct}/{run.name}", start=self.start, offset=self.offset, size=int(header["size"]),
            fetched=self.fetched, wire_in=self.wire_in, wire_out=self.wire_out, calls=self.calls,
            new_points=self.new_points, reset=self.reset, crash=self.crash, last=self.last,
            log_mtime=header.get("mtime"), remote_now=header.get("now"), files_changed=files_changed,
            checkpoints=ckpts,
        )


def pull(
    t: Transport, reg: Registry, run: RunRecord, *, chunk: int = DEFAULT_CHUNK,
    checkpoints: str | None = DEFAULT_CHECKPOINT_GLOB, hashes: bool = True,
) -> PullResult:
    """Fetch the log bytes after the run's cursor (looping `chunk` bytes per call until caught up),
    store the new metric points and the cursor after each call, and note crash signatures."""
    return _Pull(reg, run, chunk=chunk, checkpoints=checkpoints, hashes=hashes).finish(Agent.of(t))


def _check_header(agent: Agent, header: dict[str, Any]) -> None:
    """A logread header with what pull reads from it, of the types it reads (else one line naming the CT)."""
    for key, kind in (("offset", int), ("size", int), ("ident", str)):
        agent.need(header, key, kind)
    if not isinstance(header.get("reset"), str | None) or not all(
            isinstance(header.get(k), float | int | None) for k in ("now", "mtime")):
        raise AgentReplyError(f"{agent.name}: agent logread: reply header has a malformed reset, now or mtime")
    for key in ("files", "checkpoints"):
        hashes = header.get(key) or {}
        if not isinstance(hashes, dict) or not all(
                h is None or (isinstance(h, dict) and isinstance(h.get("sha256"), str)
                              and isinstance(h.get("size"), int) and isinstance(h.get("mtime_ns"), int))
                for h in hashes.values()):
            raise AgentReplyError(f"{agent.name}: agent logread: reply header has malformed {key!r}")


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
    if reg.run_files(run.id, "deployed") != files:  # written only when something changed: one poll, one write
        reg.set_run_files(run.id, "deployed", files)
    changed = tuple(p for p, h in sorted(files.items()) if h is None or h.get("sha256") != run.files.get(p))
    ckpts: dict[str, dict[str, Any]] = header.get("checkpoints") or {}
    if "checkpoints" in header and reg.run_files(run.id, "checkpoint") != ckpts:
        reg.set_run_files(run.id, "checkpoint", dict(ckpts))
    return changed, {p: h["sha256"] for p, h in sorted(ckpts.items())}


# --- stored points -------------------------------------------------------------------------------


def stored_points(reg: Registry, run: RunRecord) -> list[MetricPoint]:
    """The run's points from the registry, as MetricPoints (their JSON-lines form read back). A run across
    several containers: its nodes' points, one per step, tok/s summed (metrics.combine_nodes)."""
    if run.multi:
        return combine_nodes([stored_points(reg, m) for m in reg.members(run.id)])
    return _decoded(reg.points(run.id))


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
    pick = reg.baseline(run.key or run.ct, other_than=run.id)
    return Baseline(pick, "marked good") if pick is not None else None


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
    nodes: tuple[dict[str, Any], ...] = ()  # a run across several containers: each node's state, step, tok/s

    @property
    def eta_s(self) -> float | None:
        """Time left by the newest point's ETA, while the run is live: a run that ended has none."""
        return self.last.eta_s if self.last is not None and self.run.state.live else None

    @property
    def no_ratio_why(self) -> str | None:
        """Why there is no ratio to the baseline (None when there is one): what the empty column says."""
        if self.verdict.ratio is not None:
            return None
        if self.baseline is None:
            return "no baseline marked (ctl mark-good RUN)"
        return "no steady tok/s yet"

    def to_json(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "nodes": list(self.nodes) or None,
            "ct": self.run.ct, "key": self.run.key, "run": self.run.name, "state": self.run.state,
            "verdict": v.state.label,
            "reason": v.reason, "exit_code": int(v.exit_code), "step": v.step, "tok_s": v.tok_s,
            "baseline": self.baseline, "baseline_tok_s": v.baseline_tok_s, "ratio": v.ratio,
            "idle_s": v.idle_s, "crash": v.crash,
            "loss": self.last.loss if self.last else None, "eta_s": self.eta_s, "no_ratio_why": self.no_ratio_why,
            "last_tok_s": self.last.tok_s if self.last else None,
            "pull": self.pull.to_json() if self.pull else None, "error": self.error,
        }


@dataclass(frozen=True)
class PointWindow:
    """What judging a run reads of its stored points (a long run holds tens of thousands: they are never all
    decoded for a verdict): the tok/s of the last window of steady points, the point of the highest step, the
    newest point time, and the tok/s of the last `history` points for the trend (None where a point has none,
    or NaN: SQLite keeps NaN as NULL)."""

    steady_rates: tuple[float, ...]
    top: MetricPoint | None
    last_time: float | None
    history: tuple[float | None, ...]


def _decoded(records: list[dict[str, Any]]) -> list[MetricPoint]:
    return [p for p in map(point_of, records) if p is not None]


def point_window(reg: Registry, run: RunRecord, *, window: int = 20, history: int = 20,
                 last_time: bool = True) -> PointWindow:
    """The run's PointWindow, in a few indexed reads however many points it has: what `verdict` would take from
    `stored_points` (the same steady window, step and time). Only the top point is decoded: the rates come from
    the index's own column. The newest point time (a read of every point) only `last_time`: a verdict needs it
    only when no pull says when the log grew."""
    n = reg.point_count(run.id)
    top = _decoded([rec for rec in [reg.top_point(run.id)] if rec is not None])
    return PointWindow(tuple(reg.steady_rates(run.id, skip=warmup_skip(n), last=window)), top[0] if top else None,
                       reg.last_point_time(run.id) if last_time else None, tuple(reg.recent_rates(run.id, history)))


def judge(
    run: RunRecord, points: PointWindow, baseline: tuple[str, float] | None, *,
    pull: PullResult | None, slow_ratio: float = 0.8, stall_after_s: float = 600.0,
) -> Verdict:
    """metrics.verdict for a registry run: ended states from the record, idle time on the container's
    clock (log mtime vs the agent's now), so a skewed operator clock cannot fake a stall."""
    exit_status = run.exit_status if run.state in (Lifecycle.FINISHED, Lifecycle.FAILED) else None
    crash = run.crash or (pull.crash if pull else None)
    stopped_crash = None
    if run.state == Lifecycle.STOPPED:  # SIGINT leaves a KeyboardInterrupt traceback: the operator's, not a crash
        stopped_crash, crash = crash, None
    if run.state == Lifecycle.LOST:
        crash = crash or "session lost"
    now = pull.remote_now if pull and pull.remote_now is not None else time.time()
    last_time = pull.log_mtime if pull else None
    if not run.state.live and exit_status is None and crash is None:
        exit_status = 0  # ended without a status (should not happen): judge what it logged
    v = verdict_of_window(
        points.steady_rates, step=points.top.step if points.top else None,
        baseline_tok_s=baseline[1] if baseline else None,
        now=now, last_step_time=last_time if last_time is not None else points.last_time, slow_ratio=slow_ratio,
        stall_after_s=stall_after_s, exit_status=0 if run.state == Lifecycle.STOPPED else exit_status, crash=crash,
        baseline_name=baseline[0] if baseline else None)
    if run.state == Lifecycle.STOPPED and v.state == RunState.FINISHED:
        v = replace(v, reason=v.reason.replace("finished", "stopped by ctl stop", 1)
                    + (f" (log shows {stopped_crash})" if stopped_crash else ""))
    return v


def baseline_rate(reg: Registry, base: Baseline | None) -> tuple[str, float] | None:
    """(label, steady-state tok/s) of the baseline's stored points; None without points."""
    if base is None:
        return None
    if base.run.multi:  # its nodes' points, combined
        whole = steady_state(stored_points(reg, base.run))
        return (base.label, whole) if whole else None
    n = reg.point_count(base.run.id)
    rates = reg.steady_rates(base.run.id, skip=warmup_skip(n))  # steady_state of its points, without decoding them
    rate = median(rates) if rates else None
    return (base.label, rate) if rate else None


def status_of(
    run: RunRecord, reg: Registry, baseline: tuple[str, float] | None, *, pull: PullResult | None,
    slow_ratio: float, stall_after_s: float, error: str | None = None, unreachable: str | None = None,
) -> RunStatus:
    """One run's status line. `unreachable` (why its container did not answer) makes the verdict UNREACHABLE:
    the stored points still give step and rate, but no stall or crash is concluded from the silence."""
    points = point_window(reg, run, last_time=pull is None or pull.log_mtime is None)
    v = judge(run, points, baseline, pull=pull, slow_ratio=slow_ratio, stall_after_s=stall_after_s)
    if unreachable is not None:
        v = replace(v, state=RunState.UNREACHABLE, idle_s=None,
                    reason=f"{unreachable}; recorded state {run.state} kept")
    return RunStatus(run, v, points.top, points.history, baseline[0] if baseline else None, pull, error)


# --- several runs, one connection pool, one agent call per container ------------------------------


@dataclass(frozen=True)
class Polled:
    """What one poll of several runs found: each run as recorded after its container answered, each pull
    (or why there is none), and the containers that did not answer."""

    runs: dict[int, RunRecord]
    pulls: dict[int, PullResult | str]
    #: containers whose host did not answer (connection refused, dropped, past its deadline: exit 5), with why
    unreachable: dict[str, str]
    warnings: tuple[str, ...]
    failed: frozenset[str] = frozenset()  # containers whose call failed, for whatever reason


def poll_many(inv: Inventory, reg: Registry, pool: Pool, recs: list[RunRecord], checkpoints: str | None, *,
              states: bool = True, budget: int = DEFAULT_CHUNK) -> Polled:
    """Refresh the live runs' states (with `states`) and pull every run's new log bytes, with ONE agent call
    (`poll`) per container for all of its runs, every container's call in flight together through its host's
    session (fanout.flows), so a poll of many runs costs one SSH connection per host and one round trip per
    container. The log bytes of one container's call stay within `budget`, shared evenly; a run with more to
    read (a first pull of a long log) reads on with logread calls of its own."""
    by_ct: dict[str, list[RunRecord]] = {}
    for r in recs:
        if r.ct in inv.model.containers and (r.log_path or (states and r.state.live)):
            by_ct.setdefault(r.ct, []).append(r)
    pulls: dict[int, PullResult | str] = {r.id: f"container {r.ct} is not in the inventory" for r in recs
                                          if r.ct not in inv.model.containers}
    runs = {r.id: r for r in recs}
    if not by_ct:
        return Polled(runs, pulls, {}, ())

    # The registry is read and written here, in the calling thread; the fan-out's threads only talk to the
    # containers. A thread's first registry access opens its own SQLite connection (a schema parse: ~0.3 ms of
    # CPU, while a poll's own work is about as much), and a fan-out starts a thread per container. Only a pull
    # with more log than one call's budget (a first pull of a long log) reads on, and stores, in a fan-out thread.
    asked: dict[str, list[dict[str, Any]]] = {}
    pulling: dict[int, _Pull] = {}
    for name, mine in by_ct.items():
        for r in mine:
            if r.log_path:
                try:
                    pulling[r.id] = _Pull(reg, r, chunk=budget, checkpoints=checkpoints, hashes=True)
                except CtlError as e:
                    pulls[r.id] = str(e)
        share = max(1, budget // max(1, sum(r.id in pulling for r in mine)))  # one long log starves no other run
        asked[name] = [{**state_request(r), "state": states and r.state.live,
                        "read": pulling[r.id].args(share) if r.id in pulling else None} for r in mine]

    def ask(ct: Container, agent: Agent) -> Flow[tuple[Agent, list[Any], int, int]]:
        got = yield Read("poll", Agent.poll_args(asked[ct.name], budget))
        return agent, *agent.poll_answer(asked[ct.name], got)

    def store(name: str, agent: Agent, answers: list[Any], n_in: int, n_out: int) -> list[_Pull]:
        """Record what one container answered; the pulls with more to read than this call's budget."""
        mine = by_ct[name]
        live = [r for r in mine if states and r.state.live]
        if live:
            said = [st for r, (st, _) in zip(mine, answers, strict=True) if r in live]
            runs.update({r.id: r for r in record_states(reg, mine, live, checked_states(name, said, len(live)))})
        reads = [(r, read) for r, (_, read) in zip(mine, answers, strict=True) if read is not None]
        more = []
        for r, (header, data) in reads:
            p = pulling[r.id]
            # the call's bytes, shared out: each run's own log bytes, and an equal part of the rest
            share_in, share_out = n_in // len(reads), (n_out - sum(len(d) for _, (_, d) in reads)) // len(reads)
            if header.get("code") == "missing" and r.state == Lifecycle.STARTING:
                continue  # a launch still starting has no log yet: nothing to pull, nothing wrong
            try:
                if p.take(agent, header, data, share_in, share_out + len(data)):
                    more.append(p)  # past this call's budget: read on below
                else:
                    pulls[r.id] = p.result()
            except CtlError as e:
                pulls[r.id] = str(e)
        return more

    def read_on(ct: Container, t: Transport) -> dict[int, PullResult | str]:
        agent = Agent.of(t)
        got: dict[int, PullResult | str] = {}
        for p in going[ct.name]:
            try:
                got[p.run.id] = p.finish(agent)
            except CtlError as e:
                got[p.run.id] = str(e)
        return got

    unreachable: dict[str, str] = {}
    warnings: list[str] = []
    outcomes = flows(pool, [inv.container(c) for c in by_ct], ask)
    going: dict[str, list[_Pull]] = {}
    for i, o in enumerate(outcomes):
        if o.value is not None:
            try:
                going[o.ct] = store(o.ct, *o.value)
                continue
            except CtlError as e:  # what the container said of its runs' states is malformed
                o = outcomes[i] = Outcome(o.ct, None, str(e), int(e.exit_code))
        why = o.error or "failed"
        if states:
            warnings.append(f"{o.ct}: state not refreshed: {why}")
        if o.exit_code == int(ExitCode.CONNECTION):
            unreachable[o.ct] = why
        pulls.update({r.id: why for r in by_ct[o.ct] if r.log_path})
    going = {name: ps for name, ps in going.items() if ps}
    if going:  # rare: a first pull of a long log, read on a chunk per call
        for rest in fanout(pool, [inv.container(c) for c in going], read_on):
            pulls.update(rest.value if rest.value is not None
                         else {p.run.id: rest.error or "failed" for p in going[rest.ct]})
    return Polled(runs, pulls, unreachable, tuple(warnings), frozenset(o.ct for o in outcomes if not o.ok))


def pull_many(inv: Inventory, reg: Registry, pool: Pool, recs: list[RunRecord], checkpoints: str | None
              ) -> dict[int, PullResult | str]:
    """Pull every run whose container is in the inventory: {run id: PullResult, or why it was not pulled}.
    One agent call per container (poll_many without the state refresh). A run across several containers is
    pulled node by node (the answers are keyed by the nodes' ids)."""
    recs = [m for r in recs for m in (reg.members(r.id) if r.multi else [r])]
    polled = poll_many(inv, reg, pool, recs, checkpoints, states=False)
    return {r.id: polled.pulls[r.id] for r in recs if r.id in polled.pulls}


def baseline_for(inv: Inventory, reg: Registry, pool: Pool, rec: RunRecord, checkpoints: str | None
                 ) -> tuple[tuple[str, float] | None, str | None]:
    """(the baseline's (label, steady tok/s), a warning): its points are pulled first if none are stored."""
    base = resolve_baseline(inv, reg, rec)
    if base is None:
        return None, None
    warning = None
    if not reg.points(base.run.id):
        got = pull_many(inv, reg, pool, [base.run], checkpoints).get(base.run.id)
        if isinstance(got, str):
            warning = f"baseline {base.label}: no points stored and pull failed: {got}"
    return baseline_rate(reg, base), warning


@dataclass(frozen=True)
class StatusReport:
    statuses: tuple[RunStatus, ...]
    warnings: tuple[str, ...]


def statuses(inv: Inventory, reg: Registry, pool: Pool, recs: list[RunRecord], *, slow_ratio: float,
             stall_after_s: float, checkpoints: str | None) -> StatusReport:
    """`ctl status` and each poll of `ctl supervise`: refresh the runs' states, pull their new log bytes (and
    those of any baseline with no points stored yet) and judge each run against its baseline, in one agent call
    per container over one connection per host. A run across several containers is polled through its nodes,
    then settled (reconcile.settle: a node that ended badly makes it CRASHED, its surviving nodes are stopped)
    and judged whole.

    A live run whose container did not answer, or whose log could not be read, is UNREACHABLE: judged on stale
    points it would look stalled, and nothing is known of it but that."""
    bases = {r.id: resolve_baseline(inv, reg, r) for r in recs}
    members = {r.id: reg.members(r.id) for r in recs if r.multi}
    asked = {m.id: m for r in recs for m in members.get(r.id) or ([] if r.multi else [r])}
    for b in bases.values():  # a baseline with no points is read in the same calls
        nodes = reg.members(b.run.id) if b is not None and b.run.multi else [b.run] if b is not None else []
        if nodes and not any(m.id in asked for m in nodes) and not any(reg.point_count(m.id) for m in nodes):
            asked.update({m.id: m for m in nodes})
    polled = poll_many(inv, reg, pool, list(asked.values()), checkpoints)
    warnings = list(polled.warnings)
    rates: dict[int, tuple[str, float] | None] = {}
    for b in {b.run.id: b for b in bases.values() if b is not None}.values():
        got = [polled.pulls.get(m.id) for m in (reg.members(b.run.id) if b.run.multi else [b.run])]
        bad = next((g for g in got if isinstance(g, str)), None)
        if bad is not None and not any(reg.point_count(m.id) for m in (reg.members(b.run.id) if b.run.multi
                                                                       else [b.run])):
            warnings.append(f"baseline {b.label}: no points stored and pull failed: {bad}")
        rates[b.run.id] = baseline_rate(reg, b)
    job_silent: dict[int, str] = {}
    for r in recs:  # runs across several containers: settled from what their nodes said
        ms = [polled.runs.get(m.id, m) for m in members.get(r.id, [])]
        if not ms or not (r.state.live or any(m.state.live for m in ms)):
            continue
        quiet = [m for m in ms if m.ct in polled.unreachable and m.state.live]
        if quiet:  # one node unknown: the whole run is (its recorded state is kept)
            job_silent[r.id] = f"host did not answer: node {quiet[0].ct}: {polled.unreachable[quiet[0].ct]}"
            continue
        if any(m.ct in polled.failed for m in ms):
            continue  # a node could not be asked: nothing is concluded from the others alone
        try:
            settle(inv, reg, pool, r, ms)
        except CtlError as e:
            warnings.append(f"{r.ct}/{r.name}: not settled: {e}")
    out = []
    for r in (reg.run_by_id(r.id) for r in recs):  # re-read: states and crash signatures the poll recorded
        base = bases[r.id]
        rate = rates[base.run.id] if base is not None else None
        if r.multi:
            silent = job_silent.get(r.id) if r.state.live else None
            st = job_status(r, reg, rate, polled.pulls, slow_ratio=slow_ratio, stall_after_s=stall_after_s,
                            unreachable=silent)
            if st.error and r.state.live and silent is None:
                warnings.append(f"{r.ct}/{r.name}: metrics not pulled: {st.error}")
            out.append(st)
            continue
        res = polled.pulls.get(r.id)
        silent = None
        if r.state.live and r.ct in polled.unreachable:
            silent = f"host did not answer: {polled.unreachable[r.ct]}"
        elif isinstance(res, str) and r.state.live:
            silent = f"its log could not be read: {res}"
            warnings.append(f"{r.ct}/{r.name}: metrics not pulled: {res}")
        st = status_of(r, reg, rate, pull=None if isinstance(res, str) else res, slow_ratio=slow_ratio,
                       stall_after_s=stall_after_s, error=res if isinstance(res, str) else silent, unreachable=silent)
        out.append(st)
    return StatusReport(tuple(out), tuple(warnings))


JOB_WINDOW = 20  # steady points a verdict judges (core.metrics.verdict's window)
JOB_WHOLE_MAX = 2000  # a job run's nodes with at most this many points each are judged from all of them


@dataclass(frozen=True)
class _JobPoints:
    """What judging a run across several containers reads of its nodes' stored points. `combined`: all of them,
    one per step (`whole`), or, for a long run, those of the newest steps that every node's last points reach,
    so that a status of a weeks-long run decodes about a hundred points per node, not all."""

    combined: list[MetricPoint]
    whole: bool
    reporting: set[int]  # the nodes (member ids) that logged any point
    top_step: int | None
    last_time: float | None  # the newest time of the combined points (the newest steps')
    node_step: dict[int, int | None]
    node_tok_s: dict[int, float | None]


def _job_points(reg: Registry, members: list[RunRecord]) -> _JobPoints:
    counts = {m.id: reg.point_count(m.id) for m in members}
    reporting = {i for i, n in counts.items() if n}
    most = max(counts.values(), default=0)
    k = 2 * JOB_WINDOW
    while most > JOB_WHOLE_MAX and k <= most // 4:  # a quarter of the points: well past the warm-up (a tenth)
        # From the highest step down to where every reporting node has k points, k doubled until those steps hold
        # a whole steady window (points without a usable rate do not count) and the trend's last 20.
        # (A node with fewer than k points is read whole from there on: its points fix no start.)
        starts = [s for i in reporting if counts[i] >= k and (s := reg.step_from_top(i, k)) is not None]
        if not starts:
            break
        combined = combine_nodes([_decoded(reg.points_from_step(m.id, max(starts))) for m in members])
        steady = sum(1 for p in combined if has_rate(p))
        if steady >= JOB_WINDOW and len(combined) >= JOB_WINDOW:
            tops = {m.id: reg.top_point(m.id) for m in members}
            times = [p.time for p in combined if p.time is not None]  # as the whole: first logged of each step
            rates = {m.id: reg.steady_rates(m.id, skip=warmup_skip(counts[m.id])) for m in members}
            return _JobPoints(combined, False, reporting,
                              max((int(t["step"]) for t in tops.values() if t is not None), default=None),
                              max(times) if times else None,
                              {i: int(t["step"]) if t is not None else None for i, t in tops.items()},
                              {i: median(r) if r else None for i, r in rates.items()})
        k *= 2
    per = {m.id: stored_points(reg, m) for m in members}
    combined = combine_nodes(list(per.values()))
    return _JobPoints(combined, True, reporting, max((p.step for p in combined), default=None), None,
                      {i: max((p.step for p in ps), default=None) for i, ps in per.items()},
                      {i: steady_state(ps) for i, ps in per.items()})


def job_status(run: RunRecord, reg: Registry, baseline: tuple[str, float] | None,
               pulled: dict[int, PullResult | str], *, slow_ratio: float, stall_after_s: float,
               unreachable: str | None = None) -> RunStatus:
    """A run across several containers, judged whole: its nodes' points combined (tok/s summed), against the
    run's baseline; STALLED by the node whose log has been quiet longest, CRASHED by the node that ended it (or
    whose log shows a crash), each named."""
    members = reg.members(run.id)
    stored = _job_points(reg, members)
    points = stored.combined
    crash = run.crash
    stopped_crash = None
    if run.state == Lifecycle.STOPPED:
        stopped_crash, crash = crash, None
    if crash is None and run.state.live:
        for m in members:
            res = pulled.get(m.id)
            seen = m.crash or (res.crash if isinstance(res, PullResult) else None)
            if seen:
                crash = f"{m.ct}: {seen}"
                break
    if crash is None and run.state in (Lifecycle.CRASHED, Lifecycle.LOST, Lifecycle.FAILED):
        crash = "a node ended badly"
    exit_status = 0 if run.state in (Lifecycle.FINISHED, Lifecycle.STOPPED) else None
    idle: dict[str, float] = {}
    # The DFlash payload logs metric lines on node 0 alone (its tok/s covers every node); the other nodes' logs go
    # quiet after their first lines by design. Once any node has logged a point, only such nodes can stall the run.
    reporting = stored.reporting
    for m in members:
        res = pulled.get(m.id)
        if reporting and m.id not in reporting:
            continue
        if isinstance(res, PullResult) and res.remote_now is not None and res.log_mtime is not None and m.state.live:
            idle[m.ct] = res.remote_now - res.log_mtime  # each on its own container's clock
    stalest = max(idle, key=lambda c: idle[c]) if idle else None
    rate, name = (baseline[1], baseline[0]) if baseline else (None, None)
    now = idle[stalest] if stalest else time.time()
    if stored.whole:
        v = verdict(points, baseline_tok_s=rate, now=now, last_step_time=0.0 if stalest else None,
                    slow_ratio=slow_ratio, stall_after_s=stall_after_s, exit_status=exit_status, crash=crash,
                    baseline_name=name)
    else:  # the newest steps only: far past the warm-up, whose first points it therefore needs not skip
        steady = [p.tok_s for p in points if has_rate(p) and p.tok_s is not None][-JOB_WINDOW:]
        v = verdict_of_window(steady, step=stored.top_step, baseline_tok_s=rate, now=now,
                              last_step_time=0.0 if stalest else stored.last_time, slow_ratio=slow_ratio,
                              stall_after_s=stall_after_s, exit_status=exit_status, crash=crash, baseline_name=name)
    nodes = f"{len(members)} nodes: "
    if v.state == RunState.STALLED and stalest:
        v = replace(v, reason=f"{stalest}: {v.reason}")
    elif run.state == Lifecycle.STOPPED and v.state == RunState.FINISHED:
        v = replace(v, reason=v.reason.replace("finished", "stopped by ctl stop", 1)
                    + (f" (log shows {stopped_crash})" if stopped_crash else ""))
    v = replace(v, reason=nodes + v.reason)
    errors = [f"{m.ct}: {res}" for m in members if isinstance(res := pulled.get(m.id), str)]
    if unreachable is not None:
        v = replace(v, state=RunState.UNREACHABLE, idle_s=None,
                    reason=f"{unreachable}; recorded state {run.state} kept")
    per_node = tuple({"ct": m.ct, "node_rank": m.node_rank, "state": str(m.state), "exit_status": m.exit_status,
                      "crash": m.crash, "idle_s": idle.get(m.ct),
                      "step": stored.node_step[m.id], "tok_s": stored.node_tok_s[m.id]} for m in members)
    last = max(points, key=lambda p: p.step) if points else None
    return RunStatus(run, v, last, tuple(p.tok_s for p in points[-20:]), baseline[0] if baseline else None,
                     None, "; ".join(errors) or unreachable, per_node)


def watch(inv: Inventory, reg: Registry, pool: Pool, rec: RunRecord, *, until_step: int | None,
          limit_s: float | None, for_text: str | None, every_s: float, slow_ratio: float, stall_s: float,
          checkpoints: str | None, tick: Callable[[RunStatus], None] | None = None) -> tuple[RunStatus, str]:
    """Pull every `every_s` until the step, the time limit, the run's end or a stall: (RunStatus, why it ended).
    Shared by `ctl watch` and the runbook's `watch` step, so both judge a run the same way."""
    multi = rec.multi
    ct = None if multi else inv.container(rec.ct)
    t = None if ct is None else pool.container(ct)
    t0 = time.monotonic()
    base, _warning = baseline_for(inv, reg, pool, rec, checkpoints)
    while True:
        if ct is None or t is None:  # a run across several containers: its nodes, settled and judged whole
            st = statuses(inv, reg, pool, [reg.run_by_id(rec.id)], slow_ratio=slow_ratio, stall_after_s=stall_s,
                          checkpoints=checkpoints).statuses[0]
            rec = st.run
        else:
            rec = refresh(inv, ct, t, reg, [reg.run_by_id(rec.id)])[0]
            res = pull(t, reg, rec, checkpoints=checkpoints)
            rec = reg.run_by_id(rec.id)
            st = status_of(rec, reg, base, pull=res, slow_ratio=slow_ratio, stall_after_s=stall_s)
        v = st.verdict
        if tick is not None:
            tick(st)
        why = ""
        if until_step is not None and v.step is not None and v.step >= until_step:
            why = f"reached step {v.step}"
        elif not rec.state.live or v.state in (RunState.CRASHED, RunState.FINISHED):
            why = f"run ended ({rec.state})"
        elif v.state == RunState.STALLED:
            why = "run stalled"
        elif limit_s is not None and time.monotonic() - t0 >= limit_s:
            why = f"watched for {for_text}"
        if why:
            return st, why
        time.sleep(every_s)


# --- the baseline ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MarkResult:
    run: RunRecord
    good: bool
    forced: bool
    why: str  # what made the run acceptable (or what --force overrode)


def mark_good(inv: Inventory | None, reg: Registry, pool: Pool | None, rec: RunRecord, *, good: bool = True,
              force: bool = False, checkpoints: str | None = None) -> MarkResult:
    """Make `rec` the baseline later runs are judged against, but only a run that can be one: it finished
    cleanly (exit 0), or it is live and judged OK against its own baseline now. A run stopped for being slow,
    crashed or lost would make every later run look fine. `force` overrides; the run's note records it."""
    if not good:
        reg.mark_good(rec.id, False)
        return MarkResult(reg.run_by_id(rec.id), False, False, "unmarked")
    why = _fit_for_baseline(inv, reg, pool, rec, checkpoints)
    if why.startswith("ok: "):
        reg.mark_good(rec.id, True)
        return MarkResult(reg.run_by_id(rec.id), True, False, why[4:])
    if not force:
        raise InputError(f"{rec.ct}/{rec.name} cannot be the baseline: {why}; only a run that finished with exit 0, "
                         "or a live run judged OK, can be marked good (--force marks it anyway, and says so)")
    reg.mark_good(rec.id, True)
    note = f"marked good with --force: {why}"
    return MarkResult(reg.update_run(rec.id, note=f"{rec.note}; {note}" if rec.note else note), True, True, why)


def _fit_for_baseline(inv: Inventory | None, reg: Registry, pool: Pool | None, rec: RunRecord,
                      checkpoints: str | None) -> str:
    """'ok: <why>' when the run can be a baseline, else why not."""
    if rec.state == Lifecycle.FINISHED and rec.exit_status == 0:
        return "ok: finished with exit 0" if not rec.crash else f"it finished but its log shows {rec.crash}"
    if not rec.state.live:
        exit_text = f", exit {rec.exit_status}" if rec.exit_status is not None else ""
        return f"it is {rec.state}{exit_text}" + (f" ({rec.note})" if rec.note else "")
    if inv is None or pool is None or rec.ct not in (inv.model.jobs if rec.multi else inv.model.containers):
        return f"it is {rec.state} and its container cannot be asked how it does"
    report = statuses(inv, reg, pool, [rec], slow_ratio=0.8, stall_after_s=600.0, checkpoints=checkpoints)
    st = report.statuses[0]
    if st.run.state == Lifecycle.FINISHED and st.run.exit_status == 0:
        return "ok: finished with exit 0"
    if st.verdict.state == RunState.OK:
        return f"ok: live and {st.verdict.reason}"
    if st.verdict.state == RunState.NO_BASELINE:  # healthy and steady: the first baseline starts somewhere
        return f"ok: live and steady, the first baseline ({st.verdict.reason})"
    return f"it is {st.run.state} and judged {st.verdict.state.label.upper()}: {st.verdict.reason}"
