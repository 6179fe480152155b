"""Starting and stopping runs: on one container (`launch`, `next_name`), or on every node of a job of the
inventory (`launch_job`, `stop_job`, `next_job_name`), and what a relaunch resumes from (`find_checkpoint`,
`spread_checkpoint`). What `ctl launch`, `ctl stop`, runbooks and supervise's restarts call.

A run is claimed in the registry before anything touches the container (UNIQUE (ct, name): of two concurrent
launches exactly one proceeds), checked in one agent round trip (preflight.py), then started in a detached tmux
session by a launcher that refuses to overwrite the log (noclobber), records the training's process group and
writes its exit status beside the log when it ends.

A job's launch probes every node in one round trip each, in parallel, and that round trip also proves the
rendezvous endpoint reachable from inside each container (the first node listens on the rendezvous port, the
others connect to its address and read a nonce), so a firewall or a wrong address is refused before anything
starts (exit 5, naming node and address). The name is claimed on every node or on none (one transaction), the
nodes are started together, and if one fails to start the others are stopped.
"""

from __future__ import annotations

import re
import secrets
import shlex
import time
from dataclasses import dataclass
from typing import Any

from controller.commands import gpupreflight, reconcile
from controller.commands.envprobe import probe_for_launch, probe_request
from controller.commands.fanout import Outcome, fanout
from controller.commands.pins import Manifest, pin
from controller.commands.preflight import (
    Check,
    checked_probe,
    launcher_script,
    next_of_series,
    paths_for,
    preflight,
    probe,
    start_script,
)
from controller.commands.reconcile import TEARDOWN_GRACE_S, UNKNOWN_OUTCOME
from controller.core import series
from controller.core.redact import redact_rendered, redact_text, redact_vars, secret_values
from controller.errors import BusyError, ConnectionFailed, CtlError, DiskError, ExitCode, InputError
from controller.inventory import Container, Inventory, Job
from controller.lifecycle import Lifecycle
from controller.names import check_name
from controller.registry import Registry, RunRecord
from controller.remote.client import Agent
from controller.transport.base import Transport
from controller.transport.pool import Pool


@dataclass(frozen=True)
class Launched:
    """What `launch` started: the run as recorded, its preflight checks, and the training's pid as the launch
    answered it (None when the pid file was not written within the agent's wait)."""

    run: RunRecord
    checks: list[Check]
    pid: int | None


def next_name(inv: Inventory, ct: Container, t: Transport, reg: Registry) -> str:
    """The next of the series (one agent round trip to list the container's logs)."""
    agent = Agent.of(t)
    doc = agent.call("probe", {"series_glob": series.log_glob(inv.model.runs)})
    return next_of_series(inv, reg, [ct.name], agent.need(checked_probe(agent, doc), "series_logs", list))


def launch(
    inv: Inventory, ct: Container, t: Transport, reg: Registry, name: str | None, *, allow_drift: bool = False,
    force: bool = False, allow_env_mismatch: bool = False, probe_env: bool = True,
    extra_env: dict[str, str] | None = None, lineage: dict[str, Any] | None = None,
) -> Launched:
    """Claim the name, preflight (one round trip, which also picks the name when none is given), probe the
    environment against its lock (`probe_env`), start the run in tmux, record it. `extra_env` reaches the
    training's environment (CTL_RESUME_FROM, CTL_PARENT_RUN from a supervisor's restart); `lineage` is recorded
    with the claim (parent_id, resumed_from, resumed_step), so a restart is never recorded without its parent."""
    for key in extra_env or {}:
        if not re.fullmatch(r"CTL_[A-Z0-9_]+", key):
            raise InputError(f"{key!r} is not a CTL_* variable name")
    if name is not None:
        check_name(name, "run name")
    job = inv.job_of(ct.name)
    if job is not None and job.nnodes > 1:
        raise InputError(f"{ct.name} is node {job.rank(ct.name)} of job {job.name!r}: its start script is rendered "
                         f"for that job's rendezvous; launch the job (`ctl launch {job.name}`)")
    manifest = pin(inv, ct)
    start = start_script(inv, manifest)
    agent = Agent.of(t)
    probed = None
    # One round trip answers the preflight, the environment probe and (without a name) which name is next.
    env_req = probe_request(inv, ct, t) if probe_env else None
    slot = gpupreflight.request(ct, env_req)  # the GPU checks ride in the environment probe's slot
    if name is None:
        probed = probe(inv, ct, t, manifest, None, env=slot)
        name = next_of_series(inv, reg, [ct.key], agent.need(probed, "series_logs", list))
    rp = paths_for(inv, name)
    rec = reg.claim_run(name, ct.key, host=ct.host_name, session=rp.session, log_path=rp.log, run_dir=rp.run_dir,
                        **(lineage or {}))
    try:
        if probed is None:
            probed = probe(inv, ct, t, manifest, rp, env=slot)
        probed, gpu = gpupreflight.unwrap(ct, probed, env_req)
        gpu_check = gpupreflight.check(ct, gpu, force=force)  # first: a broken setup is also why nvidia-smi fails
        checks = preflight(inv, ct, t, rp, manifest, allow_drift=allow_drift, force=force, doc=probed)
        if gpu_check is not None:
            checks.append(Check(*gpu_check))
        env = probe_for_launch(inv, ct, t, allow_mismatch=allow_env_mismatch,
                                           reply=probed.get("env_probe")) if probe_env else None
        run_env = {**(extra_env or {}), "CTL_RUN": name, "CTL_RUN_DIR": t.path(rp.run_dir), "CTL_LOG": t.path(rp.log)}
        script = launcher_script(t, rp, start, run_env)
        command = shlex.join(["tmux", "new-session", "-d", "-s", rp.session, "bash", "-c", script])
        known = secret_values(manifest.vars)  # replaced wherever they appear in what is recorded
        command = redact_text(command, known)
        record = {
            "run": name, "ct": ct.name, "host": ct.host_name, "vmid": ct.spec.vmid, "created": rec.created,
            "commit": manifest.commit, "dirty": manifest.dirty, "files": manifest.hashes(),
            "vars": redact_vars(manifest.vars),
            "command": command, "log": rp.log, "run_dir": rp.run_dir, "session": rp.session,
            "env_fingerprint": (env or {}).get("fingerprint"),
        }
    except BaseException:
        reg.release_run(rec.id)  # nothing was started: the preflight or the environment check refused
        raise
    try:
        doc = agent.call("launch", {"log": rp.log, "session": rp.session, "script": script, "env": run_env,
                                    "record": record, "follow": list(ct.spec.follow_symlinks)}, check=False)
    except BaseException as e:
        # No answer (connection dropped, Ctrl-C, unreadable reply): tmux may have started the run. The claim
        # stays, in state `starting`; the next command that refreshes this container reconciles it.
        why = str(e) or type(e).__name__
        reg.update_run(rec.id, command=command, note=f"{UNKNOWN_OUTCOME}: {why}"[:500])
        if isinstance(e, CtlError) and e.hint is None:
            e.hint = (f"run {name} may have started: `ctl runs {ct.name}` asks the container; the name stays "
                      "claimed")
        raise
    if not doc.get("ok"):
        reg.release_run(rec.id)  # the agent answered that it started nothing (log, record or session taken)
        raise agent.error(doc)
    agent.need(doc, "started", (float, int))
    rec = reg.update_run(
        rec.id, state=Lifecycle.RUNNING, started=doc.get("started"), command=command, commit_sha=manifest.commit,
        dirty=manifest.dirty, files=manifest.hashes(), vars=redact_vars(manifest.vars),
        rendered=redact_rendered(manifest.rendered(), known),
        env_fingerprint=(env or {}).get("fingerprint"), env=env,
    )
    pid = doc.get("pid")
    return Launched(rec, checks, pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None)


# --- runs across several containers ------------------------------------------------------------------------


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


@dataclass(frozen=True)
class JobLaunched:
    run: RunRecord
    nodes: tuple[RunRecord, ...]
    checks: dict[str, list[Check]]  # node -> its preflight checks
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


def _judge_rendezvous(job: Job, docs: dict[str, dict[str, Any]]) -> dict[str, Check]:
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
    checks = {first: Check("rendezvous", True, f"listens on port {job.spec.rdzv_port}: "
                                                    f"{job.nnodes - 1} node(s) got through")}
    for ct in job.nodes[1:]:
        got = docs[ct.name].get("rdzv") or {}
        if not isinstance(got, dict) or not got.get("ok"):
            why = got.get("error", "no answer") if isinstance(got, dict) else "malformed answer"
            raise RendezvousUnreachable(
                f"{job.name}: {ct.name} cannot reach the rendezvous endpoint {endpoint} ({first}'s address and "
                f"rdzv_port) from inside its container: {why}; nothing was started",
                hint="check the first node's `address:` and the firewall between the nodes; the ports to open: "
                     "docs/guides/multinode.md")
        checks[ct.name] = Check("rendezvous", True, f"reaches {endpoint} ({got.get('seconds', 0)}s)")
    return checks


def launch_job(
    inv: Inventory, pool: Pool, reg: Registry, job_name: str, name: str | None, *, allow_drift: bool = False,
    force: bool = False, allow_env_mismatch: bool = False, probe_env: bool = True,
    extra_env: dict[str, str] | None = None, lineage: dict[str, Any] | None = None,
) -> JobLaunched:
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
    manifests: dict[str, Manifest] = {ct.name: pin(inv, ct) for ct in nodes}
    starts = {ct.name: start_script(inv, manifests[ct.name]) for ct in nodes}
    rp = paths_for(inv, name) if name is not None else None
    rdzv = _rdzv_args(job, secrets.token_hex(16))

    probed = fanout(pool, nodes, lambda ct, t: probe(inv, ct, t, manifests[ct.name], rp, rdzv.get(ct.name),
                                                     env=gpupreflight.request(ct, None)))
    err = _first_failure(job.name, probed, "; nothing was started or claimed")
    if err is not None:
        raise err
    docs = {o.ct: o.value for o in probed if o.value is not None}
    gpus: dict[str, dict[str, Any] | None] = {}  # each node's GPU document: its checks rode in the probe
    for ct in nodes:
        docs[ct.name], gpus[ct.name] = gpupreflight.unwrap(ct, docs[ct.name], None)
    if name is None:
        logs = [n for d in docs.values() for n in d.get("series_logs", []) if isinstance(n, str)]
        name = next_of_series(inv, reg, [job.name, *(ct.key for ct in nodes)], logs)
        rp = paths_for(inv, name)
    assert rp is not None
    run, members = reg.claim_job_run(name, job.name, [(ct.key, ct.host_name) for ct in nodes], session=rp.session,
                                     log_path=rp.log, run_dir=rp.run_dir, **(lineage or {}))
    by_node = {m.ct: m for m in members}
    checks: dict[str, list[Check]] = {}
    envs: dict[str, dict[str, Any] | None] = {}
    try:
        for ct in nodes:
            try:
                gpu_check = gpupreflight.check(ct, gpus[ct.name], force=force)
                checks[ct.name] = preflight(inv, ct, pool.container(ct), rp, manifests[ct.name],
                                            allow_drift=allow_drift, force=force, doc=docs[ct.name])
                if gpu_check is not None:
                    checks[ct.name].append(Check(*gpu_check))
            except CtlError as e:
                raise node_error(job.name, str(e), int(e.exit_code), "; nothing was started or claimed") from None
        for node_name, check in _judge_rendezvous(job, docs).items():
            checks[node_name].append(check)
        if probe_env:
            got = fanout(pool, nodes, lambda ct, t: probe_for_launch(inv, ct, t, allow_mismatch=allow_env_mismatch))
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
        script = launcher_script(t, rp, starts[ct.name], run_env, times=True)
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
        agent = Agent.of(t)
        try:
            doc = agent.call("launch", {"log": rp.log, "session": rp.session, "script": script, "env": run_env,
                                        "record": record, "follow": list(ct.spec.follow_symlinks)}, check=False)
        except CtlError as e:  # no answer: tmux may have started it; it is stopped with the others below
            reg.update_run(m.id, command=shown, note=f"{UNKNOWN_OUTCOME}: {e}"[:500])
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
    return JobLaunched(run, tuple(reg.members(run.id)), checks, time.monotonic() - t0)


def _undo_start(inv: Inventory, pool: Pool, reg: Registry, job: Job, run: RunRecord, ok: list[str],
                failed: list[Outcome[Any]]) -> CtlError:
    """A node did not start: stop the ones that did (and any whose answer was lost), so none waits for the
    missing one; release the name when nothing started anywhere, else keep the run, failed, with its logs."""
    members = {m.ct: m for m in reg.members(run.id)}
    unknown = [o.ct for o in failed if UNKNOWN_OUTCOME in (members[o.ct].note or "")]
    to_stop = [inv.container(c) for c in ok + unknown]
    if to_stop:
        fanout(pool, to_stop, lambda ct, t: reconcile.stop(inv, ct, t, reg, reg.run_by_id(members[ct.name].id),
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


def stop_job(inv: Inventory, pool: Pool, reg: Registry, run: RunRecord, grace: float = 30, *,
             by_operator: bool = False) -> tuple[RunRecord, list[Outcome[Any]]]:
    """SIGINT every live node's training (escalating as `ctl stop` does), in parallel; the run is STOPPED.
    `by_operator`: the stop is recorded as asked, on the run and every node, before the first signal."""
    members = reg.members(run.id)
    live = [m for m in members if m.state.live]
    if not live and not run.state.live:
        raise InputError(f"run {run.name} of {run.ct} is not running (state: {run.state})")
    missing = [m.ct for m in live if m.ct not in inv.model.containers]
    if missing:
        raise InputError(f"run {run.name}: node(s) {', '.join(missing)} are no longer in {inv.path}")
    if by_operator:
        reg.ask_stop(run.id)
    by_ct = {m.ct: m for m in live}
    outcomes = fanout(pool, [inv.container(m.ct) for m in live],
                      lambda ct, t: reconcile.stop(inv, ct, t, reg, by_ct[ct.name], grace=grace))
    err = _first_failure(run.ct, outcomes)
    if err is not None:
        raise err
    state = Lifecycle.STOPPED if run.state.live else run.state
    run = reg.update_run(run.id, state=state, ended=time.time() if run.state.live else run.ended,
                         note=f"stopped by ctl stop ({len(live)} node(s))" if run.state.live else run.note)
    return run, outcomes


def next_job_name(inv: Inventory, pool: Pool, reg: Registry, job_name: str) -> str:
    """The next of the series after every run of the job and of its nodes, and every log on every node (one
    agent round trip per node, in parallel)."""
    job = inv.job(job_name)
    pattern = series.log_glob(inv.model.runs)
    got = fanout(pool, list(job.nodes), lambda ct, t: Agent.of(t).call("probe", {"series_glob": pattern}))
    err = _first_failure(job.name, got)
    if err is not None:
        raise err
    logs = [n for o in got for n in (o.value or {}).get("series_logs", []) if isinstance(n, str)]
    return next_of_series(inv, reg, [job.name, *(c.name for c in job.nodes)], logs)


def checkpoint_dirs(inv: Inventory, reg: Registry, failed: RunRecord) -> list[dict[str, str]]:
    """Where the failed run and its ancestors keep checkpoints, newest run first: the agent's ckptscan tries them
    in that order."""
    template = inv.model.runs.checkpoints
    return [{"run": r.name, "dir": template.replace("{dir}", r.run_dir).replace("{run}", r.name)}
            for r in reversed(reg.lineage(failed.id)) if r.run_dir]


def find_checkpoint(inv: Inventory, pool: Pool, reg: Registry, failed: RunRecord, *,
                    below: int | None = None) -> dict[str, Any] | None:
    """The newest complete checkpoint of the failed run or its ancestors, looked for on every node (the node
    that writes checkpoints is torchrun's choice): {"dir", "step", "run", "node"}, or None. `below`: only
    steps under that one."""
    dirs = checkpoint_dirs(inv, reg, failed)
    if not dirs:
        return None
    job = inv.job(failed.ct)
    scan: dict[str, Any] = {"dirs": dirs} if below is None else {"dirs": dirs, "below": below}
    got = fanout(pool, list(job.nodes), lambda ct, t: Agent.of(t).call("ckptscan", scan, timeout=600))
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
    job = inv.job(job_name)
    path, step = str(found["dir"]), int(found["step"])
    parent = path.rstrip("/").rsplit("/", 1)[0]
    scans = fanout(pool, [c for c in job.nodes if c.name != found["node"]],
                   lambda ct, t: Agent.of(t).call("ckptscan", {"dirs": [{"run": "", "dir": parent}], "below": step + 1},
                                               timeout=600))  # that step, complete, or an older one
    lacking = [inv.container(o.ct) for o in scans
               if not (o.ok and ((o.value or {}).get("found") or {}).get("step") == step
                       and ((o.value or {}).get("found") or {}).get("dir") == path)]
    if not lacking:
        return []
    src = Agent.of(pool.container(inv.container(str(found["node"]))))
    answers = src.copy_dir(path, [(Agent.of(pool.container(ct)), ct.spec.follow_symlinks) for ct in lacking])
    failures = [(ct.name, doc) for ct, doc in zip(lacking, answers, strict=True) if not doc.get("ok")]
    for name, doc in failures:  # a full disk first: the caller may pick an older step that every node holds
        why = f"{job_name}: {name}: copying checkpoint {path} from {found['node']}: {doc.get('error')}"
        if doc.get("code") == "disk":
            raise DiskError(why)
    if failures:
        raise node_error(job_name, f"{failures[0][0]}: copying checkpoint {path} from {found['node']}: "
                                   f"{failures[0][1].get('error')}", int(ExitCode.VERIFY))
    return [ct.name for ct in lacking]
