"""`ctl store status|prune`: the content-addressed store in each container (old and new versions of deployed
files, what `ctl deploy --rollback` restores from). Nothing is deleted except by `ctl store prune`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from controller.cli import app as _cli
from controller.cli.app import ONLY_BY_DEFAULT, all_option, targets_argument

if TYPE_CHECKING:
    from controller.cli.app import _Console
    from controller.commands.store import StoreReport

app: typer.Typer = _cli.app
OPTS = _cli.OPTS

store_app = typer.Typer(help="The store of deployed file versions in each container: status, prune.",
                        no_args_is_help=True)
app.add_typer(store_app, name="store")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@store_app.command("status")
def status_cmd(containers: list[str] = targets_argument()) -> None:
    """Objects, bytes, and versions per destination in each container's store."""
    from controller.commands import store
    from controller.commands.fanout import worst

    inv = _cli._inv()
    cts = inv.select(containers or [])
    with _cli.session(inv) as pool:
        results = store.status_all(pool, cts)
    if OPTS.json:
        _cli._out([r.value.to_json() if r.value else {"ct": r.ct, "ok": False, "error": r.error} for r in results])
        raise typer.Exit(worst(results))
    con = _cli._console()
    for r in results:
        if r.value is None:
            con.print(f"{r.ct:<12} [red]FAILED[/red] {r.error}")
            continue
        v = r.value
        con.print(f"{r.ct:<12} {v.objects} objects, {_mib(v.bytes)}" +
                  (f" ({v.unreferenced} named by no deploy record)" if v.unreferenced else ""), markup=False)
        for d in v.dests:
            con.print(f"  {d.versions:>3} versions  {_mib(d.bytes):>10}  {d.dest}", markup=False)
    raise typer.Exit(worst(results))


@store_app.command("prune")
def prune_cmd(
    containers: list[str] = targets_argument(ONLY_BY_DEFAULT),
    all_: bool = all_option(),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be deleted; delete nothing."),
) -> None:
    """Delete versions no longer needed: keeps the newest store_keep (inventory, default 5) per destination,
    what the last deploy of each replaced, every version a recorded run used, and anything under an hour old."""
    from controller.commands import store
    from controller.commands.fanout import worst

    inv = _cli._inv()
    cts = inv.targets(containers, all_=all_, purpose="whose store to prune")
    reg = _cli._registry()
    with _cli.session(inv) as pool:
        results = store.prune_all(pool, cts, reg, dry_run=dry_run)
    def show(con: _Console, ct: str, v: StoreReport) -> None:
        verb = "would delete" if dry_run else "deleted"
        n = len(v.delete) if dry_run else len(v.deleted)
        con.print(f"{ct:<12} {verb} {n} of {v.objects} objects ({_mib(v.delete_bytes)}), kept {v.keep}",
                  markup=False)

    _cli._outcomes(results, show)
    raise typer.Exit(worst(results))
