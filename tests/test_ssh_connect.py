"""The TCP connection under every SSH connection (controller/transport/ssh.py, _tcp_connect): the one paramiko
would open, with TCP_NODELAY set before the handshake and the server's next segment ACKed at once after each
send; and a refused port still reads as paramiko said it."""

from __future__ import annotations

import socket

import paramiko
import pytest

from controller.errors import ConnectionFailed
from controller.transport.ssh import SshEndpoint, _tcp_connect


def test_the_connection_has_no_nagle_wait_from_its_first_packet() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        sock = _tcp_connect("127.0.0.1", srv.getsockname()[1], 5.0)
        try:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert sock.gettimeout() == 5.0  # paramiko's connect timeout, as it would have set it
        finally:
            sock.close()


QUICKACK = getattr(socket, "TCP_QUICKACK", None)


def _exchange(client: socket.socket, server: socket.socket) -> int:
    """One request and answer, then what the client's kernel will do with the ACK of the server's next segment:
    1 at once (quick ACK mode), 0 delayed (~40 ms; the kernel took the connection for interactive)."""
    server.sendall(b"notice")
    client.recv(64)
    client.send(b"request")  # the first send after a receive: where the kernel turns to delayed ACKs
    server.recv(64)
    return client.getsockopt(socket.IPPROTO_TCP, QUICKACK)


@pytest.mark.skipif(QUICKACK is None, reason="TCP_QUICKACK is Linux's")
def test_after_each_send_the_servers_next_segment_is_acked_at_once() -> None:
    """sshd's Nagle: its answer to our channel open waited for our delayed ACK of its host keys notice (40 ms of
    every new connection). The same exchange on a plain socket shows the kernel's delay, so the test shows this
    kernel's behaviour and not an assumption about it."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        plain = socket.create_connection(srv.getsockname())
        plain_peer, _ = srv.accept()
        acking = _tcp_connect("127.0.0.1", srv.getsockname()[1], 5.0)
        acking_peer, _ = srv.accept()
        try:
            assert [_exchange(plain, plain_peer) for _ in range(3)] == [0, 0, 0]
            assert [_exchange(acking, acking_peer) for _ in range(3)] == [1, 1, 1]
            acking.sendall(b"also through sendall")
            acking_peer.recv(64)
            assert acking.getsockopt(socket.IPPROTO_TCP, QUICKACK) == 1
        finally:
            for s in (plain, plain_peer, acking, acking_peer):
                s.close()


def test_a_refused_port_is_paramikos_error_and_ctls_one_line(tmp_path: object) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
    with pytest.raises(paramiko.ssh_exception.NoValidConnectionsError) as e:
        _tcp_connect("127.0.0.1", port, 5.0)
    assert e.value.errors and all(err.errno == 111 for err in e.value.errors.values())
    kh = f"{tmp_path}/known_hosts"
    open(kh, "w").close()
    ep = SshEndpoint("h1", "127.0.0.1", port=port, known_hosts=kh, connect_timeout=5)
    with pytest.raises(ConnectionFailed, match=rf"^h1: cannot reach 127.0.0.1:{port}: Unable to connect to port "
                                               rf"{port} on 127.0.0.1$"):
        ep.connection()
