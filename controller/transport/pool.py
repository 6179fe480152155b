"""Connections for one ctl command: one SSH connection per host, shared by its containers."""

from __future__ import annotations

import threading

from controller.inventory import Container, Inventory
from controller.transport.base import Transport
from controller.transport.local import LocalContainer
from controller.transport.pct import PctContainer
from controller.transport.ssh import SshEndpoint


class Pool:
    """Opens endpoints lazily and closes them all at the end (use as a context manager)."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self._hosts: dict[str, SshEndpoint] = {}
        self._direct: dict[str, SshEndpoint] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> SshEndpoint:
        with self._lock:
            ep = self._hosts.get(name)
            if ep is None:
                spec = self.inventory.model.hosts[name]
                ep = SshEndpoint(
                    name, spec.address, port=spec.port, user=spec.user,
                    identity_file=self._abs(spec.identity_file), known_hosts=self._abs(spec.known_hosts),
                )
                self._hosts[name] = ep
            return ep

    def _abs(self, p: str | None) -> str | None:
        if p is None or p.startswith("~") or p.startswith("/"):
            return p
        return str(self.inventory.base_dir / p)

    def container(self, ct: Container) -> Transport:
        spec = ct.spec
        if spec.transport == "local":
            assert ct.root is not None
            return LocalContainer(ct.name, ct.root)
        if spec.transport == "ssh":
            with self._lock:
                ep = self._direct.get(ct.name)
                if ep is None:
                    assert spec.address is not None
                    ep = SshEndpoint(
                        ct.name, spec.address, port=spec.port, user=spec.user,
                        identity_file=self._abs(spec.identity_file), known_hosts=self._abs(spec.known_hosts),
                    )
                    self._direct[ct.name] = ep
                return ep
        assert ct.host_name is not None and ct.host is not None and spec.vmid is not None
        return PctContainer(ct.name, self.host(ct.host_name), spec.vmid, pct=ct.host.pct,
                            stage_dir=ct.host.stage_dir)

    def round_trips(self) -> int:
        return sum(ep.round_trips for ep in [*self._hosts.values(), *self._direct.values()])

    def close(self) -> None:
        for ep in [*self._hosts.values(), *self._direct.values()]:
            ep.close()
