"""paramiko's CPU per small packet with each cipher ctl may ask for (controller/transport/ssh.py, AEAD_FIRST).

    python3 bench/ssh_ciphers.py [--rounds 3000] [--repeat 3]

Two paramiko Transports in this process, over a socketpair: a client as ctl's session process makes it, and a
server. Each round sends 200 bytes on a channel and 300 bytes back (the size of an agent request and its
answer), so a round is four packets sealed and opened in paramiko. The cases alternate in the same run; the
figure is this process's CPU (every thread) per round. sshd, the real other end, is C: only half of the packets
here are the session's own work.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from typing import Any

import paramiko
from paramiko.common import AUTH_SUCCESSFUL, OPEN_SUCCEEDED

CIPHERS = ("aes128-ctr", "aes128-gcm@openssh.com")


class _Server(paramiko.ServerInterface):
    def get_allowed_auths(self, username: str) -> str:
        return "none"

    def check_auth_none(self, username: str) -> int:
        return int(AUTH_SUCCESSFUL)

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return int(OPEN_SUCCEEDED)


def _recv_exactly(chan: Any, n: int) -> None:
    while n:
        got = chan.recv(n)
        if not got:
            raise SystemExit("bench: the channel closed")
        n -= len(got)


def measure(cipher: str, key: paramiko.PKey, rounds: int) -> float:
    """CPU seconds per round with `cipher` both ways."""
    a, b = socket.socketpair()
    server = paramiko.Transport(b)
    server.add_server_key(key)
    ready = threading.Event()
    server.start_server(event=ready, server=_Server())  # returns at once; the handshake runs in its thread
    client = paramiko.Transport(a)
    client.get_security_options().ciphers = (cipher,)
    client.connect()
    client.auth_none("bench")
    chan = client.open_session()
    peer = server.accept(10)
    if peer is None or client.remote_cipher != cipher:  # type: ignore[attr-defined]  # not in the stubs
        raise SystemExit(f"bench: no channel with {cipher}")
    ask, answer = b"a" * 200, b"b" * 300

    def serve() -> None:
        for _ in range(rounds):
            _recv_exactly(peer, len(ask))
            peer.sendall(answer)

    t = threading.Thread(target=serve)
    c0 = time.process_time()
    t.start()
    for _ in range(rounds):
        chan.sendall(ask)
        _recv_exactly(chan, len(answer))
    t.join()
    cpu = time.process_time() - c0
    client.close()
    server.close()
    return cpu / rounds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    key = paramiko.ECDSAKey.generate()
    got: dict[str, list[float]] = {c: [] for c in CIPHERS}
    for _ in range(args.repeat):
        for c in CIPHERS:
            got[c].append(measure(c, key, args.rounds))
    print(f"paramiko {paramiko.__version__}, {args.rounds} rounds (4 packets each), medians of {args.repeat}:")
    med = {c: statistics.median(v) for c, v in got.items()}
    for c, v in med.items():
        print(f"  {c:<24} {v * 1e6:7.1f} us CPU a round")
    print(f"ratio {CIPHERS[1]} / {CIPHERS[0]}: {med[CIPHERS[1]] / med[CIPHERS[0]]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
