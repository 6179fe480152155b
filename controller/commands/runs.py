"""Runs: naming, preflight, launch, state, stop, follow.

A run is claimed in the registry before anything touches the container (UNIQUE (ct, name): of two
concurrent launches exactly one proceeds), checked in one agent round trip, then started in a
detached tmux session by a launcher that refuses to overwrite the log (noclobber), records the
training's process group and writes its exit status beside the log when it ends.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.commands.fanout import fanout
from controller.core.loglines import LineSplitter
from controller.core.redact import redact_rendered, redact_text, redact_vars, secret_values
from controller.errors import (
    BusyError,
    ClobberError,
    ConnectionFailed,
    CtlError,
    DiskError,
    DriftError,
    ExitCode,
    InputError,
)
from controller.inventory import Container, Inventory
from controller.lifecycle import Lifecycle
from controller.names import check_name
from controller.registry import Registry, RunRecord
from controller.remote.client import Agent, AgentReplyError
from controller.settings import follow_reconnect
from controller.transport.base import Transport, limit
from controller.transport.pool import Pool

if TYPE_CHECKING:
    from controller.commands.deploy import Manifest

START_SCRIPT = "start_training.sh"
UNKNOWN_OUTCOME = "launch outcome unknown"  # note of a `starting` run whose launch got no answer
LAUNCH_GRACE_S = 120.0  # a `starting` run with no trace in its container after this long was never started
MIN_FREE_BYTES = 1 << 30  # free space the log directory needs before a launch


@dataclass(frozen=True)
class RunPaths:
    name: str
    session: str
    log: str
    run_dir: str

    @property
    def exit_file(self) -> str:
        return self.log + ".exit"

    @property
    def record_file(self) -> str:
        return self.log + ".ctl.json"


def paths_for(inv: Inventory, name: str) -> RunPaths:
    check_name(name, "run name")
    runs = inv.model.runs
    # tmux turns '.' and ':' in session names into '_'; do it ourselves so lookups match.
    session = f"{runs.session}-{name}".replace(".", "_")
    return RunPaths(name, session, runs.log.replace("{run}", name), runs.dir.replace("{run}", name))


def _series_numbers(series: str, names: list[str]) -> list[int]:
    """The numbers of the series' names. A container's log names are untrusted: a number whose successor would
    not be a valid run name (`fresh` and 66 digits) is ignored, so no log can block automatic naming."""
    pat = re.compile(rf"{re.escape(series)}(\d{{1,18}})")
    out = []
    for name in names:
        m = pat.fullmatch(name)
        if m is not None and _valid_name(f"{series}{int(m[1]) + 1}"):
            out.append(int(m[1]))
    return out


def _valid_name(name: str) -> bool:
    try:
        check_name(name)
    except InputError:
        return False
    return True


def _series_glob(inv: Inventory) -> str:
    runs = inv.model.runs
    return runs.log.replace("{run}", runs.series + "*")


def _name_after(inv: Inventory, ct: Container | list[str], reg: Registry, series_logs: list[str]) -> str:
    """The next of the series after every run known to the registry AND every log in the container (or in
    every one of several: the nodes of a job, and the job's own runs)."""
    runs = inv.model.runs
    log_prefix, log_suffix = posixpath.basename(runs.log).split("{run}", 1)
    from_logs = [n[len(log_prefix):len(n) - len(log_suffix) if log_suffix else None]
                 for n in series_logs if n.startswith(log_prefix) and n.endswith(log_suffix)]
    names = [ct.name] if isinstance(ct, Container) else ct
    nums = _series_numbers(runs.series, [n for c in names for n in reg.names(c)] + from_logs)
    return f"{runs.series}{max(nums, default=0) + 1}"


def next_name(inv: Inventory, ct: Container, t: Transport, reg: Registry) -> str:
    """The next of the series (one agent round trip to list the container's logs)."""
    agent = Agent(t)
    doc = agent.call("probe", {"series_glob": _series_glob(inv)})
    return _name_after(inv, ct, reg, agent.need(_checked_probe(agent, doc), "series_logs", list))


# --- preflight -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    forced: bool = False


def _probe(inv: Inventory, ct: Container, t: Transport, manifest: Manifest, rp: RunPaths | None,
           rdzv: dict[str, Any] | None = None, env: tuple[dict[str, Any], bytes] | None = None) -> dict[str, Any]:
    """Everything the preflight needs in one agent round trip. Without a run name yet (rp None), the same
    round trip lists the series' logs and every tmux session, so the name is chosen from its answer. `rdzv`:
    a node of a job also checks the rendezvous endpoint in it (listens on it, or connects to it). `env`
    (environment.probe_request): the environment probe runs in it too, its output under "env_probe"."""
    args: dict[str, Any] = {"files": [f.dest for f in manifest.files], "gpus": bool(ct.spec.gpus.all),
                            "follow": list(ct.spec.follow_symlinks)}
    if rdzv is not None:
        args["rdzv"] = rdzv
    if rp is None:
        runs = inv.model.runs
        args.update(series_glob=_series_glob(inv), sessions=True, log=runs.log.replace("{run}", runs.series + "0"))
    else:
        args.update(session=rp.session, log=rp.log, run_dir=rp.run_dir)
    payload = b""
    if env is not None:
        args["env_probe"], payload = env
    agent = Agent(t)
    return _checked_probe(agent, agent.call("probe", args, payload=payload, timeout=180 if env else None))


def _checked_probe(agent: Agent, doc: dict[str, Any]) -> dict[str, Any]:
    """The probe's answer with each part the preflight reads of the shape it reads, else one line naming
    the container (a foreign python3 or a broken agent, never a traceback)."""
    def bad(what: str) -> AgentReplyError:
        return AgentReplyError(f"{agent.name}: agent probe: malformed {what} in its reply")

    files = agent.need(doc, "files", dict)
    if not all(h is None or (isinstance(h, dict) and isinstance(h.get("sha256", ""), str)) for h in files.values()):
        raise bad("'files'")
    for key in ("tmux", "log", "disk", "gpus", "run_dir"):
        if not isinstance(doc.get(key, {}), dict):
            raise bad(repr(key))
    tmux = doc.get("tmux", {})
    if not isinstance(tmux.get("sessions", []), list) or not isinstance(tmux.get("error", ""), str):
        raise bad("'tmux'")
    if not isinstance(doc.get("disk", {}).get("free"), int | None):
        raise bad("'disk'")
    if "series_logs" in doc and not (isinstance(doc["series_logs"], list)
                                     and all(isinstance(n, str) for n in doc["series_logs"])):
        raise bad("'series_logs'")
    gpus = doc.get("gpus", {})
    if not isinstance(gpus.get("error", ""), str) or not isinstance(gpus.get("gpus", []), list) or not all(
            isinstance(g, dict) and isinstance(g.get("index"), int) and isinstance(g.get("procs"), list)
            and all(isinstance(p, dict) for p in g["procs"]) and isinstance(g.get("used_mib"), int | float)
            for g in gpus.get("gpus", [])):
        raise bad("'gpus'")
    return doc


def preflight(
    inv: Inventory, ct: Container, t: Transport, rp: RunPaths, manifest: Manifest, *, allow_drift: bool,
    force: bool, gpu_mem_threshold_mib: float = 1024, doc: dict[str, Any] | None = None,
) -> list[Check]:
    """Judge the probe (one agent round trip, or `doc` when the launch already made it); raises the first
    failing check as its own error (and exit code)."""
    doc = _probe(inv, ct, t, manifest, rp) if doc is None else _checked_probe(Agent(t), doc)
    checks: list[Check] = [Check("container", True, "running")]

    drift = []
    for f in manifest.files:
        h = doc["files"].get(f.dest)
        if h is None:
            drift.append(f"{f.dest} missing")
        elif h.get("sha256") != f.sha256:
            drift.append(f"{f.dest} differs ({h.get('sha256', '?')[:12]} != pinned {f.sha256[:12]})")
    if drift and not allow_drift:
        raise DriftError(f"{ct.name}: deployed files differ from the pinned payload: {'; '.join(drift)}",
                         hint="run `ctl deploy " + ct.name + "`, or pass --allow-drift")
    checks.append(Check("payload", not drift, "matches pins" if not drift else "; ".join(drift), forced=bool(drift)))

    tmux = doc.get("tmux", {})
    if "error" in tmux:
        raise CtlError(f"{ct.name}: {tmux['error']}")
    if tmux.get("exists") or rp.session in tmux.get("sessions", ()):
        raise BusyError(f"{ct.name}: tmux session {rp.session!r} already exists (a run is live under that name)")
    checks.append(Check("session", True, f"{rp.session} free"))

    if doc.get("log", {}).get("exists"):
        raise ClobberError(f"{ct.name}: log {rp.log} already exists; a log is never overwritten "
                           "(--force does not change that): pick another run name")
    checks.append(Check("log", True, f"{rp.log} is new"))

    disk = doc.get("disk", {})
    free = disk.get("free")
    if free is not None and free < MIN_FREE_BYTES:
        msg = f"{ct.name}: only {free / 2**20:.0f} MiB free in {disk.get('path')} for the log"
        if not force:
            raise DiskError(msg, hint="free space, or pass --force")
        checks.append(Check("disk", False, msg, forced=True))
    else:
        checks.append(Check("disk", True, f"{(free or 0) / 2**30:.1f} GiB free"))

    if ct.spec.gpus.all:
        checks.append(_gpu_check(ct, doc.get("gpus", {}), gpu_mem_threshold_mib, force))
    return checks


def _gpu_check(ct: Container, info: dict[str, Any], threshold: float, force: bool) -> Check:
    want = ct.spec.gpus.all
    if "error" in info:
        msg = f"{ct.name}: GPUs cannot be checked: {info['error']}"
        if not force:
            raise BusyError(msg, hint="fix the driver/passthrough, or pass --force")
        return Check("gpus", False, msg, forced=True)
    by_index = {g["index"]: g for g in info.get("gpus", [])}
    problems = []
    for i in want:
        g = by_index.get(i)
        if g is None:
            problems.append(f"GPU {i} not visible")
        elif g["procs"]:
            pids = ", ".join(str(p["pid"]) for p in g["procs"])
            problems.append(f"GPU {i} busy (pids {pids})")
        elif g["used_mib"] > threshold:
            problems.append(f"GPU {i} has {g['used_mib']:.0f} MiB in use")
    if problems:
        msg = f"{ct.name}: " + "; ".join(problems)
        if not force:
            raise BusyError(msg, hint="stop what runs there, or pass --force")
        return Check("gpus", False, msg, forced=True)
    return Check("gpus", True, f"{len(want)} idle")


# --- launch --------------------------------------------------------------------------------------


def start_script(inv: Inventory, manifest: Manifest) -> str:
    """Where the pinned start_training.sh goes (the payload must have one)."""
    start = [f for f in manifest.files if posixpath.basename(f.dest) == START_SCRIPT]
    if not start:
        raise InputError(f"{inv.path}: payload has no {START_SCRIPT} (a template entry whose dest ends in it)")
    return start[0].dest


def launcher_script(t: Transport, rp: RunPaths, start_script: str, env: dict[str, str], *,
                    times: bool = False) -> str:
    """What tmux runs: log opened with noclobber, training in its own process group, exit status kept.

    The run's variables are exported by the script itself: a tmux server that is already running gives
    new sessions ITS environment, not the launching client's, so CTL_RUN would be a previous run's.
    With `times` (a node of a run across several containers), LOG.times gets "SIZE EPOCH" whenever the log
    grew, sampled every half second, so `ctl tail` can merge the nodes' logs in the order they were written.
    """
    log = shlex.quote(t.path(rp.log))
    start = shlex.quote(t.path(start_script))
    sampler = [
        f'(last=-1; while :; do s=$(stat -c %s {log} 2>/dev/null) && [ "$s" != "$last" ] && '
        f'echo "$s ${{EPOCHREALTIME:-$(date +%s.%N)}}" >> {log}.times && last=$s; '
        'kill -0 $pid 2>/dev/null || break; sleep 0.5; done) &',
    ] if times else []
    return "\n".join([
        *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
        "set -m -C",
        f"exec 3>{log} || {{ echo 'ctl: refusing to overwrite '{log} >&2; exit 97; }}",
        f"bash {start} >&3 2>&1 3>&- &",
        "pid=$!",
        # The training's start time beside its pid: `ctl stop` signals the pid only if it is still that process.
        f's=$(cat /proc/$pid/stat 2>/dev/null) && s=${{s##*) }} && set -- $s && echo "${{20}}" > {log}.pid.start',
        f"echo $pid > {log}.pid",
        "exec 3>&-",
        *sampler,
        f"tail -n +1 -F --pid=$pid {log} 2>/dev/null &",
        "wait $pid; rc=$?",
        f"echo $rc > {log}.exit.tmp && mv -f {log}.exit.tmp {log}.exit",
        "wait",
    ])


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
    # Only a launch pins and probes: `ctl status` (through monitor) loads this module without them.
    from controller.commands import environment
    from controller.commands.deploy import pin

    manifest = pin(inv, ct)
    start = start_script(inv, manifest)
    agent = Agent(t)
    probed = None
    # One round trip answers the preflight, the environment probe and (without a name) which name is next.
    env_req = environment.probe_request(inv, ct, t) if probe_env else None
    if name is None:
        probed = _probe(inv, ct, t, manifest, None, env=env_req)
        name = _name_after(inv, ct, reg, agent.need(probed, "series_logs", list))
    rp = paths_for(inv, name)
    rec = reg.claim_run(name, ct.name, host=ct.host_name, session=rp.session, log_path=rp.log, run_dir=rp.run_dir,
                        **(lineage or {}))
    try:
        if probed is None:
            probed = _probe(inv, ct, t, manifest, rp, env=env_req)
        checks = preflight(inv, ct, t, rp, manifest, allow_drift=allow_drift, force=force, doc=probed)
        env = environment.probe_for_launch(inv, ct, t, allow_mismatch=allow_env_mismatch,
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


# --- state ---------------------------------------------------------------------------------------

def _state_from(st: dict[str, Any]) -> tuple[Lifecycle, int | None]:
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
    agent = Agent(t)
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
        state, code = _state_from(st)
        if state != r.state:
            updated[r.id] = reg.update_run(r.id, state=state, exit_status=code,
                                           ended=_ended(st) if state != Lifecycle.RUNNING else None)
    return [updated.get(r.id, r) for r in runs]


def _ended(st: dict[str, Any]) -> float | None:
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
    state, code = _state_from(st)
    if state == Lifecycle.LOST and st.get("pid") is None and (
            st.get("session") or time.time() - r.created < LAUNCH_GRACE_S):
        return None  # the record is written, tmux or the launcher has not started the training yet
    fields: dict[str, Any] = {}
    if ours and record is not None:
        fields = {"command": record.get("command"), "commit_sha": record.get("commit"),
                  "dirty": bool(record.get("dirty")), "files": record.get("files") or {},
                  "vars": record.get("vars") or {}, "env_fingerprint": record.get("env_fingerprint")}
    return reg.update_run(r.id, state=state, exit_status=code, started=r.started or r.created,
                          ended=_ended(st) if state != Lifecycle.RUNNING else None,
                          note=f"reconciled from the container{was}", **fields)


def live(inv: Inventory, ct: Container, t: Transport, reg: Registry) -> list[RunRecord]:
    """Runs the registry believes live on this CT, confirmed by asking the container (one round trip)."""
    candidates = reg.live_runs(ct.name)
    if not candidates:
        return []
    return [r for r in refresh(inv, ct, t, reg, candidates) if r.state.live]


def stop(inv: Inventory, ct: Container, t: Transport, reg: Registry, run: RunRecord, grace: float = 30, *,
         term_first: bool = False) -> RunRecord:
    """SIGINT the training's process group, `grace` seconds, SIGTERM, SIGKILL; then whatever of the run is left
    in the container (torchrun's workers, each in a session of its own). `term_first`: no SIGINT (a node whose
    peer died cannot finish a step anyway)."""
    if not run.state.live:
        raise InputError(f"run {run.name} on {ct.name} is not running (state: {run.state})")
    deadline = limit(None, t.request_timeout)  # the agent waits up to `grace` after SIGINT and after SIGTERM
    args = {"log": run.log_path, "session": run.session, "grace": grace, "run": run.name}
    if term_first:
        args["term_first"] = True
    doc = Agent(t).call("stop", args, timeout=None if deadline is None else deadline + 3 * grace + 30)
    if doc.get("alive"):
        raise CtlError(f"{ct.name}: run {run.name} survived SIGINT, SIGTERM and SIGKILL")
    note = "stopped by ctl stop (" + " -> ".join(signal_steps(doc.get("signals"))) + ")"
    return reg.update_run(run.id, state=Lifecycle.STOPPED, exit_status=doc.get("exit"), ended=time.time(), note=note)


def signal_steps(steps: Any) -> list[str]:
    """The agent's account of a stop (`SIGINT`, `SIGTERM`, ...), each step a short signal-like word or `?`: the
    container's words reach the record and the operator's terminal."""
    if not isinstance(steps, list):
        return []
    return [x if isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9_+:. ()-]{1,40}", x) else "?"
            for x in steps[:10]]


# --- follow --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launched:
    """What `launch` started: the run as recorded, its preflight checks, and the training's pid as the launch
    answered it (None when the pid file was not written within the agent's wait)."""

    run: RunRecord
    checks: list[Check]
    pid: int | None


@dataclass
class FollowEnd:
    exit_status: int | None
    crash: str | None
    state: Lifecycle

    @property
    def exit_code(self) -> int:
        if self.crash or (self.exit_status not in (None, 0)) or self.state in (Lifecycle.LOST, Lifecycle.FAILED):
            return int(ExitCode.RUN_FAILED)
        return 0


def follow(
    t: Transport, reg: Registry, run: RunRecord, *, lines: int, follow: bool, emit: Callable[[str], None],
    detect: Callable[[str], str | None], reconnect_s: float | None = None, crash_grace: float = 3.0,
    note: Callable[[str], None] | None = None, start_offset: int | None = None, launched_pid: int | None = None,
) -> FollowEnd:
    """Print the last `lines` lines (all of them when negative), then (with follow) new ones until the run
    ends or crashes.

    A dropped connection (an SSH connection cut, or one the keepalive found silent: ConnectionDropped), or a
    request past its deadline, is resumed from the last byte offset received: no line is lost or repeated.
    Reconnecting goes on for `reconnect_s` seconds after the failure (CTL_FOLLOW_RECONNECT, 300), then the last
    error is raised (exit 5) and the registry keeps the run's state. `note` hears of each drop and reconnection.
    `launched_pid`: the run was just launched by this command, whose answer named the training's pid and made
    its log; the stream then starts at once instead of after a runstate round trip (`ctl launch -f`).
    """
    if reconnect_s is None:
        reconnect_s = follow_reconnect()
    assert run.log_path is not None
    crash = None
    offset = 0  # lines < 0: the whole log, from its first byte
    # Following all of it (`launch -f`) needs no history first: the first runstate below says whether the log exists.
    if start_offset is not None:  # the caller showed the history (several nodes' logs merged)
        offset = start_offset
    elif lines >= 0 or not follow:
        agent = Agent(t)
        info = agent.call("tailinfo", {"log": run.log_path, "lines": max(lines, 0)}, check=False)
        if not info.get("ok"):
            raise InputError(f"{run.ct}: cannot read {run.log_path}: {info.get('error')}")
        for line in agent.need(info, "text", str).splitlines():
            emit(line)
            crash = _named(crash, detect(line))
        offset = agent.need(info, "size", int) if lines >= 0 else 0
    if not follow:
        return FollowEnd(run.exit_status, crash, run.state)
    splitter = LineSplitter()  # holds at most LINE_CAP bytes of an unfinished line, however long it gets
    crash_at: float | None = None
    tries = 0
    failing_since: float | None = None
    first = True
    while True:
        try:
            if first and launched_pid is not None and offset == 0:
                st = {"pid": launched_pid, "alive": True, "log_size": 0}
            else:
                st = _runstate(t, run)
            if first and st.get("log_size") is None:
                raise InputError(f"{run.ct}: cannot read {run.log_path}: it does not exist")
            first = False
            if failing_since is not None:
                if note is not None:
                    note(f"{run.ct}: reconnected after {time.monotonic() - failing_since:.0f}s; "
                         f"following {run.name} from byte {offset}")
                failing_since, tries = None, 0
            if not st.get("alive") and st.get("log_size") == offset and crash_at is None:
                break
            argv = ["tail", "-c", f"+{offset + 1}"]
            if st.get("pid") and st.get("alive"):
                argv += ["-F", f"--pid={st['pid']}", "-s", "0.2"]  # tail ends when the training does
            argv.append(t.path(run.log_path))
            for kind, data in t.stream(argv, idle=0.5):
                if kind == "out":
                    offset += len(data)
                    for raw in splitter.feed(data):
                        line = raw.decode("utf-8", "replace")
                        emit(line)
                        crash = _named(crash, detect(line))
                        if crash is not None and crash_at is None:
                            crash_at = time.monotonic()
                if crash_at is not None and time.monotonic() - crash_at > crash_grace:
                    break
                if kind == "exit":
                    break
            break
        except ConnectionFailed as e:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                if note is not None:
                    note(f"{e}; reconnecting (for up to {reconnect_s:g}s)")
            tries += 1
            if now - failing_since >= reconnect_s:
                raise
            time.sleep(min(2.0, 0.2 * tries))
    for raw in splitter.flush():
        emit(raw.decode("utf-8", "replace"))
    st = _runstate(t, run)
    state, code = _state_from(st)
    if crash is not None and state == Lifecycle.RUNNING:
        state = Lifecycle.CRASHED
    # Recorded only if nothing else recorded its end meanwhile (`ctl stop`, or the teardown of a run across
    # several containers, says STOPPED: the exit status that stop caused is no failure of its own)
    if state not in (Lifecycle.RUNNING, Lifecycle.CRASHED) and reg.run_by_id(run.id).state.live:
        reg.update_run(run.id, state=state, exit_status=code, ended=_ended(st) or time.time())
    if crash:
        reg.update_run(run.id, crash=crash)
    return FollowEnd(code, crash, state)


def _named(crash: str | None, found: str | None) -> str | None:
    """The crash so far, renamed when a traceback's cause line (OOM, NCCL, ...) names it better."""
    if found is None or (crash is not None and crash != "traceback"):
        return crash
    return found


def last_lines(t: Transport, run: RunRecord, lines: int, *, timeout: float | None = None) -> list[str]:
    """The last `lines` lines of the run's log (one round trip; the agent reads at most its last 1 MiB and cuts
    lines at 4 KiB). Raw text from the container: clean it before showing it."""
    if not run.log_path or lines <= 0:
        return []
    info = Agent(t).call("tailinfo", {"log": run.log_path, "lines": lines}, check=False, timeout=timeout)
    if not info.get("ok"):
        return []
    return str(info.get("text") or "").splitlines()[-lines:]


def state_of(t: Transport, run: RunRecord) -> tuple[Lifecycle, int | None]:
    """What the container says of one run now (one round trip), without recording it."""
    return _state_from(_runstate(t, run))


def _runstate(t: Transport, run: RunRecord) -> dict[str, Any]:
    agent = Agent(t)
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
    live run across several containers is asked through its nodes and then settled (commands/jobs.py): a node
    that ended badly makes it CRASHED and its surviving nodes are stopped."""
    from controller.commands import jobs

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
            fresh[r.id] = jobs.settle(inv, reg, pool, r, ms)
        except CtlError as e:
            warnings.append(f"{r.ct}/{r.name}: not settled: {e}")
    return Refreshed(tuple(fresh.get(r.id, r) for r in recs), tuple(warnings), unreachable)


def recorded(inv: Inventory, reg: Registry, container: str | None, *, limit: int) -> list[RunRecord]:
    """The registry's runs, newest first: all, or of one container or group. A name that is neither in the
    inventory nor in the registry is refused as every other command refuses it (exit 4), never an empty list;
    a container gone from the inventory still shows its history."""
    if container is None:
        return reg.runs(None, limit=limit)
    m = inv.model
    if container in m.containers or container in m.groups:
        names = [ct.name for ct in inv.select([container])]
    elif container in m.jobs or reg.names(container):
        names = [container]
    else:
        inv.container(container)  # raises: unknown container, naming the known ones
        names = []
    return whole_runs(reg, [r for n in names for r in reg.runs(n, limit=limit)])[:limit]


def whole_runs(reg: Registry, recs: list[RunRecord]) -> list[RunRecord]:
    """Records as runs: a node's row of a run across several containers stands for that run (once), newest
    first."""
    out: dict[int, RunRecord] = {}
    for r in recs:
        w = reg.whole(r)
        out.setdefault(w.id, w)
    return sorted(out.values(), key=lambda r: r.created, reverse=True)
