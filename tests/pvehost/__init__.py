"""A faithful local Proxmox VE host for the integration tests: sshd per node, real LXC containers, pct.

    python -m tests.pvehost up [--dir D] [--port P] [--extra-cts N]   # default dir /tmp/ctl-pvehost (CTL_PVEHOST_DIR)
    python -m tests.pvehost status [--dir D]
    python -m tests.pvehost down [--dir D]
"""

from tests.pvehost.host import (
    DEFAULT_DIR,
    DEFAULT_NODES,
    DEFAULT_PORT,
    NodeSpec,
    PveHost,
    PveHostError,
    down,
    find_free_port,
    leftover_processes,
    load,
    missing_prerequisites,
    owner_alive,
)

__all__ = [
    "DEFAULT_DIR",
    "DEFAULT_NODES",
    "DEFAULT_PORT",
    "NodeSpec",
    "PveHost",
    "PveHostError",
    "down",
    "find_free_port",
    "leftover_processes",
    "load",
    "missing_prerequisites",
    "owner_alive",
]
