"""Persistent host sessions (on by default: 60 idle seconds; `CTL_PERSIST=SECONDS`, the config file's `persist`,
or `persist:` on a host in the inventory set them, 0 turns them off): one background process per host, user
and state directory.

Without one, each `ctl` command pays, before its agent says a word, paramiko's import, an SSH handshake, an
exec request and the host's login shell (~0.3 s). With it, the first command that needs host H starts the
session process for H (daemon.py, `python -m controller.transport.mux.daemon`): it opens the SSH connection
(host keys verified as always: known_hosts, unknown keys refused) and ONE long-running exec of ctl's host
relay (controller/farside/relay/), then listens on a Unix socket. Later commands connect to that socket,
import no paramiko, do no handshake, and send the relay's own frames for the exact argv they would have run
(`pct exec VMID -- python3 ... agent ...`, `pct status`, `tail -F`, the `cat` of a download); the session
renumbers stream ids between its clients and the one relay channel. `MuxRelay` (client.py) is the client: a
`HostRelay` whose channel is the socket, so `PctContainer` and deploy see the same Duplex as over a direct exec.

The session exits after SECONDS with no client and no live stream (never under a command that reached it),
when `ctl mux stop` asks (after the commands using it finish, up to a grace period), when a newer ctl replaces
it, or at once when its SSH connection drops; the clients of a dropped session get a "connection dropped" error
(ConnectionDropped) and the next command starts a fresh session. Only the user's own processes can reach it
(sock.py: a short per-user 0700 directory, a 0600 socket, owners checked, peers of another uid dropped).

client.py  MuxRelay, sessions(), stop(): what commands use
daemon.py  the session process
spare.py   the spare: a session process started before the command knows its hosts, forked for each
sock.py    the socket's place and permissions, its frames (the wire protocol), peer and host key checks

The names below load their module on first use: `ctl` imports spare.py first thing, before anything heavy.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from controller.transport.mux.client import ENV, MuxRelay, sessions, start_early, stop
    from controller.transport.mux.sock import mux_dir, session_key, socket_dir

__all__ = ["ENV", "MuxRelay", "mux_dir", "session_key", "sessions", "socket_dir", "start_early", "stop"]
_WHERE = {"ENV": "client", "MuxRelay": "client", "sessions": "client", "start_early": "client", "stop": "client",
          "mux_dir": "sock", "session_key": "sock", "socket_dir": "sock"}


def __getattr__(name: str) -> object:
    if name in _WHERE:
        return getattr(importlib.import_module(f"controller.transport.mux.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
