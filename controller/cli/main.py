"""The `ctl` command line: thin typer commands that call one commands.* function and render its result.

Every CtlError is caught in `main` and printed as one line; `--debug` shows the traceback. Start-up stays thin:
heavy modules (paramiko, jinja2, rich, pydantic, matplotlib) are imported inside commands, a command line imports
only the cli module of its verb (COMMANDS), and `ctl --help` prints the text typer renders for it (helptext.py,
kept equal to typer's by tests/test_cli_startup.py) without importing typer at all. The app, its global options
and the output helpers live in cli/app.py; each verb group in its own module, which registers its commands on
the app when imported.
"""

from __future__ import annotations

import importlib
import os
import sys

# verb -> the cli module that registers it (tests/test_cli_startup.py checks it against the modules).
COMMANDS: dict[str, str] = {
    "deploy": "deploy", "ping": "inventory", "inventory": "inventory",
    "mark-good": "metrics", "status": "metrics", "watch": "metrics", "plot": "metrics", "metrics": "metrics",
    "launch": "runs", "tail": "runs", "runs": "runs", "show": "runs", "stop": "runs", "attach": "runs",
    "diff": "runs", "rollback": "snapshot", "snapshot": "snapshot", "supervise": "supervise",
    "events": "supervise", "config": "config", "env": "env", "cache": "env", "mux": "mux", "runbook": "runbook",
    "store": "store",
}
MODULES = ("config", "deploy", "env", "inventory", "metrics", "mux", "runbook", "runs", "snapshot", "store",
           "supervise")  # in the order `ctl --help` lists their commands
_GLOBAL_VALUE = ("-i", "--inventory")  # global options that take a value
HELP_WIDTH = 80  # click renders help at min(terminal width, 80)


def verb(argv: list[str]) -> str | None:
    """The verb of a command line (its first word after the global options); None when there is none."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[i + 1] if i + 1 < len(argv) else None
        if a in _GLOBAL_VALUE:
            i += 2
            continue
        if not a.startswith("-"):
            return a
        i += 1
    return None


def load(argv: list[str]) -> None:
    """Register the commands this command line may run: its verb's module, or all (help, an unknown verb)."""
    v = verb(argv)
    wanted = [COMMANDS[v]] if v in COMMANDS and not {"--help", "--version"} & set(argv[:argv.index(v)]) else MODULES
    for m in wanted:
        importlib.import_module(f"controller.cli.{m}")


def _plain_help(argv: list[str]) -> bool:
    """`ctl --help` on a terminal at least as wide as click renders: the text typer would print, without typer."""
    if argv != ["--help"]:
        return False
    import shutil

    if shutil.get_terminal_size().columns < HELP_WIDTH:
        return False
    from controller.cli.helptext import TEXT

    sys.stdout.write(TEXT)
    return True


def render_help() -> str:
    """What typer prints for `ctl --help` on a terminal of HELP_WIDTH columns (the source of helptext.py)."""
    import subprocess

    code = ("import sys; from controller.cli.main import load; load(['--help']); from controller.cli.app import app; "
            "app(['--help'], prog_name='ctl')")
    env = {**os.environ, "COLUMNS": str(HELP_WIDTH), "PYTHONPATH": os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout


def main() -> None:
    # Global flags are accepted anywhere on the line (`ctl deploy ct200 --json`), not only before the verb.
    argv = sys.argv[1:]
    if _plain_help(argv):
        sys.exit(0)
    import typer

    from controller.cli.app import OPTS, app
    from controller.core.terminal import clean_line
    from controller.errors import CtlError, ExitCode

    head, sep, tail = (argv[: argv.index("--")], ["--"], argv[argv.index("--") + 1:]) if "--" in argv else (
        argv, [], [])
    for flag in ("--json", "--text", "--debug"):
        if flag in head[1:]:
            head = [a for a in head if a != flag]
            head.insert(0, flag)
    load(head + sep + tail)
    try:
        rc = app(args=head + sep + tail, prog_name="ctl", standalone_mode=False)
    except CtlError as e:
        if OPTS.debug:
            import traceback

            traceback.print_exc()
        sys.stderr.write(f"ctl: error: {clean_line(str(e))}\n")  # may quote a container's text: no escapes
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
