"""Shared fixtures. `pvehost`: the local Proxmox test host (tests/pvehost), once per session."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pvehost import DEFAULT_NODES, PveHost, down, find_free_port, missing_prerequisites, owner_alive


def _reap_stale_hosts() -> None:
    """Remove test hosts left by sessions that died without teardown (their owner pid is gone)."""
    for base in Path(tempfile.gettempdir()).glob("ctl-pvehost-*"):
        if (base / "state.json").exists() and not owner_alive(base):
            down(base)


@pytest.fixture(scope="session")
def pvehost() -> Iterator[PveHost]:
    """Two simulated Proxmox hosts over real sshd, real LXC containers, pct and nvidia-smi stand-ins.

    Skips (with the reason) when this machine cannot run it: not root, or lxc/sshd/tmux missing.
    CTL_PVEHOST_DIR and CTL_PVEHOST_PORT pin the base directory and port; by default each session gets
    its own directory and the first free port from 2222, so concurrent sessions do not collide.
    """
    why = missing_prerequisites()
    if why:
        pytest.skip(f"local Proxmox test host unavailable: {why}")
    _reap_stale_hosts()
    base = os.environ.get("CTL_PVEHOST_DIR") or tempfile.mkdtemp(prefix="ctl-pvehost-")
    addresses = [n.address for n in DEFAULT_NODES] + ["127.0.0.4"]
    port = int(os.environ.get("CTL_PVEHOST_PORT") or find_free_port(addresses))
    host = PveHost(base=Path(base), port=port).up(owner_pid=os.getpid())
    try:
        yield host
    finally:
        host.down()
