"""Preflight: what a launch checks in the container before anything starts, in one agent round trip.

The probe asks for everything at once (deployed files' hashes, the tmux session, the log, free disk, the GPUs,
the environment probe, and for a node of a job the rendezvous endpoint); `preflight` judges the answer and
raises the first failing check as its own error and exit code. Also here: where a run's files go (RunPaths),
the launcher script tmux runs, and the next name of the series. Shared by launches of one container and of a
job, and by supervise's relaunches.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controller.core import series
from controller.errors import BusyError, ClobberError, CtlError, DiskError, DriftError, InputError
from controller.inventory import Container, Inventory
from controller.names import check_name
from controller.registry import Registry
from controller.remote.client import Agent, AgentReplyError
from controller.transport.base import Transport

if TYPE_CHECKING:
    from controller.commands.pins import Manifest


START_SCRIPT = "start_training.sh"


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


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    forced: bool = False


def probe(inv: Inventory, ct: Container, t: Transport, manifest: Manifest, rp: RunPaths | None,
           rdzv: dict[str, Any] | None = None, env: tuple[dict[str, Any], bytes] | None = None) -> dict[str, Any]:
    """Everything the preflight needs in one agent round trip. Without a run name yet (rp None), the same
    round trip lists the series' logs and every tmux session, so the name is chosen from its answer. `rdzv`:
    a node of a job also checks the rendezvous endpoint in it (listens on it, or connects to it). `env`
    (envprobe.probe_request): the environment probe runs in it too, its output under "env_probe"."""
    args: dict[str, Any] = {"files": [f.dest for f in manifest.files], "gpus": bool(ct.spec.gpus.all),
                            "follow": list(ct.spec.follow_symlinks)}
    if rdzv is not None:
        args["rdzv"] = rdzv
    if rp is None:
        runs = inv.model.runs
        args.update(series_glob=series.log_glob(runs), sessions=True, log=runs.log.replace("{run}", runs.series + "0"))
    else:
        args.update(session=rp.session, log=rp.log, run_dir=rp.run_dir)
    payload = b""
    if env is not None:
        args["env_probe"], payload = env
    agent = Agent.of(t)
    return checked_probe(agent, agent.call("probe", args, payload=payload, timeout=180 if env else None))


def checked_probe(agent: Agent, doc: dict[str, Any]) -> dict[str, Any]:
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
    doc = probe(inv, ct, t, manifest, rp) if doc is None else checked_probe(Agent.of(t), doc)
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
        # Without job control from here: with it, `wait` also returns when the training is merely stopped
        # (SIGSTOP, a stall), and 147 would be written as its exit while it still holds its GPUs.
        "set +m",
        "wait $pid; rc=$?",
        f"echo $rc > {log}.exit.tmp && mv -f {log}.exit.tmp {log}.exit",
        "wait",
    ])


def next_of_series(inv: Inventory, reg: Registry, containers: list[str], series_logs: list[str]) -> str:
    """The next of the series after every run the registry knows in `containers` (a container, or a job and its
    nodes) AND every log the probe found in them."""
    return series.name_after(inv.model.runs, [n for c in containers for n in reg.names(c)], series_logs)
