"""Docs that cannot lie: the generated references equal what scripts/gen_docs.py writes from the code, every `ctl`
line of README.md and the site's code blocks is a command line ctl's parser accepts, and every internal link and
anchor of the built site resolves."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def gen_docs() -> Any:
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- generated pages ---------------------------------------------------------------------------------------------


def test_generated_references_equal_what_the_script_writes() -> None:
    for path, text in gen_docs().pages().items():
        rel = path.relative_to(REPO)
        assert path.exists(), f"{rel} is missing: run `python scripts/gen_docs.py`"
        assert path.read_text() == text, f"{rel} differs from the code: run `python scripts/gen_docs.py`"


def test_every_inventory_key_is_described_and_no_description_is_stale() -> None:
    assert gen_docs().check_keys() == []


def test_the_references_hold_every_command_option_and_key() -> None:
    g = gen_docs()
    commands = g.COMMANDS_MD.read_text()
    sections = dict(re.findall(r"^#{2,4} (.+)\n((?:(?!#{2,4} ).*\n)*)", commands, re.M))
    root = g.click_command()
    seen = 0
    for path, cmd in g._walk(root, ["ctl"]):
        title = "Global options" if len(path) == 1 else " ".join(path)
        assert title in sections, title
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden:
                assert re.search(rf"^\| `[^`]*{re.escape(p.opts[-1])}\b", sections[title], re.M), \
                    f"{title}: {p.opts[-1]}"
                seen += 1
    assert seen > 100, seen  # the walk reached every verb, not just the root
    inventory = g.INVENTORY_MD.read_text()
    for key in ("`address`", "`vmid`", "`rdzv_port`", "`socket_ifname`", "`notify_secret_env`", "`store_keep`"):
        assert f"| {key} |" in inventory, key


def test_every_help_opens_with_one_sentence_and_the_daily_commands_show_examples() -> None:
    g = gen_docs()
    bad = []
    for path, cmd in g._walk(g.click_command(), ["ctl"]):
        first = " ".join(re.split(r"\n\s*\n", (cmd.help or "").strip())[0].split())
        if len(re.findall(r"[.!?](?:\s|$)", first)) != 1 or not first[:1].isupper():
            bad.append(f"{' '.join(path)}: {first!r}")
    assert not bad, "a command's help must open with one sentence, then a blank line:\n" + "\n".join(bad)
    root = g.click_command()
    for verb in ("deploy", "launch", "tail", "status", "supervise"):
        lines = [ln for ln in (root.commands[verb].epilog or "").splitlines() if re.match(rf"ctl (--\S+ )*{verb} ", ln)]
        assert len(lines) >= 3, verb


# --- every ctl line parses -----------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)(```|~~~)(\w*)")
_SHELL = {"", "bash", "sh", "shell", "console"}
_STOP = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "&"}
# Root flags whose callbacks act (install a completion script, print the version): their presence is checked,
# but they are not run.
_ACTING = {"--install-completion", "--show-completion", "--version"}


def ctl_lines(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv after `ctl`) of every `ctl ...` command line in the shell code blocks of a Markdown
    text: env assignments before it, comments and what follows a pipe or redirection left out."""
    out: list[tuple[int, list[str]]] = []
    fence: str | None = None
    lang = ""
    held = ""  # a line continued with a backslash, waiting for its end
    for n, line in enumerate(text.splitlines(), 1):
        if held or (fence is not None and line.rstrip().endswith("\\")):
            held += line.rstrip().removesuffix("\\") + " "
            if line.rstrip().endswith("\\"):
                continue
            line, held = held, ""
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence, lang = m.group(2), m.group(3).lower()
            elif m.group(2) == fence:
                fence = None
            continue
        if fence is None or lang not in _SHELL:
            continue
        if lang == "console" and not line.lstrip().startswith("$ "):
            continue  # a console block: a command after `$ `, what it printed on the lines between
        try:
            words = shlex.split(line.strip().removeprefix("$ "), comments=True)
        except ValueError as e:
            out.append((n, ["<unparsable shell line>", str(e)]))
            continue
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words.pop(0)
        if not words or words[0] != "ctl":
            continue
        argv: list[str] = []
        for w in words[1:]:
            if w in _STOP:
                break
            argv.append(w)
        out.append((n, argv))
    return out


def parse_error(root: Any, argv: list[str]) -> str | None:
    """Why ctl's command line refuses argv (an unknown command or option, a value an option cannot take, an
    extra argument), or None when it accepts it. Parses only: no command runs."""
    root_opts = {o for p in root.params for o in (*p.opts, *p.secondary_opts)}
    args = list(argv)
    # Global flags are taken anywhere on the line (cli/main.py moves them to the front the same way).
    for flag in ("--json", "--text", "--debug"):
        if flag in args[1:]:
            args = [flag] + [a for a in args if a != flag]
    for flag in _ACTING & set(args):
        if flag not in root_opts:
            return f"no such option: {flag}"
        return None if args[0] == flag else f"{flag} must come first"
    cmd, name, ctx = root, "ctl", None
    try:
        while True:
            ctx = cmd.make_context(name, args, parent=ctx)
            if not hasattr(cmd, "get_command"):
                return None
            rest = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
            if not rest:
                return None
            sub = cmd.get_command(ctx, rest[0])
            if sub is None:
                return f"no such command: {' '.join([*ctx.command_path.split()[1:], rest[0]])}"
            cmd, name, args = sub, rest[0], rest[1:]
    except Exception as e:
        if type(e).__name__ == "Exit":  # --help, which click answers while parsing
            return None
        if hasattr(e, "format_message"):
            return str(e.format_message())
        raise


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_ctl_line_of_the_readme_and_the_docs_is_a_command_ctl_accepts(capsys: pytest.CaptureFixture[str]
                                                                            ) -> None:
    root = gen_docs().click_command()
    bad = []
    count = 0
    for md in markdown_files():
        for n, argv in ctl_lines(md.read_text()):
            count += 1
            why = parse_error(root, argv)
            if why is not None:
                bad.append(f"{md.relative_to(REPO)}:{n}: ctl {shlex.join(argv)}: {why}")
    assert not bad, "\n".join(bad)
    assert count > 100, count  # the lines were found: a broken extractor must not pass by finding none
    readme = [argv for _, argv in ctl_lines((REPO / "README.md").read_text())]
    assert ["launch", "local", "-f"] in readme


@pytest.mark.parametrize(("line", "why"), [
    ("ctl deploy ct200 --no-such-flag", "No such option"),
    ("ctl depoly ct200", "no such command"),
    ("ctl env nosuch ct200", "no such command"),
    ("ctl status --slow-ratio", "requires an argument"),
    ("ctl show fresh6 fresh7", "unexpected extra argument"),
    ("ctl --install-completions", "No such option"),
    ("ctl supervise --restart on-failure:3 --unitt > x.service", "No such option"),
])
def test_a_line_ctl_would_refuse_is_reported(line: str, why: str) -> None:
    root = gen_docs().click_command()
    (_, argv), = ctl_lines(f"```bash\n{line}   # a comment\n```\n")
    err = parse_error(root, argv)
    assert err is not None and why.lower() in err.lower(), err


def test_lines_outside_shell_blocks_and_other_programs_are_not_taken() -> None:
    text = ("ctl nosuch (prose)\n```yaml\nctl: nosuch\n```\n```bash\nbash scripts/test.sh\n"
            "CTL_PERSIST=0 ctl deploy ct200 | tee log\nctl supervise --once \\\n  --interval 1m  # one poll\n```\n")
    assert ctl_lines(text) == [(7, ["deploy", "ct200"]), (9, ["supervise", "--once", "--interval", "1m"])]
    # a console block: the command after `$ `; what it printed (an apostrophe in it, a `ctl` it names) is output
    console = "```console\n$ ctl doctor ct200\nct200: the host's driver\nctl nosuch --is-output\n```\n"
    assert ctl_lines(console) == [(2, ["doctor", "ct200"])]


# --- the built site's links ---------------------------------------------------------------------------------------


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "a" and a.get("name"):
            self.ids.add(str(a["name"]))
        for key in ("href", "src"):
            if tag in ("a", "img") and a.get(key):
                self.links.append(str(a[key]))


def broken_links(site: Path) -> list[str]:
    """Internal links and anchors of a built site that lead nowhere, as 'page: link (why)'."""
    pages: dict[Path, _Page] = {}
    for html in site.rglob("*.html"):
        p = _Page()
        p.feed(html.read_text(errors="replace"))
        pages[html.resolve()] = p
    bad = []
    for html, page in sorted(pages.items()):
        for link in page.links:
            u = urlsplit(link)
            if u.scheme or u.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            if not u.path:
                target = html
            elif u.path.startswith("/"):  # from the site's root (the 404 page's links: it is served anywhere)
                target = (site / unquote(u.path).lstrip("/")).resolve()
            else:
                target = (html.parent / unquote(u.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            rel = html.relative_to(site.resolve())
            if not target.exists():
                bad.append(f"{rel}: {link} (no such file)")
                continue
            if u.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else set()
                if unquote(u.fragment) not in ids:
                    bad.append(f"{rel}: {link} (no anchor #{u.fragment})")
    return bad


def test_the_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "index.html").write_text('<h2 id="here">x</h2><a href="#here">ok</a><a href="a/">ok</a>'
                                         '<a href="a/#gone">bad</a><a href="b.html">bad</a>'
                                         '<a href="https://example.org/#x">external</a>')
    (tmp_path / "a" / "index.html").write_text('<a href="../index.html#here">ok</a><img src="../pic.png">'
                                               '<a href="/a/">ok</a><a href="/c/">bad</a>')
    assert broken_links(tmp_path) == ["a/index.html: ../pic.png (no such file)", "a/index.html: /c/ (no such file)",
                                      "index.html: a/#gone (no anchor #gone)", "index.html: b.html (no such file)"]


@pytest.mark.slow  # a full mkdocs build: a few seconds
def test_the_site_builds_strict_and_every_internal_link_and_anchor_resolves(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra: scripts/setup.sh installs it")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (site / "reference" / "commands" / "index.html").exists()
    assert broken_links(site) == []
