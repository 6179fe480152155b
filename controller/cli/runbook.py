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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer

from controller.cli import app as _cli
from controller.errors import ExitCode

app: typer.Typer = _cli.app
OPTS = _cli.OPTS
_console, _inv, _out, _registry, _table = _cli._console, _cli._inv, _cli._out, _cli._registry, _cli._table

runbook_app = typer.Typer(help="Run a YAML runbook of ctl steps (deploy, env-check, launch, watch, stop, "
                               "mark-good, cache-restore, fail): check it, run it, list past runs.",
                          no_args_is_help=True)
app.add_typer(runbook_app, name="runbook")

_VAR_HELP = "Set a variable declared in the runbook's `vars:` (repeatable): --var ct=ct200."


class _Actions:
    """The step kinds bound to the domain functions, sharing one Pool, inventory and registry."""

    def __init__(self, inv: Any, reg: Any, pool: Any, live: bool) -> None:
        self.inv, self.reg, self.pool, self.live = inv, reg, pool, live
        self.launched: dict[str, int] = {}  # run name -> registry id, so `{{ run }}` is never ambiguous

    def table(self) -> dict[str, Any]:
        return {"deploy": self.deploy, "env-check": self.env_check, "launch": self.launch, "watch": self.watch,
                "stop": self.stop, "mark-good": self.mark_good, "cache-restore": self.cache_restore}

    def _ct(self, name: str) -> tuple[Any, Any]:
        ct = _cli._one_ct(self.inv, name)
        return ct, self.pool.container(ct)

    def _run(self, ref: str) -> Any:
        return self.reg.find_run(f"#{self.launched[ref]}" if ref in self.launched else ref)

    def deploy(self, a: Mapping[str, Any], dry: bool) -> Any:
        from controller.commands import deploy
        from controller.commands.fanout import fanout, worst
        from controller.core.runbook import Done

        cts = self.inv.select(a["containers"])
        results = fanout(self.pool, cts, lambda ct, t: deploy.deploy(self.inv, ct, t, self.reg, dry_run=dry,
                                                                     allow_dirty=a["allow_dirty"]))
        lines: list[str] = []
        for r in results:
            if dry and r.value is not None:
                lines += [f"{r.ct}: {p.action:<7} {p.dest}  {p.want[:12]}" for p in r.value.plan]
                lines += [f"{r.ct}: {c}" for c in r.value.commands]
        detail = "; ".join(f"{r.ct}: {r.value.summary()}" if r.value is not None else f"{r.ct}: FAILED {r.error}"
                           for r in results)
        return Done(detail, exit_code=worst(results), lines=tuple(lines))

    def env_check(self, a: Mapping[str, Any], dry: bool) -> Any:
        from controller.commands import environment
        from controller.core.runbook import Done

        ct, t = self._ct(a["ct"])
        if dry:
            lock = a["lock"] or (f"{ct.spec.lock}" if ct.spec.lock else "its lock (none configured)")
            return Done(f"would compare {ct.name}'s environment with {lock}")
        res = environment.check(self.inv, ct, t, a["lock"])
        if res.ok:
            return Done(f"matches {res.lock_path} (fingerprint {res.fingerprint[:16]})")
        return Done(f"{len(res.findings)} difference(s) from {res.lock_path}: {res.findings[0].message}",
                    exit_code=int(ExitCode.ENV_MISMATCH), lines=tuple(f.message for f in res.findings))

    def launch(self, a: Mapping[str, Any], dry: bool) -> Any:
        from controller.commands import environment, runs
        from controller.core.runbook import Done

        ct, t = self._ct(a["ct"])
        if dry:
            name = a["run"] or runs.next_name(self.inv, ct, t, self.reg)
            return Done(f"would launch {name} on {ct.name} (after its preflight)", sets={"run": name})
        rec, checks = runs.launch(
            self.inv, ct, t, self.reg, a["run"], allow_drift=a["allow_drift"], force=a["force"],
            env_probe=lambda: environment.probe_for_launch(self.inv, ct, t, allow_mismatch=a["allow_env_mismatch"]))
        self.launched[rec.name] = rec.id
        forced = [c.name for c in checks if c.forced]
        return Done(f"{rec.name}: tmux session {rec.session}, log {rec.log_path}"
                    + (f" (forced: {', '.join(forced)})" if forced else ""), sets={"run": rec.name})

    def watch(self, a: Mapping[str, Any], dry: bool) -> Any:
        from controller.cli import metrics
        from controller.core.metrics import format_rate, parse_duration
        from controller.core.runbook import Done

        until = " or ".join(x for x in (f"step {a['until_step']}" if a["until_step"] is not None else "",
                                        a["for"] or "") if x)
        if dry:
            return Done(f"would watch {a['run']} until {until} (slow below {a['slow_ratio']:.2f}x the baseline)")
        rec = self._run(a["run"])
        _ct, t = self._ct(rec.ct)
        status = _console().status(f"watching {rec.ct}/{rec.name} until {until}") if self.live else None

        def tick(st: Any) -> None:
            if status is not None:
                v = st.verdict
                status.update(f"watching {rec.ct}/{rec.name} until {until}: step "
                              f"{v.step if v.step is not None else '-'} "
                              f"{format_rate(st.last.tok_s if st.last else None)} tok/s {v.state.name}")

        def seconds(text: str) -> float:
            return parse_duration(text) or 0.0  # checked by the runbook's validators already

        if status is not None:
            status.start()
        try:
            st, why = metrics._watch_loop(
                self.inv, self.reg, rec, t, until_step=a["until_step"],
                limit_s=seconds(a["for"]) if a["for"] else None, for_text=a["for"], every_s=seconds(a["every"]),
                slow_ratio=a["slow_ratio"], stall_s=seconds(a["stall_after"]), glob=a["checkpoints"], tick=tick)
        finally:
            if status is not None:
                status.stop()
        v = st.verdict
        return Done(f"{why}: {v.reason}", state=v.state.name, exit_code=int(v.exit_code))

    def stop(self, a: Mapping[str, Any], dry: bool) -> Any:
        from controller.commands import runs
        from controller.core.runbook import Done

        if dry:
            return Done(f"would stop {a['run']} (SIGINT, {a['grace']:.0f}s grace, escalate)")
        rec = self._run(a["run"])
        ct, t = self._ct(rec.ct)
        rec = runs.refresh(self.inv, ct, t, self.reg, [rec])[0]
        rec = runs.stop(self.inv, ct, t, self.reg, rec, grace=a["grace"])
        return Done(f"{rec.ct}/{rec.name}: {rec.state} ({rec.note})")

    def mark_good(self, a: Mapping[str, Any], dry: bool) -> Any:
        from controller.core.runbook import Done

        if dry:
            return Done(f"would mark {a['run']} good (the baseline of later runs)")
        rec = self._run(a["run"])
        self.reg.mark_good(rec.id, True)
        return Done(f"{rec.ct}/{rec.name}: marked good (baseline)")

    def cache_restore(self, a: Mapping[str, Any], dry: bool) -> Any:
        from controller.commands import cache
        from controller.core.runbook import Done

        ct, t = self._ct(a["ct"])
        if dry:
            return Done(f"would restore the compile cache {a['name']} into {ct.name} (verified; current kept aside)")
        res = cache.restore(self.inv, ct, t, a["name"], force=a["force"])
        return Done(f"restored {a['name']} into {res.dir} (sha256 {res.sha256[:12]} verified)"
                    + (f", previous kept at {res.aside}" if res.aside else ""))


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


def _print_step(r: Any) -> None:
    con = _console()
    colour = {"ok": "green", "OK": "green", "FINISHED": "green", "planned": "cyan", "FAILED": "red", "SLOW": "yellow",
              "STALLED": "red", "CRASHED": "red"}.get(r.outcome)
    indent = "  " * r.depth
    outcome = f"[{colour}]{r.outcome:<8}[/{colour}]" if colour else f"{r.outcome:<8}"
    from rich.markup import escape

    con.print(f"{indent}{escape(r.path):<{26 - len(indent)}} {escape(r.label):<24} {outcome} {r.seconds:6.2f}s  "
              f"{escape(r.detail)}" + (f"  -> on {r.branch}" if r.branch else ""))
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
    code. The run is recorded in the registry (`ctl runbook history`)."""
    from controller.core import runbook
    from controller.transport.pool import Pool

    book, variables = _load(file, var)
    inv = _inv()
    reg = _registry()
    con = _console()
    show = not OPTS.json
    if show:
        con.print(f"runbook {book.name} ({file}, sha256 {book.sha256[:12]})" + (": dry run" if dry_run else ""),
                  markup=False)
    record_id = None if dry_run else reg.start_runbook(book.name, str(book.path), book.sha256, variables)
    steps: list[Any] = []

    def emit(r: Any) -> None:
        steps.append(r)
        if show:
            _print_step(r)

    try:
        with Pool(inv) as pool:
            actions = _Actions(inv, reg, pool, live=show and sys.stdout.isatty())
            res = runbook.execute(book, variables, actions.table(), dry_run=dry_run, emit=emit)
    except BaseException as e:
        if record_id is not None:
            code = 130 if isinstance(e, KeyboardInterrupt) else int(getattr(e, "exit_code", 1))
            reg.finish_runbook(record_id, "interrupted", code, f"{type(e).__name__}: {e}",
                               [s.to_json() for s in steps])
        raise
    if record_id is not None:
        reg.finish_runbook(record_id, "ok" if res.ok else "failed", res.exit_code, res.message,
                           [s.to_json() for s in res.steps])
    if OPTS.json:
        _out({**res.to_json(), "record": record_id})
    elif res.ok:
        con.print(f"runbook {book.name}: " + ("plan ok" if dry_run else "ok") + f" ({len(res.steps)} steps)",
                  markup=False)
    if not res.ok:
        sys.stderr.write(f"ctl: error: runbook {book.name} failed at {res.failed_at} (exit {res.exit_code}): "
                         f"{res.message}\n")
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

