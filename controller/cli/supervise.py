"""`ctl supervise` (watch, notify, restart) and `ctl events` (what it saw and did)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from controller import settings as ctl_settings
from controller.cli import names as _c
from controller.cli.app import (
    OPTS,
    _console,
    _inv,
    _out,
    _registry,
    _seconds,
    _warn,
    app,
    examples,
    session,
    targets_argument,
)
from controller.errors import InputError

if TYPE_CHECKING:
    from controller.core.supervision import Event


@app.command("supervise", epilog=examples(
    'ctl supervise --restart on-failure:3 --notify https://ops.example/hooks/ctl',
    "ctl supervise pair --interval 1m  # only this job's runs",
    'ctl supervise --once           # one poll, then exit (cron)',
    'ctl supervise --restart on-failure:3 --unit > ~/.config/systemd/user/ctl-supervise.service',
))
def supervise_cmd(
    targets: list[str] = targets_argument("Containers or groups to watch (default: all)."),
    interval: str | None = typer.Option(None, "--interval", help="Between polls (default: runs.supervise.interval, "
                                                                  "30s)."),
    restart: str | None = typer.Option(None, "--restart", help="no | on-failure[:N] | always[:N] (N restarts per "
                                                                "lineage; default: runs.supervise.restart, no)."),
    notify: list[str] = typer.Option(None, "--notify", help="https://... (signed JSON), slack:https://..., or "
                                                            "cmd:PROGRAM (JSON on stdin); repeatable."),
    backoff: str | None = typer.Option(None, "--backoff", help="Wait before a relaunch, doubling per restart."),
    stall_after: str | None = typer.Option(None, "--stall-after", help="STALLED when a log is quiet this long."),
    standby: bool = typer.Option(False, "--standby", help="If another supervisor holds the lease, wait and take "
                                                          "over when it expires."),
    once: bool = typer.Option(False, "--once", help="One poll, then exit (cron, tests)."),
    unit: bool = typer.Option(False, "--unit", help="Print a systemd user unit that runs this command; change "
                                                    "nothing."),
    allow_http_loopback: bool = typer.Option(False, "--allow-http-loopback", help="Let an http:// sink on "
                                             "127.0.0.1 or ::1 be used (sinks are https:// otherwise)."),
) -> None:
    """Watch every live run: verdict changes become events (`ctl events`) sent to the sinks.

    With a restart policy a CRASHED or STALLED run is relaunched as the next of its series from its last
    complete checkpoint. Ctrl-C stops the supervisor; the runs keep training."""
    if unit:
        _print_unit()
        return
    from controller.commands.supervise import Settings, Supervisor
    from controller.core.supervision import Policy, Sink

    inv = _inv()
    spec = inv.model.runs.supervise
    configured = ctl_settings.notify_sinks(notify)  # --notify > CTL_NOTIFY > config `notify`; else the inventory's
    sinks = tuple(Sink.parse(s, allow_http_loopback=allow_http_loopback, lookup=ctl_settings.secret_lookup)
                  for s in (spec.notify if configured is None else configured))
    if any(s.kind == "slack" and s.source is None for s in sinks):
        _warn([f"a Slack URL given as is sits in the process list and the unit file; `--notify slack:env:NAME` "
               f"reads it from NAME (the environment or {ctl_settings.supervise_env_path()}, 0600)"])
    secret_env = spec.notify_secret_env
    secret = os.environ.get(secret_env)
    if any(s.kind == "webhook" for s in sinks) and not secret:
        raise InputError(f"webhook notifications are signed: set {secret_env} (runs.supervise.notify_secret_env in "
                         f"{inv.path}) to the shared secret")
    settings = Settings(
        interval_s=_seconds(interval or spec.interval, "--interval"),
        policy=Policy.parse(restart or spec.restart, spec.max_restarts),
        backoff_s=_seconds(backoff or spec.backoff, "--backoff"),
        stall_after_s=_seconds(stall_after or spec.stall_after, "--stall-after"),
        slow_ratio=spec.slow_ratio, sinks=sinks, secret=secret.encode() if secret else None)
    cts = inv.select(targets or [])
    reg = _registry()
    con = _console()

    def on_event(ev: Event) -> None:
        if OPTS.json:
            import json

            sys.stdout.write(json.dumps(ev.doc(), default=str) + "\n")
            sys.stdout.flush()
        else:
            con.print(f"{time.strftime('%H:%M:%S')} {ev.summary}" + (f"  -> {ev.action}" if ev.action not in
                                                                       ("none", "logged") else ""), markup=False)

    sup = Supervisor(inv, reg, settings, cts, lambda: session(inv), on_event=on_event)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        gone = sup.acquire(standby=standby, stop=stop)
        if gone is not None:
            sys.stderr.write(f"ctl: took over the supervisor lease of {gone}: that process is gone\n")
        if not OPTS.json:
            con.print(f"supervising {', '.join(c.name for c in cts)} every {settings.interval_s:.0f}s "
                      f"({settings.policy.describe()}; {len(sinks)} sink(s)); Ctrl-C stops watching, runs keep "
                      "training", markup=False)
        if once:
            sup.poll()
        else:
            def skipped(why: str) -> None:
                sys.stderr.write(f"ctl: {why}\n")

            sup.run(stop, on_skip=skipped)
    except KeyboardInterrupt:
        if not OPTS.json:
            con.print("supervisor stopped; the runs keep training", markup=False)
    finally:
        sup.release()


def _print_unit() -> None:
    """A systemd user unit: `ctl supervise --unit > ~/.config/systemd/user/ctl-supervise.service`."""
    args = [a for a in sys.argv[1:] if a != "--unit"]
    inv = OPTS.inventory or os.environ.get("CTL_INVENTORY") or "inventory.yaml"
    if "-i" not in args and "--inventory" not in args:
        args = ["-i", str(Path(inv).resolve()), *args]
    if any(re.match(r"(--notify=)?slack:https?://", a) for a in args):
        _warn(["this unit holds a Slack URL (a secret) in clear: put it in "
               f"{ctl_settings.supervise_env_path()} (0600) as NAME=URL and use `--notify slack:env:NAME`"])
    cmd = _systemd(shlex.join([sys.executable, "-m", "controller", *args]))
    state = os.environ.get("CTL_STATE_DIR")
    sys.stdout.write(
        "[Unit]\n"
        "Description=ctl supervise: watch training runs, notify, restart from checkpoints\n"
        "After=network-online.target\n\n"
        "[Service]\n"
        f"ExecStart={cmd}\n"
        f"WorkingDirectory={_systemd(str(Path.cwd()))}\n"
        + (f"Environment={_systemd(shlex.quote(f'CTL_STATE_DIR={state}'))}\n" if state else "")
        + "# Secrets (the webhook key, PVE tokens) come from a file only you can read:\n"
          "EnvironmentFile=-%h/.config/ctl/supervise.env\n"
          "Restart=on-failure\nRestartSec=10\n\n"
          "[Install]\nWantedBy=default.target\n")


def _systemd(text: str) -> str:
    """A value as systemd reads it literally: `%` starts a specifier and `$` a variable there, so both are
    doubled (a URL's %2F, a `$` in a path)."""
    return text.replace("%", "%%").replace("$", "$$")


@app.command("events")
def events_cmd(
    run: str | None = typer.Argument(None, autocompletion=_c.runs, help="Only this run (NAME, CT/NAME or #ID)."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new events (Ctrl-C ends)."),
    limit: int = typer.Option(50, "-n", "--limit", help="How many of the newest events to show first."),
) -> None:
    """What `ctl supervise` saw and did: verdict changes, restarts, give-ups, failed notifications."""
    reg = _registry()
    run_id = reg.find_run(run).id if run else None
    every = reg.events(run_id, limit=1_000_000)
    shown = every[-limit:] if limit > 0 else []
    last = every[-1]["id"] if every else 0
    if OPTS.json and not follow:
        _out(shown)
        return
    con = _console()

    def emit(evs: list[dict[str, Any]]) -> None:
        for e in evs:
            if OPTS.json:  # with --follow: one JSON document a line
                import json

                sys.stdout.write(json.dumps(e, default=str) + "\n")
            else:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e.get("time", 0))))
                con.print(f"{when}  {e['summary']}" + (f"  -> {e['action']}" if e.get("action") not in
                                                        (None, "none", "logged") else ""), markup=False)
        sys.stdout.flush()

    emit(shown)
    if not every and not follow and not OPTS.json:
        con.print("no events recorded" + (f" for {run}" if run else "") + " (`ctl supervise` records them)")
    try:
        while follow:
            time.sleep(1.0)
            new = reg.events(run_id, after=last)
            if new:
                last = new[-1]["id"]
                emit(new)
    except KeyboardInterrupt:
        pass

