"""`ctl inventory` and `ctl ping`: what the inventory names, and whether each container answers."""

from __future__ import annotations

import typer

from controller.cli import names as _c
from controller.cli.app import (
    OPTS,
    _console,
    _esc,
    _inv,
    _out,
    _registry,
    _table,
    _warn,
    app,
    session,
    targets_argument,
)

inventory_app = typer.Typer(help="List hosts and containers of the inventory; `discover` reads them from PVE.",
                            invoke_without_command=True)
app.add_typer(inventory_app, name="inventory")


@inventory_app.callback()
def inventory_cmd(ctx: typer.Context) -> None:
    """List hosts and containers of the inventory (`ctl inventory discover --help`: read them from PVE)."""
    if ctx.invoked_subcommand is not None:
        return
    inv = _inv()
    m = inv.model
    if OPTS.json:
        from controller.schema import dump

        # keys: each container's identity in the registry (a `local` target's includes its root)
        _out({"path": str(inv.path), **dump(m), "keys": {n: inv.container(n).key for n in m.containers}})
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
    if m.jobs:
        _table("jobs (runs across several containers)", ["job", "nodes", "rendezvous", "nproc/node"],
               [[name, ", ".join(j.nodes), inv.job(name).rdzv_endpoint, j.nproc_per_node]
                for name, j in m.jobs.items()])


@app.command("ping")
def ping_cmd(containers: list[str] = targets_argument()) -> None:
    """Reach ctl's agent in each container as every command does, and time it.

    Its first answer (the connection, and pct exec unless the host session keeps a staying agent there) and the
    best round trip of a request."""
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
                how = "staying agent" if r.value["staying"] else "agent exec"
                con.print(f"{r.ct:<12} ok    rtt {r.value['rtt_ms']:.1f} ms (first {r.value['first_ms']:.1f} ms; "
                          f"{how}, python {_esc(str(r.value['python']))})")
            else:
                con.print(f"{r.ct:<12} [red]FAIL[/red]  {_esc(r.error)}")
    raise typer.Exit(worst(results))


@inventory_app.command("discover")
def discover_cmd(
    api: str = typer.Option(None, "--api", help="https://HOST:8006 of any node of the cluster."),
    token_id: str = typer.Option(None, "--token-id", help="USER@REALM!TOKENID (the secret: --token-env)."),
    token_env: str = typer.Option("PVE_TOKEN", "--token-env", help="Variable holding the token's secret."),
    ca: str = typer.Option(None, "--ca", help="CA bundle that signed the API's certificate (default: system CAs)."),
    host: str = typer.Option(None, "--host", help="Use the `api:` of this inventory host instead of --api.",
                             autocompletion=_c.hosts),
    diff: bool = typer.Option(False, "--diff", help="Show what differs from the inventory: added, removed, "
                              "moved to another node, GPUs changed."),
    write: bool = typer.Option(False, "--write", help="Merge into the inventory file (comments, order and "
                               "hand-written keys kept)."),
    prune: bool = typer.Option(False, "--prune", help="With --write: also drop containers gone from the cluster "
                               "that have runs in the registry."),
) -> None:
    """Read nodes, containers and GPU passthrough from the PVE API; print the inventory it would write."""
    from pathlib import Path

    from controller import settings
    from controller.commands.discover import discover_via, plan
    from controller.commands.discover import write as write_plan
    from controller.errors import InputError
    from controller.inventory import ApiSpec
    from controller.schema import SchemaError, build

    path = Path(settings.inventory_path(OPTS.inventory))
    base_dir = path.parent
    if host is not None:
        if api or token_id:
            raise InputError("give either --host or --api/--token-id, not both")
        h = _inv().model.hosts.get(host)
        if h is None or h.api is None:
            raise InputError(f"host {host!r} has no `api:` section in {path}")
        spec = h.api
    else:
        if not api or not token_id:
            raise InputError("give --api URL and --token-id USER@REALM!TOKENID (or --host NAME)")
        try:
            spec = build(ApiSpec, {"url": api, "node": "", "token_id": token_id, "token_secret_env": token_env,
                                   "ca_file": ca})
        except SchemaError as e:
            flag = {"url": "--api", "token_id": "--token-id", "token_secret_env": "--token-env"}.get(e.loc[0], "--ca")
            raise InputError(f"{flag}: {e.message}") from None
        base_dir = Path.cwd()
    found, ca_file = discover_via(spec, base_dir)
    new_api: dict[str, object] = {"url": spec.url, "token_id": spec.token_id, "token_secret_env": spec.token_secret_env,
                                  "ca_file": spec.ca_file if host is not None else ca_file}
    if not spec.verify:
        new_api["verify"] = False

    def has_runs(ct: str) -> bool:
        return bool(_registry().runs(ct, limit=1))

    p = plan(path, found, api_spec=new_api, prune=prune, has_runs=has_runs)
    if write:
        write_plan(p)
    _warn(found.errors)
    if p.kept:
        _warn([f"{ct} is no longer in the cluster but has runs in the registry: kept (--prune drops it)"
               for ct in p.kept])
    if OPTS.json:
        _out({**found.to_json(), **p.to_json(), "written": write})
        return
    con = _console()
    if diff or write:
        if not p.changes:
            con.print(f"{path}: up to date with {spec.url}", markup=False)
        for ch in p.changes:
            con.print(ch.describe(), markup=False)
        if write:
            con.print(f"wrote {path}" + (f" (dropped: {', '.join(p.dropped)})" if p.dropped else ""), markup=False)
        return
    _table(f"containers ({spec.url}, {found.requests} requests)", ["vmid", "node", "name", "status", "gpus_seen"],
           [[c.vmid, c.node, c.name + (" (template)" if c.template else ""), c.status,
             ",".join(map(str, c.gpus_seen)) or "-"] for c in found.containers])
    con.print(f"# {path} as --write would leave it", markup=False)
    con.print(p.text, markup=False, end="")
