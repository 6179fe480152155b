"""What every `ctl` command module shares: the typer app, global options, output helpers.

Command modules (cli.py, cli_metrics.py, cli_env.py, ...) import from here, so there is one app and
one OPTS however ctl is started, and no module imports its own caller.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from controller.core.terminal import cell_width, clean, clean_line, escape_markup, markup_text

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Protocol, TypeVar

    from rich.console import Console

    from controller.commands.fanout import Outcome
    from controller.inventory import Container, Inventory
    from controller.registry import Registry, RunRecord
    from controller.transport.base import Transport as Transport  # for the verb modules' annotations: only this
    from controller.transport.pool import Pool as Pool  # module of cli/ may name transport/ (tests/test_layers.py)

    class _Shown(Protocol):
        def to_json(self) -> Any: ...

    V = TypeVar("V", bound=_Shown)

app = typer.Typer(
    name="ctl",
    help="Operate GPU training runs in Proxmox VE LXC containers: deploy, launch, follow, compare.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@dataclass
class Opts:
    """The global options of this command line (set by the app's callback, read by every verb)."""

    inventory: str | None = None
    json: bool = False
    output: str | None = None  # --json / --text as given (None: CTL_OUTPUT, the config file or the default)
    debug: bool = False


OPTS = Opts()


def _version(value: bool) -> None:
    if value:
        from controller import settings

        sys.stdout.write(f"ctl {settings.version()} (commit {settings.build_commit()})\n")
        raise typer.Exit(0)


@app.callback()
def _global(
    ctx: typer.Context,
    inventory: str | None = typer.Option(
        None, "-i", "--inventory", help="Inventory file (env CTL_INVENTORY, config `inventory`; default "
        "./inventory.yaml)."
    ),
    as_json: bool | None = typer.Option(None, "--json/--text", help="Machine-readable output, or text (env "
                                        "CTL_OUTPUT, config `output`; default text).", show_default=False),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print ctl's version and the commit it was built from."),
) -> None:
    from controller import settings
    from controller.errors import InputError

    OPTS.inventory = inventory
    OPTS.debug = debug
    flag = None if as_json is None else ("json" if as_json else "text")
    OPTS.output = flag
    try:
        OPTS.json = settings.output_format(flag) == "json"
    except InputError:
        if ctx.invoked_subcommand != "config":  # `ctl config path|show` must work to repair a bad config file
            raise
        OPTS.json = flag == "json"


# --- helpers -------------------------------------------------------------------------------------


def examples(*lines: str) -> str:
    """A command's epilog: example command lines under `--help`, kept as typed (click's \\b paragraph), which
    scripts/gen_docs.py copies into the command reference and tests/test_docs.py parses like any docs line."""
    return "Examples:\n\n\b\n" + "\n".join(lines)


def _inv() -> Inventory:
    from controller import inventory

    return inventory.load(OPTS.inventory)


def _note(msg: str) -> None:
    """What --debug adds on stderr: how ctl reached the containers (relay or not, and why)."""
    if OPTS.debug:
        sys.stderr.write(f"ctl: debug: {clean_line(msg)}\n")


def _out(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


class _Console:
    """Where the cli prints for people. A string that rich would print as it stands (no colour to add, nothing
    to lay out: the common case) is written directly; anything else goes to a rich Console, made on first need
    (importing it costs ~25 ms, a tenth of a warm deploy). Strings lose their escape sequences either way
    (core/terminal.py); text from a container still needs markup=False or `_esc` at the call. Emoji codes stay
    as typed: `:x:` in a log line is text, not a picture."""

    def __init__(self) -> None:
        self._rich: Console | None = None

    def rich(self) -> Console:
        if self._rich is None:
            from rich.console import Console

            self._rich = Console(highlight=False, soft_wrap=True, emoji=False,
                                 width=None if sys.stdout.isatty() else PIPE_WIDTH)
        return self._rich

    def print(self, *objects: Any, markup: bool = True, end: str = "\n", **kwargs: Any) -> None:
        objects = tuple(clean(o) if isinstance(o, str) else o for o in objects)
        if self._rich is None and kwargs.keys() <= {"soft_wrap"} and kwargs.get("soft_wrap", True) and all(
                isinstance(o, str) for o in objects):
            line = _as_rich_prints(" ".join(objects), markup)
            if line is not None:
                sys.stdout.write(line + end)
                sys.stdout.flush()  # as rich does: lines and stderr's messages keep their order
                return
        self.rich().print(*objects, markup=markup, end=end, **kwargs)

    def __getattr__(self, name: str) -> Any:  # status, rule, ...: rich's own
        return getattr(self.rich(), name)


def _as_rich_prints(text: str, markup: bool) -> str | None:
    """`text` as rich would write it to stdout, when that is the text itself (its markup read); None when only
    rich can say: a tab (rich expands it), colour to add to a terminal, markup ctl's own reader does not know."""
    if "\t" in text:
        return None
    shown = markup_text(text) if markup else (text, False)
    if shown is None:
        return None
    if shown[1] and _styled():
        return None
    return shown[0]


def _styled() -> bool:
    """Whether rich would write styles to stdout: a terminal, or one forced by TTY_COMPATIBLE or FORCE_COLOR
    (set to anything, even empty: that errs towards rich)."""
    env = os.environ
    if env.get("TTY_COMPATIBLE") == "0":
        return False
    return env.get("TTY_COMPATIBLE") == "1" or "FORCE_COLOR" in env or sys.stdout.isatty()


def _console() -> _Console:
    return _Console()


def _outcomes(results: list[Outcome[V]], ok: Callable[[_Console, str, V], None]) -> None:
    """One line per container of a fan-out: --json prints each value's to_json() (or the error); otherwise a
    FAILED line naming the container, or `ok(console, container, value)` for the ones that worked."""
    if OPTS.json:
        _out([r.value.to_json() if r.value is not None else {"ct": r.ct, "ok": False, "error": r.error}
              for r in results])
        return
    con = _console()
    for r in results:
        if not r.ok or r.value is None:
            con.print(f"{r.ct:<12} [red]FAILED[/red] {_esc(r.error)}")
        else:
            ok(con, r.ct, r.value)


def _esc(text: object) -> str:
    """Text that may come from a container, for a string printed with markup on: no control bytes, no newline,
    its `[` escaped so that `[link=...]` or `[conceal]` stay literal."""
    return escape_markup(clean_line(str(text)))


def _table(title: str | None, columns: list[str], rows: list[list[Any]], *, markup: frozenset[int] = frozenset()
           ) -> None:
    """A table of `rows` under `columns`, titled, every cell escaped text but those in the `markup` columns
    (ctl's own markup). Written directly when it is plain text laid out by width alone (`_plain_table`), which
    is what rich would write; else by rich."""
    head = None if title is None else _esc(title)
    cells = [[v if i in markup else ("" if v is None else _esc(v)) for i, v in enumerate(r)] for r in rows]
    plain = _plain_table(head, columns, cells)
    if plain is not None:
        sys.stdout.write(plain)
        sys.stdout.flush()
        return
    from rich.table import Table

    t = Table(title=head, title_justify="left", box=None, pad_edge=False, header_style="bold")
    for c in columns:
        t.add_column(c)
    for r in cells:
        t.add_row(*r)
    _console().print(t)


PIPE_WIDTH = 160  # the rich console's width when stdout is not a terminal (_Console.rich)


def _plain_table(title: str | None, columns: list[str], rows: list[list[str]]) -> str | None:
    """The table as rich's Table (no box, no edge padding) prints to a pipe: each column as wide as its widest
    cell, two spaces between columns, the title on a line of its own; a table of 20 runs in under 1 ms (0.9 ms
    under cProfile) where rich took ~35. None when only rich can lay it out: stdout a terminal or styles to write,
    markup ctl's reader does not know, a character not measured here (cell_width), a table wider than the
    console (rich shrinks its columns and wraps their cells), an empty column, a row of another length."""
    if not columns or _styled() or sys.stdout.isatty():
        return None
    grid: list[list[tuple[str, int]]] = []
    for row in (columns, *rows):
        line = [_plain_cell(cell) for cell in row]
        if len(row) != len(columns) or None in line:
            return None
        grid.append(line)  # type: ignore[arg-type]  # (no None in it)
    widths = [max(line[i][1] for line in grid) for i in range(len(columns))]
    if 0 in widths or sum(widths) + 2 * (len(widths) - 1) > PIPE_WIDTH:  # (rich's own rule for an empty column)
        return None
    out = []
    if title is not None:
        head = _plain_cell(title)
        if head is None or not 0 < head[1] <= PIPE_WIDTH:
            return None
        out.append(head[0])
    out.extend("  ".join(text + " " * (widths[i] - w) for i, (text, w) in enumerate(line)) for line in grid)
    return "\n".join(out) + "\n"


def _plain_cell(markup: str) -> tuple[str, int] | None:
    """(the text markup shows, its width in cells); None when only rich can say."""
    shown = markup_text(markup)
    width = None if shown is None else cell_width(shown[0])
    return None if shown is None or width is None else (shown[0], width)


def _registry() -> Registry:
    """The registry as this inventory sees it (another checkout's `local` runs are not its own); a command that
    only reads the registry still works where the inventory does not load, seeing every row."""
    from controller.errors import CtlError
    from controller.registry import Registry

    try:
        here: dict[str, str] | None = _inv().keys()
    except CtlError:
        here = None
    return Registry(here=here)


@contextmanager
def session(inv: Inventory | None = None) -> Iterator[Pool]:
    """The connection pool of one command (the only place ctl builds one), closed at the end; --debug shows
    how it reached each host (relay or not, persistent session or not, and why)."""
    from controller.transport.pool import Pool

    with Pool(inv if inv is not None else _inv(), note=_note, warn=lambda line: _warn([line])) as pool:
        yield pool


@contextmanager
def _session(container: str | None) -> Iterator[tuple[Inventory, Container, Pool]]:
    """(inventory, the one container named, the command's pool) for a one-container verb."""
    inv = _inv()
    ct = _one_ct(inv, container)
    with session(inv) as pool:
        yield inv, ct, pool


def _one_ct(inv: Inventory, name: str | None) -> Container:
    """The container a one-container verb acts on: the one named, or with none named the inventory's only one."""
    if name is None:
        from controller.errors import InputError

        cts = inv.select([])
        if len(cts) != 1:
            shown = ", ".join(ct.name for ct in cts[:8]) + (" ..." if len(cts) > 8 else "")
            raise InputError(f"name the container ({inv.path} has {len(cts)}: {shown or 'none'})")
        return cts[0]
    return inv.one(name)


def _run_and_ct(inv: Inventory, reg: Registry, ref: str) -> tuple[RunRecord, Container]:
    run = reg.find_run(ref)
    return run, inv.container(run.ct)


def _warn(lines: Iterable[object]) -> None:
    for line in lines:
        sys.stderr.write(f"ctl: warning: {clean_line(str(line))}\n")


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    d = time.time() - ts
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= n:
            return f"{d / n:.0f}{unit} ago"
    return f"{d:.0f}s ago"


def _seconds(text: str, what: str) -> float:
    """A duration option's value (5s, 10m, 1h) in seconds; one line naming the option when it is not one."""
    from controller.core.metrics import parse_duration
    from controller.errors import InputError

    s = parse_duration(text)
    if s is None or s <= 0:
        raise InputError(f"{what}: {text!r} is not a duration such as 30s, 10m, 1h")
    return s


# The container arguments verbs share: names completed from the inventory, the same help everywhere.
ALL_BY_DEFAULT = "Containers or groups (default: all)."
ONLY_BY_DEFAULT = "Containers or groups (none: --all, or the inventory's only container)."


def targets_argument(help_text: str = ALL_BY_DEFAULT) -> Any:
    from controller.cli.names import targets

    return typer.Argument(None, autocompletion=targets, help=help_text)


def container_argument(help_text: str = "The container") -> Any:
    """A one-container verb's argument: optional where the inventory has only one container (as deploy's)."""
    from controller.cli.names import containers

    return typer.Argument(None, autocompletion=containers,
                          help=f"{help_text.rstrip('.')} (default: the inventory's only container).")


def all_option(help_text: str = "Every container of the inventory.") -> Any:
    return typer.Option(False, "--all", help=help_text)

