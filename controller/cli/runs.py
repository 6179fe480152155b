"""The run verbs: `ctl launch`, `tail`, `runs`, `show`, `stop`, `attach`, `diff`, `export`."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import typer

from controller.cli import names as _c
from controller.cli.app import (
    OPTS,
    _ago,
    _console,
    _esc,
    _inv,
    _one_ct,
    _out,
    _registry,
    _session,
    _table,
    _warn,
    app,
    container_argument,
    examples,
    session,
)
from controller.errors import CtlError, ExitCode, InputError

if TYPE_CHECKING:
    from controller.cli.app import Pool, Transport
    from controller.inventory import Inventory
    from controller.registry import Registry, RunRecord


@app.command("launch", epilog=examples(
    'ctl launch ct200 -f            # the next run of the series, followed to its end',
    'ctl launch ct200 --run fresh7  # a name of your own',
    'ctl launch pair -f             # a job: every node, or none',
))
def launch_cmd(
    container: str | None = container_argument("The container to run in, or a job of the inventory."),
    run: str | None = typer.Option(None, "--run", help="Run name (default: next of the inventory's series)."),
    allow_drift: bool = typer.Option(False, "--allow-drift", help="Launch although deployed files differ from pins."),
    force: bool = typer.Option(False, "--force", help="Override GPU-busy, GPU-setup and disk checks (never the log "
                               "clobber)."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Follow the log after the launch (like ctl tail -f)."),
    allow_env_mismatch: bool = typer.Option(
        False, "--allow-env-mismatch", help="Launch although the environment differs from its lock."),
) -> None:
    """Preflight, then start the run in a detached tmux session with its own, never-reused log.

    A job of the inventory starts on all its nodes (torchrun's c10d rendezvous), or on none."""
    from controller.commands import launcher

    reg = _registry()
    inv = _inv()
    if container is not None and container in inv.model.jobs:
        raise typer.Exit(_launch_job(inv, reg, container, run, allow_drift=allow_drift, force=force,
                                     allow_env_mismatch=allow_env_mismatch, follow=follow))
    with _session(container) as (inv, ct, pool):
        t = pool.container(ct)
        got = launcher.launch(inv, ct, t, reg, run, allow_drift=allow_drift, force=force,
                              allow_env_mismatch=allow_env_mismatch)
        rec, checks = got.run, got.checks
        if OPTS.json and not follow:
            _out({"run": _redacted(rec), "checks": [c.__dict__ for c in checks]})
            return
        con = _console()
        for c in checks:
            mark = "ok" if c.ok else "[yellow]FORCED[/yellow]"
            con.print(f"  {c.name:<10} {mark:<6} {_esc(c.detail)}")
        con.print(f"launched {rec.name} on {ct.name}: tmux session {rec.session}, log {rec.log_path}")
        if follow:
            raise typer.Exit(_follow(t, reg, rec, -1, True, launched_pid=got.pid))


def _launch_job(inv: Inventory, reg: Registry, job: str, run: str | None, *, allow_drift: bool, force: bool,
                allow_env_mismatch: bool, follow: bool) -> int:
    from controller.commands import launcher

    exposed = launcher.exposed_nodes(inv.job(job))
    if exposed:
        _warn([f"{job}: {', '.join(exposed)} not on a private network: the rendezvous (port "
               f"{inv.job(job).spec.rdzv_port} of node 0) has no authentication and runs what it is sent; open it "
               "only between the nodes (Proxmox firewall rules, a dedicated VLAN)"])
    with session(inv) as pool:
        got = launcher.launch_job(inv, pool, reg, job, run, allow_drift=allow_drift, force=force,
                                  allow_env_mismatch=allow_env_mismatch)
        if OPTS.json and not follow:
            _out({"run": _redacted(got.run), "nodes": [_redacted(m) for m in got.nodes],
                  "checks": {n: [c.__dict__ for c in cs] for n, cs in got.checks.items()},
                  "seconds": round(got.seconds, 3)})
            return 0
        con = _console()
        for node, cs in got.checks.items():
            for c in cs:
                mark = "ok" if c.ok else "[yellow]FORCED[/yellow]"
                con.print(f"  {node:<10} {c.name:<10} {mark:<6} {_esc(c.detail)}")
        con.print(f"launched {got.run.name} on {len(got.nodes)} node(s) of {job} "
                  f"({', '.join(m.ct for m in got.nodes)}): tmux session {got.run.session}, log {got.run.log_path} "
                  f"on each ({got.seconds:.1f}s)")
        if follow:
            return _follow_job(inv, pool, reg, got.run, -1, True, None)
    return 0


def _follow_job(inv: Inventory, pool: Pool, reg: Registry, rec: RunRecord, lines: int, follow: bool,
                node: str | None) -> int:
    from controller.commands import runs
    from controller.core import metrics

    con = _console()
    width = max(len(m.ct) for m in reg.members(rec.id))

    def emit(n: str, line: str) -> None:
        con.print(f"[{n}]".ljust(width + 3) + line, markup=False)

    end = runs.follow_job(inv, pool, reg, rec, lines=lines, follow=follow, emit=emit,
                          detect=metrics.detect_crash, node=node, note=lambda text: _warn([text]))
    if follow:
        if end.state.live:
            con.print(f"run {rec.name}: still running")
        elif end.crash or end.state.name in ("CRASHED", "FAILED"):
            con.print(f"[red]run {rec.name}: {end.state}: {_esc(end.crash or '')}[/red]")
        else:
            con.print(f"run {rec.name}: {end.state}")
    return end.exit_code


def _follow(t: Transport, reg: Registry, rec: RunRecord, lines: int, follow: bool, *,
            launched_pid: int | None = None) -> int:
    from controller.commands import runs
    from controller.core import metrics

    con = _console()
    live = follow and sys.stdout.isatty() and not OPTS.json
    status = con.status(f"following {rec.ct}/{rec.name}") if live else None

    def emit(line: str) -> None:
        con.print(line, markup=False)  # the console strips escape sequences; markup off keeps [..] literal
        if status is not None:  # the latest metric line, as a status line under the log
            p = metrics.parse_line(line)
            if isinstance(p, metrics.MetricPoint):
                status.update(
                    f"{rec.name}  step {p.step}  loss {p.loss if p.loss is not None else '-'}  "
                    f"{metrics.format_rate(p.tok_s)} tok/s  ETA {metrics.format_eta(p.eta_s)}"
                    + (f"  q_hs={list(p.q_hs)}" if p.q_hs is not None else ""))

    if status is not None:
        status.start()
    try:
        end = runs.follow(t, reg, rec, lines=lines, follow=follow, emit=emit, detect=metrics.detect_crash,
                          note=lambda text: _warn([text]), launched_pid=launched_pid)
    finally:
        if status is not None:
            status.stop()
    if follow:
        if end.crash:
            con.print(f"[red]run {rec.name}: crash signature '{end.crash}' seen ({end.state})[/red]")
        elif end.state.live:
            con.print(f"run {rec.name}: still running")
        else:
            con.print(f"run {rec.name}: {end.state}" + (f", exit status {end.exit_status}"
                                                        if end.exit_status is not None else ""))
    return end.exit_code


@app.command("tail", epilog=examples(
    "ctl tail ct200                 # the last lines of the container's latest run",
    'ctl tail fresh7 -f             # follow to its exit status or crash signature',
    'ctl tail fresh7 -f --node ct300  # one node of a run across several containers',
))
def tail_cmd(
    container: str = typer.Argument(..., autocompletion=_c.container_or_run,
                                    help="Container or job (its latest run), or a run as CT/NAME or NAME."),
    run: str | None = typer.Option(None, "--run", help="Run name (default: the container's latest run).",
                                   autocompletion=_c.runs),
    lines: int = typer.Option(20, "-n", "--lines", help="Lines of history to show first."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Follow until the run ends or crashes."),
    node: str | None = typer.Option(None, "--node", help="A run across several containers: only this node "
                                                         "(its container or its index in the job)."),
) -> None:
    """Show the run's log; with -f follow it until the run ends (exit status) or crashes (non-zero).

    A run across several containers: the nodes' logs merged in the order they were written, each line after
    [node]."""
    inv = _inv()
    reg = _registry()
    rec = None
    if container in inv.model.jobs:
        rec = reg.find_run(f"{container}/{run}") if run else next(iter(reg.runs(container, limit=1)), None)
        if rec is None:
            raise CtlError(f"{container}: no runs recorded; `ctl launch {container}` starts one")
    elif "/" in container or (container not in inv.model.containers and container not in inv.model.groups):
        rec = reg.find_run(container)
    if rec is not None and rec.multi:
        with session(inv) as pool:
            raise typer.Exit(_follow_job(inv, pool, reg, rec, lines, follow, node))
    if node is not None:
        raise InputError("--node is for a run across several containers")
    if rec is not None:
        ct = inv.container(rec.ct)
    else:
        ct = _one_ct(inv, container)
        if run:
            rec = reg.find_run(f"{ct.name}/{run}")
        else:
            recs = reg.runs(ct.key, limit=1)
            if not recs:
                raise CtlError(f"{ct.name}: no runs recorded; `ctl launch {ct.name}` starts one")
            rec = recs[0]
    with session(inv) as pool:
        raise typer.Exit(_follow(pool.container(ct), reg, rec, lines, follow))


@app.command("runs")
def runs_cmd(
    container: str | None = typer.Argument(None, autocompletion=_c.targets,
                                           help="Only runs of this container or group."),
    limit: int = typer.Option(30, "-n", "--limit"),
    no_refresh: bool = typer.Option(False, "--no-refresh", help="Do not ask containers about live runs."),
    tree: bool = typer.Option(False, "--tree", help="Lineages of restarted runs: fresh7 -> fresh8 -> fresh9, each "
                                                    "with its exit and the step it resumed from."),
) -> None:
    """List runs from the registry (live ones are refreshed from their containers)."""
    from controller.commands.reconcile import refresh_all
    from controller.commands.runs import recorded

    inv = _inv()
    reg = _registry()
    recs = recorded(inv, reg, container, limit=limit)
    silent: dict[int, str] = {}  # run id -> why its container did not answer (state unknown, record kept)
    if not no_refresh:
        with session(inv) as pool:
            refreshed = refresh_all(inv, reg, pool, recs)
        _warn(refreshed.warnings)
        recs = list(refreshed.runs)
        silent = {r.id: why for r in recs if (why := refreshed.unreachable_run(r)) is not None}
    code = int(ExitCode.CONNECTION) if silent else 0  # a host that did not answer: exit 5, like the others
    if tree:
        _render_tree(reg, recs)
        raise typer.Exit(code)
    if OPTS.json:
        _out([{**_redacted(r), "unreachable": silent.get(r.id)} for r in recs])
        raise typer.Exit(code)
    rows = [[r.ct, r.name + (" *" if r.good else ""), r.nodes or 1,
             f"UNREACHABLE ({r.state})" if r.id in silent else r.state + (f": {r.crash}" if r.multi and r.crash
                                                                           and not r.state.live else ""),
             "" if r.exit_status is None else r.exit_status,
             _ago(r.started or r.created), (r.commit_sha or "-")[:10] + ("+dirty" if r.dirty else ""), r.log_path]
            for r in recs]
    _table(None, ["ct", "run", "nodes", "state", "exit", "started", "commit", "log"], rows)
    if any(r.good for r in recs):
        _console().print("* marked good (baseline)")
    raise typer.Exit(code)


def _render_tree(reg: Registry, recs: list[RunRecord]) -> None:
    from controller.commands.supervise import lineages

    chains = list(lineages(reg, recs))
    if OPTS.json:
        _out([[{"run": r.name, "ct": r.ct, "state": r.state, "exit_status": r.exit_status,
                "resumed_step": r.resumed_step, "resumed_from": r.resumed_from} for r in c] for c in chains])
        return
    con = _console()
    for chain in chains:
        parts = []
        for r in chain:
            end = f"{r.state}" + (f" {r.exit_status}" if r.exit_status is not None else "")
            resumed = f", from step {r.resumed_step}" if r.resumed_step is not None else ""
            parts.append(f"{r.name} ({end}{resumed})")
        con.print(f"{chain[0].ct:<10} " + " -> ".join(parts), markup=False)


def _redacted(rec: RunRecord) -> dict[str, Any]:
    """A run's record as --json prints it: secrets redacted (records made before launches redacted them too)."""
    from controller.core.redact import redact_run

    return redact_run(rec.to_json())


@app.command("show")
def show_cmd(run: str = typer.Argument(..., autocompletion=_c.runs, help="Run as NAME, CT/NAME or #ID.")) -> None:
    """Everything recorded about one run."""
    reg = _registry()
    rec = reg.find_run(run)
    data = _redacted(rec)
    exports = reg.exports(rec.id)
    if OPTS.json:
        doc = {**data, "members": [_redacted(m) for m in reg.members(rec.id)]} if rec.multi else data
        _out({**doc, "exports": exports})
        return
    con = _console()
    for k in ("ct", "name", "state", "exit_status", "crash", "host", "session", "log_path", "run_dir", "commit_sha",
              "dirty", "env_fingerprint", "good", "note"):
        con.print(f"{k:<16} {data[k]}", markup=False)
    con.print(f"{'created':<16} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec.created))}")
    con.print("files:")
    for dest, sha in sorted(rec.files.items()):
        con.print(f"  {sha[:16]}  {dest}", markup=False)
    con.print(f"command:\n  {rec.command}", markup=False)
    for m in reg.members(rec.id):  # a run across several containers: its nodes
        con.print(f"node {m.node_rank}: {m.ct} on {m.host or '-'}: {m.state}"
                  + (f", exit {m.exit_status}" if m.exit_status is not None else "")
                  + (f", {m.crash}" if m.crash else "") + (f" ({m.note})" if m.note else "")
                  + f", log {m.log_path}", markup=False)
    if exports:
        con.print("exports:")
    for e in exports:  # `ctl export`: the drafter in the reference layout, where it went
        at = e["provenance"].get("metrics") or {}
        shown = "".join(f" {k}={at[k]:g}" for k in ("loss", "accept_len") if isinstance(at.get(k), (int, float)))
        con.print(f"  step {e['step']:<8} {e['dtype']:<9} {time.strftime('%Y-%m-%d %H:%M', time.localtime(e['time']))}"
                  f"  {e['files']['model.safetensors']['sha256'][:16]}{shown}  {e['path']}", markup=False)


@app.command("stop")
def stop_cmd(
    run: str = typer.Argument(..., autocompletion=_c.runs, help="Run as NAME, CT/NAME or #ID."),
    grace: float = typer.Option(30, "--grace", help="Seconds to wait after SIGINT before SIGTERM."),
) -> None:
    """SIGINT the training, wait, escalate, end its tmux session; the record says stopped."""
    from controller.commands import launcher, reconcile

    inv = _inv()
    reg = _registry()
    rec = reg.find_run(run)
    if rec.multi:
        with session(inv) as pool:
            rec = reconcile.refresh_all(inv, reg, pool, [rec]).runs[0]
            rec, stopped = launcher.stop_job(inv, pool, reg, rec, grace=grace, by_operator=True)
        if OPTS.json:
            _out({**_redacted(rec), "nodes": [_redacted(m) for m in reg.members(rec.id)]})
        else:
            con = _console()
            for o in stopped:
                if o.value is not None:
                    con.print(f"  {o.ct:<10} {o.value.state} ({_esc(o.value.note)})")
            con.print(f"{rec.ct}/{rec.name}: {rec.state} ({_esc(rec.note)})")
        return
    ct = inv.container(rec.ct)
    with session(inv) as pool:
        t = pool.container(ct)
        rec = reconcile.refresh(inv, ct, t, reg, [rec])[0]
        rec = reconcile.stop(inv, ct, t, reg, rec, grace=grace, by_operator=True)
    if OPTS.json:
        _out(_redacted(rec))
    else:
        _console().print(f"{rec.ct}/{rec.name}: {rec.state} ({_esc(rec.note)})")


@app.command("attach")
def attach_cmd(
    run: str = typer.Argument(..., autocompletion=_c.runs, help="Run as NAME, CT/NAME or #ID."),
    node: str | None = typer.Option(None, "--node", help="A run across several containers: the node to attach "
                                                         "to (its container or its index; default: node 0)."),
) -> None:
    """Attach to the run's tmux session interactively (ssh -t + pct exec; detach with C-b d).

    A run that has ended has no session left: ctl says how it ended and points to `ctl tail`."""
    from controller.commands import reconcile

    inv = _inv()
    reg = _registry()
    rec = reg.find_run(run)
    if rec.multi:
        members = reg.members(rec.id)
        pick = [m for m in members if node in (m.ct, str(m.node_rank))] if node is not None else members[:1]
        if not pick:
            raise InputError(f"run {rec.name} has no node {node!r} (nodes: "
                             + ", ".join(f"{m.node_rank}={m.ct}" for m in members) + ")")
        rec = pick[0]
    elif node is not None:
        raise InputError("--node is for a run across several containers")
    ct = inv.container(rec.ct)
    with session(inv) as pool:
        t = pool.container(ct)
        rec = reconcile.refresh(inv, ct, t, reg, [rec])[0]
        if not rec.state.live:
            how = f"{rec.state}" + (f", exit status {rec.exit_status}" if rec.exit_status is not None else "")
            raise InputError(f"run {rec.ct}/{rec.name} has ended ({how}): there is no session to attach to; "
                             f"`ctl tail {rec.ct}/{rec.name}` shows its log")
        if not OPTS.json and not (sys.stdin.isatty() and sys.stdout.isatty()):
            raise InputError(f"ctl attach {run} needs a terminal (stdin and stdout are not one); "
                             f"`ctl tail {rec.ct}/{rec.name} -f` follows its log without one")
        argv = t.interactive_argv(["tmux", "attach-session", "-t", "=" + str(rec.session)])
    if OPTS.json:
        _out({"argv": argv})
        return
    os.execvp(argv[0], argv)  # noqa: S606 - replaces ctl with the interactive session


@app.command("diff")
def diff_cmd(
    run_a: str = typer.Argument(..., autocompletion=_c.runs, help="The run that worked (NAME, CT/NAME or #ID)."),
    run_b: str = typer.Argument(..., autocompletion=_c.runs, help="The run to compare with it."),
) -> None:
    """What changed between two runs: payload hashes, rendered scripts, template variables, environment."""
    from controller.core import rundiff

    reg = _registry()
    a, b = reg.find_run(run_a), reg.find_run(run_b)
    multi = a.multi or b.multi  # runs across several containers: node by node
    d = rundiff.diff_nodes(a, reg.members(a.id), b, reg.members(b.id)) if multi else rundiff.diff(a, b)
    if OPTS.json:
        _out(d.to_json())
    else:
        _console().print(d.render(), markup=False)
    raise typer.Exit(0 if d.same else 1)


@app.command("export")
def export_cmd(
    run: str = typer.Argument(..., autocompletion=_c.runs, help="Run as NAME, CT/NAME or #ID."),
    out: str | None = typer.Option(None, "-o", "--output", help="Directory to write (default ./exports/RUN-stepN)."),
    step: int | None = typer.Option(None, "--step", help="Export this step (default: the newest complete "
                                                          "checkpoint)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Weights as bfloat16, float16 or float32."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
) -> None:
    """Export the run's drafter for SGLang, vLLM or z-lab's dflash.

    The newest complete checkpoint (or --step N) in the reference DFlash layout: config.json and model.safetensors,
    checked by sha256, with provenance.json (run, step, commit, hashes, loss and accept_len at that step)."""
    from controller.commands import export

    inv = _inv()
    reg = _registry()
    rec = reg.find_run(run)
    with session(inv) as pool:
        done = export.export_run(inv, pool, reg, rec, out=out, step=step, dtype=dtype, force=force)
    if OPTS.json:
        _out(done.to_json())
        return
    m = done.metrics
    shown = ", ".join(f"{k} {m[k]:g}" + (f" (step {m[k + '_step']})" if m.get(k + "_step") != done.step else "")
                      for k in ("loss", "accept_len") if isinstance(m.get(k), (int, float)))
    _console().print(f"{done.run}: step {done.step} exported from {done.node}:{done.checkpoint} to {done.dir} "
                     f"({done.dtype}{', replaced' if done.replaced else ''})" + (f"; {shown}" if shown else ""),
                     markup=False)
