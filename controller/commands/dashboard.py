"""`ctl dashboard`'s data: what `ctl status`, `ctl runs` and `ctl events` show, kept fresh for a web page.

A Board polls the runs of each host on a thread of its own (a container without a host, `local` or `ssh`, is a
host of its own), judging them exactly as `ctl status` does. A host slow to answer delays only its own rows, and
past the board's deadline those rows read UNREACHABLE (from the stored points, as `ctl status` shows a host that
did not answer) while the poll goes on waiting for the transport's own deadline. Pages read the latest snapshot:
nothing a page asks for reaches a container.

Text from containers (log lines, crash signatures, reasons quoting them) is cleaned of escape sequences here; the
page still shows every string as text, never as markup.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from controller.commands import monitor, reconcile
from controller.commands.monitor import RunStatus
from controller.core.metrics import RunState, format_eta
from controller.core.redact import redact_run
from controller.core.rundiff import diff
from controller.core.terminal import clean_line
from controller.errors import CtlError
from controller.inventory import Container, Inventory
from controller.registry import Registry, RunRecord
from controller.transport.pool import Pool

CHART_POINTS = 1500  # points of a run's chart (evenly thinned beyond that)
RECENT_RUNS = 30
RECENT_EVENTS = 20
BASELINE_TTL_S = 30.0


@dataclass(frozen=True)
class Settings:
    interval_s: float = 10.0  # between the polls of one host
    deadline_s: float = 15.0  # a poll running longer shows its host's runs UNREACHABLE
    slow_ratio: float = 0.8
    stall_after_s: float = 600.0
    log_lines: int = 30  # last lines of each run's log, read with each poll of a live run
    checkpoints: str | None = None


@dataclass(frozen=True)
class Row:
    """One run on the page: `ctl status`'s line for it, and where it came from."""

    status: RunStatus
    host: str  # the poll group: `host NAME`, or the container itself
    parent: str | None  # the run it was restarted from (ctl supervise), as CT/NAME
    polled_at: float | None  # when its host last answered a poll; None: never in this dashboard
    pending: bool = False  # its host has not finished a first poll yet (still within the deadline)

    def to_json(self) -> dict[str, Any]:
        st, v, r = self.status, self.status.verdict, self.status.run
        return {
            "id": r.id, "ct": r.ct, "run": r.name, "host": self.host, "state": str(r.state),
            "verdict": "pending" if self.pending else v.state.label,
            "reason": clean_line(v.reason), "step": v.step,
            "loss": st.last.loss if st.last else None, "tok_s": st.last.tok_s if st.last else None,
            "steady_tok_s": v.tok_s, "ratio": v.ratio, "baseline": st.baseline, "baseline_tok_s": v.baseline_tok_s,
            "eta_s": st.eta_s, "eta": format_eta(st.eta_s), "no_ratio_why": st.no_ratio_why,
            "idle_s": v.idle_s, "crash": clean_line(v.crash) if v.crash else None,
            "exit_status": r.exit_status, "history": list(st.tok_s_history), "parent": self.parent,
            "resumed_step": r.resumed_step, "good": r.good, "started": r.started, "polled_at": self.polled_at,
            "error": clean_line(st.error) if st.error else None,
        }


@dataclass
class _Host:
    """What the board knows of one poll group; changed only under the board's lock."""

    name: str
    cts: list[str]
    statuses: list[RunStatus] = field(default_factory=list)
    polled_at: float | None = None  # end of the last poll that finished
    seconds: float | None = None  # how long it took
    polling_since: float | None = None  # start of the poll under way
    pending: list[RunRecord] = field(default_factory=list)  # the runs the poll under way asks about
    warnings: list[str] = field(default_factory=list)
    error: str | None = None  # the last poll failed as a whole


class Board:
    """The runs of `targets`, polled per host; `snapshot()` and `run_detail()` for the page, thread-safe."""

    def __init__(self, inv: Inventory, reg: Registry, targets: list[Container],
                 open_pool: Callable[[], AbstractContextManager[Pool]], settings: Settings,
                 clock: Callable[[], float] = time.time) -> None:
        self.inv, self.reg, self.open_pool, self.s, self.clock = inv, reg, open_pool, settings, clock
        self.hosts: dict[str, _Host] = {}
        for ct in targets:
            key = f"host {ct.host_name}" if ct.spec.transport == "pct" and ct.host_name else ct.name
            self.hosts.setdefault(key, _Host(key, [])).cts.append(ct.name)
        self._lines: dict[int, list[str]] = {}  # run id -> its log's last lines, as last read
        self._rates: dict[int, tuple[float, tuple[str, float] | None]] = {}  # baseline run id -> (when, rate)
        self._stand_ins: dict[str, tuple[float, list[RunStatus]]] = {}  # host -> (poll start, rows judged without it)
        self._lock = threading.Condition()
        self.version = 0  # bumped whenever a poll starts or ends: what a live page waits on

    # --- polling -----------------------------------------------------------------------------------

    def select(self, cts: list[str]) -> list[RunRecord]:
        """`ctl status`'s runs: each container's live runs, else its latest one."""
        out: list[RunRecord] = []
        for name in cts:
            mine = self.reg.runs(name, limit=50)
            live = [r for r in mine if r.state.live]
            out.extend(live or mine[:1])
        return out

    def poll(self, key: str) -> None:
        """One poll of one host: refresh its runs' states, pull their new log bytes, judge them against their
        baselines and read the last lines of their logs. A failure is kept for the page, never raised."""
        host = self.hosts[key]
        recs = self.select(host.cts)
        t0 = self.clock()
        with self._lock:
            host.polling_since, host.pending = t0, recs
            self._bump()
        sts: list[RunStatus] = []
        warnings: list[str] = []
        error = None
        lines: dict[int, list[str]] = {}
        try:
            if recs:
                with self.open_pool() as pool:
                    report = monitor.statuses(self.inv, self.reg, pool, recs, slow_ratio=self.s.slow_ratio,
                                              stall_after_s=self.s.stall_after_s, checkpoints=self.s.checkpoints)
                    sts, warnings = list(report.statuses), list(report.warnings)
                    lines = self._read_lines(pool, sts)
        except CtlError as e:
            error = str(e)
        except Exception as e:  # a poll thread never dies: the page says what went wrong
            error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._lines.update(lines)
            if error is None:
                host.statuses = sts
            host.error = clean_line(error) if error else None
            host.warnings = [clean_line(w) for w in warnings]
            host.polled_at = self.clock()
            host.seconds = host.polled_at - t0
            host.polling_since, host.pending = None, []
            self._bump()

    def _read_lines(self, pool: Pool, sts: list[RunStatus]) -> dict[int, list[str]]:
        """The last lines of each run whose container answered: every poll for a live run, once for an ended
        one. Bounded by the agent (at most its last 1 MiB read, lines cut at 4 KiB) and by a deadline."""
        out: dict[int, list[str]] = {}
        for st in sts:
            r = st.run
            if not r.log_path or st.verdict.state == RunState.UNREACHABLE or r.ct not in self.inv.model.containers:
                continue
            if not r.state.live and r.id in self._lines:
                continue
            try:
                t = pool.container(self.inv.container(r.ct))
                got = reconcile.last_lines(t, r, self.s.log_lines, timeout=self.s.deadline_s)
            except CtlError:
                continue
            out[r.id] = [clean_line(line) for line in got]
        return out

    def run(self, stop: threading.Event) -> list[threading.Thread]:
        """A daemon thread per host, polling every interval until `stop` is set."""
        threads = []
        for key in self.hosts:
            def loop(key: str = key) -> None:
                while not stop.is_set():
                    self.poll(key)
                    stop.wait(self.s.interval_s)

            th = threading.Thread(target=loop, name=f"ctl-dashboard {key}", daemon=True)
            th.start()
            threads.append(th)
        return threads

    def _bump(self) -> None:
        self.version += 1
        self._lock.notify_all()

    def wait(self, version: int, timeout: float) -> int:
        """Until the board changes after `version`, or `timeout` seconds: the version now."""
        with self._lock:
            self._lock.wait_for(lambda: self.version != version, timeout=timeout)
            return self.version

    # --- what the page shows -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every run of every host, the registry's newest runs and events: one JSON document."""
        now = self.clock()
        with self._lock:
            version = self.version
            hosts = [(h.name, list(h.cts), list(h.statuses), h.polled_at, h.seconds, h.polling_since,
                      list(h.pending), list(h.warnings), h.error) for h in self.hosts.values()]
        rows: list[dict[str, Any]] = []
        host_docs = []
        for name, cts, sts, polled_at, seconds, since, pending, warnings, error in hosts:
            late = since is not None and now - since >= self.s.deadline_s
            state = "ok"
            if late:
                assert since is not None
                state = "unreachable"
                why = (f"no answer from {name} for {format_eta(now - since)} (the dashboard's deadline is "
                       f"{self.s.deadline_s:g}s); still waiting")
                shown = self._stand_in(name, since, pending or [s.run for s in sts])
                rows += [self._row(name, replace(st, verdict=replace(st.verdict, reason=f"{why}; recorded state "
                                                                     f"{st.run.state} kept")) if st.run.state.live
                                   else st, polled_at).to_json() for st in shown]
            elif polled_at is None and since is not None:
                state = "first poll"
                rows += [self._row(name, replace(st, verdict=replace(st.verdict, reason="first poll under way")),
                                   None, pending=True).to_json() for st in self._stand_in(name, since, pending)]
            else:
                rows += [self._row(name, st, polled_at).to_json() for st in sts]
                if any(s.verdict.state == RunState.UNREACHABLE for s in sts):
                    state = "unreachable"
            if error:
                state = "error"
            host_docs.append({
                "name": name, "containers": cts, "state": state, "polled_at": polled_at, "seconds": seconds,
                "polling_for": now - since if since is not None else None, "warnings": warnings, "error": error})
        return {
            "version": version, "time": now, "interval_s": self.s.interval_s, "deadline_s": self.s.deadline_s,
            "runs": rows, "hosts": host_docs,
            "recent": [self._recent(r) for r in self.reg.runs(None, limit=RECENT_RUNS)],
            "events": [_event(e) for e in self.reg.latest_events(RECENT_EVENTS)],
        }

    def _baseline_rate(self, base: monitor.Baseline | None) -> tuple[str, float] | None:
        """monitor.baseline_rate, remembered for a while: it reads all of the baseline's points."""
        if base is None:
            return None
        now = self.clock()
        with self._lock:
            got = self._rates.get(base.run.id)
        if got is not None and now - got[0] < BASELINE_TTL_S:
            return got[1]
        rate = monitor.baseline_rate(self.reg, base)
        with self._lock:
            self._rates[base.run.id] = (now, rate)
        return rate

    def _row(self, host: str, st: RunStatus, polled_at: float | None, *, pending: bool = False) -> Row:
        parent = None
        if st.run.parent_id is not None:
            p = self.reg.run_by_id(st.run.parent_id)
            parent = f"{p.ct}/{p.name}"
        return Row(st, host, parent, polled_at, pending)

    def _stand_in(self, host: str, since: float, recs: list[RunRecord]) -> list[RunStatus]:
        """The runs of a host whose poll is under way, judged on what the registry holds (stored points), their
        verdict UNREACHABLE while live; worked out once per poll, not for every page that asks."""
        with self._lock:
            got = self._stand_ins.get(host)
        if got is not None and got[0] == since:
            return got[1]
        out = []
        for r in recs:
            rec = self.reg.run_by_id(r.id)
            base = self._baseline_rate(monitor.resolve_baseline(self.inv, self.reg, rec))
            out.append(monitor.status_of(rec, self.reg, base, pull=None, slow_ratio=self.s.slow_ratio,
                                         stall_after_s=self.s.stall_after_s,
                                         unreachable="no answer" if rec.state.live else None))
        with self._lock:
            self._stand_ins[host] = (since, out)
        return out

    @staticmethod
    def _recent(r: RunRecord) -> dict[str, Any]:
        return {"id": r.id, "ct": r.ct, "run": r.name, "state": str(r.state), "exit_status": r.exit_status,
                "started": r.started or r.created, "commit": (r.commit_sha or "")[:10], "dirty": r.dirty,
                "good": r.good, "parent_id": r.parent_id, "resumed_step": r.resumed_step}

    def run_detail(self, run_id: int) -> dict[str, Any] | None:
        """One run's page: its points against the baseline (what `ctl plot` draws), its last log lines, its
        provenance (secrets redacted), what changed since its parent or baseline (`ctl diff`), its events."""
        if not self.reg.has_run(run_id):
            return None
        rec = self.reg.run_by_id(run_id)
        points = self.reg.series(rec.id)  # a page asks every few seconds: the columns, not each point's JSON
        if len(points) > CHART_POINTS:
            every = len(points) / CHART_POINTS
            points = [points[int(i * every)] for i in range(CHART_POINTS)] + [points[-1]]
        base = monitor.resolve_baseline(self.inv, self.reg, rec)
        rate = self._baseline_rate(base)
        other, against = None, None
        if rec.parent_id is not None:
            other, against = self.reg.run_by_id(rec.parent_id), "parent"
        elif base is not None:
            other, against = base.run, "baseline"
        doc = redact_run(rec.to_json())
        with self._lock:
            lines = list(self._lines.get(run_id, []))
        return {
            "id": rec.id, "ct": rec.ct, "run": rec.name,
            "points": [{"step": step, "tok_s": tok_s, "loss": loss} for step, tok_s, loss in points],
            "baseline": {"run": rate[0], "tok_s": rate[1]} if rate else None,
            "lines": lines,
            "provenance": {k: doc.get(k) for k in (
                "state", "exit_status", "crash", "host", "session", "log_path", "run_dir", "created", "started",
                "ended", "commit_sha", "dirty", "env_fingerprint", "command", "good", "note", "resumed_from",
                "resumed_step", "files")},
            "diff": {"against": against, "run": f"{other.ct}/{other.name}", "text": diff(other, rec).render()}
            if other is not None else None,
            "events": [_event(e) for e in self.reg.latest_events(RECENT_EVENTS, run_id=rec.id)],
        }


def _event(e: dict[str, Any]) -> dict[str, Any]:
    return {"id": e.get("id"), "time": e.get("time"), "kind": e.get("kind"), "run": e.get("run"),
            "summary": clean_line(str(e.get("summary", ""))), "action": clean_line(str(e.get("action") or ""))}
