"""What every `ctl` command module shares: the typer app, global options, output helpers.

Command modules (cli.py, cli_metrics.py, cli_env.py, ...) import from here, so there is one app and
one OPTS however ctl is started, and no module imports its own caller.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import typer

from controller.errors import CtlError

app = typer.Typer(
    name="ctl",
    help="Operate GPU training runs in Proxmox VE LXC containers: deploy, launch, follow, compare.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@dataclass
class Opts:
    inventory: str | None = None
    json: bool = False
    debug: bool = False


OPTS = Opts()


@app.callback()
def _global(
    inventory: str | None = typer.Option(
        None, "-i", "--inventory", help="Inventory file (env CTL_INVENTORY; default ./inventory.yaml)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    OPTS.inventory = inventory
    OPTS.json = as_json
    OPTS.debug = debug


# --- helpers -------------------------------------------------------------------------------------


def _inv() -> Any:
    from controller import inventory

    return inventory.load(OPTS.inventory)


def _note(msg: str) -> None:
    """What --debug adds on stderr: how ctl reached the containers (relay or not, and why)."""
    if OPTS.debug:
        sys.stderr.write(f"ctl: debug: {msg}\n")


def _out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def _table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=None, pad_edge=False, header_style="bold")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[("" if v is None else str(v)) for v in r])
    _console().print(t)


def _registry() -> Any:
    from controller.registry import Registry

    return Registry()


@contextmanager
def _session(container: str) -> Iterator[tuple[Any, Any, Any]]:
    """(inventory, the one container named, a connection pool closed at the end) for a one-container verb."""
    from controller.transport.pool import Pool

    inv = _inv()
    ct = _one_ct(inv, container)
    with Pool(inv) as pool:
        yield inv, ct, pool


def _one_ct(inv: Any, name: str) -> Any:
    cts = inv.select([name])
    if len(cts) != 1:
        raise CtlError(f"{name!r} names {len(cts)} containers; give one container")
    return cts[0]


def _run_and_ct(inv: Any, reg: Any, ref: str) -> tuple[Any, Any]:
    run = reg.find_run(ref)
    return run, inv.container(run.ct)


def _refresh_all(inv: Any, reg: Any, recs: list[Any]) -> list[Any]:
    from controller.commands import runs
    from controller.commands.fanout import fanout
    from controller.transport.pool import Pool

    by_ct: dict[str, list[Any]] = {}
    for r in recs:
        by_ct.setdefault(r.ct, []).append(r)
    live_cts = [c for c, rs in by_ct.items() if any(r.state in runs.LIVE for r in rs) and
                c in inv.model.containers]
    if not live_cts:
        return recs
    with Pool(inv) as pool:
        results = fanout(pool, [inv.container(c) for c in live_cts],
                         lambda ct, t: runs.refresh(inv, ct, t, reg, by_ct[ct.name]))
    fresh = {r.id: r for o in results if o.value for r in o.value}
    for o in results:
        if not o.ok:
            sys.stderr.write(f"ctl: warning: {o.ct}: state not refreshed: {o.error}\n")
    return [fresh.get(r.id, r) for r in recs]


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    d = time.time() - ts
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= n:
            return f"{d / n:.0f}{unit} ago"
    return f"{d:.0f}s ago"
