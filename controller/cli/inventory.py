"""`ctl inventory` and `ctl ping`: what the inventory names, and whether each container answers."""

from __future__ import annotations

import typer

from controller.cli.app import OPTS, _console, _esc, _inv, _out, _table, app, session


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
    from controller.commands.fanout import ping, worst

    inv = _inv()
    with session(inv) as pool:
        results = ping(pool, inv.select(containers or []))
    if OPTS.json:
        _out([{"ct": r.ct, "ok": r.ok, "error": r.error, **(r.value or {})} for r in results])
    else:
        con = _console()
        for r in results:
            if r.ok and r.value:
                con.print(f"{r.ct:<12} ok    rtt {r.value['rtt_ms']:.1f} ms (first {r.value['first_ms']:.1f} ms)")
            else:
                con.print(f"{r.ct:<12} [red]FAIL[/red]  {_esc(r.error)}")
    raise typer.Exit(worst(results))
