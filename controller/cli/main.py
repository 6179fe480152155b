"""The `ctl` command line: thin typer commands that call one commands.* function and render its result.

Every CtlError is caught in `main` and printed as one line; `--debug` shows the traceback. Heavy modules
(paramiko, jinja2, matplotlib) are imported inside commands, so that `ctl --help` stays fast. The app,
its global options and the output helpers live in cli/app.py; each verb group in its own module, which
registers its commands on the app when `load_app` imports it. A shell's completion request (a TAB) is answered
by cli/complete.py before any of that is imported.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # a TAB's answer (cli/complete.py) does not pay for importing typing
if TYPE_CHECKING:
    from typing import Any

__all__ = ["load_app", "main"]  # also `app` and `OPTS`, loaded on first use (__getattr__)


def load_app() -> Any:
    """The typer app with every verb group registered (each module registers its commands when imported)."""
    from controller.cli import config as _config  # noqa: F401
    from controller.cli import dashboard as _dashboard  # noqa: F401
    from controller.cli import deploy as _deploy  # noqa: F401
    from controller.cli import env as _env  # noqa: F401
    from controller.cli import inventory as _inventory  # noqa: F401
    from controller.cli import metrics as _metrics  # noqa: F401
    from controller.cli import mux as _mux  # noqa: F401
    from controller.cli import runbook as _runbook  # noqa: F401
    from controller.cli import runs as _runs  # noqa: F401
    from controller.cli import snapshot as _snapshot  # noqa: F401
    from controller.cli import store as _store  # noqa: F401
    from controller.cli import supervise as _supervise  # noqa: F401
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


def main() -> None:
    if os.environ.get("_CTL_COMPLETE", "").startswith("complete_"):
        # A TAB in the shell: answered before typer, pydantic and the commands are imported (cli/complete.py).
        from controller.cli.complete import answer

        sys.exit(answer())
    _main()


def _main() -> None:
    import typer

    from controller.cli.app import OPTS
    from controller.core.terminal import clean_line
    from controller.errors import CtlError, ExitCode

    app = load_app()
    # Global flags are accepted anywhere on the line (`ctl deploy ct200 --json`), not only before the verb.
    argv = sys.argv[1:]
    head, sep, tail = (argv[: argv.index("--")], ["--"], argv[argv.index("--") + 1:]) if "--" in argv else (
        argv, [], [])
    for flag in ("--json", "--text", "--debug"):
        if flag in head[1:]:
            head = [a for a in head if a != flag]
            head.insert(0, flag)
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
