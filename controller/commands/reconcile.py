"""Reconciliation: what the registry says of runs, brought in line with what their containers hold.

One agent round trip per container asks about its live runs (`refresh`, `refresh_all`); a `starting` run whose
launch got no answer is reconciled from the container's facts; a run across several containers is settled from
its nodes (a node that ended badly makes it CRASHED and its survivors are stopped: `settle`, `teardown`); and
`stop` ends one container's run. Shared by every verb that shows or judges runs, and by supervise.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from controller.commands.fanout import Outcome, fanout
from controller.errors import CtlError, ExitCode, InputError
from controller.inventory import Container, Inventory
from controller.lifecycle import Lifecycle
from controller.registry import Registry, RunRecord
from controller.remote.client import Agent, AgentReplyError
from controller.transport.base import Transport, limit
from controller.transport.pool import Pool

UNKNOWN_OUTCOME = "launch outcome unknown"  # note of a `starting` run whose launch got no answer
# Test hook: the process ends abruptly (exit 137) at the step named here: stop_signalled (the agent's stop returned),
# or a supervisor's restart at planned, launching or launched (commands/supervise.py)
DIE_AT = "CTL_TEST_DIE_AT"


LAUNCH_GRACE_S = 120.0  # a `starting` run with no trace in its container after this long was never started


def state_from(st: dict[str, Any]) -> tuple[Lifecycle, int | None]:
    if st.get("exit") is not None:
        return (Lifecycle.FINISHED if st["exit"] == 0 else Lifecycle.FAILED), st["exit"]
    if st.get("alive"):
        return Lifecycle.RUNNING, None
    return Lifecycle.LOST, None


def state_request(r: RunRecord) -> dict[str, Any]:
    """What the agent's runstate (and poll) needs to know of one run; a `starting` run asks for its record too."""
    return {"name": r.name, "log": r.log_path, "session": r.session, "record": r.state == Lifecycle.STARTING}


def refresh(inv: Inventory, ct: Container, t: Transport, reg: Registry, runs: list[RunRecord]) -> list[RunRecord]:
    """Ask the container about live runs (one round trip) and record what ended; a `starting` run (a launch
    in progress, or one whose answer was lost) is reconciled from the container's facts."""
    live = [r for r in runs if r.state.live]
    if not live:
        return runs
    agent = Agent.of(t)
    doc = agent.call("runstate", {"runs": [state_request(r) for r in live]})
    return record_states(reg, runs, live, checked_states(ct.name, agent.need(doc, "runs", list), len(live)))


def record_states(reg: Registry, runs: list[RunRecord], live: list[RunRecord], states: list[dict[str, Any]]
                  ) -> list[RunRecord]:
    """`runs` with what the container said of the `live` ones (`states`, in their order) recorded."""
    updated = {}
    for r, st in zip(live, states, strict=True):
        if r.state == Lifecycle.STARTING:
            new = _reconcile(reg, r, st)
            if new is not None:
                updated[r.id] = new
            continue
        if st.get("impostor") and st.get("exit") is None:
            continue  # its pid file names another process: whether the run lives cannot be told, keep its state
        state, code = state_from(st)
        if state != r.state:
            updated[r.id] = reg.update_run(r.id, state=state, exit_status=code,
                                           ended=ended_at(st) if state != Lifecycle.RUNNING else None)
    return [updated.get(r.id, r) for r in runs]


def ended_at(st: dict[str, Any]) -> float | None:
    """When a run ended, by the container's clock: its exit status file's time (a torchrun killed alone leaves
    workers that still write the log), else the log's last write."""
    return st.get("exit_mtime") or st.get("log_mtime")


def _reconcile(reg: Registry, r: RunRecord, st: dict[str, Any]) -> RunRecord | None:
    """A `starting` run, from what its container shows (log, pid file, tmux session, LOG.ctl.json): the record
    a launch would have written when the run is there; lost when it is not and never will be; None: leave it."""
    record = st.get("record") if isinstance(st.get("record"), dict) else None
    ours = record is not None and record.get("created") == r.created and record.get("run") == r.name
    seen = ours or st.get("pid") is not None or st.get("exit") is not None or st.get("log_size") is not None
    was = f" ({r.note})" if r.note else ""
    if record is not None and not ours:
        return reg.update_run(r.id, state=Lifecycle.LOST, ended=time.time(),
                              note=f"{r.log_path}.ctl.json belongs to another launch: this one started nothing{was}")
    if not seen:
        if st.get("session") or time.time() - r.created < LAUNCH_GRACE_S:
            return None  # tmux is starting it, or a launch is still in its preflight
        return reg.update_run(r.id, state=Lifecycle.LOST, ended=time.time(),
                              note=f"never started: nothing of it in the container{was}")
    if st.get("impostor") and st.get("exit") is None:
        return None  # its pid file names another process: nothing can be told yet
    state, code = state_from(st)
    if state == Lifecycle.LOST and st.get("pid") is None and (
            st.get("session") or time.time() - r.created < LAUNCH_GRACE_S):
        return None  # the record is written, tmux or the launcher has not started the training yet
    fields: dict[str, Any] = {}
    if ours and record is not None:
        fields = {"command": record.get("command"), "commit_sha": record.get("commit"),
                  "dirty": bool(record.get("dirty")), "files": record.get("files") or {},
                  "vars": record.get("vars") or {}, "env_fingerprint": record.get("env_fingerprint")}
    return reg.update_run(r.id, state=state, exit_status=code, started=r.started or r.created,
                          ended=ended_at(st) if state != Lifecycle.RUNNING else None,
                          note=f"reconciled from the container{was}", **fields)


def live(inv: Inventory, ct: Container, t: Transport, reg: Registry) -> list[RunRecord]:
    """Runs the registry believes live on this CT, confirmed by asking the container (one round trip)."""
    candidates = reg.live_runs(ct.key)
    if not candidates:
        return []
    return [r for r in refresh(inv, ct, t, reg, candidates) if r.state.live]


def stop(inv: Inventory, ct: Container, t: Transport, reg: Registry, run: RunRecord, grace: float = 30, *,
         term_first: bool = False, by_operator: bool = False) -> RunRecord:
    """SIGINT the training's process group, `grace` seconds, SIGTERM, SIGKILL; then whatever of the run is left
    in the container (torchrun's workers, each in a session of its own). `term_first`: no SIGINT (a node whose
    peer died cannot finish a step anyway). `by_operator`: the stop is recorded as asked before the first
    signal, so a supervisor that sees the training end under it never relaunches it."""
    if not run.state.live:
        raise InputError(f"run {run.name} on {ct.name} is not running (state: {run.state})")
    if by_operator:
        reg.ask_stop(run.id)
    deadline = limit(None, t.request_timeout)  # the agent waits up to `grace` after SIGINT and after SIGTERM
    args = {"log": run.log_path, "session": run.session, "grace": grace, "run": run.name}
    if term_first:
        args["term_first"] = True
    doc = Agent.of(t).call("stop", args, timeout=None if deadline is None else deadline + 3 * grace + 30)
    die_if("stop_signalled")
    if doc.get("alive"):
        raise CtlError(f"{ct.name}: run {run.name} survived SIGINT, SIGTERM and SIGKILL")
    note = "stopped by ctl stop (" + " -> ".join(signal_steps(doc.get("signals"))) + ")"
    return reg.update_run(run.id, state=Lifecycle.STOPPED, exit_status=doc.get("exit"), ended=time.time(), note=note)


def last_lines(t: Transport, run: RunRecord, lines: int, *, timeout: float | None = None) -> list[str]:
    """The last `lines` lines of the run's log (one round trip; the agent reads at most its last 1 MiB and cuts
    lines at 4 KiB). Raw text from the container: clean it before showing it."""
    if not run.log_path or lines <= 0:
        return []
    info = Agent.of(t).call("tailinfo", {"log": run.log_path, "lines": lines}, check=False, timeout=timeout)
    if not info.get("ok"):
        return []
    return str(info.get("text") or "").splitlines()[-lines:]


def state_of(t: Transport, run: RunRecord) -> tuple[Lifecycle, int | None]:
    """What the container says of one run now (one round trip), without recording it."""
    return state_from(runstate(t, run))


def runstate(t: Transport, run: RunRecord) -> dict[str, Any]:
    agent = Agent.of(t)
    doc = agent.call("runstate", {"runs": [{"name": run.name, "log": run.log_path, "session": run.session}]})
    return checked_states(run.ct, agent.need(doc, "runs", list), 1)[0]


def checked_states(ct: str, states: list[Any], n: int) -> list[dict[str, Any]]:
    """The agent's runstate answer for n runs, checked: one dict each, numbers where numbers go."""
    if len(states) != n or not all(
            isinstance(st, dict) and all(isinstance(st.get(k), int | None) for k in ("exit", "pid", "log_size"))
            for st in states):
        raise AgentReplyError(f"{ct}: agent runstate answered {str(states)[:60]!r} for {n} run(s)")
    return states


@dataclass(frozen=True)
class Refreshed:
    runs: tuple[RunRecord, ...]
    warnings: tuple[str, ...]  # containers that could not be asked (their runs keep their recorded state)
    #: containers whose host did not answer (connection refused, dropped, past its deadline: exit 5), with why;
    #: their runs keep their recorded state and are shown UNREACHABLE, never crashed or lost
    unreachable: dict[str, str] = field(default_factory=dict)

    def unreachable_run(self, r: RunRecord) -> str | None:
        """Why a live run's state is unknown (its container did not answer), else None."""
        return self.unreachable.get(r.ct) if r.state.live else None


def refresh_all(inv: Inventory, reg: Registry, pool: Pool, recs: list[RunRecord]) -> Refreshed:
    """Ask each container with a live run about its runs: one round trip per container, one exec per host. A
    live run across several containers is asked through its nodes and then settled (settle, below): a node
    that ended badly makes it CRASHED and its surviving nodes are stopped."""
    members = {r.id: ms for r in recs if r.multi and (ms := reg.members(r.id))
               and (r.state.live or any(m.state.live for m in ms))}  # also a crashed run whose teardown is due
    flat = [r for r in recs if not r.multi] + [m for ms in members.values() for m in ms]
    by_ct: dict[str, list[RunRecord]] = {}
    for r in flat:
        by_ct.setdefault(r.ct, []).append(r)
    live_cts = [c for c, rs in by_ct.items() if any(r.state.live for r in rs) and c in inv.model.containers]
    if not live_cts:
        return Refreshed(tuple(recs), ())
    results = fanout(pool, [inv.container(c) for c in live_cts],
                     lambda ct, t: refresh(inv, ct, t, reg, by_ct[ct.name]))
    fresh = {r.id: r for o in results if o.value for r in o.value}
    warnings = [f"{o.ct}: state not refreshed: {o.error}" for o in results if not o.ok]
    unreachable = {o.ct: o.error or "unreachable" for o in results
                   if not o.ok and o.exit_code == int(ExitCode.CONNECTION)}
    for r in recs:
        if r.id not in members:
            continue
        ms = [fresh.get(m.id, m) for m in members[r.id]]
        silent = [m for m in ms if m.ct in unreachable and m.state.live]
        if silent:  # one node unknown: the whole run is (its recorded state is kept)
            unreachable[r.ct] = f"node {silent[0].ct}: {unreachable[silent[0].ct]}"
            continue
        if any(m.ct in {o.ct for o in results if not o.ok} for m in ms):
            continue  # a node could not be asked: nothing is concluded from the others alone
        try:
            fresh[r.id] = settle(inv, reg, pool, r, ms)
        except CtlError as e:
            warnings.append(f"{r.ct}/{r.name}: not settled: {e}")
    return Refreshed(tuple(fresh.get(r.id, r) for r in recs), tuple(warnings), unreachable)


def signal_steps(steps: Any) -> list[str]:
    """The agent's account of a stop (`SIGINT`, `SIGTERM`, ...), each step a short signal-like word or `?`: the
    container's words reach the record and the operator's terminal."""
    if not isinstance(steps, list):
        return []
    return [x if isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9_+:. ()-]{1,40}", x) else "?"
            for x in steps[:10]]


# --- runs across several containers ------------------------------------------------------------------------


TEARDOWN_GRACE_S = 5.0  # a surviving node's trainer gets SIGINT, then this long before SIGTERM


_ENDED_BADLY = frozenset({Lifecycle.FAILED, Lifecycle.CRASHED, Lifecycle.LOST})


def exit_text(code: int | None) -> str:
    """137 -> "exit 137 (SIGKILL)"."""
    if code is None:
        return "no exit status"
    if code > 128:
        try:
            return f"exit {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit {code}"


def culprit(members: list[RunRecord]) -> RunRecord | None:
    """The node that ended the run: of those that failed, crashed or were lost, the first to end."""
    bad = [m for m in members if m.state in _ENDED_BADLY]
    if not bad:
        return None
    return min(bad, key=lambda m: (m.ended or float("inf"), m.node_rank or 0))


def aggregate(members: list[RunRecord]) -> Lifecycle:
    """The state of a run across several containers, from its nodes' states."""
    states = [m.state for m in members]
    if any(s in _ENDED_BADLY for s in states):
        return Lifecycle.CRASHED
    if all(s == Lifecycle.FINISHED for s in states):
        return Lifecycle.FINISHED
    if any(s == Lifecycle.STARTING for s in states):
        return Lifecycle.STARTING
    if any(s == Lifecycle.RUNNING for s in states):
        return Lifecycle.RUNNING
    return Lifecycle.STOPPED  # none live, none failed, not all finished: ctl stop ended (some of) it


def _signature(pool: Pool, inv: Inventory, m: RunRecord) -> str:
    """What ended a node: the crash signature in its log's last lines (OOM, NCCL, traceback ...) and its exit."""
    from controller.core.metrics import detect_crash

    crash = m.crash
    if crash is None and m.log_path and m.ct in inv.model.containers:
        try:
            t = pool.container(inv.container(m.ct))
            info = Agent.of(t).call("tailinfo", {"log": m.log_path, "lines": 60}, check=False, timeout=30)
            for line in str(info.get("text") or "").splitlines():
                found = detect_crash(line)
                if found is not None and (crash is None or crash == "traceback"):
                    crash = found
        except CtlError:
            pass
    if m.state == Lifecycle.LOST:
        return crash or "lost (no exit status: the container restarted or the launcher was killed)"
    return f"{crash}, {exit_text(m.exit_status)}" if crash else exit_text(m.exit_status)


def settle(inv: Inventory, reg: Registry, pool: Pool, run: RunRecord, members: list[RunRecord]) -> RunRecord:
    """Record the run's state from its (just refreshed) nodes. A node that ended badly while others live makes
    the run CRASHED, naming it and its signature, and stops the survivors now (teardown)."""
    state = aggregate(members)
    if state == Lifecycle.CRASHED and run.stop_asked is not None:
        # The operator's stop ended a node first (its SIGINT is an exit like any other): the run is stopped,
        # not crashed, and its other nodes go with it
        if any(m.state.live for m in members):
            teardown(inv, pool, reg, members, "stopped by ctl stop")
        if not run.state.live:
            return run
        ended = [m.ended for m in members if m.ended]
        return reg.update_run(run.id, state=Lifecycle.STOPPED, ended=max(ended) if ended else time.time(),
                              note="stopped by ctl stop")
    if state == run.state and not (state == Lifecycle.CRASHED and any(m.state.live for m in members)):
        return run
    fields: dict[str, Any] = {"state": state}
    if state == Lifecycle.CRASHED:
        bad = culprit(members)
        assert bad is not None
        if run.state != Lifecycle.CRASHED or not run.crash:
            sig = _signature(pool, inv, bad)
            if bad.crash is None and "exit" not in sig:
                reg.update_run(bad.id, crash=sig)
            fields.update(crash=f"{bad.ct}: {sig}", exit_status=bad.exit_status, ended=bad.ended or time.time())
        why = fields.get("crash") or run.crash
        survivors = [m.ct for m in members if m.state.live]
        teardown(inv, pool, reg, members, f"stopped by ctl: {why}")
        if survivors:
            fields["note"] = f"{why}; stopped the other node(s): {', '.join(survivors)}"[:500]
    elif not state.live:
        ended = [m.ended for m in members if m.ended]
        fields.update(ended=max(ended) if ended else time.time(),
                      exit_status=0 if state == Lifecycle.FINISHED else None)
    elif state == Lifecycle.RUNNING and run.started is None:
        fields["started"] = min((m.started for m in members if m.started), default=None)
    return reg.update_run(run.id, **fields)


def teardown(inv: Inventory, pool: Pool, reg: Registry, members: list[RunRecord], note: str) -> list[Outcome[Any]]:
    """After a node ended badly: the surviving nodes' trainers are stopped (SIGTERM first: no step can finish
    without the dead peer), and what the dead node left behind is ended too (torchrun starts each worker in a
    session of its own, so a killed torchrun leaves its workers waiting on a collective). In parallel."""
    todo = [m for m in members if m.ct in inv.model.containers and m.log_path and (
        m.state.live or m.state in _ENDED_BADLY)]
    if not todo:
        return []
    by_ct = {m.ct: m for m in todo}

    def one(ct: Container, t: Transport) -> Any:
        m = by_ct[ct.name]
        if m.state.live:
            rec = stop(inv, ct, t, reg, m, grace=TEARDOWN_GRACE_S, term_first=True)
            return reg.update_run(rec.id, note=note[:500])
        return Agent.of(t).call("stop", {"log": m.log_path, "session": m.session, "grace": 0, "run": m.name,
                                      "term_first": True}, timeout=60)

    return fanout(pool, [inv.container(m.ct) for m in todo], one)


def settle_now(inv: Inventory, reg: Registry, pool: Pool, run: RunRecord) -> RunRecord:
    """Refresh every node of a run across several containers (one round trip each, in parallel), then settle it."""
    members = reg.members(run.id)
    by_ct: dict[str, list[RunRecord]] = {}
    for m in members:
        by_ct.setdefault(m.ct, []).append(m)
    fresh = fanout(pool, [inv.container(c) for c in by_ct],
                   lambda ct, t: refresh(inv, ct, t, reg, by_ct[ct.name]))
    members = [r for o in fresh if o.value for r in o.value] or members
    members.sort(key=lambda m: m.node_rank or 0)
    return settle(inv, reg, pool, reg.run_by_id(run.id), members)


def die_if(step: str) -> None:
    if os.environ.get(DIE_AT) == step:
        os._exit(137)
