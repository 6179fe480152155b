"""Text from containers made safe for the operator's terminal (pure; the cli applies it where it prints).

Everything a container writes is untrusted: a log line, the agent's error text, a remote command's stderr
can carry escape sequences that a terminal obeys (OSC 52 writes the clipboard, OSC 0/2 set the window
title, ESC[2J clears the screen, ESC[6n makes the terminal type its answer into ctl's input, DCS and APC
strings reach terminal extensions). `clean` removes every whole escape sequence (CSI, OSC up to BEL or ST,
DCS/SOS/PM/APC up to ST, the 8-bit C1 forms too, and two-byte ESC sequences), and shows any other control
character (C0 except tab and newline, DEL, C1, bidi overrides) as a visible `\\xNN`. What is left is
printable text; the cli still prints it with rich markup off (or escaped), so `[link=...]` stays literal.
`--json` output and files keep the raw text: only what reaches a terminal goes through here.
"""

from __future__ import annotations

import re

_SEQUENCES = re.compile(
    r"""
      \x1b\[[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?        # CSI ... final byte (ESC[2J, ESC[6n, SGR)
    | \x9b[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?          # 8-bit CSI
    | (?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?        # OSC up to BEL or ST (titles, OSC 52)
    | (?:\x1b[PX^_]|[\x90\x98\x9e\x9f])[^\x1b\x9c]*(?:\x1b\\|\x9c)?  # DCS, SOS, PM, APC up to ST
    | \x1b[\x20-\x2f]*[\x30-\x7e]                       # other ESC sequences (ESC c, ESC 7, ESC ( B, ...)
    """,
    re.VERBOSE,
)
# C0 but tab and newline, DEL, C1, and the bidi overrides/isolates that reorder what the eye reads.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def clean(text: str) -> str:
    """`text` without escape sequences, its other control characters shown as \\xNN; tab and newline kept."""
    if text.isprintable():  # the common case: nothing to do (isprintable is false for \t and \n too)
        return text
    return _CONTROLS.sub(_visible, _SEQUENCES.sub("", text))


def clean_line(text: str) -> str:
    """`clean` for one line of a table or a message: a newline is shown as \\x0a too."""
    return clean(text).replace("\n", "\\x0a")


# Console markup as rich reads it: `[` then a letter, `#`, `/` or `@`, anything but `[`, then `]` is a tag;
# the backslashes before one escape it when odd in number, and half of them print either way.
_TAG = re.compile(r"(\\*)\[([a-z#/@][^[]*?)]")
# The styles ctl's own markup uses: enough to read every tag the cli writes; any other goes to rich.
STYLE_WORDS = frozenset({"bold", "dim", "italic", "underline", "reverse", "strike", "black", "red", "green",
                         "yellow", "blue", "magenta", "cyan", "white"})


# Characters a terminal shows one cell wide, and rich measures so (tests/test_console.py checks each against
# rich's own measure): printable ASCII, Latin-1 and Latin Extended-A/B, general punctuation, arrows, box drawing
# and block elements (the sparklines). Anything else (CJK, emoji, combining marks) is rich's to measure.
_NARROW = re.compile("[\x20-\x7e\xa1-\xac\xae-\u024f\u2010-\u2027\u2030-\u205e\u2190-\u21ff\u2500-\u259f]*")


def cell_width(text: str) -> int | None:
    """How many terminal cells `text` takes, when every character of it is one rich measures one cell wide
    (`_NARROW`); None otherwise."""
    return len(text) if _NARROW.fullmatch(text) else None


def escape_markup(text: str) -> str:
    """`text` for a string printed with markup on: every `[` that would open a tag escaped, and a trailing lone
    backslash doubled (it would escape the next string's tag), so it prints as written."""
    text = _TAG.sub(lambda m: f"{m[1]}{m[1]}\\[{m[2]}]", text)
    return text + "\\" if text.endswith("\\") and not text.endswith("\\\\") else text


def markup_text(markup: str) -> tuple[str, bool] | None:
    """(the text that markup shows, whether it has any style tag), with its escapes resolved; None for markup
    with a tag outside STYLE_WORDS or a closing tag that closes nothing (which only rich can render, or
    refuse)."""
    if "[" not in markup:
        return markup, False
    out: list[str] = []
    opened: list[str] = []
    pos, styled = 0, False
    for m in _TAG.finditer(markup):
        slashes, tag = m[1], m[2]
        out.append(markup[pos:m.start()].replace("\\[", "[") + "\\" * (len(slashes) // 2))
        pos = m.end()
        if len(slashes) % 2:
            out.append(f"[{tag}]")
            continue
        styled = True
        if tag.startswith("/"):
            name = " ".join(tag[1:].split())
            if not opened or (name and name not in opened):
                return None
            opened.pop(len(opened) - 1 - opened[::-1].index(name) if name else -1)
            continue
        words = tag.split()
        if not words or not STYLE_WORDS.issuperset(words):
            return None
        opened.append(" ".join(words))
    out.append(markup[pos:].replace("\\[", "["))  # rich unescapes `\[` in plain text, tag or not
    return "".join(out), styled
