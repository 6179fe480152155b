"""Runs across several containers (a job of the inventory): launch, state, stop, follow, on torchrun's c10d
rendezvous.

One run is one row of the registry (its `ct` is the job's name) plus one row per node (that container's log,
session, state and metrics). ctl's part is what torchrun does not do:

- launch: every node is probed in one agent round trip, all in parallel, and that round trip also proves the
  rendezvous endpoint reachable from inside each container (the first node listens on the rendezvous port,
  the others connect to its address and read a nonce), so a firewall or a wrong address is refused before
  anything starts (exit 5, naming node and address). The name is claimed on every node or on none (one
  transaction), the nodes are started together, and if one fails to start the others are stopped.
- state: a node that fails (exit status, crash signature, lost) makes the whole run CRASHED, naming the node and
  what ended it, and the surviving nodes are stopped at once: without that they would wait on a collective until
  NCCL's timeout. Whoever notices settles it: `ctl runs`, `ctl status`, `ctl supervise`, `ctl tail -f`.
- stop: every node; follow: the nodes' logs merged in the order their lines were written, `[node]` first.
"""

from __future__ import annotations

import queue
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controller.commands import runs
from controller.commands.fanout import Outcome, fanout
from controller.core.redact import redact_rendered, redact_text, redact_vars, secret_values
from controller.errors import BusyError, ConnectionFailed, CtlError, ExitCode, InputError
from controller.inventory import Container, Inventory, Job
from controller.lifecycle import Lifecycle
from controller.names import check_name
from controller.registry import Registry, RunRecord
from controller.remote.client import Agent
from controller.transport.base import Transport
from controller.transport.pool import Pool

if TYPE_CHECKING:
    from controller.commands.deploy import Manifest

TEARDOWN_GRACE_S = 5.0  # a surviving node's trainer gets SIGINT, then this long before SIGTERM


class RendezvousUnreachable(ConnectionFailed):
    """A node of a job cannot reach the rendezvous endpoint from inside its container (exit 5)."""


def node_error(job: str, message: str, code: int, tail: str = "") -> CtlError:
    """One node's failure as the job's error: the node's own message (it names the container), its exit code."""
    e = CtlError(f"{job}: {message}{tail}")
    e.exit_code = ExitCode(code) if code in ExitCode._value2member_map_ else ExitCode.FAILURE
    return e


def _first_failure(job: str, outcomes: list[Outcome[Any]], tail: str = "") -> CtlError | None:
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return None
    more = f" (and {len(failed) - 1} other node(s): {', '.join(o.ct for o in failed[1:])})" if len(failed) > 1 else ""
    return node_error(job, str(failed[0].error), failed[0].exit_code or int(ExitCode.FAILURE), more + tail)


# --- launch ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launched:
    run: RunRecord
    nodes: tuple[RunRecord, ...]
    checks: dict[str, list[runs.Check]]  # node -> its preflight checks
    seconds: float


def exposed_nodes(job: Job) -> list[str]:
    """`CT (ADDRESS)` for each node whose address is an IP outside the private, loopback and link-local ranges.
    torch's c10d store has no authentication and the rendezvous unpickles what it reads from it, so whoever
    reaches node 0's rdzv_port during a run runs code as root on every node: the nodes belong on a private
    network (a host name is not judged: resolving it here would ask the operator's resolver, not the nodes')."""
    import ipaddress

    out = []
    for ct in job.nodes:
        addr = (ct.spec.address or "").strip("[]")
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            continue
        if not (ip.is_private or ip.is_loopback or ip.is_link_local):
            out.append(f"{ct.name} ({addr})")
    return out


def _rdzv_args(job: Job, nonce: str) -> dict[str, dict[str, Any]]:
    """What each node's probe does for the rendezvous: node 0 listens on the port, the others connect."""
    if job.nnodes < 2:
        return {}
    timeout = job.spec.preflight_timeout
    out: dict[str, dict[str, Any]] = {job.nodes[0].name: {"listen": job.spec.rdzv_port, "nonce": nonce,
                                                           "expect": job.nnodes - 1, "timeout": timeout}}
    for ct in job.nodes[1:]:
        out[ct.name] = {"connect": [job.master_addr, job.spec.rdzv_port], "nonce": nonce, "timeout": timeout}
    return out


def _judge_rendezvous(job: Job, docs: dict[str, dict[str, Any]]) -> dict[str, runs.Check]:
    """The rendezvous part of the probes: the endpoint node could listen, every other node got through."""
    if job.nnodes < 2:
        return {}
    first = job.nodes[0].name
    listen = docs[first].get("rdzv") or {}
    endpoint = job.rdzv_endpoint
    if not isinstance(listen, dict) or not listen.get("bound"):
        why = listen.get("error", "no answer") if isinstance(listen, dict) else "malformed answer"
        if isinstance(listen, dict) and listen.get("in_use"):
            raise BusyError(f"{job.name}: {first}: rendezvous port {job.spec.rdzv_port} is already in use in the "
                            f"container ({why}): a run of this job may still be live there, or pick another "
                            "rdzv_port")
        raise RendezvousUnreachable(f"{job.name}: {first}: cannot listen on the rendezvous port "
                                    f"{job.spec.rdzv_port}: {why}")
    checks = {first: runs.Check("rendezvous", True, f"listens on port {job.spec.rdzv_port}: "
                                                    f"{job.nnodes - 1} node(s) got through")}
    for ct in job.nodes[1:]:
        got = docs[ct.name].get("rdzv") or {}
        if not isinstance(got, dict) or not got.get("ok"):
            why = got.get("error", "no answer") if isinstance(got, dict) else "malformed answer"
            raise RendezvousUnreachable(
                f"{job.name}: {ct.name} cannot reach the rendezvous endpoint {endpoint} ({first}'s address and "
                f"rdzv_port) from inside its container: {why}; nothing was started",
                hint="check the first node's `address:` and the firewall between the nodes; README: Runs across "
                     "several containers")
        checks[ct.name] = runs.Check("rendezvous", True, f"reaches {endpoint} ({got.get('seconds', 0)}s)")
    return checks


def launch(
    inv: Inventory, pool: Pool, reg: Registry, job_name: str, name: str | None, *, allow_drift: bool = False,
    force: bool = False, allow_env_mismatch: bool = False, probe_env: bool = True,
    extra_env: dict[str, str] | None = None, lineage: dict[str, Any] | None = None,
) -> Launched:
    """Probe every node (one round trip each, in parallel, rendezvous reachability included), claim the name on
    all of them, check the environments, start the nodes together; a node that fails to start gets the others
    stopped. Every failure names the node."""
    t0 = time.monotonic()
    job = inv.job(job_name)
    for key in extra_env or {}:
        if not key.startswith("CTL_") or not key.replace("_", "").isalnum() or not key.isupper():
            raise InputError(f"{key!r} is not a CTL_* variable name")
    if name is not None:
        check_name(name, "run name")
    nodes = list(job.nodes)
    from controller.commands import environment  # a launch's: `ctl status` settles jobs without them
    from controller.commands.deploy import pin

    manifests: dict[str, Manifest] = {ct.name: pin(inv, ct) for ct in nodes}
    starts = {ct.name: runs.start_script(inv, manifests[ct.name]) for ct in nodes}
    rp = runs.paths_for(inv, name) if name is not None else None
    rdzv = _rdzv_args(job, secrets.token_hex(16))

    probed = fanout(pool, nodes, lambda ct, t: runs._probe(inv, ct, t, manifests[ct.name], rp, rdzv.get(ct.name)))
    err = _first_failure(job.name, probed, "; nothing was started or claimed")
    if err is not None:
        raise err
    docs = {o.ct: o.value for o in probed if o.value is not None}
    if name is None:
        logs = [n for d in docs.values() for n in d.get("series_logs", []) if isinstance(n, str)]
        name = runs._name_after(inv, [job.name, *(ct.name for ct in nodes)], reg, logs)
        rp = runs.paths_for(inv, name)
    assert rp is not None
    run, members = reg.claim_job_run(name, job.name, [(ct.name, ct.host_name) for ct in nodes], session=rp.session,
                                     log_path=rp.log, run_dir=rp.run_dir, **(lineage or {}))
    by_node = {m.ct: m for m in members}
    checks: dict[str, list[runs.Check]] = {}
    envs: dict[str, dict[str, Any] | None] = {}
    try:
        for ct in nodes:
            try:
                checks[ct.name] = runs.preflight(inv, ct, pool.container(ct), rp, manifests[ct.name],
                                                 allow_drift=allow_drift, force=force, doc=docs[ct.name])
            except CtlError as e:
                raise node_error(job.name, str(e), int(e.exit_code), "; nothing was started or claimed") from None
        for node_name, check in _judge_rendezvous(job, docs).items():
            checks[node_name].append(check)
        if probe_env:
            got = fanout(pool, nodes, lambda ct, t: environment.probe_for_launch(inv, ct, t,
                                                                                   allow_mismatch=allow_env_mismatch))
            err = _first_failure(job.name, got, "; nothing was started or claimed")
            if err is not None:
                raise err
            envs = {o.ct: o.value for o in got}
    except BaseException:
        reg.release_run(run.id)
        raise

    def start(ct: Container, t: Transport) -> dict[str, Any]:
        m = by_node[ct.name]
        run_env = {**(extra_env or {}), "CTL_RUN": name, "CTL_RUN_DIR": t.path(rp.run_dir), "CTL_LOG": t.path(rp.log)}
        script = runs.launcher_script(t, rp, starts[ct.name], run_env, times=True)
        manifest = manifests[ct.name]
        known = secret_values(manifest.vars)  # replaced wherever they appear in what is recorded
        shown = redact_text(script, known)
        record = {
            "run": name, "ct": ct.name, "host": ct.host_name, "vmid": ct.spec.vmid, "created": m.created,
            "job": job.name, "node_rank": m.node_rank, "nodes": [c.name for c in nodes],
            "rdzv_endpoint": job.rdzv_endpoint, "commit": manifest.commit, "dirty": manifest.dirty,
            "files": manifest.hashes(), "vars": redact_vars(manifest.vars), "command": shown, "log": rp.log,
            "run_dir": rp.run_dir, "session": rp.session,
            "env_fingerprint": (envs.get(ct.name) or {}).get("fingerprint"),
        }
        agent = Agent(t)
        try:
            doc = agent.call("launch", {"log": rp.log, "session": rp.session, "script": script, "env": run_env,
                                        "record": record, "follow": list(ct.spec.follow_symlinks)}, check=False)
        except CtlError as e:  # no answer: tmux may have started it; it is stopped with the others below
            reg.update_run(m.id, command=shown, note=f"{runs.UNKNOWN_OUTCOME}: {e}"[:500])
            raise
        if not doc.get("ok"):
            raise agent.error(doc)
        agent.need(doc, "started", (float, int))
        reg.update_run(m.id, state=Lifecycle.RUNNING, started=doc.get("started"), command=shown,
                       commit_sha=manifest.commit, dirty=manifest.dirty, files=manifest.hashes(),
                       vars=redact_vars(manifest.vars), rendered=redact_rendered(manifest.rendered(), known),
                       env_fingerprint=(envs.get(ct.name) or {}).get("fingerprint"), env=envs.get(ct.name))
        return doc

    started = fanout(pool, nodes, start)
    failed = [o for o in started if not o.ok]
    if failed:
        raise _undo_start(inv, pool, reg, job, run, [o.ct for o in started if o.ok], failed)
    n0 = manifests[nodes[0].name]
    run = reg.update_run(run.id, state=Lifecycle.RUNNING, host=None,
                         started=min(float((o.value or {}).get("started") or time.time()) for o in started),
                         command=f"ctl launch {job.name}: {job.nnodes} node(s), rendezvous {job.rdzv_endpoint}",
                         commit_sha=n0.commit, dirty=any(m.dirty for m in manifests.values()),
                         files=n0.hashes(), vars=redact_vars({"job": job.name, "nodes": [c.name for c in nodes],
                                                              "rdzv_endpoint": job.rdzv_endpoint}))
    return Launched(run, tuple(reg.members(run.id)), checks, time.monotonic() - t0)


def _undo_start(inv: Inventory, pool: Pool, reg: Registry, job: Job, run: RunRecord, ok: list[str],
                failed: list[Outcome[Any]]) -> CtlError:
    """A node did not start: stop the ones that did (and any whose answer was lost), so none waits for the
    missing one; release the name when nothing started anywhere, else keep the run, failed, with its logs."""
    members = {m.ct: m for m in reg.members(run.id)}
    unknown = [o.ct for o in failed if runs.UNKNOWN_OUTCOME in (members[o.ct].note or "")]
    to_stop = [inv.container(c) for c in ok + unknown]
    if to_stop:
        fanout(pool, to_stop, lambda ct, t: runs.stop(inv, ct, t, reg, reg.run_by_id(members[ct.name].id),
                                                       grace=TEARDOWN_GRACE_S, term_first=True))
    culprit = failed[0]
    why = f"{culprit.ct} did not start: {culprit.error}"
    if not ok and not unknown:
        reg.forget_job_claim(run.id)
        tail = "; no node started: the run name is released"
    else:
        for o in failed:
            if o.ct not in unknown:
                reg.update_run(members[o.ct].id, state=Lifecycle.LOST, ended=time.time(),
                               note=f"not started: {o.error}"[:500])
        reg.update_run(run.id, state=Lifecycle.FAILED, ended=time.time(),
                       note=f"{why}; stopped: {', '.join(ok + unknown)}"[:500])
        tail = f"; stopped the node(s) that had started ({', '.join(ok + unknown)}): run {run.name} is recorded " \
               "as failed (its logs stay)"
    return node_error(job.name, str(culprit.error), culprit.exit_code or int(ExitCode.FAILURE), tail)


# --- state -----------------------------------------------------------------------------------------------


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
            info = Agent(t).call("tailinfo", {"log": m.log_path, "lines": 60}, check=False, timeout=30)
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
            rec = runs.stop(inv, ct, t, reg, m, grace=TEARDOWN_GRACE_S, term_first=True)
            return reg.update_run(rec.id, note=note[:500])
        return Agent(t).call("stop", {"log": m.log_path, "session": m.session, "grace": 0, "run": m.name,
                                      "term_first": True}, timeout=60)

    return fanout(pool, [inv.container(m.ct) for m in todo], one)


# --- stop ------------------------------------------------------------------------------------------------


def stop(inv: Inventory, pool: Pool, reg: Registry, run: RunRecord, grace: float = 30) -> tuple[RunRecord,
                                                                                           list[Outcome[Any]]]:
    """SIGINT every live node's training (escalating as `ctl stop` does), in parallel; the run is STOPPED."""
    members = reg.members(run.id)
    live = [m for m in members if m.state.live]
    if not live and not run.state.live:
        raise InputError(f"run {run.name} of {run.ct} is not running (state: {run.state})")
    missing = [m.ct for m in live if m.ct not in inv.model.containers]
    if missing:
        raise InputError(f"run {run.name}: node(s) {', '.join(missing)} are no longer in {inv.path}")
    by_ct = {m.ct: m for m in live}
    outcomes = fanout(pool, [inv.container(m.ct) for m in live],
                      lambda ct, t: runs.stop(inv, ct, t, reg, by_ct[ct.name], grace=grace))
    err = _first_failure(run.ct, outcomes)
    if err is not None:
        raise err
    state = Lifecycle.STOPPED if run.state.live else run.state
    run = reg.update_run(run.id, state=state, ended=time.time() if run.state.live else run.ended,
                         note=f"stopped by ctl stop ({len(live)} node(s))" if run.state.live else run.note)
    return run, outcomes


# --- follow ----------------------------------------------------------------------------------------------


@dataclass
class FollowEnd:
    state: Lifecycle
    crash: str | None
    exit_status: int | None

    @property
    def exit_code(self) -> int:
        if self.crash or self.state in (Lifecycle.CRASHED, Lifecycle.FAILED, Lifecycle.LOST) or (
                self.exit_status not in (None, 0)):
            return int(ExitCode.RUN_FAILED)
        return 0


def history(inv: Inventory, pool: Pool, members: list[RunRecord], lines: int) -> tuple[list[tuple[str, str]],
                                                                                        dict[int, int]]:
    """The nodes' last `lines` lines, merged in the order they were written (the launcher's LOG.times; a line
    with no sample keeps its place after the one before it): [(node, line)], and each node's log size then."""
    def one(ct: Container, t: Transport) -> dict[str, Any]:
        m = next(x for x in members if x.ct == ct.name)
        return Agent(t).call("tailinfo", {"log": m.log_path, "lines": max(lines, 0), "times": True}, check=False)

    got = fanout(pool, [inv.container(m.ct) for m in members], one)
    merged: list[tuple[float, int, int, str, str]] = []
    sizes: dict[int, int] = {}
    for m, o in zip(members, got, strict=True):
        info = o.value or {}
        if not o.ok or not info.get("ok"):
            raise InputError(f"{m.ct}: cannot read {m.log_path}: {o.error or info.get('error')}")
        sizes[m.id] = int(info.get("size") or 0)
        texts = str(info.get("text") or "").splitlines()
        raw = info.get("times")
        times: list[Any] = raw if isinstance(raw, list) else []
        last = float("-inf")
        for i, text in enumerate(texts):
            t = times[i] if i < len(times) and isinstance(times[i], int | float) else None
            last = max(last, float(t)) if t is not None else last
            merged.append((last, m.node_rank or 0, i, m.ct, text))
    merged.sort(key=lambda x: (x[0], x[1], x[2]))
    return [(node, text) for _t, _r, _i, node, text in merged], sizes


def follow(
    inv: Inventory, pool: Pool, reg: Registry, run: RunRecord, *, lines: int, follow: bool,
    emit: Callable[[str, str], None], detect: Callable[[str], str | None], node: str | None = None,
    note: Callable[[str], None] | None = None,
) -> FollowEnd:
    """Show the nodes' logs merged (history first, then with `follow` every node's new lines as they come) until
    the run ends; a node that ends badly makes the run CRASHED and its survivors are stopped (settle)."""
    members = reg.members(run.id)
    if node is not None:
        members = [m for m in members if m.ct == node or str(m.node_rank) == node]
        if not members:
            names = ", ".join(f"{m.node_rank}={m.ct}" for m in reg.members(run.id))
            raise InputError(f"run {run.name} has no node {node!r} (nodes: {names})")
    missing = [m.ct for m in members if m.ct not in inv.model.containers]
    if missing:
        raise InputError(f"run {run.name}: node(s) {', '.join(missing)} are no longer in {inv.path}")
    crash: str | None = None
    past, sizes = history(inv, pool, members, lines if lines >= 0 else 1 << 30)
    for n, text in past:
        emit(n, text)
    if not follow:
        return FollowEnd(run.state, run.crash, run.exit_status)
    lines_q: queue.Queue[tuple[str, str | None]] = queue.Queue()
    ends: dict[str, runs.FollowEnd | BaseException] = {}
    lock = threading.Lock()

    def follow_one(m: RunRecord) -> None:
        t = pool.container(inv.container(m.ct))
        try:
            end = runs.follow(t, reg, m, lines=0, follow=True, emit=lambda text: lines_q.put((m.ct, text)),
                              detect=detect, note=note, start_offset=sizes.get(m.id, 0))
            with lock:
                ends[m.ct] = end
        except BaseException as e:  # reported below
            with lock:
                ends[m.ct] = e
        finally:
            lines_q.put((m.ct, None))

    threads = [threading.Thread(target=follow_one, args=(m,), name=f"follow-{m.ct}", daemon=True) for m in members]
    for th in threads:
        th.start()
    open_ = len(threads)
    settled = False
    while open_:
        try:
            n, got = lines_q.get(timeout=1.0)
        except queue.Empty:
            continue
        if got is None:
            open_ -= 1
            with lock:
                end = ends.get(n)
            if isinstance(end, runs.FollowEnd) and (end.crash or end.exit_code) and not settled:
                settled = True  # a node ended badly: settle now, so the survivors' follows end with them
                run = _settle_now(inv, reg, pool, run)
            continue
        found = detect(got)
        if found is not None and (crash is None or crash.endswith(": traceback")):
            crash = f"{n}: {found}"
        emit(n, got)
    for m in members:
        e = ends.get(m.ct)
        if isinstance(e, BaseException):
            raise e
    run = _settle_now(inv, reg, pool, run)
    return FollowEnd(run.state, run.crash or crash, run.exit_status)


def _settle_now(inv: Inventory, reg: Registry, pool: Pool, run: RunRecord) -> RunRecord:
    members = reg.members(run.id)
    by_ct: dict[str, list[RunRecord]] = {}
    for m in members:
        by_ct.setdefault(m.ct, []).append(m)
    fresh = fanout(pool, [inv.container(c) for c in by_ct],
                   lambda ct, t: runs.refresh(inv, ct, t, reg, by_ct[ct.name]))
    members = [r for o in fresh if o.value for r in o.value] or members
    members.sort(key=lambda m: m.node_rank or 0)
    return settle(inv, reg, pool, reg.run_by_id(run.id), members)


# --- restarts (ctl supervise) ----------------------------------------------------------------------------


def next_name(inv: Inventory, pool: Pool, reg: Registry, job_name: str) -> str:
    """The next of the series after every run of the job and of its nodes, and every log on every node (one
    agent round trip per node, in parallel)."""
    job = inv.job(job_name)
    pattern = runs._series_glob(inv)
    got = fanout(pool, list(job.nodes), lambda ct, t: Agent(t).call("probe", {"series_glob": pattern}))
    err = _first_failure(job.name, got)
    if err is not None:
        raise err
    logs = [n for o in got for n in (o.value or {}).get("series_logs", []) if isinstance(n, str)]
    return runs._name_after(inv, [job.name, *(c.name for c in job.nodes)], reg, logs)


def find_checkpoint(inv: Inventory, pool: Pool, reg: Registry, failed: RunRecord) -> dict[str, Any] | None:
    """The newest complete checkpoint of the failed run or its ancestors, looked for on every node (the node
    that writes checkpoints is torchrun's choice): {"dir", "step", "run", "node"}, or None."""
    template = inv.model.runs.checkpoints
    dirs = [{"run": r.name, "dir": template.replace("{dir}", r.run_dir).replace("{run}", r.name)}
            for r in reversed(reg.lineage(failed.id)) if r.run_dir]
    if not dirs:
        return None
    job = inv.job(failed.ct)
    got = fanout(pool, list(job.nodes), lambda ct, t: Agent(t).call("ckptscan", {"dirs": dirs}, timeout=600))
    best: dict[str, Any] | None = None
    for o in got:
        found = (o.value or {}).get("found")
        if isinstance(found, dict) and isinstance(found.get("step"), int) and (
                best is None or found["step"] > best["step"]):
            best = {**found, "node": o.ct}
    return best


def spread_checkpoint(inv: Inventory, pool: Pool, job_name: str, found: dict[str, Any]) -> list[str]:
    """Give every node of the job its own copy of the checkpoint `found` (the payload resumes each node from its
    own copy, at the same path): nodes that have it complete keep theirs; to the others it is carried from the
    node that has it, through this machine (base64 lines in, a tar stream out, unpacked beside its place and
    checked against its manifest before it is renamed there). Returns the nodes it was copied to."""
    import base64

    from controller.remote.client import agent_source

    job = inv.job(job_name)
    path, step = str(found["dir"]), int(found["step"])
    parent = path.rstrip("/").rsplit("/", 1)[0]
    scans = fanout(pool, [c for c in job.nodes if c.name != found["node"]],
                   lambda ct, t: Agent(t).call("ckptscan", {"dirs": [{"run": "", "dir": parent}]}, timeout=600))
    lacking = [inv.container(o.ct) for o in scans
               if not (o.ok and ((o.value or {}).get("found") or {}).get("step") == step
                       and ((o.value or {}).get("found") or {}).get("dir") == path)]
    if not lacking:
        return []
    src_t = pool.container(inv.container(str(found["node"])))
    src_agent = Agent(src_t)
    src = src_t.open(src_agent.argv("packdir", {"dir": path}))
    src.send(agent_source())
    dests = []
    for ct in lacking:
        t = pool.container(ct)
        d = t.open(Agent(t).argv("unpackdir", {"dir": path, "follow": list(ct.spec.follow_symlinks)}))
        d.send(agent_source())
        dests.append((ct, t, d))
    head = Agent.json_line(src.readline(timeout=120))
    if head is None or not head.get("ok"):
        src_agent.fail("packdir", src.finish(timeout=30))
    while True:
        line = src.readline(timeout=600)
        if not line:
            raise ConnectionFailed(f"{job_name}: {found['node']}: the checkpoint {path} stream ended early")
        if line.startswith(b"{"):
            break
        chunk = base64.b64decode(line)
        for _ct, _t, d in dests:
            d.send(chunk)
    src.finish(timeout=60)
    for ct, t, d in dests:
        doc = Agent(t).parse("unpackdir", d.finish(timeout=600))
        if not doc.get("ok"):
            raise node_error(job_name, f"{ct.name}: copying checkpoint {path} from {found['node']}: "
                                       f"{doc.get('error')}", int(ExitCode.VERIFY))
    return [ct.name for ct, _t, _d in dests]
