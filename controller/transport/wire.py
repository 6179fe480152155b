"""The names ctl's side of the host relay's wire gives its frame kinds and a relay's states.

A frame is a 7-byte header (kind: 1 byte, stream id: 2 bytes, length: 4 bytes, big-endian; relay.py HEADER), then
its data. The relay itself (controller/farside/relay/) is stdlib code that travels alone and spells the same kinds
as letters; tests/test_farside.py holds the two to the same letters. The session socket (mux/sock.py) carries the
relay's frames and three kinds of its own.
"""

from __future__ import annotations

from enum import Enum
from typing import Final


class Kind:
    """A frame's kind. Plain bytes, not an Enum: every frame's header is packed with one and compared with them."""

    # ctl -> relay
    START: Final = b"S"  # start an argv (data: JSON argv)
    AGENT: Final = b"A"  # an agent request a staying agent may answer (JSON {"argv", "at", "n", "retry", "sha"})
    STDIN: Final = b"I"  # that stream's stdin data
    CLOSE: Final = b"C"  # close that stream's stdin
    ABANDON: Final = b"K"  # close its stdin and stop reading its output (its EXIT still comes)
    AGENTS: Final = b"T"  # (stream 0) which staying agents the relay keeps; answered by the same kind
    # relay -> ctl
    HELLO: Final = b"H"  # (stream 0) the relay's hello, JSON
    STDOUT: Final = b"O"
    STDERR: Final = b"E"
    EXIT: Final = b"X"  # the stream's exit status (ASCII); its id is free again once this is read
    NO_SOURCE: Final = b"U"  # (before EXIT) that agent request's source is not kept there: send it again with it
    # the session socket's own (mux/sock.py)
    STOP: Final = b"Q"  # client -> session (stream 0): stop the session, JSON {"grace"}
    ENDED: Final = b"D"  # session -> client (stream 0): the session ended, JSON {"kind", "why"}
    NOTHING: Final = b"N"  # session -> client: nothing (tells a closed client from one that ended its input)


class RelayState(Enum):
    """Where a host's relay stands (HostRelay, and the session client that stands in for it)."""

    NEW = "new"  # not started: the first use starts it
    UP = "up"
    UNAVAILABLE = "unavailable"  # the host cannot run it: one exec per container
