"""A persistent host session (opt-in: `CTL_PERSIST=SECONDS`, or `persist:` on the host in the inventory): one
background process per host and user.

Each `ctl` command otherwise pays, before its agent says a word, paramiko's import, an SSH handshake, an
exec request and the host's login shell (~0.3 s). With persistence on, the first command that needs host H
starts the session process for H (daemon.py, `python -m controller.transport.mux.daemon`): it opens the SSH
connection (host keys verified as always: known_hosts, unknown keys refused) and ONE long-running exec of
ctl's host relay (controller/remote/hostrelay.py), then listens on a Unix socket. Later commands connect to
that socket, import no paramiko, do no handshake, and send the relay's own frames for the exact argv they
would have run (`pct exec VMID -- python3 ... agent ...`); the session renumbers stream ids between its
clients and the one relay channel. `MuxRelay` (client.py) is the client: a `HostRelay` whose channel is the
socket, so `PctContainer` and deploy see the same Duplex as over a direct exec.

The session exits after SECONDS with no client and no live stream, when `ctl mux stop` asks, or when its
SSH connection drops; the clients of a dropped session get a "connection dropped" error (ConnectionDropped)
and the next command starts a fresh session. Only the user's own processes can reach it (sock.py: a 0700
directory, a 0600 socket named by a hash of the connection, owners checked, peers of another uid dropped).

client.py  MuxRelay, sessions(), stop(): what commands use
daemon.py  the session process
sock.py    the socket's place and permissions, its frames (the wire protocol), peer checks
"""

from controller.transport.mux.client import ENV, MuxRelay, sessions, stop
from controller.transport.mux.sock import mux_dir, session_key

__all__ = ["ENV", "MuxRelay", "mux_dir", "session_key", "sessions", "stop"]
