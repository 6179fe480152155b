"""Metrics commands (`ctl metrics ...`, `ctl status`, `ctl watch`, `ctl plot`, `ctl mark-good`): registered on
the main app. Each converts options, calls controller.commands.monitor / metrics / plot, and renders the result.

Exit codes of `status` and `watch` are the verdict's (metrics.exit_code_for): 0 OK / FINISHED / warming up /
no baseline, 21 SLOW, 22 STALLED, 5 UNREACHABLE (status: the host did not answer), 20 CRASHED, so that a runbook
can branch on them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from controller.cli import app as _cli
from controller.cli import names as _c
from controller.cli.app import targets_argument
from controller.errors import CtlError, InputError
from controller.lifecycle import Lifecycle
from controller.settings import checkpoint_glob

if TYPE_CHECKING:
    from controller.commands.monitor import RunStatus
    from controller.inventory import Inventory
    from controller.registry import Registry, RunRecord

app: typer.Typer = _cli.app
OPTS = _cli.OPTS
_console, _inv, _out, _registry, _warn, session = _cli._console, _cli._inv, _cli._out, _cli._registry, _cli._warn, \
    _cli.session
_esc, _table, examples = _cli._esc, _cli._table, _cli.examples

metrics_app = typer.Typer(help="Pull a run's metrics (only new log bytes travel) and export them.",
                          no_args_is_help=True)
app.add_typer(metrics_app, name="metrics")

_CHECKPOINTS_HELP = "Checkpoint files to hash, a glob under the run directory (env CTL_CHECKPOINT_GLOB; " \
                    "default checkpoints/**/*.pt)."


def _duration(text: str, what: str) -> float:
    from controller.core.metrics import parse_duration

    seconds = parse_duration(text)
    if seconds is None or seconds <= 0:
        raise InputError(f"{what}: {text!r} is not a duration such as 90s, 10m, 1h30m")
    return seconds


def _ratio(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise InputError(f"--slow-ratio must be in (0, 1], got {value}")
    return value


def _pull_first(inv: Inventory, reg: Registry, recs: list[RunRecord], doing: str) -> None:
    """Pull the runs' new log bytes before using their stored points; a run that cannot be reached is a warning
    (its stored points are used as they are)."""
    from controller.commands import monitor

    with session(inv) as pool:
        pulled = monitor.pull_many(inv, reg, pool, recs, None)
    for rid, got in pulled.items():
        if isinstance(got, str):
            r = reg.run_by_id(rid)
            _warn([f"{r.ct}/{r.name}: not pulled, {doing} stored points: {got}"])


# --- ctl metrics pull / export -------------------------------------------------------------------


@metrics_app.command("pull")
def pull_cmd(
    run: str = typer.Argument(..., autocompletion=_c.runs, help="Run as NAME, CT/NAME or #ID."),
    chunk_mib: float = typer.Option(8, "--chunk-mib", help="Log bytes per agent call (MiB)."),
    checkpoints: str | None = typer.Option(None, "--checkpoints", help=_CHECKPOINTS_HELP),
    no_hashes: bool = typer.Option(False, "--no-hashes", help="Skip hashing deployed files and checkpoints."),
) -> None:
    """Fetch only the log bytes added since the last pull, parse them, store the points and file hashes."""
    from controller.commands import monitor

    inv = _inv()
    reg = _registry()
    rec = reg.find_run(run)
    glob = checkpoint_glob(checkpoints)
    if rec.multi:  # every node's log, in parallel
        with session(inv) as pool:
            pulled = monitor.pull_many(inv, reg, pool, [rec], glob)
        members = {m.id: m for m in reg.members(rec.id)}
        if OPTS.json:
            _out([{"node": members[i].ct, **(r.to_json() if not isinstance(r, str) else {"error": r})}
                  for i, r in pulled.items()])
        else:
            for i, r in pulled.items():
                _console().print(f"{members[i].ct}: " + (r if isinstance(r, str) else
                                 f"{r.fetched:,} new log bytes, {r.new_points} new point(s)"
                                 + (f", crash signature: {r.crash}" if r.crash else "")), markup=False)
        raise typer.Exit(1 if any(isinstance(r, str) for r in pulled.values()) else 0)
    ct = inv.container(rec.ct)
    with session(inv) as pool:
        res = monitor.pull(pool.container(ct), reg, rec, chunk=max(1, int(chunk_mib * 2**20)),
                               checkpoints=glob, hashes=not no_hashes)
    if OPTS.json:
        _out(res.to_json())
        return
    con = _console()
    if res.reset:
        con.print(f"[yellow]{res.run}: log {_esc(res.reset)}: read again from byte 0[/yellow]")
    last = res.last
    con.print(f"{res.run}: {res.fetched:,} new log bytes in {res.calls} call(s) ({res.start:,} -> {res.offset:,} "
              f"of {res.size:,}), {res.new_points} new point(s)"
              + (f", last step {last.step}" if last else ""))
    con.print(f"  wire: {res.wire_in:,} bytes out, {res.wire_out:,} bytes back")
    if res.crash:
        con.print(f"  [red]crash signature: {res.crash}[/red]")
    if res.files_changed:
        con.print(f"  [yellow]deployed files changed since launch: {_esc(', '.join(res.files_changed))}[/yellow]")
    for path, sha in res.checkpoints.items():
        con.print(f"  checkpoint {sha[:16]}  {path}", markup=False)


@metrics_app.command("export")
def export_cmd(
    run_refs: list[str] = typer.Argument(..., autocompletion=_c.runs, help="Runs as NAME, CT/NAME or #ID."),
    fmt: str = typer.Option("csv", "--format", help="tensorboard, csv or jsonl."),
    output: Path | None = typer.Option(
        None, "-o", "--output",
        help="csv/jsonl: a file for one run (default: stdout), a directory for several (one CT_NAME.csv each); "
             "tensorboard: a directory, one CT_NAME subdirectory per run."),
    no_pull: bool = typer.Option(False, "--no-pull", help="Only what the registry has; do not contact the runs."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing output files or run directories."),
) -> None:
    """Write runs' metric points as CSV or JSON lines, or as TensorBoard event files (loss, tok_s, lr,
    accept_len, tgt_bps, dft_bps by step, at the points' wall times) to compare the runs side by side."""
    from controller.commands import monitor
    from controller.core import export, plot

    if fmt not in export.FORMATS:
        raise InputError(f"unknown export format {fmt!r}: use tensorboard, csv or jsonl")
    if fmt == "tensorboard":
        export.require_tensorboard()  # before pulling: say at once that the library is missing
        if output is None:
            raise InputError("--format tensorboard needs -o DIR (one subdirectory per run)")
    reg = _registry()
    recs = list({r.id: r for r in (reg.find_run(ref) for ref in run_refs)}.values())
    to_dir = fmt == "tensorboard" or len(recs) > 1 or (output is not None and output.is_dir())
    if to_dir and output is None:
        raise InputError(f"{len(recs)} runs need -o DIR (one file per run)")
    if not no_pull:
        _pull_first(_inv(), reg, recs, "exporting")
    runs = [export.RunPoints(r.ct, r.name, monitor.stored_points(reg, r), r.started) for r in recs]
    if output is None:
        plot.export_points(runs[0].points, fmt, sys.stdout)
        return
    if not to_dir:
        n = export.write_file(runs[0].points, fmt, output, overwrite=force)
        if OPTS.json:
            _out({"run": runs[0].label, "points": n, "format": fmt, "output": str(output)})
        else:
            _console().print(f"{runs[0].label}: {n} point(s) written to {output} ({fmt})", markup=False)
        return
    if fmt == "tensorboard":
        done = export.write_tensorboard(runs, output, overwrite=force)
    else:
        done = export.write_files(runs, fmt, output, overwrite=force)
    if OPTS.json:
        _out({"format": fmt, "output": str(output),
              "runs": [{"run": w.run, "points": w.points, "output": str(w.output)} for w in done]})
        return
    con = _console()
    for w in done:
        con.print(f"{w.run}: {w.points} point(s) written to {w.output} ({fmt})", markup=False)
    if fmt == "tensorboard":
        con.print(f"view: tensorboard --logdir {output}", markup=False)


# --- ctl mark-good -------------------------------------------------------------------------------


@app.command("mark-good")
def mark_good_cmd(
    run: str = typer.Argument(..., autocompletion=_c.runs, help="Run as NAME, CT/NAME or #ID."),
    unset: bool = typer.Option(False, "--unset", help="Remove the mark."),
    force: bool = typer.Option(False, "--force", help="Mark a run that did not finish cleanly or is not OK "
                                                      "(recorded in the run's note)."),
) -> None:
    """Mark a run as known-good: the baseline of later runs (an inventory `baseline:` takes precedence).

    Only a run that finished with exit 0, or a live run judged OK against its own baseline, unless --force."""
    from controller.commands import monitor

    reg = _registry()
    rec = reg.find_run(run)
    if unset or (rec.state == Lifecycle.FINISHED and rec.exit_status == 0):  # nothing to ask a container
        res = monitor.mark_good(None, reg, None, rec, good=not unset, force=force)
    else:
        inv = _inv()
        with session(inv) as pool:
            res = monitor.mark_good(inv, reg, pool, rec, force=force)
    if OPTS.json:
        _out({"run": f"{rec.ct}/{rec.name}", "good": res.good, "forced": res.forced, "why": res.why})
    elif not res.good:
        _console().print(f"{rec.ct}/{rec.name}: no longer marked good")
    else:
        _console().print(f"{rec.ct}/{rec.name}: marked good (baseline)"
                         + (f" [yellow]although {res.why} (--force, recorded)[/yellow]" if res.forced else ""))


# --- ctl status ----------------------------------------------------------------------------------


def _render_status(sts: list[Any]) -> None:
    from controller.core.metrics import format_eta, format_rate, sparkline

    colour = {"ok": "green", "finished": "green", "slow": "yellow", "stalled": "red", "unreachable": "magenta",
              "crashed": "red"}
    rows = []
    for s in sts:
        v, last = s.verdict, s.last
        label = v.state.label.upper()
        c = colour.get(v.state.label)
        rows.append([
            s.run.ct, s.run.name, s.run.state, v.step if v.step is not None else "-",
            f"{last.loss:.4f}" if last and last.loss is not None else "-",
            format_rate(last.tok_s if last else None), format_eta(s.eta_s),
            sparkline(list(s.tok_s_history)), f"[{c}]{label}[/{c}]" if c else label, v.reason,
        ])
    _table(None, ["ct", "run", "state", "step", "loss", "tok/s", "ETA", "tok/s trend", "verdict", "why"], rows,
           markup=frozenset({8}))  # every cell but the verdict (ctl's own markup) escaped: names and reasons are text


@app.command("status", epilog=examples(
    'ctl status                     # every live run, judged against its baseline',
    'ctl status ct200 --slow-ratio 0.9',
    "ctl --json status pair         # a job's run, judged whole",
))
def status_cmd(
    containers: list[str] = targets_argument("Containers, groups, jobs or runs (NAME, CT/NAME, #ID; default: all)."),
    slow_ratio: float = typer.Option(0.8, "--slow-ratio", help="SLOW below this fraction of the baseline's tok/s."),
    stall_after: str = typer.Option("10m", "--stall-after", help="STALLED when the log is quiet this long."),
    checkpoints: str | None = typer.Option(None, "--checkpoints", help=_CHECKPOINTS_HELP),
) -> None:
    """Show the live runs (else each container's latest run), judged against their baseline.

    Pulls new metrics and shows step, loss, tok/s, ETA, trend and the verdict. Exit code: the worst verdict's
    (21 SLOW, 22 STALLED, 5 UNREACHABLE, 20 CRASHED)."""
    from controller.commands import monitor
    from controller.core.metrics import exit_code_for
    from controller.registry import NoSuchRun

    stall_s = _duration(stall_after, "--stall-after")
    _ratio(slow_ratio)
    glob = checkpoint_glob(checkpoints)
    inv = _inv()
    reg = _registry()
    recs: list[Any] = []
    seen: set[int] = set()  # a run across several containers is shown once, whichever of them named it
    # A word the inventory does not know as a container, group or job is a run (NAME, CT/NAME, #ID), as `ctl tail`
    # takes it: `ctl status fresh7`.
    m = inv.model
    named = [w for w in containers or [] if w in m.containers or w in m.groups or w in m.jobs]
    for ref in [w for w in containers or [] if w not in named]:
        try:
            rec = reg.find_run(ref)
        except NoSuchRun:
            if "/" in ref or ref.startswith("#"):
                raise
            raise InputError(f"{ref!r} is neither a container, group or job of {inv.path} nor a run of the "
                             "registry (`ctl runs` lists them)") from None
        if rec.id not in seen:
            seen.add(rec.id)
            recs.append(rec)
    for ct in inv.select(named) if named or not containers else []:
        mine = reg.latest_whole(ct.key, 50)  # a node's part of a run stands for the whole run
        for rid in [rid for rid, state in mine if state.live] or [rid for rid, _ in mine[:1]]:
            if rid not in seen:
                seen.add(rid)
                recs.append(reg.run_by_id(rid))
    if not recs:
        if OPTS.json:
            _out([])
        else:
            _console().print("no runs recorded for these containers")
        return
    with session(inv) as pool:
        report = monitor.statuses(inv, reg, pool, recs, slow_ratio=slow_ratio, stall_after_s=stall_s,
                                  checkpoints=glob)
    _warn(report.warnings)
    sts = list(report.statuses)
    if OPTS.json:
        _out([s.to_json() for s in sts])
    else:
        _render_status(sts)
    raise typer.Exit(int(exit_code_for(s.verdict for s in sts)))


# --- ctl watch -----------------------------------------------------------------------------------


@app.command("watch")
def watch_cmd(
    run: str = typer.Argument(..., autocompletion=_c.runs, help="Run as NAME, CT/NAME or #ID."),
    until_step: int | None = typer.Option(None, "--until-step", help="End when the run has logged this step."),
    for_: str | None = typer.Option(None, "--for", help="End after this long (90s, 10m, 1h)."),
    every: str = typer.Option("5s", "--every", help="Pull interval."),
    slow_ratio: float = typer.Option(0.8, "--slow-ratio"),
    stall_after: str = typer.Option("10m", "--stall-after"),
    checkpoints: str | None = typer.Option(None, "--checkpoints", help=_CHECKPOINTS_HELP),
) -> None:
    """Pull every few seconds until --until-step or --for is reached, or the run ends, crashes or stalls;
    print the verdict and exit with its code."""
    from controller.commands import monitor
    from controller.core.metrics import format_rate

    if until_step is None and for_ is None:
        raise InputError("give --until-step N or --for DURATION (or both)")
    limit_s = _duration(for_, "--for") if for_ else None
    every_s = _duration(every, "--every")
    stall_s = _duration(stall_after, "--stall-after")
    _ratio(slow_ratio)
    glob = checkpoint_glob(checkpoints)
    inv = _inv()
    reg = _registry()
    rec = reg.find_run(run)
    if rec.multi:
        inv.job(rec.ct)  # refused when the run's job left the inventory
    else:
        inv.container(rec.ct)  # refused when the run's container left the inventory
    con = _console()

    def tick(st: RunStatus) -> None:
        if not OPTS.json:
            v = st.verdict
            step = v.step if v.step is not None else "-"
            con.print(f"{time.strftime('%H:%M:%S')} {st.run.ct}/{st.run.name} step {step} "
                      f"{format_rate(st.last.tok_s if st.last else None)} tok/s  {v.state.label.upper()}",
                      markup=False)

    with session(inv) as pool:
        st, why = monitor.watch(inv, reg, pool, rec, until_step=until_step, limit_s=limit_s, for_text=for_,
                                every_s=every_s, slow_ratio=slow_ratio, stall_s=stall_s, checkpoints=glob, tick=tick)
    rec, v = st.run, st.verdict
    if OPTS.json:
        _out({**st.to_json(), "ended_because": why})
    else:
        con.print(f"{rec.ct}/{rec.name}: {why}: {v.state.label.upper()}: {v.reason}", markup=False)
    raise typer.Exit(int(v.exit_code))


# --- ctl plot ------------------------------------------------------------------------------------


@app.command("plot")
def plot_cmd(
    run_refs: list[str] = typer.Argument(..., autocompletion=_c.runs, help="Runs as NAME, CT/NAME or #ID."),
    output: Path = typer.Option(..., "-o", "--output", help="Image file (.png, .svg, .pdf)."),
    no_pull: bool = typer.Option(False, "--no-pull", help="Only what the registry has; do not contact runs."),
    no_baseline: bool = typer.Option(False, "--no-baseline", help="Do not draw the baseline."),
    title: str | None = typer.Option(None, "--title"),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing image."),
) -> None:
    """Plot tok/s and loss by step of several runs, with the baseline of the last one as a dashed line."""
    from controller.commands import monitor
    from controller.core import plot

    reg = _registry()
    recs = [reg.find_run(r) for r in run_refs]
    inv = None
    if not no_pull or not no_baseline:
        try:
            inv = _inv()
        except CtlError:
            if not no_pull:
                raise
    if not no_pull and inv is not None:
        _pull_first(inv, reg, recs, "plotting")
    series = {f"{r.ct}/{r.name}" if len({x.name for x in recs}) < len(recs) else r.name:
              monitor.stored_points(reg, r) for r in recs}
    base = None if no_baseline else monitor.baseline_rate(reg, monitor.resolve_baseline(inv, reg, recs[-1]))
    out = plot.plot_runs(series, output, base, title=title, overwrite=force)
    if OPTS.json:
        _out({"output": str(out), "runs": list(series), "baseline": base})
    else:
        _console().print(f"wrote {out} ({', '.join(series)}" + (f"; baseline {base[0]}" if base else "") + ")")
