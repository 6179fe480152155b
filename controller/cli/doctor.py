"""`ctl doctor`: each container's GPU checks, one line each, and the exact lines that fix a failure."""

from __future__ import annotations

import typer

from controller.cli.app import OPTS, _console, _esc, _inv, _out, app, examples, session, targets_argument

_MARK = {"ok": "ok  ", "warn": "[yellow]warn[/yellow]", "FAIL": "[red]FAIL[/red]"}


@app.command("doctor", epilog=examples(
    "ctl doctor ct200         # one container's checks",
    "ctl doctor               # every container of the inventory",
    "ctl doctor pair --json   # a job's nodes, as JSON",
))
def doctor_cmd(containers: list[str] = targets_argument("Containers, groups or jobs (default: all).")) -> None:
    """Say why a container's GPUs do not work, and print the exact lines that fix it.

    Checks the host's driver, the device nodes and the container's config, user space against the driver,
    torch's CUDA, the GPU split, /dev/shm and NCCL. Read-only. Exit code 14 when a check failed."""
    from controller.commands.doctor import doctor, exit_code

    inv = _inv()
    cts = inv.select(containers or [])
    with session(inv) as pool:
        results = doctor(inv, pool, cts)
    if OPTS.json:
        _out([r.value.to_json() if r.value is not None else {"ct": r.ct, "ok": False, "error": r.error}
              for r in results])
        raise typer.Exit(exit_code(results))
    con = _console()
    for r in results:
        if r.value is None:
            said = str(r.error)  # names the container itself when it comes from its transport
            con.print(f"[red]FAIL[/red] {_esc(said if said.startswith(r.ct) else f'{r.ct}: {said}')}")
            continue
        con.print(_esc(r.value.label))
        width = max(len(c.name) for c in r.value.checks)
        for c in r.value.checks:
            con.print(f"  {_MARK.get(c.status, c.status)}  {_esc(c.name):<{width}}  {_esc(c.seen)}")
            for f in c.fixes:
                con.print(f"        fix ({_esc(f.where)}): {_esc(f.lead)}")
                for line in f.lines:
                    con.print(f"          {_esc(line)}")
    raise typer.Exit(exit_code(results))
