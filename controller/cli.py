"""The `ctl` command line: thin typer commands that call one function and render its result.

Every CtlError is caught in `main` and printed as one line; `--debug` shows the traceback.
Heavy modules (fabric, paramiko, jinja2, matplotlib) are imported inside commands, so that
`ctl --help` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import typer

from controller.errors import CtlError, ExitCode

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


# --- inventory / ping ----------------------------------------------------------------------------


@app.command("inventory")
def inventory_cmd() -> None:
    """List hosts and containers of the inventory."""
    inv = _inv()
    m = inv.model
    if OPTS.json:
        _out({"path": str(inv.path), **m.model_dump(mode="json")})
        return
    _table(f"hosts ({inv.path})", ["host", "address", "port", "user", "api"],
           [[n, h.address, h.port, h.user, h.api.url if h.api else "-"] for n, h in m.hosts.items()])
    rows = []
    for name, c in m.containers.items():
        where = f"{c.host}/{c.vmid}" if c.transport == "pct" else (c.address if c.transport == "ssh" else c.root)
        split = f"target {c.gpus.target} drafter {c.gpus.drafter}" if c.gpus.all else "cpu"
        groups = ",".join(g for g, members in m.groups.items() if name in members)
        rows.append([name, c.transport, where, split, groups])
    _table("containers", ["container", "transport", "where", "gpus", "groups"], rows)


@app.command("ping")
def ping_cmd(containers: list[str] = typer.Argument(None, help="Containers or groups (default: all).")) -> None:
    """Run `true` in each container and report round-trip times."""
    from controller.commands.fanout import fanout, worst
    from controller.transport.pool import Pool

    inv = _inv()
    cts = inv.select(containers or [])

    def one(ct: Any, t: Any) -> dict[str, float]:
        times = []
        for _ in range(3):
            t0 = time.monotonic()
            t.check(["true"], what="ping")
            times.append(time.monotonic() - t0)
        return {"first_ms": times[0] * 1000, "rtt_ms": min(times) * 1000}

    with Pool(inv) as pool:
        results = fanout(pool, cts, one)
    if OPTS.json:
        _out([{"ct": r.ct, "ok": r.ok, "error": r.error, **(r.value or {})} for r in results])
    else:
        con = _console()
        for r in results:
            if r.ok and r.value:
                con.print(f"{r.ct:<12} ok    rtt {r.value['rtt_ms']:.1f} ms (first {r.value['first_ms']:.1f} ms)")
            else:
                con.print(f"{r.ct:<12} [red]FAIL[/red]  {r.error}")
    raise typer.Exit(worst(results))


# --- deploy --------------------------------------------------------------------------------------


@app.command("deploy")
def deploy_cmd(
    containers: list[str] = typer.Argument(None, help="Containers or groups (default: all)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the exact commands; change nothing."),
    allow_dirty: bool = typer.Option(False, "--allow-dirty", help="Deploy sources that differ from git HEAD."),
    check: bool = typer.Option(False, "--check", help="Report drift (files changed in the container); fix nothing."),
    rollback: bool = typer.Option(False, "--rollback", help="Restore the files the last deploy replaced."),
) -> None:
    """Pin the payload, push only what changed, verify it inside each container, record it."""
    from controller import deploy
    from controller.commands.fanout import fanout, worst
    from controller.transport.pool import Pool

    if sum([dry_run, check, rollback]) > 1:
        raise CtlError("choose one of --dry-run, --check, --rollback")
    inv = _inv()
    cts = inv.select(containers or [])
    reg = _registry()
    with Pool(inv) as pool:
        if check:
            checks = fanout(pool, cts, lambda ct, t: deploy.check(inv, ct, t, reg))
            _render_check(checks)
            drift = any(r.ok and any(p.action != "same" for p in (r.value or [])) for r in checks)
            raise typer.Exit(worst(checks) or (int(ExitCode.DRIFT) if drift else 0))
        if rollback:
            results = fanout(pool, cts, lambda ct, t: deploy.rollback(ct, t, reg))
        else:
            results = fanout(pool, cts, lambda ct, t: deploy.deploy(inv, ct, t, reg, dry_run=dry_run,
                                                                     allow_dirty=allow_dirty))
    if OPTS.json:
        _out([r.value.to_json() if r.value else {"ct": r.ct, "ok": False, "error": r.error} for r in results])
    else:
        con = _console()
        for r in results:
            if not r.ok or r.value is None:
                con.print(f"{r.ct:<12} [red]FAILED[/red] {r.error}")
                continue
            res = r.value
            con.print(f"{r.ct:<12} {res.summary()}")
            if dry_run or len(cts) == 1:
                for p in res.plan:
                    if p.action != "same" or dry_run:
                        con.print(f"  {p.action:<7} {p.dest}  {p.want[:12]}" + (f" (was {p.have[:12]})" if p.have
                                                                               and p.have != p.want else ""))
            if dry_run:
                con.print("  commands (run on the operator's machine; stdin is the agent source + bundle):")
                for c in res.commands:
                    con.print(f"    {c}", soft_wrap=True, markup=False)
    raise typer.Exit(worst(results))


def _render_check(checks: list[Any]) -> None:
    if OPTS.json:
        _out([{"ct": r.ct, "ok": r.ok, "error": r.error,
               "files": [p.__dict__ for p in (r.value or [])]} for r in checks])
        return
    con = _console()
    for r in checks:
        if not r.ok:
            con.print(f"{r.ct:<12} [red]FAILED[/red] {r.error}")
            continue
        bad = [p for p in r.value if p.action != "same"]
        con.print(f"{r.ct:<12} " + ("no drift" if not bad else f"[yellow]DRIFT[/yellow] in {len(bad)} file(s)"))
        for p in bad:
            con.print(f"  {p.action:<8} {p.dest}  deployed {p.want[:12]}, now {(p.have or 'absent')[:12]}")


# --- entry point ---------------------------------------------------------------------------------


def main() -> None:
    try:
        rc = app(standalone_mode=False)
    except CtlError as e:
        if OPTS.debug:
            import traceback

            traceback.print_exc()
        sys.stderr.write(f"ctl: error: {e}\n")
        sys.exit(int(e.exit_code))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("ctl: interrupted\n")
        sys.exit(130)
    except Exception as e:  # click usage errors and the like
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(int(ExitCode.USAGE))
        if isinstance(e, click.exceptions.Abort):
            sys.exit(1)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
