"""Runbook commands (`ctl runbook check|run|history`), registered on the main app.

The step actions live here: each calls, in-process, the functions the matching CLI command calls
(deploy.deploy through fanout, environment.check, runs.launch with the launch env probe, the `ctl watch` loop,
runs.stop, Registry.mark_good, cache.restore), over one connection pool for the whole runbook.
Exit code of `run`: 0, or the exit code of the step that stopped it (a `fail:` in a branch: the code of
the step whose branch it is). An invalid runbook or value is 4 (INPUT), one line naming file, line and key.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from controller.cli import app as _cli
from controller.core.terminal import clean_line, escape_markup

if TYPE_CHECKING:
    from controller.core.runbook import StepResult

app: typer.Typer = _cli.app
OPTS = _cli.OPTS
_console, _inv, _out, _registry, _table, session = (_cli._console, _cli._inv, _cli._out, _cli._registry, _cli._table,
                                                   _cli.session)

runbook_app = typer.Typer(help="Run a YAML runbook of ctl steps (deploy, env-check, launch, watch, stop, "
                               "mark-good, cache-restore, fail): check it, run it, list past runs.",
                          no_args_is_help=True)
app.add_typer(runbook_app, name="runbook")

_VAR_HELP = "Set a variable declared in the runbook's `vars:` (repeatable): --var ct=ct200."


def _load(file: Path, var: list[str] | None) -> tuple[Any, dict[str, Any]]:
    from controller.core import runbook

    given = runbook.parse_var_options(var)
    book = runbook.load(file, given)
    return book, runbook.variables_for(book, given)


@runbook_app.command("check")
def check_cmd(
    file: Path = typer.Argument(..., help="The runbook (YAML)."),
    var: list[str] = typer.Option(None, "--var", help=_VAR_HELP),
) -> None:
    """Validate a runbook without running anything: kinds, keys, types, values, templates and variables."""
    from controller.core import runbook

    given = runbook.parse_var_options(var)
    book = runbook.load(file, given)
    steps, branches = book.count()
    required = [k for k, v in book.vars.items() if v is None and k not in given]
    if OPTS.json:
        _out({"path": str(file), "name": book.name, "sha256": book.sha256, "steps": steps, "branches": branches,
              "vars": dict(book.vars), "required": required})
        return
    _console().print(f"{file}: ok: runbook {book.name}, {steps} step(s), {branches} branch(es)"
                     + (f"; needs --var {', --var '.join(k + '=...' for k in required)}" if required else ""),
                     markup=False)


def _print_step(r: StepResult) -> None:
    con = _console()
    colour = {"ok": "green", "OK": "green", "FINISHED": "green", "planned": "cyan", "FAILED": "red", "SLOW": "yellow",
              "STALLED": "red", "CRASHED": "red"}.get(r.outcome)
    indent = "  " * r.depth
    outcome = f"[{colour}]{r.outcome:<8}[/{colour}]" if colour else f"{r.outcome:<8}"
    con.print(f"{indent}{escape_markup(r.path):<{26 - len(indent)}} {escape_markup(r.label):<24} {outcome} "
              f"{r.seconds:6.2f}s  {_cli._esc(r.detail)}" + (f"  -> on {escape_markup(r.branch)}" if r.branch else ""))
    for line in r.lines:
        con.print(f"{indent}    {line}", markup=False)


@runbook_app.command("run")
def run_cmd(
    file: Path = typer.Argument(..., help="The runbook (YAML)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (deploy: its dry-run plan); change "
                                                          "nothing, record nothing."),
    var: list[str] = typer.Option(None, "--var", help=_VAR_HELP),
) -> None:
    """Run the runbook's steps in order, one line per step; stop at the first unhandled failure with its exit
    code.

    The run is recorded in the registry (`ctl runbook history`)."""
    from controller.commands import runbook

    book, variables = _load(file, var)
    inv = _inv()
    reg = _registry()
    con = _console()
    show = not OPTS.json
    if show:
        con.print(f"runbook {book.name} ({file}, sha256 {book.sha256[:12]})" + (": dry run" if dry_run else ""),
                  markup=False)

    @contextmanager
    def watching(text: str) -> Iterator[Callable[[str], None] | None]:
        if not (show and sys.stdout.isatty()):
            yield None
            return
        status = con.status(text)
        status.start()
        try:
            yield status.update
        finally:
            status.stop()

    with session(inv) as pool:
        res, record_id = runbook.run(book, variables, inv, reg, pool, dry_run=dry_run,
                                     emit=_print_step if show else lambda r: None, watching=watching)
    if OPTS.json:
        _out({**res.to_json(), "record": record_id})
    elif res.ok:
        con.print(f"runbook {book.name}: " + ("plan ok" if dry_run else "ok") + f" ({len(res.steps)} steps)",
                  markup=False)
    if not res.ok:
        sys.stderr.write(clean_line(f"ctl: error: runbook {book.name} failed at {res.failed_at} "
                                    f"(exit {res.exit_code}): {res.message}") + "\n")
    raise typer.Exit(res.exit_code)


@runbook_app.command("history")
def history_cmd(
    name: str | None = typer.Argument(None, help="Only runs of this runbook (its `name:`)."),
    limit: int = typer.Option(20, "-n", "--limit"),
) -> None:
    """Past runbook runs from the registry: when, which file (sha256), outcome, exit code, where it stopped."""
    reg = _registry()
    recs = reg.runbook_runs(name=name, limit=limit)
    if OPTS.json:
        _out([r.to_json() for r in recs])
        return
    if not recs:
        _console().print("no runbook runs recorded" + (f" for {name}" if name else ""))
        return
    rows = []
    for r in recs:
        took = f"{r.ended - r.started:.1f}s" if r.ended else "-"
        last = r.steps[-1]["path"] if r.steps and r.outcome != "ok" else ""
        rows.append([r.id, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started)), r.name, r.sha256[:12],
                     r.outcome, "" if r.exit_code is None else r.exit_code, len(r.steps), took,
                     (f"{last}: " if last else "") + (r.message or "")])
    _table(None, ["#", "started", "runbook", "sha256", "outcome", "exit", "steps", "took", "message"], rows)

