"""Connections for one ctl command: one SSH connection per host, shared by its containers.

By default each host (and each container with its own sshd) is reached through the user's persistent session
for it (controller/transport/mux/): every request of the command goes over that session's socket, and the SSH
connection is opened by the session process, once for all commands within its idle timeout. With persistence
off (CTL_PERSIST=0, or `persist: 0` on the host), a command opens its own connection, and containers of one
host that it reaches together share one exec (the host relay)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from controller import settings
from controller.inventory import Container, HostSpec, Inventory
from controller.settings import persist_seconds
from controller.transport.base import Transport
from controller.transport.local import LocalContainer
from controller.transport.mux import MuxRelay, start_early
from controller.transport.pct import PctContainer
from controller.transport.relay import HostRelay, RelayEndpoint
from controller.transport.ssh import SshEndpoint


class Pool:
    """Opens endpoints lazily and closes them all at the end (use as a context manager)."""

    def __init__(self, inventory: Inventory, *, note: Callable[[str], None] | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.inventory = inventory
        self.note = note  # what --debug shows: relay used or not, and why
        self.warn = warn  # what the user is told in one line (a session replaced, and why)
        self._hosts: dict[str, SshEndpoint] = {}
        self._direct: dict[str, SshEndpoint] = {}
        self._relays: dict[str, HostRelay] = {}
        self._direct_relays: dict[str, MuxRelay] = {}
        # each container's transport as last made: (the container, the host relay it went through, the transport)
        self._containers: dict[str, tuple[Container, HostRelay | None, Transport]] = {}
        self._lock = threading.Lock()
        self._persist_env = persist_seconds()  # CTL_PERSIST, when set, wins over the inventory's `persist:`
        # CTL_KEEPALIVE_INTERVAL / _COUNT, CTL_CONNECT_TIMEOUT, CTL_TIMEOUT win over each host's keys
        self._env = {"keepalive_interval": settings.keepalive_interval(), "keepalive_count": settings.keepalive_count(),
                     "connect_timeout": settings.connect_timeout(), "request_timeout": settings.request_timeout()}

    def limits(self, spec: HostSpec | None) -> dict[str, Any]:
        """SshEndpoint's keepalive, connect timeout and request deadline: the CTL_* variable when set, else the
        host's inventory keys (defaults: settings.DEFAULT_*). A container with its own sshd has no host: its
        endpoint gets the variables, else the defaults."""
        keepalive = spec.keepalive if spec is not None else None
        base: dict[str, Any] = {
            "keepalive_interval": keepalive.interval if keepalive else settings.DEFAULT_KEEPALIVE_INTERVAL,
            "keepalive_count": keepalive.count if keepalive else settings.DEFAULT_KEEPALIVE_COUNT,
            "connect_timeout": spec.connect_timeout if spec is not None else settings.DEFAULT_CONNECT_TIMEOUT,
            "request_timeout": spec.timeout if spec is not None else settings.DEFAULT_TIMEOUT,
        }
        base.update({k: v for k, v in self._env.items() if v is not None})
        if not base["request_timeout"]:
            base["request_timeout"] = None  # 0: no deadline
        return base

    def persist(self, host: str | None) -> int:
        """Idle seconds of the user's persistent session for this host (0: none): CTL_PERSIST or the config
        file's `persist` when set, else the host's `persist:` in the inventory, else DEFAULT_PERSIST. A container
        with its own sshd (host None) follows the first two, else the default."""
        if self._persist_env is not None:
            seconds = self._persist_env
        else:
            own = self.inventory.model.hosts[host].persist if host is not None else None
            seconds = settings.DEFAULT_PERSIST if own is None else own
        if seconds:
            from controller.transport.mux.sock import squatted

            if squatted(self.warn):  # a socket directory another user holds: never used, and never fatal
                return 0
        return seconds

    def _new_relay(self, host: str) -> HostRelay:
        seconds = self.persist(host)
        if seconds:
            return MuxRelay(self.host(host), seconds, note=self.note, warn=self.warn)
        return HostRelay(self.host(host), note=self.note)

    def host_exec(self, name: str) -> Transport:
        """Commands on the host itself (`pct snapshot ...`): through its session when it has one."""
        if self.persist(name):
            return RelayEndpoint(self.host(name), self._relay(name))
        return self.host(name)

    def _relay(self, host: str) -> HostRelay:
        with self._lock:
            relay = self._relays.get(host)
        if relay is None:
            relay = self._new_relay(host)
            with self._lock:
                relay = self._relays.setdefault(host, relay)
        return relay

    def share_exec(self, cts: Iterable[Container]) -> list[str]:
        """Hosts with two or more of these `pct` containers get one exec for all of them (ctl's host relay,
        controller/transport/relay.py): their login shell and SSH channel are paid once, not per container.
        One container alone keeps its direct exec (the relay would add a hop). Returns those hosts."""
        per_host: dict[str, int] = {}
        for ct in cts:
            if ct.spec.transport == "pct" and ct.host_name is not None:
                per_host[ct.host_name] = per_host.get(ct.host_name, 0) + 1
        shared = [h for h, n in per_host.items() if n > 1]
        for h in shared:
            self._relay(h)
        return shared

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
                    **self.limits(spec),
                )
                self._hosts[name] = ep
            return ep

    def _abs(self, p: str | None) -> str | None:
        if p is None or p.startswith("~") or p.startswith("/"):
            return p
        return str(self.inventory.base_dir / p)

    def container(self, ct: Container) -> Transport:
        """The container's transport: the same object every time this command asks for it (so one client of its
        agent serves the command: remote/'s Agent.of), unless the way there changed since, a host relay begun
        for it (share_exec)."""
        relay = None
        if ct.spec.transport == "pct":
            assert ct.host_name is not None
            if self.persist(ct.host_name):  # a lone container uses the session too
                self._relay(ct.host_name)
            with self._lock:
                relay = self._relays.get(ct.host_name)

        def kept() -> Transport | None:  # (called holding the lock)
            got = self._containers.get(ct.name)
            return got[2] if got is not None and got[1] is relay and (got[0] is ct or got[0] == ct) else None

        with self._lock:
            t = kept()
        if t is None:
            made = self._new_container(ct, relay)
            with self._lock:
                t = kept()  # another thread's, made meanwhile
                if t is None:
                    t = made
                    self._containers[ct.name] = (ct, relay, t)
        return t

    def _new_container(self, ct: Container, relay: HostRelay | None) -> Transport:
        spec = ct.spec
        if spec.transport == "local":
            assert ct.root is not None
            return LocalContainer(ct.name, ct.root)
        if spec.transport == "ssh":
            ep = self._direct_ep(ct)
            seconds = self.persist(None)
            if not seconds:
                return ep
            with self._lock:
                mux = self._direct_relays.get(ct.name)
                if mux is None:
                    mux = self._direct_relays[ct.name] = MuxRelay(ep, seconds, note=self.note, warn=self.warn)
            return RelayEndpoint(ep, mux)
        assert ct.host_name is not None and ct.host is not None and spec.vmid is not None
        return PctContainer(ct.name, self.host(ct.host_name), spec.vmid, pct=ct.host.pct,
                            stage_dir=ct.host.stage_dir, relay=relay)

    def _direct_ep(self, ct: Container) -> SshEndpoint:
        """The endpoint of a container with its own sshd."""
        spec = ct.spec
        with self._lock:
            ep = self._direct.get(ct.name)
            if ep is None:
                assert spec.address is not None
                ep = SshEndpoint(
                    ct.name, spec.address, port=spec.port, user=spec.user,
                    identity_file=self._abs(spec.identity_file), known_hosts=self._abs(spec.known_hosts),
                    **self.limits(None),
                )
                self._direct[ct.name] = ep
            return ep

    def start_sessions(self, cts: Iterable[Container]) -> list[str]:
        """Begin starting, in the background, the persistent sessions these containers are reached through (one
        per host, or per container with its own sshd), for a command that will need them once it has loaded
        (mux.start_early; the command's own requests wait for them). Returns the names of those begun."""
        begun: list[str] = []
        seen: set[str] = set()
        for ct in cts:
            if ct.spec.transport == "pct" and ct.host_name is not None:
                name, seconds = ct.host_name, self.persist(ct.host_name)
                ep = self.host(name) if seconds else None
            elif ct.spec.transport == "ssh":
                name, seconds = ct.name, self.persist(None)
                ep = self._direct_ep(ct) if seconds else None
            else:
                continue
            if ep is None or name in seen:
                continue
            seen.add(name)
            if start_early(ep, seconds, warn=self.warn):
                begun.append(name)
        return begun

    def round_trips(self) -> int:
        return sum(ep.round_trips for ep in [*self._hosts.values(), *self._direct.values()])

    def close(self) -> None:
        for relay in [*self._relays.values(), *self._direct_relays.values()]:
            relay.close()
        for ep in [*self._hosts.values(), *self._direct.values()]:
            ep.close()
