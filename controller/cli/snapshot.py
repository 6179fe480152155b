"""Snapshot commands (`ctl snapshot create|list|rollback|delete`, and `ctl rollback` as a shortcut), registered
on the main app. Each converts options, calls controller.commands.snapshot, and renders the result.

Through the PVE API when the container's host has an `api:` section (token secret from the variable it
names), otherwise `pct` over SSH; messages and exit codes are the same either way: 4 bad name or unknown
snapshot, 5 API/SSH unreachable or token refused, 9 a live run blocks the rollback, 30 PVE refused it
or its task failed.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import typer

from controller.cli import app as _cli
from controller.cli import names as _c
from controller.cli.app import container_argument
from controller.errors import CtlError, InputError

if TYPE_CHECKING:
    from controller.commands.snapshot import SnapshotResult

app: typer.Typer = _cli.app
OPTS = _cli.OPTS
_console, _inv, _out, _registry, _table, _one_ct = (
    _cli._console, _cli._inv, _cli._out, _cli._registry, _cli._table, _cli._one_ct)

snapshot_app = typer.Typer(help="Snapshots of a container (PVE API, or pct over SSH): create, list, rollback, "
                                "delete.", no_args_is_help=True)
app.add_typer(snapshot_app, name="snapshot")


def _name(name: str) -> str:
    from controller.names import check_snapshot_name

    return check_snapshot_name(name)


def _confirm(yes: bool, what: str) -> Any:
    """None when --yes; else a callback that asks on the terminal, or refuses when there is none."""
    if yes:
        return None

    def ask(question: str) -> None:
        if not sys.stdin.isatty():
            raise InputError(f"{what}: confirm with --yes (no terminal to ask on)")
        if not typer.confirm(question + ". Continue?", default=False, err=True):
            raise CtlError("aborted: nothing was changed")

    return ask


def _when(ts: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _render(res: SnapshotResult) -> None:
    if OPTS.json:
        _out(res.to_json())
        return
    con = _console()
    if res.dry_run:
        con.print(f"{res.ct}: would send (via {res.via}):", markup=False)
        con.print(f"  {res.request}", markup=False)
        if res.stopped_runs:
            con.print(f"  and kill run {', '.join(res.stopped_runs)} (--force)", markup=False)
        return
    task = f"{res.exitstatus}, task {res.upid}" if res.upid else f"{res.exitstatus}, pct"
    head = f"{res.ct} ({res.host}/{res.vmid})"
    if res.action == "snapshot":
        con.print(f"{head}: snapshot {res.name!r} taken via {res.via} in {res.seconds:.1f}s ({task})", markup=False)
    elif res.action == "delete":
        con.print(f"{head}: snapshot {res.name!r} deleted via {res.via} ({task})", markup=False)
    else:
        hint = " (--start restarts it after a rollback)" if res.status == "stopped" else ""
        con.print(f"{head}: rolled back to {res.name!r} via {res.via} in {res.seconds:.1f}s ({task}); "
                  f"container {res.status or 'state unknown'}{hint}", markup=False)
        for run in res.stopped_runs:
            con.print(f"  run {run} was live and is recorded as stopped", markup=False)


@snapshot_app.command("create")
def create_cmd(
    container: str = typer.Argument(..., autocompletion=_c.containers, help="The container."),
    name: str = typer.Argument(..., help="Snapshot name: a letter, then letters, digits, '_' or '-' (2-40)."),
    description: str | None = typer.Option(None, "-d", "--description", help="Free text stored with it."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the request; change nothing."),
) -> None:
    """Take a snapshot of the container (waits for the PVE task and reports its exit status)."""
    from controller.commands import snapshot

    _name(name)
    with _cli._session(container) as (inv, ct, pool):
        res = snapshot.create(snapshot.target(inv, ct, pool), name, description, dry_run=dry_run)
    _render(res)


@snapshot_app.command("list")
def list_cmd(container: str | None = container_argument()) -> None:
    """List the container's snapshots (oldest first; * = the one the container currently derives from)."""
    from controller.commands import snapshot

    with _cli._session(container) as (inv, ct, pool):
        lst = snapshot.list_snapshots(snapshot.target(inv, ct, pool))
    if OPTS.json:
        _out(lst.to_json())
        return
    if not lst.snapshots:
        _console().print(f"{ct.name} ({lst.host}/{lst.vmid}): no snapshots (via {lst.via})", markup=False)
        return
    _table(f"{ct.name} ({lst.host}/{lst.vmid}) via {lst.via}", ["snapshot", "taken", "parent", "description"],
           [[s.name + (" *" if s.current else ""), _when(s.snaptime), s.parent or "-", s.description]
            for s in lst.snapshots])


def rollback_cmd(
    container: str = typer.Argument(..., autocompletion=_c.containers, help="The container."),
    name: str = typer.Argument(..., help="The snapshot to go back to."),
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask (needed without a terminal)."),
    force: bool = typer.Option(False, "--force", help="Roll back although a run is live on the container "
                                                      "(it is killed and recorded as stopped)."),
    start: bool = typer.Option(False, "--start", help="Start the container after the rollback (default: stopped)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Run the checks and show the request; change nothing."),
) -> None:
    """Roll the container back to a snapshot: stops it, discards every change since; asks first."""
    from controller.commands import snapshot

    _name(name)
    reg = _registry()
    with _cli._session(container) as (inv, ct, pool):
        t = snapshot.target(inv, ct, pool)
        res = snapshot.rollback(inv, ct, t, pool, reg, name, start=start, force=force, dry_run=dry_run,
                                confirm=_confirm(yes, f"rollback of {ct.name} to {name!r} discards every change "
                                                      "since the snapshot"))
    _render(res)


snapshot_app.command("rollback")(rollback_cmd)
app.command("rollback", help="Shortcut for `ctl snapshot rollback`.")(rollback_cmd)


@snapshot_app.command("delete")
def delete_cmd(
    container: str = typer.Argument(..., autocompletion=_c.containers, help="The container."),
    name: str = typer.Argument(..., help="The snapshot to delete."),
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask (needed without a terminal)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the request; change nothing."),
) -> None:
    """Delete a snapshot (the container itself is not touched); asks first."""
    from controller.commands import snapshot

    _name(name)
    with _cli._session(container) as (inv, ct, pool):
        t = snapshot.target(inv, ct, pool)
        res = snapshot.delete(t, name, dry_run=dry_run,
                              confirm=_confirm(yes, f"deleting snapshot {name!r} of {ct.name}"))
    _render(res)
