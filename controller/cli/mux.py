"""`ctl mux status|stop`: the user's persistent host sessions (CTL_PERSIST, controller/transport/mux/).

A session is started on demand by the first command that needs a host while CTL_PERSIST, or that host's
`persist:` in the inventory, is set; these commands only list and stop them. They read no inventory.
"""

from __future__ import annotations

import time

import typer

from controller.cli import app as _cli
from controller.cli import complete as _c

app: typer.Typer = _cli.app
OPTS = _cli.OPTS

mux_app = typer.Typer(help="Persistent host sessions (CTL_PERSIST=SECONDS or a host's persist:): list or stop them.",
                      no_args_is_help=True)
app.add_typer(mux_app, name="mux")


@mux_app.command("status")
def status_cmd() -> None:
    """List this user's sessions: host, address, pid, idle timeout, age, whether it answers."""
    from controller.transport import mux

    docs = mux.sessions()
    if OPTS.json:
        _cli._out(docs)
        return
    now = time.time()
    _cli._table(f"persistent host sessions ({mux.mux_dir()})", ["host", "address", "pid", "idle", "age", "state"],
                [[d.get("host"), f"{d.get('user')}@{d.get('address')}:{d.get('port')}", d.get("pid"),
                  f"{d.get('idle')}s", f"{now - float(d.get('started', now)):.0f}s",
                  "live" if d["live"] else "gone"] for d in docs])


@mux_app.command("stop")
def stop_cmd(host: str = typer.Argument(None, autocompletion=_c.hosts,
                                        help="Only the session of this host (default: all).")) -> None:
    """Stop sessions: each closes its relay (children see the end of their stdin) and its SSH connection."""
    from controller.transport import mux

    stopped = mux.stop(host)
    if OPTS.json:
        _cli._out([{"host": d.get("host"), "pid": d.get("pid")} for d in stopped])
        return
    con = _cli._console()
    for d in stopped:
        con.print(f"{d.get('host')}: stopped session (pid {d.get('pid')})")
    if not stopped:
        con.print("no live session" + (f" for {host}" if host else ""))
