"""`ctl supervise`: watch every live run, turn verdict changes into events, and relaunch failed runs from
their last complete checkpoint.

Each poll judges the runs exactly as `ctl status` does (one connection pool, so one SSH connection per
host), plus UNREACHABLE: a container whose state or log could not be read within the deadline. That is
never a crash and never restarted; when it answers again its real state is read and reported.

A restart is a small state machine in the registry (table `restarts`, keyed by the failed run), so a
supervisor killed at any moment and started again finishes or rolls back the step it was in:

    planned    the failure is claimed (at most one relaunch per failure); waits out the backoff
    launching  the new run's name is chosen and written here BEFORE its claim: after a crash, a claim of
               that name that never reached the container is released and the launch is made again; a run
               that did start is adopted
    done       the new run started (its record names its parent and the checkpoint it resumed from)
    refused    drift, a bad inventory, or three failed attempts: an event says why
    gave_up    the lineage reached its restart limit

One supervisor per state directory holds the lease `supervise` (renewed every poll); a second one says who
holds it and exits, or with `standby` waits until the lease expires.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from controller.commands import launcher, reconcile
from controller.commands.monitor import RunStatus, statuses
from controller.commands.notify import Deliverer
from controller.core.metrics import RunState
from controller.core.supervision import UNREACHABLE, Event, Policy, Sink, backoff_s, summary_line
from controller.errors import (
    BusyError,
    ConnectionFailed,
    CtlError,
    DiskError,
    DriftError,
    InputError,
    InventoryError,
    RegistryLocked,
)
from controller.inventory import Container, Inventory
from controller.lifecycle import Lifecycle
from controller.registry import Registry, RunRecord
from controller.remote.client import Agent
from controller.transport.base import Transport
from controller.transport.pool import Pool

LEASE = "supervise"
TERMINAL = frozenset({"finished", "crashed", "stopped"})
HEALTHY_FIRST_SIGHT = frozenset({"ok", "warmup", "no-baseline"})  # recorded, not worth waking anyone for
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Settings:
    interval_s: float
    policy: Policy
    backoff_s: float
    stall_after_s: float
    slow_ratio: float
    sinks: tuple[Sink, ...] = ()
    secret: bytes | None = None


@dataclass
class Poll:
    """What one poll saw and did (for the CLI to render)."""

    verdicts: dict[str, str] = field(default_factory=dict)  # CT/NAME -> verdict
    events: list[Event] = field(default_factory=list)
    seconds: float = 0.0


class Supervisor:
    def __init__(self, inv: Inventory, reg: Registry, settings: Settings, targets: list[Container],
                 open_pool: Callable[[], AbstractContextManager[Pool]], *,
                 on_event: Callable[[Event], None] | None = None) -> None:
        self.inv, self.reg, self.s, self.open_pool = inv, reg, settings, open_pool
        self.targets = {c.name for c in targets}
        # A run across several containers is watched when all its job's nodes are (and restarted whole)
        self.targets |= {j for j, spec in inv.model.jobs.items() if set(spec.nodes) <= self.targets}
        self.on_event = on_event
        self.holder = lease_holder(os.getpid())
        self.deliverer = Deliverer(list(settings.sinks), settings.secret, self._delivery_failed)
        self.watching: set[int] = {rid for rid, ct in reg.live_ids() if ct in self.targets}
        self.watching |= {rid for rid, ct in reg.unsettled_runs(TERMINAL) if ct in self.targets}

    # --- the lease -------------------------------------------------------------------------------------

    def lease_ttl(self) -> float:
        """Three missed polls (at least 10 s) before a standby may take over."""
        return max(3 * self.s.interval_s, 10.0)

    def acquire(self, *, standby: bool = False, stop: threading.Event | None = None) -> str | None:
        """Take the lease (a standby waits for it). The holder it took over from when that one's process is gone
        (a supervisor killed on this machine: no need to wait out its lease), else None."""
        while True:
            held, row = self.reg.take_lease(LEASE, self.holder, self.lease_ttl())
            if held:
                return None
            assert row is not None
            gone = str(row["holder"])
            if holder_gone(gone):
                held, row = self.reg.take_lease(LEASE, self.holder, self.lease_ttl(), replacing=gone)
                if held:
                    return gone
                assert row is not None
            who = (f"{row['holder']} (since {time.strftime('%H:%M:%S', time.localtime(row['since']))}, lease "
                   f"expires in {row['expires'] - time.time():.0f}s)")
            if not standby:
                raise BusyError(f"another supervisor holds {self.reg.path}: {who}; `--standby` waits to take over")
            if stop is not None and stop.wait(min(self.s.interval_s, 5.0)):
                raise KeyboardInterrupt
            if stop is None:
                time.sleep(min(self.s.interval_s, 5.0))

    def release(self) -> None:
        self.reg.drop_lease(LEASE, self.holder)
        self.deliverer.close()

    # --- one poll --------------------------------------------------------------------------------------

    def poll(self) -> Poll:
        t0 = time.monotonic()
        held, row = self.reg.take_lease(LEASE, self.holder, self.lease_ttl())
        if not held:
            raise BusyError(f"lost the supervisor lease to {row and row['holder']}: stopping")
        out = Poll()
        self.watching |= {rid for rid, ct in self.reg.live_ids() if ct in self.targets}
        recs = [self.reg.run_by_id(i) for i in sorted(self.watching)]
        recs = [r for r in recs if r.ct in self.inv.model.containers or (r.multi and r.ct in self.inv.model.jobs)]
        with self.open_pool() as pool:
            if recs:
                report = statuses(self.inv, self.reg, pool, recs, slow_ratio=self.s.slow_ratio,
                                  stall_after_s=self.s.stall_after_s, checkpoints=None)
                for st in report.statuses:
                    verdict = self._verdict(st)
                    out.verdicts[f"{st.run.ct}/{st.run.name}"] = verdict
                    self._judge(pool, st, verdict, out)
            self._restarts(pool, out)
        out.seconds = time.monotonic() - t0
        return out

    def _verdict(self, st: RunStatus) -> str:
        # monitor.statuses decides UNREACHABLE (a container that did not answer, a live run's log not read),
        # so `ctl status` and the supervisor agree
        if st.verdict.state == RunState.UNREACHABLE:
            return UNREACHABLE
        if st.run.state == Lifecycle.STOPPED:
            return "stopped"
        label = st.verdict.state.label
        if st.run.stop_asked is not None and label in ("crashed", "finished"):
            return "stopped"  # ended under an operator's `ctl stop` whose record is not written yet
        return label

    def _judge(self, pool: Pool, st: RunStatus, verdict: str, out: Poll) -> None:
        run = st.run
        before = self.reg.last_verdict(run.id)
        if verdict == before:
            return
        v = st.verdict
        if verdict == UNREACHABLE:
            reason = f"no answer from {run.ct}: {st.error or 'its state could not be read'}; not a crash, not restarted"
        else:
            reason = v.reason
        detail: dict[str, Any] = {
            "run_id": run.id, "state": str(run.state), "exit_status": run.exit_status, "crash": v.crash or run.crash,
            "step": v.step, "tok_s": v.tok_s, "baseline": v.baseline_name, "baseline_tok_s": v.baseline_tok_s,
            "ratio": v.ratio, "reason": reason, "log": run.log_path, "look": f"ctl tail {run.ct}/{run.name}",
            # one more round trip, for verdicts someone acts on only (a first sight of a healthy run is not one)
            "last_lines": self._last_lines(pool, run) if verdict not in HEALTHY_FIRST_SIGHT | {UNREACHABLE} else [],
        }
        wanted = self.s.policy.wants(verdict) and run.state != Lifecycle.STOPPED and run.stop_asked is None
        action = "none"
        if wanted:
            action = self._plan(run, verdict)
        elif verdict in ("crashed", "stalled"):
            action = f"none: restart policy is {self.s.policy.mode}"
        ev = Event("verdict", f"{run.ct}/{run.name}", run.ct, run.host, before, verdict,
                   summary_line(f"{run.ct}/{run.name}", before, verdict, reason), action, detail=detail)
        self._record(run.id, ev, notify=not (before is None and verdict in HEALTHY_FIRST_SIGHT))
        out.events.append(ev)
        if verdict in TERMINAL:
            self.watching.discard(run.id)

    def _last_lines(self, pool: Pool, run: RunRecord) -> list[str]:
        if run.multi:  # the node that ended it (named first in its crash), else node 0
            members = self.reg.members(run.id)
            named = [m for m in members if run.crash and run.crash.startswith(f"{m.ct}: ")]
            run = (named or members or [run])[0]
        if not run.log_path:
            return []
        try:
            return reconcile.last_lines(pool.container(self.inv.container(run.ct)), run, 20, timeout=30)
        except CtlError:
            return []

    def _record(self, run_id: int | None, ev: Event, *, notify: bool = True) -> None:
        doc = ev.doc()
        self.reg.add_event(run_id, ev.kind, ev.summary, doc, from_verdict=ev.before, to_verdict=ev.after)
        if notify:
            self.deliverer.send(doc)
        if self.on_event is not None:
            self.on_event(ev)

    def _delivery_failed(self, sink: Sink, doc: dict[str, Any], error: str) -> None:
        ev = Event("notify_failed", str(doc.get("run")), str(doc.get("ct")), doc.get("host"), None, None,
                   f"{doc.get('run')}: notification to {sink.label()} failed: {error}", "logged")
        self.reg.add_event(doc.get("run_id"), ev.kind, ev.summary, ev.doc())
        if self.on_event is not None:
            self.on_event(ev)

    # --- restarts --------------------------------------------------------------------------------------

    def _plan(self, run: RunRecord, verdict: str) -> str:
        done_before = len(self.reg.lineage(run.id)) - 1
        if done_before >= self.s.policy.max_restarts:
            if self.reg.plan_restart(run.id, {"verdict": verdict, "gave_up": True}) is not None:
                self.reg.set_restart(run.id, state="gave_up")
                ev = Event("gave_up", f"{run.ct}/{run.name}", run.ct, run.host, None, verdict,
                           f"{run.ct}/{run.name}: GAVE_UP after {done_before} restart(s) of this lineage",
                           f"none: {self.s.policy.describe()}")
                self._record(run.id, ev)
            return f"gave up: {done_before} restart(s) already"
        wait = backoff_s(self.s.backoff_s, done_before)
        plan = self.reg.plan_restart(run.id, {"verdict": verdict, "not_before": time.time() + wait, "attempts": 0})
        if plan is None:
            return "restart already planned"
        reconcile.die_if("planned")
        return f"relaunch as the next run of the series in {wait:.0f}s, from its last complete checkpoint"

    def _restarts(self, pool: Pool, out: Poll) -> None:
        import json

        for row in self.reg.unfinished_restarts():
            doc = json.loads(row["doc"])
            if row["state"] == "planned" and time.time() < float(doc.get("not_before", 0)):
                continue
            failed = self.reg.run_by_id(row["failed_run_id"])
            if failed.ct not in self.inv.model.containers and not (failed.multi and failed.ct in self.inv.model.jobs):
                continue
            # The lease again, right before acting: a poll stalled past its expiry (a registry held by another
            # writer) must not relaunch what the supervisor that took over relaunches too.
            held, holder = self.reg.take_lease(LEASE, self.holder, self.lease_ttl())
            if not held:
                raise BusyError(f"lost the supervisor lease to {holder and holder['holder']}: stopping")
            if row["state"] == "planned" and (failed.state == Lifecycle.STOPPED or failed.stop_asked is not None):
                # An operator asked for the stop (recorded before its first signal) after this relaunch was
                # planned: an operator's stop is never undone by a relaunch.
                self._refuse(failed, f"refused: {failed.note or 'stopped by the operator'}")
                continue
            try:
                self._relaunch(pool, failed, row, doc, out)
            except (DriftError, InputError, InventoryError) as e:
                self._refuse(failed, f"refused: {e}")
            except ConnectionFailed as e:  # the host is away: try again next poll, it is no crash of ours
                doc["last_error"] = str(e)
                self.reg.set_restart(failed.id, doc=json.dumps(doc))
            except CtlError as e:
                doc["attempts"] = int(doc.get("attempts", 0)) + 1
                doc["last_error"] = str(e)
                self.reg.set_restart(failed.id, doc=json.dumps(doc))
                if doc["attempts"] >= MAX_ATTEMPTS:
                    self._refuse(failed, f"refused after {MAX_ATTEMPTS} failed attempts: {e}")

    def _refuse(self, failed: RunRecord, why: str) -> None:
        self.reg.set_restart(failed.id, state="refused")
        ev = Event("refused", f"{failed.ct}/{failed.name}", failed.ct, failed.host, None, None,
                   f"{failed.ct}/{failed.name}: not relaunched: {why}", why)
        self._record(failed.id, ev)

    def _claim(self, failed: RunRecord, row: dict[str, Any], out: Poll, *, adopt: Callable[[str], RunRecord | None],
               stop: Callable[[RunRecord], RunRecord], next_name: Callable[[], str]) -> tuple[RunRecord, str] | None:
        """This supervisor's claim on the relaunch: (the failed run, now stopped; the new run's name, recorded before
        the launch) when it is ours to make, else None: another supervisor took it, or the launch a crashed
        supervisor began had started (adopted as the relaunch)."""
        if row["state"] == "launching" and row["new_name"]:
            name = str(row["new_name"])
            adopted = adopt(name)
            if adopted is not None:
                self._launched(failed, adopted, out)
                return None
            return failed, name
        if row["state"] == "planned" and not self.reg.take_restart(failed.id):
            return None  # another supervisor took this one
        if failed.state.live:  # a stalled run still holds its GPUs: stop it first
            failed = stop(failed)
        name = next_name()
        self.reg.set_restart(failed.id, state="launching", new_name=name)
        reconcile.die_if("launching")
        return failed, name

    def _relaunch_job(self, pool: Pool, failed: RunRecord, row: dict[str, Any], out: Poll) -> None:
        """A run across several containers is restarted whole: every node, from the newest complete checkpoint
        any node holds, copied first to the nodes that lack it (each resumes from its own copy). A node whose
        disk cannot hold that copy makes it the next older complete step, down to one every node holds."""
        claimed = self._claim(failed, row, out, adopt=lambda name: self._adopt_job(pool, failed.ct, name),
                              stop=lambda run: launcher.stop_job(self.inv, pool, self.reg, run, grace=30)[0],
                              next_name=lambda: launcher.next_job_name(self.inv, pool, self.reg, failed.ct))
        if claimed is None:
            return
        failed, name = claimed
        found = launcher.find_checkpoint(self.inv, pool, self.reg, failed)
        while found is not None:
            try:
                launcher.spread_checkpoint(self.inv, pool, failed.ct, found)
                break
            except DiskError as e:
                self._record(failed.id, Event(
                    "checkpoint_skipped", f"{failed.ct}/{failed.name}", failed.ct, failed.host, None, None,
                    f"{failed.ct}/{failed.name}: not resuming from step {found['step']}: {e}",
                    "an older complete step"), notify=False)
                found = launcher.find_checkpoint(self.inv, pool, self.reg, failed, below=int(found["step"]))
        env = {"CTL_PARENT_RUN": failed.name}
        lineage: dict[str, Any] = {"parent_id": failed.id}
        if found is not None:
            env["CTL_RESUME_FROM"] = str(found["dir"])
            lineage.update(resumed_from=found["dir"], resumed_step=int(found["step"]))
        got = launcher.launch_job(self.inv, pool, self.reg, failed.ct, name, extra_env=env, lineage=lineage)
        reconcile.die_if("launched")
        self._launched(failed, got.run, out)

    def _adopt_job(self, pool: Pool, job: str, name: str) -> RunRecord | None:
        """The job's run of that name if it started (refreshed), else None: a claim that reached no node is
        forgotten, so the launch is made again under the same name."""
        try:
            rec = self.reg.find_run(f"{job}/{name}")
        except InputError:
            return None
        if rec.state == Lifecycle.STARTING:
            states = []
            for m in self.reg.members(rec.id):
                states.append(reconcile.state_of(pool.container(self.inv.container(m.ct)), m)[0])
            if all(s == Lifecycle.LOST for s in states):  # nothing ever ran under that claim
                self.reg.forget_job_claim(rec.id)
                return None
            return reconcile.refresh_all(self.inv, self.reg, pool, [rec]).runs[0]
        return rec

    def _relaunch(self, pool: Pool, failed: RunRecord, row: dict[str, Any], doc: dict[str, Any], out: Poll) -> None:
        if failed.multi:
            self._relaunch_job(pool, failed, row, out)
            return
        ct = self.inv.container(failed.ct)
        t = pool.container(ct)

        def stop(run: RunRecord) -> RunRecord:
            return reconcile.stop(self.inv, ct, t, self.reg, reconcile.refresh(self.inv, ct, t, self.reg, [run])[0],
                                  grace=30)

        claimed = self._claim(failed, row, out, adopt=lambda name: self._adopt(ct, t, name), stop=stop,
                              next_name=lambda: launcher.next_name(self.inv, ct, t, self.reg))
        if claimed is None:
            return
        failed, name = claimed
        found = self._checkpoint(t, failed)
        env = {"CTL_PARENT_RUN": failed.name}
        lineage: dict[str, Any] = {"parent_id": failed.id}
        if found is not None:
            env["CTL_RESUME_FROM"] = t.path(found["dir"])
            lineage.update(resumed_from=found["dir"], resumed_step=int(found["step"]))
        rec = launcher.launch(self.inv, ct, t, self.reg, name, extra_env=env, lineage=lineage).run
        reconcile.die_if("launched")
        self._launched(failed, rec, out)

    def _adopt(self, ct: Container, t: Transport, name: str) -> RunRecord | None:
        """After a crash between choosing the name and recording the result: the run if it started, else None
        (a claim with nothing behind it is released, so the launch is made again under the same name)."""
        try:
            rec = self.reg.find_run(f"{ct.name}/{name}")
        except InputError:
            return None
        if rec.state == Lifecycle.STARTING:
            state, _code = reconcile.state_of(t, rec)
            if state == Lifecycle.LOST:  # nothing ever ran under that claim
                self.reg.release_run(rec.id)
                return None
            return reconcile.refresh(self.inv, ct, t, self.reg, [rec])[0]
        return rec

    def _launched(self, failed: RunRecord, rec: RunRecord, out: Poll) -> None:
        self.reg.set_restart(failed.id, state="done", new_run_id=rec.id)
        self.watching.add(rec.id)
        resumed = (f"resuming from step {rec.resumed_step} ({rec.resumed_from})" if rec.resumed_from
                   else "from scratch: no complete checkpoint found")
        ev = Event("restart", f"{failed.ct}/{failed.name}", failed.ct, failed.host, None, None,
                   f"{failed.ct}/{failed.name}: relaunched as {rec.name}, {resumed}",
                   f"launched {rec.name}", detail={"new_run": rec.name, "run_id": failed.id,
                                                   "resumed_from": rec.resumed_from, "resumed_step": rec.resumed_step,
                                                   "look": f"ctl tail {rec.ct}/{rec.name} -f"})
        self._record(failed.id, ev)
        out.events.append(ev)

    def _checkpoint(self, t: Transport, failed: RunRecord) -> dict[str, Any] | None:
        """The newest complete checkpoint of the failed run or, failing that, of its ancestors."""
        dirs = launcher.checkpoint_dirs(self.inv, self.reg, failed)
        if not dirs:
            return None
        doc = Agent.of(t).call("ckptscan", {"dirs": dirs}, timeout=600)
        found: dict[str, Any] | None = doc.get("found")
        return found

    # --- the loop ----------------------------------------------------------------------------------------

    def run(self, stop: threading.Event, on_poll: Callable[[Poll], None] | None = None,
            on_skip: Callable[[str], None] | None = None) -> None:
        while not stop.is_set():
            try:
                p = self.poll()
            except RegistryLocked as e:
                # Another writer held the registry past SQLite's wait: this poll recorded nothing, so the next
                # one judges the same runs again (and steps down if the lease went to a standby meanwhile)
                if on_skip is not None:
                    on_skip(f"poll skipped: {e}")
            else:
                if on_poll is not None:
                    on_poll(p)
            stop.wait(self.s.interval_s)


def lineages(reg: Registry, recs: list[RunRecord]) -> Iterator[list[RunRecord]]:
    """Chains of restarted runs (oldest first), each run in one chain; for `ctl runs --tree`."""
    children: dict[int, list[RunRecord]] = {}
    for r in recs:
        if r.parent_id is not None:
            children.setdefault(r.parent_id, []).append(r)
    ids = {r.id for r in recs}
    for r in sorted(recs, key=lambda x: x.created):
        if r.parent_id is not None and r.parent_id in ids:
            continue
        chain = [r]
        while children.get(chain[-1].id):
            chain.append(min(children[chain[-1].id], key=lambda x: x.created))
        yield chain


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, what tells
    a process from a later one that got the same pid. None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def lease_holder(pid: int) -> str:
    """How a supervisor names itself in the lease: host, pid, the pid's start time, and a random part."""
    return f"{socket.gethostname()}:{pid}:{_start_time(pid) or '?'}:{uuid.uuid4().hex[:6]}"


def holder_gone(holder: str) -> bool:
    """The lease's holder is a process of this machine that no longer exists (killed -9, the machine's OOM
    killer): its lease may be taken over at once. Another machine's holder, or one whose name does not say
    enough (an older ctl's, without the start time), is never judged gone: its lease expires as before."""
    parts = holder.split(":")
    if len(parts) != 4 or parts[0] != socket.gethostname() or not parts[1].isdigit() or parts[2] == "?":
        return False
    return _start_time(int(parts[1])) != parts[2]

