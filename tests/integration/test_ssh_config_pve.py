"""ssh_config is honoured without Fabric: HostName, IdentityFile and ProxyJump (each hop's key verified)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from controller.errors import HostKeyError
from controller.transport import ssh as ssh_mod
from controller.transport.ssh import SshEndpoint
from tests.pvehost import PveHost

pytestmark = pytest.mark.pvehost


def _config(tmp_path: Path, pvehost: PveHost, monkeypatch: pytest.MonkeyPatch, jump: bool) -> Path:
    addr1, port, _ = pvehost.hosts["pve1"]
    addr2, _, _ = pvehost.hosts["pve2"]
    key = pvehost.base / "keys" / "id_ed25519"
    cfg = tmp_path / "ssh_config"
    lines = ["Host pve2-alias", f"    HostName {addr2}", f"    IdentityFile {key}"]
    if jump:
        lines.append(f"    ProxyJump root@{addr1}:{port}")
        lines += [f"Host {addr1}", f"    IdentityFile {key}"]  # the jump host's own entry, as for OpenSSH
    cfg.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(ssh_mod, "SSH_CONFIGS", (str(cfg),))
    return cfg


@pytest.mark.parametrize("jump", [False, True])
def test_hostname_identityfile_and_proxyjump(pvehost: PveHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             jump: bool) -> None:
    _config(tmp_path, pvehost, monkeypatch, jump)
    _, port, _ = pvehost.hosts["pve2"]
    ep = SshEndpoint("pve2", "pve2-alias", port=port, known_hosts=str(pvehost.base / "keys" / "known_hosts"))
    try:
        res = ep.run(["sh", "-c", "echo $PVE_NODE"])
        assert (res.returncode, res.out.strip()) == (0, "pve2")
        assert (ep._jump_ep is not None) == jump
        # Small frames go out at once (no Nagle wait for a delayed ACK: 40 ms a request); through a jump, the
        # jump host's TCP connection carries them.
        tcp = (ep._jump_ep if jump else ep).connection().get_transport().sock  # type: ignore[union-attr]
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        # and sshd's packets are ACKed at once after each of ours (its Nagle waits for that: test_ssh_connect.py)
        assert isinstance(tcp, ssh_mod._AckingSocket)
    finally:
        ep.close()


def test_jump_host_key_is_verified_too(pvehost: PveHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _config(tmp_path, pvehost, monkeypatch, jump=True)
    _, port, _ = pvehost.hosts["pve2"]
    addr2 = pvehost.hosts["pve2"][0]
    only_target = tmp_path / "known_hosts"
    only_target.write_text("".join(ln + "\n" for ln in
                                   (pvehost.base / "keys" / "known_hosts").read_text().splitlines()
                                   if ln.startswith(f"[{addr2}]")))
    ep = SshEndpoint("pve2", "pve2-alias", port=port, known_hosts=str(only_target))
    try:
        with pytest.raises(HostKeyError, match="is unknown"):
            ep.run(["true"])
    finally:
        ep.close()
