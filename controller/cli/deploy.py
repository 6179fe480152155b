"""`ctl deploy`: pin, push only what changed, verify, record; `--check` (drift) and `--rollback`."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import typer

from controller.cli.app import (
    ONLY_BY_DEFAULT,
    OPTS,
    _console,
    _esc,
    _inv,
    _out,
    _outcomes,
    _registry,
    all_option,
    app,
    examples,
    session,
    targets_argument,
)
from controller.errors import CtlError, ExitCode

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from controller.cli.app import _Console
    from controller.commands.deploy import DeployResult


@app.command("deploy", epilog=examples(
    'ctl deploy ct200 --dry-run     # the plan and the exact command; changes nothing',
    'ctl deploy ct200               # only changed files travel, verified in place',
    'ctl deploy ct200 --check       # drift: files changed by hand (exit 8)',
    'ctl deploy ct200 --rollback    # restore what the last deploy replaced',
    'ctl deploy pair                # every node of a job, or a group, in parallel',
))
def deploy_cmd(
    containers: list[str] = targets_argument(ONLY_BY_DEFAULT),
    all_: bool = all_option("Every container of the inventory (listed first)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the exact commands; change nothing."),
    allow_dirty: bool = typer.Option(False, "--allow-dirty", help="Deploy sources that differ from git HEAD."),
    check: bool = typer.Option(False, "--check", help="Report drift (files changed in the container); fix nothing."),
    rollback: bool = typer.Option(False, "--rollback", help="Restore the files the last deploy replaced."),
) -> None:
    """Pin the payload, push only what changed, verify it inside each container, record it."""
    from controller.commands import deploy
    from controller.commands.fanout import worst

    if sum([dry_run, check, rollback]) > 1:
        raise CtlError("choose one of --dry-run, --check, --rollback")
    inv = _inv()
    cts = inv.targets(containers, all_=all_, purpose="to deploy to")
    if all_ and not OPTS.json:
        _console().print(f"deploying to all {len(cts)} containers of {inv.path}: {', '.join(c.name for c in cts)}",
                         markup=False)
    reg = _registry()
    with session(inv) as pool:
        if check:
            checks = deploy.check_all(inv, pool, cts, reg)
            _render_check(checks)
            drift = any(r.ok and any(p.action != "same" for p in (r.value or [])) for r in checks)
            raise typer.Exit(worst(checks) or (int(ExitCode.DRIFT) if drift else 0))
        if rollback:
            results = deploy.rollback_all(pool, cts, reg)
        else:
            with _TransferProgress(enabled=not OPTS.json and sys.stderr.isatty()) as progress:
                results = deploy.deploy_all(inv, pool, cts, reg, dry_run=dry_run, allow_dirty=allow_dirty,
                                            progress=progress)

    def show(con: _Console, ct: str, res: DeployResult) -> None:
        con.print(f"{ct:<12} {res.summary()}")
        if dry_run or len(cts) == 1:
            for p in res.plan:
                if p.action != "same" or dry_run:
                    con.print(f"  {p.action:<7} {p.dest}  {p.want[:12]}" + (f"  {p.mode}" if p.mode else "")
                              + (f" (was {p.have[:12]})" if p.have and p.have != p.want else ""))
        if dry_run:
            con.print("  commands (run on the operator's machine; stdin is the agent source + bundle):")
            for c in res.commands:
                con.print(f"    {c}", soft_wrap=True, markup=False)

    _outcomes(results, show)
    raise typer.Exit(worst(results))


class _TransferProgress:
    """Progress bars (on stderr) for transfers that last over a second; silent for quick ones."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.bar: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> _TransferProgress | None:
        return self if self.enabled else None

    def __call__(self, ct: str, sent: int, total: int) -> None:
        if self.bar is None:
            if time.monotonic() - self.t0 < 1.0:
                return
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self.bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
        if ct not in self.tasks:
            self.tasks[ct] = self.bar.add_task(ct, total=total)
        self.bar.update(self.tasks[ct], completed=sent)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _render_check(checks: list[Any]) -> None:
    if OPTS.json:
        _out([{"ct": r.ct, "ok": r.ok, "error": r.error,
               "files": [p.__dict__ for p in (r.value or [])]} for r in checks])
        return
    con = _console()
    for r in checks:
        if not r.ok:
            con.print(f"{r.ct:<12} [red]FAILED[/red] {_esc(r.error)}")
            continue
        bad = [p for p in r.value if p.action != "same"]
        con.print(f"{r.ct:<12} " + ("no drift" if not bad else f"[yellow]DRIFT[/yellow] in {len(bad)} file(s)"))
        for p in bad:
            con.print(f"  {p.action:<8} {p.dest}  deployed {p.want[:12]}, now {(p.have or 'absent')[:12]}")
