"""`ctl config path|show`: the user config file, and every setting it holds with where its value came from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from controller.cli.app import OPTS, _console, _out, _table, app

config_app = typer.Typer(help="The user config file: where it is, and the effective settings (flag > CTL_* > "
                         "config file > default).", no_args_is_help=True)
app.add_typer(config_app, name="config")

if TYPE_CHECKING:
    from controller.settings import Setting


@config_app.command("path")
def path_cmd() -> None:
    """Print where ctl reads its config file (CTL_CONFIG moves it)."""
    from controller import settings

    p = settings.config_path()
    if OPTS.json:
        _out({"path": str(p), "exists": p.exists()})
    else:
        _console().print(str(p), markup=False)


@config_app.command("show")
def show_cmd() -> None:
    """The effective value of each setting and where it came from (flag, env CTL_*, config FILE, default)."""
    from controller import settings

    flags = {"inventory": OPTS.inventory, "output": OPTS.output}
    rows = [_shown(s) for s in settings.effective(flags)]
    if OPTS.json:
        _out({"path": str(settings.config_path()), "settings": [s.to_json() for s in rows]})
        return
    _table(None, ["setting", "value", "from"],
           [[s.name, _text(s.value), s.source] for s in rows])


def _text(value: object) -> str:
    if value is None:
        return "- (the inventory decides)"
    if isinstance(value, list):
        return ", ".join(value) or "[]"
    return str(value)


def _shown(s: Setting) -> Setting:
    """A setting as shown: notification sinks with their URL paths hidden (a Slack URL is a secret)."""
    from controller import settings
    from controller.core.supervision import redact_sink

    if s.name == "notify" and isinstance(s.value, list):
        return settings.Setting(s.name, [redact_sink(str(v)) for v in s.value], s.source)
    return s
