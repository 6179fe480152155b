"""The `ctl` command line: thin typer commands that call one function and render its result.

Every CtlError is caught in `main` and printed as one line; `--debug` shows the traceback.
Heavy modules (paramiko, jinja2, matplotlib) are imported inside commands, so that
`ctl --help` stays fast. Shared plumbing (app, options, output) lives in cli_base.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import typer

from controller.cli.app import (
    OPTS,
    _ago,
    _console,
    _inv,
    _note,
    _one_ct,
    _out,
    _refresh_all,
    _registry,
    _run_and_ct,
    _session,
    _table,
    app,
)
from controller.errors import CtlError, ExitCode

__all__ = ["OPTS", "app", "main"]


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
    from controller.commands import deploy
    from controller.commands.fanout import fanout, worst
    from controller.transport.pool import Pool

    if sum([dry_run, check, rollback]) > 1:
        raise CtlError("choose one of --dry-run, --check, --rollback")
    inv = _inv()
    cts = inv.select(containers or [])
    reg = _registry()
    with Pool(inv, note=_note) as pool:  # fanout shares one exec among the containers of a host
        if check:
            checks = fanout(pool, cts, lambda ct, t: deploy.check(inv, ct, t, reg))
            _render_check(checks)
            drift = any(r.ok and any(p.action != "same" for p in (r.value or [])) for r in checks)
            raise typer.Exit(worst(checks) or (int(ExitCode.DRIFT) if drift else 0))
        if rollback:
            results = fanout(pool, cts, lambda ct, t: deploy.rollback(ct, t, reg))
        else:
            with _TransferProgress(enabled=not OPTS.json and sys.stderr.isatty()) as progress:
                results = fanout(pool, cts, lambda ct, t: deploy.deploy(
                    inv, ct, t, reg, dry_run=dry_run, allow_dirty=allow_dirty, progress=progress))
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


class _TransferProgress:
    """Progress bars (on stderr) for transfers that last over a second; silent for quick ones."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.bar: Any = None
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> _TransferProgress | None:
        return self if self.enabled else None

    def __call__(self, ct: str, sent: int, total: int) -> None:
        if self.bar is None:
            if time.monotonic() - self.t0 < 1.0:
                return
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self.bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
        if ct not in self.tasks:
            self.tasks[ct] = self.bar.add_task(ct, total=total)
        self.bar.update(self.tasks[ct], completed=sent)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


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


# --- runs ----------------------------------------------------------------------------------------


@app.command("launch")
def launch_cmd(
    container: str = typer.Argument(..., help="The container to run in."),
    run: str | None = typer.Option(None, "--run", help="Run name (default: next of the inventory's series)."),
    allow_drift: bool = typer.Option(False, "--allow-drift", help="Launch although deployed files differ from pins."),
    force: bool = typer.Option(False, "--force", help="Override GPU-busy and disk checks (never the log clobber)."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Follow the log after the launch (like ctl tail -f)."),
    allow_env_mismatch: bool = typer.Option(
        False, "--allow-env-mismatch", help="Launch although the environment differs from its lock."),
) -> None:
    """Preflight, then start the run in a detached tmux session with its own, never-reused log."""
    from controller.commands import environment, runs

    reg = _registry()
    with _session(container) as (inv, ct, pool):
        t = pool.container(ct)
        rec, checks = runs.launch(inv, ct, t, reg, run, allow_drift=allow_drift, force=force,
                                  env_probe=lambda: environment.probe_for_launch(inv, ct, t,
                                                                            allow_mismatch=allow_env_mismatch))
        if OPTS.json and not follow:
            _out({"run": rec.to_json(), "checks": [c.__dict__ for c in checks]})
            return
        con = _console()
        for c in checks:
            mark = "ok" if c.ok else "[yellow]FORCED[/yellow]"
            con.print(f"  {c.name:<10} {mark:<6} {c.detail}")
        con.print(f"launched {rec.name} on {ct.name}: tmux session {rec.session}, log {rec.log_path}")
        if follow:
            raise typer.Exit(_follow(t, reg, rec, -1, True))


def _follow(t: Any, reg: Any, rec: Any, lines: int, follow: bool) -> int:
    from controller.commands import runs
    from controller.core import metrics

    con = _console()
    live = follow and sys.stdout.isatty() and not OPTS.json
    status = con.status(f"following {rec.ct}/{rec.name}") if live else None

    def emit(line: str) -> None:
        con.print(line, markup=False)
        if status is not None:  # the latest metric line, as a status line under the log
            p = metrics.parse_line(line)
            if isinstance(p, metrics.MetricPoint):
                status.update(
                    f"{rec.name}  step {p.step}  loss {p.loss if p.loss is not None else '-'}  "
                    f"{metrics.format_rate(p.tok_s)} tok/s  ETA {metrics.format_eta(p.eta_s)}"
                    + (f"  q_hs={list(p.q_hs)}" if p.q_hs is not None else ""))

    if status is not None:
        status.start()
    try:
        end = runs.follow(t, reg, rec, lines=lines, follow=follow, emit=emit, detect=metrics.detect_crash)
    finally:
        if status is not None:
            status.stop()
    if follow:
        if end.crash:
            con.print(f"[red]run {rec.name}: crash signature '{end.crash}' seen ({end.state})[/red]")
        elif end.state == "running":
            con.print(f"run {rec.name}: still running")
        else:
            con.print(f"run {rec.name}: {end.state}" + (f", exit status {end.exit_status}"
                                                        if end.exit_status is not None else ""))
    return end.exit_code


@app.command("tail")
def tail_cmd(
    container: str = typer.Argument(..., help="Container (its latest run) or a run as CT/NAME."),
    run: str | None = typer.Option(None, "--run", help="Run name (default: the container's latest run)."),
    lines: int = typer.Option(20, "-n", "--lines", help="Lines of history to show first."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Follow until the run ends or crashes."),
) -> None:
    """Show the run's log; with -f follow it until the run ends (exit status) or crashes (non-zero)."""
    from controller.transport.pool import Pool

    inv = _inv()
    reg = _registry()
    if "/" in container:
        rec, ct = _run_and_ct(inv, reg, container)
    else:
        ct = _one_ct(inv, container)
        if run:
            rec = reg.find_run(f"{ct.name}/{run}")
        else:
            recs = reg.runs(ct.name, limit=1)
            if not recs:
                raise CtlError(f"{ct.name}: no runs recorded; `ctl launch {ct.name}` starts one")
            rec = recs[0]
    with Pool(inv) as pool:
        raise typer.Exit(_follow(pool.container(ct), reg, rec, lines, follow))


@app.command("runs")
def runs_cmd(
    container: str | None = typer.Argument(None, help="Only runs of this container."),
    limit: int = typer.Option(30, "-n", "--limit"),
    no_refresh: bool = typer.Option(False, "--no-refresh", help="Do not ask containers about live runs."),
) -> None:
    """List runs from the registry (live ones are refreshed from their containers)."""
    inv = _inv()
    reg = _registry()
    recs = reg.runs(container, limit=limit)
    if not no_refresh:
        recs = _refresh_all(inv, reg, recs)
    if OPTS.json:
        _out([r.to_json() for r in recs])
        return
    rows = [[r.ct, r.name + (" *" if r.good else ""), r.state, "" if r.exit_status is None else r.exit_status,
             _ago(r.started or r.created), (r.commit_sha or "-")[:10] + ("+dirty" if r.dirty else ""), r.log_path]
            for r in recs]
    _table(None, ["ct", "run", "state", "exit", "started", "commit", "log"], rows)
    if any(r.good for r in recs):
        _console().print("* marked good (baseline)")


@app.command("show")
def show_cmd(run: str = typer.Argument(..., help="Run as NAME, CT/NAME or #ID.")) -> None:
    """Everything recorded about one run."""
    reg = _registry()
    rec = reg.find_run(run)
    data = rec.to_json()
    if OPTS.json:
        _out(data)
        return
    con = _console()
    for k in ("ct", "name", "state", "exit_status", "crash", "host", "session", "log_path", "run_dir", "commit_sha",
              "dirty", "env_fingerprint", "good", "note"):
        con.print(f"{k:<16} {data[k]}", markup=False)
    con.print(f"{'created':<16} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec.created))}")
    con.print("files:")
    for dest, sha in sorted(rec.files.items()):
        con.print(f"  {sha[:16]}  {dest}", markup=False)
    con.print(f"command:\n  {rec.command}", markup=False)


@app.command("stop")
def stop_cmd(
    run: str = typer.Argument(..., help="Run as NAME, CT/NAME or #ID."),
    grace: float = typer.Option(30, "--grace", help="Seconds to wait after SIGINT before SIGTERM."),
) -> None:
    """SIGINT the training, wait, escalate, end its tmux session; the record says stopped."""
    from controller.commands import runs
    from controller.transport.pool import Pool

    inv = _inv()
    reg = _registry()
    rec, ct = _run_and_ct(inv, reg, run)
    with Pool(inv) as pool:
        t = pool.container(ct)
        rec = runs.refresh(inv, ct, t, reg, [rec])[0]
        rec = runs.stop(inv, ct, t, reg, rec, grace=grace)
    if OPTS.json:
        _out(rec.to_json())
    else:
        _console().print(f"{rec.ct}/{rec.name}: {rec.state} ({rec.note})")


@app.command("attach")
def attach_cmd(run: str = typer.Argument(..., help="Run as NAME, CT/NAME or #ID.")) -> None:
    """Attach to the run's tmux session interactively (ssh -t + pct exec; detach with C-b d)."""
    from controller.transport.local import LocalContainer
    from controller.transport.pct import PctContainer
    from controller.transport.pool import Pool
    from controller.transport.ssh import SshEndpoint

    inv = _inv()
    reg = _registry()
    rec, ct = _run_and_ct(inv, reg, run)
    tmux = ["tmux", "attach-session", "-t", "=" + str(rec.session)]
    with Pool(inv) as pool:
        t = pool.container(ct)
        if isinstance(t, PctContainer):
            argv = t.host.interactive_argv(t.exec_argv(tmux))
        elif isinstance(t, SshEndpoint):
            argv = t.interactive_argv(tmux)
        else:
            assert isinstance(t, LocalContainer)
            argv = tmux
    if OPTS.json:
        _out({"argv": argv})
        return
    os.execvp(argv[0], argv)  # noqa: S606 - replaces ctl with the interactive session


@app.command("diff")
def diff_cmd(
    run_a: str = typer.Argument(..., help="The run that worked (NAME, CT/NAME or #ID)."),
    run_b: str = typer.Argument(..., help="The run to compare with it."),
) -> None:
    """What changed between two runs: payload hashes, rendered scripts, template variables, environment."""
    from controller.core import rundiff

    reg = _registry()
    a, b = reg.find_run(run_a), reg.find_run(run_b)
    d = rundiff.diff(a, b)
    if OPTS.json:
        _out(d.to_json())
    else:
        _console().print(d.render(), markup=False)
    raise typer.Exit(0 if d.same else 1)


# Command groups kept in their own modules register themselves on `app` when imported.
from controller.cli import env as _cli_env  # noqa: E402,F401
from controller.cli import metrics as _cli_metrics  # noqa: E402,F401
from controller.cli import mux as _cli_mux  # noqa: E402,F401
from controller.cli import runbook as _cli_runbook  # noqa: E402,F401
from controller.cli import snapshot as _cli_snapshot  # noqa: E402,F401

# --- entry point ---------------------------------------------------------------------------------


def main() -> None:
    # Global flags are accepted anywhere on the line (`ctl deploy ct200 --json`), not only before the verb.
    argv = sys.argv[1:]
    head, sep, tail = (argv[: argv.index("--")], ["--"], argv[argv.index("--") + 1:]) if "--" in argv else (
        argv, [], [])
    for flag in ("--json", "--debug"):
        if flag in head[1:]:
            head = [a for a in head if a != flag]
            head.insert(0, flag)
    try:
        rc = app(args=head + sep + tail, prog_name="ctl", standalone_mode=False)
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
    except Exception as e:  # click's usage errors (typer vendors click, so match by shape)
        if callable(getattr(e, "show", None)) and hasattr(e, "exit_code"):
            e.show()  # type: ignore[attr-defined]
            sys.exit(int(ExitCode.USAGE))
        if type(e).__name__ == "Abort":
            sys.exit(1)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
