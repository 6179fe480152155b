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
