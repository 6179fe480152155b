"""Log lines as a reader sees them (pure): split on `\\n` and on `\\r` (tqdm redraws its bar with `\\r`, so
one "line" of a log can be a whole run of progress updates), each cut to LINE_CAP bytes with a marker.

The agent's `tailinfo` (controller/farside/agent/, stdlib only, so it keeps its own copy of these rules)
does the same on the last TAIL_WINDOW bytes of a log; `ctl tail -f` feeds what arrives to `LineSplitter`,
which never holds more than LINE_CAP bytes of an unfinished line.
"""

from __future__ import annotations

import re

LINE_CAP = 4096  # bytes of one log line shown; the rest is replaced by CUT_MARK
CUT_MARK = b" ... [cut: %d bytes]"  # what a line cut to LINE_CAP ends with (the bytes left out)
CUT_OPEN = b" ... [cut: the line goes on]"  # a followed line cut before its end arrived
_SEP = re.compile(rb"\r\n|\r|\n")


def cut(line: bytes, cap: int = LINE_CAP) -> bytes:
    """`line`, or its first `cap` bytes and a marker saying how many were left out."""
    return line if len(line) <= cap else line[:cap] + CUT_MARK % (len(line) - cap)


class LineSplitter:
    """Bytes in, complete lines out (without their separator), each at most LINE_CAP bytes plus a marker.

    `\\r\\n`, `\\r` and `\\n` end a line; an empty line ended by a bare `\\r` (a progress bar's redraw) is
    dropped. An unfinished line longer than the cap is emitted at once, cut, and the rest of it skipped
    up to its end: the buffer never grows past the cap.
    """

    def __init__(self, cap: int = LINE_CAP) -> None:
        self.cap = cap
        self.buf = b""
        self.skipping = False  # inside a line already emitted cut

    def feed(self, data: bytes) -> list[bytes]:
        buf = self.buf + data
        out: list[bytes] = []
        pos = 0
        for m in _SEP.finditer(buf):
            if m.group() == b"\r" and m.end() == len(buf):
                break  # maybe the first half of \r\n: wait for the next byte
            seg, pos = buf[pos:m.start()], m.end()
            if self.skipping:
                self.skipping = False
            elif seg or m.group() != b"\r":
                out.append(cut(seg, self.cap))
        rest = buf[pos:]
        held_cr = b"\r" if rest.endswith(b"\r") else b""
        if self.skipping:
            rest = held_cr
        elif len(rest) - len(held_cr) > self.cap:
            out.append(rest[:self.cap] + CUT_OPEN)
            self.skipping = True
            rest = held_cr
        self.buf = rest
        return out

    def flush(self) -> list[bytes]:
        """The unfinished last line, if any (the stream ended)."""
        rest, self.buf = self.buf, b""
        skipping, self.skipping = self.skipping, False
        rest = rest[:-1] if rest.endswith(b"\r") else rest
        return [cut(rest, self.cap)] if rest and not skipping else []
