"""The `ctl` command line: thin typer commands that call one commands.* function and render its result.

Every CtlError is caught in `main` and printed as one line; `--debug` shows the traceback. Start-up stays thin:
heavy modules (paramiko, jinja2, rich, matplotlib) are imported inside commands, option values are converted
without typer's pydantic adapters (cli/coerce.py), a command line imports only the cli module of its verb
(COMMANDS), `ctl --help` prints the text typer renders for it (helptext.py, kept equal to typer's by
tests/test_cli_startup.py) without importing typer at all, and a shell's completion request (a TAB) is answered
by cli/complete.py before any of that is imported. The app, its global options and the
output helpers live in cli/app.py; each verb group in its own module, which registers its commands on the app
when imported (`load`, `load_app`).
"""

from __future__ import annotations

import importlib
import os
import sys

TYPE_CHECKING = False  # a TAB's answer (cli/complete.py) does not pay for importing typing
if TYPE_CHECKING:
    from typing import Any

__all__ = ["load_app", "main"]  # also `app` and `OPTS`, loaded on first use (__getattr__)

# verb -> the cli module that registers it (tests/test_cli_startup.py checks it against the modules).
COMMANDS: dict[str, str] = {
    "deploy": "deploy", "ping": "inventory", "inventory": "inventory",
    "mark-good": "metrics", "status": "metrics", "watch": "metrics", "plot": "metrics", "metrics": "metrics",
    "launch": "runs", "tail": "runs", "runs": "runs", "show": "runs", "stop": "runs", "attach": "runs",
    "diff": "runs", "export": "runs", "rollback": "snapshot", "snapshot": "snapshot", "supervise": "supervise",
    "events": "supervise", "config": "config", "env": "env", "cache": "env", "mux": "mux", "runbook": "runbook",
    "store": "store", "dashboard": "dashboard",
}
MODULES = ("config", "dashboard", "deploy", "env", "inventory", "metrics", "mux", "runbook", "runs", "snapshot",
           "store", "supervise")  # in the order `ctl --help` lists their commands
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


def load(argv: list[str]) -> Any:
    """Register the commands this command line may run: its verb's module, or all (help, an unknown verb).
    Returns the app."""
    v = verb(argv)
    if v in COMMANDS and not {"--help", "--version"} & set(argv[:argv.index(v)]):
        importlib.import_module(f"controller.cli.{COMMANDS[v]}")
        from controller.cli.app import app

        return app
    return load_app()


def load_app() -> Any:
    """The typer app with every verb group registered (each module registers its commands when imported)."""
    for m in MODULES:
        importlib.import_module(f"controller.cli.{m}")
    from controller.cli.app import app

    return app


def __getattr__(name: str) -> Any:
    # `from controller.cli.main import app, OPTS` keeps working without making every `import` pay for typer.
    if name == "app":
        return load_app()
    if name == "OPTS":
        from controller.cli.app import OPTS

        return OPTS
    raise AttributeError(name)


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

    code = "from controller.cli.main import load_app; load_app()(['--help'], prog_name='ctl')"
    env = {**os.environ, "COLUMNS": str(HELP_WIDTH), "PYTHONPATH": os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout


def main() -> None:
    if os.environ.get("_CTL_COMPLETE", "").startswith("complete_"):
        # A TAB in the shell: answered before typer, pydantic and the commands are imported (cli/complete.py).
        from controller.cli.complete import answer

        sys.exit(answer())
    if _plain_help(sys.argv[1:]):
        sys.exit(0)
    from controller.cli import served

    code = served.run(sys.argv[1:])  # the user's command server runs it, when there is one (cli/served.py)
    if code is not None:
        served.exit_as(code)
    try:
        run_here()
    finally:
        served.start_server(sys.argv[1:])  # none answered: one for the next commands (unless sessions are off)


def run_here() -> None:
    """Run the command line in this process (also what the command server's forked child runs)."""
    from controller.cli.early import spare, start

    spare(sys.argv[1:])  # a session process for the hosts not yet known imports paramiko while this one reads
    _completion_shell(sys.argv[1:])
    start(sys.argv[1:])  # the hosts' sessions come up while typer and the command load
    _main()


SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


def _completion_shell(argv: list[str]) -> None:
    """`ctl --install-completion [SHELL]` (and --show-completion): typer detects the shell from the process tree,
    which finds none under a CI runner, cron or an exec'ing wrapper, and then ignores a shell named after the flag.
    A named shell is used as given; an undetectable one is asked for in one line."""
    if not argv or argv[0] not in ("--install-completion", "--show-completion") or len(argv) > 2:
        return
    if len(argv) == 2:
        if argv[1] not in SHELLS:
            sys.stderr.write(f"ctl: error: {argv[0]} {argv[1]!r}: not a shell ctl completes ({', '.join(SHELLS)})\n")
            sys.exit(2)
        os.environ["_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION"] = "1"  # typer's option then takes the shell
        return
    import shellingham

    try:
        shellingham.detect_shell()
    except shellingham.ShellDetectionFailure:
        sys.stderr.write(f"ctl: error: {argv[0]}: no shell found among this process's parents; name it: "
                         f"ctl {argv[0]} bash (or {', '.join(SHELLS[1:])})\n")
        sys.exit(2)


_built: Any = None  # every verb's click command, built once by the command server (cli/server.py)


def build(app: Any) -> Any:
    """The click command typer makes of app, its option values converted without building pydantic adapters
    (cli/coerce.py)."""
    import typer.main

    from controller.cli.coerce import install

    command = typer.main.get_command(app)
    install(command)
    return command


def build_all() -> None:
    """Build the command of every verb now (the command server, before it forks)."""
    global _built
    _built = build(load_app())


def _main() -> None:
    import typer
    import typer.main

    from controller.cli.app import OPTS
    from controller.core.terminal import clean_line
    from controller.errors import CtlError, ExitCode

    # Global flags are accepted anywhere on the line (`ctl deploy ct200 --json`), not only before the verb.
    argv = sys.argv[1:]
    head, sep, tail = (argv[: argv.index("--")], ["--"], argv[argv.index("--") + 1:]) if "--" in argv else (
        argv, [], [])
    for flag in ("--json", "--text", "--debug"):
        if flag in head[1:]:
            head = [a for a in head if a != flag]
            head.insert(0, flag)
    command = _built if _built is not None else build(load(head + sep + tail))
    try:
        rc = command(args=head + sep + tail, prog_name="ctl", standalone_mode=False)
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
