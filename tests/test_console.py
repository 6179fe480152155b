"""The cli's console writes what rich would write, without importing rich for the lines it can write itself.

`markup_text` and `escape_markup` (core/terminal.py) are held to rich's own markup reader and escape on random
markup; the console (cli/app.py) to a rich Console on a pipe and on a real terminal (a pty): the same bytes, or,
where only rich can say (colour on a terminal, markup ctl does not use, a tab), rich itself prints."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.errors import MarkupError
from rich.markup import escape as rich_escape

from controller.cli import app as cli_app
from controller.core.terminal import escape_markup, markup_text

PIECES = ["[red]", "[/red]", "[/]", "[bold yellow]", "[/bold yellow]", "[yellow bold]", "[green]", "[/green]",
          "[link=http://x]", "[/link]", "[@click]", "[#ff0000]", "[conceal]", "[Red]", "[/RED]", "[1]", "[]",
          "\\", "\\\\", "[", "]", "/", "a", "b c", ":x:", "=", "é", "[red  bold]", "[/ red]", "[i]", "\\[red]"]
markups = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)


def rich_plain(text: str, markup: bool = True) -> str:
    """What the cli's rich console wrote to a pipe before: no terminal, no emoji, no highlighting."""
    buf = io.StringIO()
    Console(file=buf, force_terminal=False, highlight=False, soft_wrap=True, emoji=False, width=160).print(
        text, markup=markup)
    return buf.getvalue()


@given(st.text(alphabet="[]\\/ab#@=r ed", max_size=30) | markups)
@settings(max_examples=400, deadline=None)
def test_escape_is_riches(text: str) -> None:
    assert escape_markup(text) == rich_escape(text)
    if "\\" not in text:  # (rich's escape is for tags: other backslashes may not survive)
        assert rich_plain(escape_markup(text)) == text + "\n"  # printed as written


@given(markups)
@settings(max_examples=1500, deadline=None)
def test_markup_text_reads_markup_as_rich_does(text: str) -> None:
    ours = markup_text(text)
    try:
        theirs = rich_plain(text)
    except MarkupError:
        assert ours is None  # only rich may refuse it, so ctl leaves such markup to rich
        return
    if ours is not None:
        assert ours[0] + "\n" == theirs


def test_markup_text_examples() -> None:
    assert markup_text("ct200  [red]FAILED[/red] x") == ("ct200  FAILED x", True)
    assert markup_text("a \\[red] b") == ("a [red] b", False)  # escaped: text, not a tag
    assert markup_text("[1] \\[2]") == ("[1] [2]", False)  # not tags; rich drops the escape anyway
    assert markup_text("plain") == ("plain", False)
    assert markup_text("[link=http://x]click[/link]") is None  # rich's to render
    assert markup_text("[/red]") is None  # rich refuses it


def test_the_console_writes_plain_lines_itself_and_the_rest_through_rich(capsys: pytest.CaptureFixture[str]
                                                                          ) -> None:
    con = cli_app._Console()
    lines = ["ct200        up to date (3 files verified, 0.25s)", "ct201        [red]FAILED[/red] no route",
             "ct202        [yellow]DRIFT[/yellow] in 1 file(s)", "time 12:30:05 :x: \\[kept]",
             "a line past rich's 160 columns [red]is not wrapped[/red]  " * 8, ""]
    for line in lines:
        con.print(line)
    con.print("[link=x]raw[/link] kept", markup=False)
    con.print("two", "words", end="")
    assert con._rich is None  # none of these needed rich
    tabbed = cli_app._Console()
    tabbed.print("a\tb")
    assert tabbed._rich is not None  # rich expands tabs: its to print
    want = "".join(rich_plain(x) for x in lines) + rich_plain("[link=x]raw[/link] kept", markup=False)
    assert capsys.readouterr().out == want + "two words" + rich_plain("a\tb")


def test_markup_only_rich_knows_goes_to_rich(capsys: pytest.CaptureFixture[str]) -> None:
    con = cli_app._Console()
    con.print("[link=http://x]click[/link] done :x:")
    assert con._rich is not None
    assert capsys.readouterr().out == "click done :x:\n"  # rich's console too leaves emoji codes as typed
    with pytest.raises(MarkupError):  # a closing tag with nothing to close is still refused, by rich
        cli_app._Console().print("oops [/red]")


def test_escape_sequences_are_cleaned_on_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    cli_app._Console().print("a\x1b]52;c;aGk=\x07b\x1b[2Jc")
    cli_app._Console().print("a\x1b]52;c;aGk=\x07b\x1b[2Jc [link=x]y[/link]")
    assert capsys.readouterr().out == "abc\nabc y\n"


def _on_a_pty(code: str, env: dict[str, str] | None = None) -> bytes:
    """What `code` writes to a real terminal: run in a child whose stdout is a pty's slave end."""
    master, slave = pty.openpty()
    child_env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE")}
    child_env.update(TERM="xterm-256color", COLUMNS="200", **(env or {}))
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=slave, stderr=subprocess.PIPE,
                         env=child_env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(timeout=60) == 0, p.stderr.read() if p.stderr else ""
    return out


PTY_CODE = """
    import sys
    from controller.cli.app import _Console
    con = _Console()
    con.print("ct200        up to date (3 files verified, 0.25s)")
    con.print("plain \\\\[red] stays")
    print("rich imported" if "rich" in sys.modules else "no rich", flush=True)
    con.print("ct201        [red]FAILED[/red] no route")
    print("rich imported" if "rich" in sys.modules else "no rich", flush=True)
"""
RICH_CODE = """
    from rich.console import Console
    con = Console(highlight=False, soft_wrap=True, emoji=False)
    con.print("ct200        up to date (3 files verified, 0.25s)")
    con.print("plain \\\\[red] stays")
    print("no rich", flush=True)
    con.print("ct201        [red]FAILED[/red] no route")
    print("rich imported", flush=True)
"""


def test_on_a_terminal_plain_lines_match_rich_and_colour_is_richs() -> None:
    ours, theirs = _on_a_pty(PTY_CODE), _on_a_pty(RICH_CODE)
    assert ours == theirs
    assert b"\x1b[31mFAILED\x1b[0m" in ours  # colour on a terminal, as before
    assert b"no rich" in ours and b"rich imported" in ours
    told = _on_a_pty(PTY_CODE, env={"TTY_COMPATIBLE": "0"})  # rich's switch for "not a terminal", honoured
    assert b"\x1b[" not in told and b"FAILED no route" in told and b"rich imported" not in told


def test_a_deploy_that_changes_nothing_does_not_import_rich() -> None:
    code = """
        import sys
        from controller.cli.app import _Console, _esc
        _Console().print(f"{'ct200':<12} up to date; {_esc('[link=x]from a container[/link]')}")
        _Console().print(f"{'ct201':<12} [red]FAILED[/red] {_esc('no route to [host]')}")
        assert "rich" not in sys.modules, sorted(m for m in sys.modules if m.startswith("rich"))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("ct200        up to date; [link=x]from a container[/link]\n"
                        "ct201        FAILED no route to [host]\n")


# --- tables ----------------------------------------------------------------------------------------------------

def rich_table(title: str | None, columns: list[str], rows: list[list[str]]) -> str:
    """What the cli's tables (cli/app.py `_table`) looked like on a pipe when rich laid them all out."""
    from rich.table import Table

    buf = io.StringIO()
    t = Table(title=title, title_justify="left", box=None, pad_edge=False, header_style="bold")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*r)
    Console(file=buf, force_terminal=False, highlight=False, soft_wrap=True, emoji=False, width=160).print(t)
    return buf.getvalue()


def test_every_character_measured_one_cell_wide_is_so_for_rich() -> None:
    from rich.cells import cell_len

    from controller.core.terminal import cell_width

    ones = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000 and cell_width(chr(c)) == 1]
    assert len(ones) > 800 and "▇" in ones and "é" in ones and "…" in ones  # ASCII, Latin, punctuation, blocks
    assert [c for c in ones if cell_len(c) != 1] == []
    assert cell_width("漢") is None and cell_width("e\u0301") is None and cell_width("🙂") is None  # rich's to measure
    assert cell_width("ct200 ▁▃█") == 9


PLAIN_PIECES = ["ct200", "s1", "", " ", "running", "12.8K", "▁▃▅▇█", "é", "—", "[red]", "[green]OK[/green]",
                "\\[x]", "[1]", "\\", "x" * 40]
RICHS_PIECES = ["漢字", "🙂", "e\u0301", "[/red]", "[link=x]", "y" * 75]  # rich's to lay out or refuse
cells = st.lists(st.sampled_from(PLAIN_PIECES * 8 + RICHS_PIECES), max_size=3).map("".join)


@given(st.none() | cells, st.integers(1, 6).flatmap(
    lambda n: st.tuples(st.lists(cells, min_size=n, max_size=n),
                        st.lists(st.lists(cells, min_size=n, max_size=n), max_size=5))))
@settings(max_examples=600, deadline=None)
def test_a_table_written_directly_is_what_rich_writes(title: str | None, table: tuple[list[str], list[list[str]]]
                                                      ) -> None:
    columns, rows = table
    ours = cli_app._plain_table(title, columns, rows)
    if ours is not None:  # else rich lays it out, as before
        try:
            theirs = rich_table(title, columns, rows)
        except MarkupError:
            raise AssertionError("written directly, where rich refuses the markup") from None
        assert ours == theirs


def test_status_like_tables_are_written_directly(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(var, raising=False)
    columns = ["ct", "run", "state", "step", "loss", "tok/s", "ETA", "tok/s trend", "verdict", "why"]
    rows = [[f"ct{200 + i}", "s1", "running", 255 - i, "1.8123", "12.9K", "13.1d", "▅▁▁▅██▁▇▅▃▁▁▃█▅▁▁██▇",
             "[green]OK[/green]", "12.8K tok/s, 0.99x of [baseline] #3"] for i in range(20)]
    text_rows = [[str(v) if i == 8 else cli_app._esc(v) for i, v in enumerate(r)] for r in rows]
    assert cli_app._plain_table(None, columns, text_rows) == rich_table(None, columns, text_rows)
    cli_app._table(None, columns, rows, markup=frozenset({8}))
    out = capsys.readouterr().out
    assert out == rich_table(None, columns, text_rows)
    assert "[baseline] #3" in out and "OK  " in out and "[green]" not in out
    wide = [["x" * 100, "y" * 59]]  # 161 columns: rich shrinks it, so rich writes it
    assert cli_app._plain_table(None, ["a", "b"], wide) is None
    cli_app._table(None, ["a", "b"], wide)
    assert capsys.readouterr().out == rich_table(None, ["a", "b"], wide)
    monkeypatch.setenv("FORCE_COLOR", "1")  # styles to write: rich's
    assert cli_app._plain_table(None, columns, text_rows) is None
