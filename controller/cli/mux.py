"""`ctl mux status|stop`: the user's persistent host sessions (controller/transport/mux/).

A session is started on demand by the first command that needs a host, unless CTL_PERSIST=0 (or the config
file's `persist: 0`, or the host's `persist: 0` in the inventory) turns them off; these commands only list and
stop the sessions of the state directory. They read no inventory.
"""

from __future__ import annotations

import time
from typing import Any

import typer

from controller.cli import app as _cli
from controller.cli import names as _c

app: typer.Typer = _cli.app
OPTS = _cli.OPTS

mux_app = typer.Typer(help="Persistent host sessions (on by default, 60 idle seconds; CTL_PERSIST=0 turns them "
                      "off): list or stop them.", no_args_is_help=True)
app.add_typer(mux_app, name="mux")


@mux_app.command("status")
def status_cmd() -> None:
    """List this user's persistent host sessions, then the command server.

    Host, address, pid, idle timeout, age, whether it answers, and the agents it keeps in containers (requests
    they answered); then the command server. With --json: {"sessions": [...], "servers": [...],
    "servers_failed": [...]}."""
    from controller.commands import sessions
    from controller.launch import served

    where, docs = sessions.listed()
    if OPTS.json:
        _cli._out({"sessions": docs, "servers": served.servers(), "servers_failed": served.failed_servers()})
        return
    now = time.time()
    _cli._table(f"persistent host sessions ({where})",
                ["host", "address", "pid", "idle", "age", "state", "agents", "socket"],
                [[d.get("host"), f"{d.get('user')}@{d.get('address')}:{d.get('port')}", d.get("pid"),
                  f"{d.get('idle')}s", f"{now - float(d.get('started', now)):.0f}s",
                  "live" if d["live"] else "gone", _agents_cell(d.get("agents")), d.get("socket")] for d in docs])
    con = _cli._console()
    for d in served.servers():
        con.print(f"command server: pid {d['pid']}, {d['served']} commands served, {d['running']} running, "
                  f"idle {d['idle_for']:.0f}s of {d['idle']:.0f}s, age {now - float(d['started']):.0f}s "
                  f"({d['socket']})", markup=False)
    for d in served.failed_servers():
        con.print(f"command server: could not start ({d['why']}); commands run in a process of their own. "
                  f"Its log: {d['log']}; `ctl mux stop` lets the next command try again", markup=False)


def _agents_cell(agents: list[dict[str, Any]] | None) -> str:
    if agents is None:
        return "-"
    served = sum(a["requests"] for a in agents)
    return f"{len(agents)} ({served} requests)"


@mux_app.command("stop")
def stop_cmd(host: str = typer.Argument(None, autocompletion=_c.hosts,
                                        help="Only the session of this host (default: all)."),
             grace: float = typer.Option(30.0, "--grace", min=0, help="Seconds the commands still using a session "
                                         "get to finish before it ends them (0: end them now).")) -> None:
    """Stop sessions: each takes no new command, lets the running ones finish (up to --grace), then closes its
    relay (children see the end of their stdin) and its SSH connection."""
    from controller.commands import sessions

    stopped = sessions.stop(host, grace=grace)
    servers: list[dict[str, Any]] = []
    if host is None:
        from controller.launch import served

        servers = served.stop_servers()  # the next command runs in a process of its own, as the first did
    if OPTS.json:
        _cli._out({"sessions": [{"host": d.get("host"), "pid": d.get("pid")} for d in stopped],
                   "servers": [{"pid": d["pid"], "running": d["running"]} for d in servers]})
        return
    con = _cli._console()
    for d in stopped:
        con.print(f"{d.get('host')}: stopped session (pid {d.get('pid')})")
    for d in servers:
        con.print(f"command server: stopping (pid {d['pid']}) once its {d['running']} running commands end"
                  if d["running"] else f"command server: stopped (pid {d['pid']})")
    if not stopped and not servers:
        con.print("no live session" + (f" for {host}" if host else ""))
