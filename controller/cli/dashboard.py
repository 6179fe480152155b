"""`ctl dashboard`: the runs of `ctl status`, live in a browser (controller/web serves commands.dashboard's Board)."""

from __future__ import annotations

import signal
import sys
import threading

import typer

from controller.cli.app import OPTS, _console, _inv, _out, _registry, _seconds, app, session, targets_argument
from controller.errors import InputError


@app.command("dashboard")
def dashboard_cmd(
    targets: list[str] = targets_argument(),
    port: int = typer.Option(8765, "--port", help="Port to serve on (0: any free one)."),
    bind: str = typer.Option("127.0.0.1", "--bind", help="Address to serve on (default: loopback only)."),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow --bind to a non-loopback address: anyone "
                                                                    "who reaches it with the URL sees the runs."),
    interval: str = typer.Option("10s", "--interval", help="Between two polls of one host."),
    deadline: str = typer.Option("15s", "--deadline", help="A host whose poll takes longer shows its runs "
                                                           "UNREACHABLE (the poll goes on, within its own deadline)."),
    slow_ratio: float = typer.Option(0.8, "--slow-ratio", help="SLOW below this fraction of the baseline's tok/s."),
    stall_after: str = typer.Option("10m", "--stall-after", help="STALLED when the log is quiet this long."),
    log_lines: int = typer.Option(30, "--log-lines", help="Last lines of each run's log to show (0-5000; read "
                                                          "from at most the log's last MiB)."),
) -> None:
    """Serve a local web page of the live runs, updated as they train.

    Step, loss, tok/s against the baseline, ETA, verdict, trend, the last log lines and the events. Prints its
    URL once (with a token that every request needs); Ctrl-C stops it. Read-only."""
    from controller.commands.dashboard import Board, Settings
    from controller.web.server import Dashboard

    if not 0.0 < slow_ratio <= 1.0:
        raise InputError(f"--slow-ratio must be in (0, 1], got {slow_ratio}")
    if not 0 <= log_lines <= 5000:
        raise InputError(f"--log-lines must be from 0 to 5000, got {log_lines}")
    settings = Settings(interval_s=_seconds(interval, "--interval"), deadline_s=_seconds(deadline, "--deadline"),
                        slow_ratio=slow_ratio, stall_after_s=_seconds(stall_after, "--stall-after"),
                        log_lines=log_lines)
    inv = _inv()
    cts = inv.select(targets or [])
    board = Board(inv, _registry(), cts, lambda: session(inv), settings)
    web = Dashboard(board, bind, port, allow_remote=allow_remote)
    stop = threading.Event()

    def _term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    board.run(stop)
    try:  # Ctrl-C stops it from the moment it is up, even before its address is printed: exit 0
        if OPTS.json:
            _out({"url": web.url, "port": web.port, "containers": [c.name for c in cts]})
        else:
            con = _console()
            con.print(f"ctl dashboard: {web.url}", markup=False)
            con.print(f"  {len(cts)} container(s) on {len(board.hosts)} host(s), polled every "
                      f"{settings.interval_s:g}s; the token in the URL is needed by every request; Ctrl-C stops",
                      markup=False)
            if web.remote:
                con.print(f"  [yellow]serving on {bind}, not only this machine (--allow-remote): plain HTTP, the "
                          "token is all that protects the page[/yellow]")
        sys.stdout.flush()
        web.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        web.close()
