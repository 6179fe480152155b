"""The cipher ctl asks for first (controller/transport/ssh.py, AEAD_FIRST), against real sshd: AES-GCM where the
server has it, and a server configured without it still connects, with a cipher of paramiko's own order."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from controller.transport.ssh import SshEndpoint
from tests.pvehost import PveHost, find_free_port
from tests.pvehost.host import SSHD

pytestmark = pytest.mark.pvehost


def _negotiated(ep: SshEndpoint) -> tuple[str, str, bytes]:
    """(cipher out, cipher in, what `echo` sent back) over ep's connection."""
    try:
        t = ep.connection().get_transport()
        assert t is not None
        r = ep.run(["echo", "sealed"], timeout=30)
        return t.local_cipher, t.remote_cipher, r.stdout  # type: ignore[attr-defined]  # not in the stubs
    finally:
        ep.close()


def test_aes_gcm_where_the_server_has_it(pvehost: PveHost) -> None:
    addr, port, _ = pvehost.hosts["pve1"]
    ep = SshEndpoint("pve1", addr, port=port, identity_file=str(pvehost.client_key),
                     known_hosts=str(pvehost.known_hosts))
    assert _negotiated(ep) == ("aes128-gcm@openssh.com", "aes128-gcm@openssh.com", b"sealed\n")


def test_a_server_without_aes_gcm_still_connects(pvehost: PveHost, tmp_path: Path) -> None:
    addr, port, _ = pvehost.hosts["pve1"]
    other = find_free_port([addr], start=port + 1)
    # The host's own sshd once more, on another port, offering AES-CTR only (its host key is the same).
    sshd = subprocess.Popen([SSHD, "-D", "-f", str(pvehost.node_dir("pve1") / "sshd_config"), "-p", str(other),
                             "-o", "Ciphers=aes256-ctr,aes128-ctr", "-o", f"PidFile={tmp_path / 'sshd.pid'}",
                             "-E", str(tmp_path / "sshd.log")])
    try:
        label = f"[{addr}]:{port}"
        lines = [ln.split(None, 1)[1] for ln in pvehost.known_hosts.read_text().splitlines()
                 if ln.split(None, 1)[0] == label]
        assert lines, f"no line for {label} in {pvehost.known_hosts}"
        kh = tmp_path / "known_hosts"
        kh.write_text("".join(f"[{addr}]:{other} {rest}\n" for rest in lines))
        ep = SshEndpoint("pve1", addr, port=other, identity_file=str(pvehost.client_key), known_hosts=str(kh),
                         connect_timeout=10)
        deadline = time.monotonic() + 10
        while True:  # until it listens
            try:
                got = _negotiated(ep)
                break
            except Exception:
                if time.monotonic() > deadline or sshd.poll() is not None:
                    raise
                time.sleep(0.1)
        assert got == ("aes128-ctr", "aes128-ctr", b"sealed\n")  # paramiko's first that the server offers
    finally:
        sshd.terminate()
        sshd.wait(10)
