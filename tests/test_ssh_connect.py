"""The TCP connection under every SSH connection (controller/transport/ssh.py, _tcp_connect): the one paramiko
would open, with TCP_NODELAY set before the handshake; and a refused port still reads as paramiko said it."""

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
