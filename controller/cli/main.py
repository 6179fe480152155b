"""The `ctl` command line: thin typer commands that call one commands.* function and render its result.

Every CtlError is caught in `main` and printed as one line; `--debug` shows the traceback. Heavy modules
(paramiko, jinja2, matplotlib) are imported inside commands, so that `ctl --help` stays fast. The app,
its global options and the output helpers live in cli/app.py; each verb group in its own module, which
registers its commands on the app when imported here.
"""

from __future__ import annotations

import os
import sys

import typer

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
from controller.cli.app import OPTS, app
from controller.core.terminal import clean_line
from controller.errors import CtlError, ExitCode

__all__ = ["OPTS", "app", "main"]


def main() -> None:
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
