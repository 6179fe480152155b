"""SSH endpoints: a Proxmox host, or a container running its own sshd.

One paramiko `SSHClient` per endpoint, opened lazily and reused for every call of a command
(exec channels are cheap; handshakes are not). Host keys are verified against known_hosts: an
unknown or changed key is refused with a message that says how to accept it (jump hosts of
ssh_config's ProxyJump too). HostName, IdentityFile, ProxyJump and ProxyCommand of ~/.ssh/config and
/etc/ssh/ssh_config are honoured, so a host reachable with `ssh NAME` is reachable by ctl. Exec goes
straight to a paramiko channel so that stdin/stdout stay binary-safe and stdout/stderr stay apart.

Silent hosts: every connection sends keepalives that want an answer (`_Keepalive`, like OpenSSH's
ServerAliveInterval/ServerAliveCountMax) and is closed when `count` in a row go unanswered, so every reader
fails with ConnectionDropped instead of waiting forever; each step of connecting (TCP, banner, authentication) is
bounded by connect_timeout and the whole of it by connect_deadline() (an ssh agent or ProxyCommand that never
answers included); and every request but a follow (`stream`) has a deadline (`request_timeout`, DeadlineExceeded).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shlex
import socket
import stat
import sys
import threading
import time
import types
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.errors import ConnectionDropped, ConnectionFailed, DeadlineExceeded, HostKeyError
from controller.transport.base import Duplex, Result, Transport, limit, too_large

if TYPE_CHECKING:  # paramiko costs ~50 ms to import: only when a connection opens
    from paramiko import SSHClient

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
SSH_CONFIGS = ("~/.ssh/config", "/etc/ssh/ssh_config")  # the user's first: the first value found wins
_CHUNK = 1 << 16
CONNECT_PHASES = 3  # TCP connect, SSH banner, authentication: paramiko gives each connect_timeout


class _Versions(types.ModuleType):
    """What paramiko's import asks of importlib.metadata (its own version, for its SSH banner), answered from the
    name of its dist-info directory: importlib.metadata itself (email, zipfile, csv...) is a fifth of paramiko's
    import. Any other question goes to the real module."""

    def __init__(self) -> None:
        super().__init__("importlib.metadata")

    def version(self, name: str) -> str:
        for base in sys.path:
            try:
                names = os.listdir(base or ".")
            except OSError:
                continue
            for n in names:
                stem = n.removesuffix(".dist-info")
                if stem != n and stem.startswith(name + "-") and stem.count("-") == 1:
                    return stem[len(name) + 1:]
        return str(self._real().version(name))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real(), attr)

    def _real(self) -> Any:
        if sys.modules.get("importlib.metadata") is self:
            del sys.modules["importlib.metadata"]
        import importlib.metadata

        return importlib.metadata


_PARAMIKO_LOCK = threading.Lock()


def _paramiko() -> Any:
    """paramiko, imported on first use without invoke (paramiko.config imports it, ~40 ms, only to evaluate
    `Match exec` in ssh_config, which _ssh_config loads on demand) and without importlib.metadata (_Versions)."""
    if "paramiko" in sys.modules:
        import paramiko

        return paramiko
    # One import at a time: the stand-ins in sys.modules are the whole process's, and a second thread must
    # neither put its own over them nor take them away under the first one's import.
    with _PARAMIKO_LOCK:
        if "paramiko" not in sys.modules and "invoke" not in sys.modules:
            _import_paramiko()
    import paramiko

    return paramiko


def _import_paramiko() -> None:
    import importlib

    sys.modules["invoke"] = None  # type: ignore[assignment]  # import invoke -> ImportError, handled by paramiko
    versions = None
    if "importlib.metadata" not in sys.modules:
        # Also the package's attribute: another thread's `import importlib.metadata` finds the stand-in in
        # sys.modules and then reads importlib.metadata (no attribute is set for a module found there).
        versions = sys.modules["importlib.metadata"] = _Versions()
        importlib.metadata = versions
    try:
        import paramiko  # noqa: F401
    finally:
        del sys.modules["invoke"]
        if versions is not None:
            if sys.modules.get("importlib.metadata") is versions:
                del sys.modules["importlib.metadata"]
            if getattr(importlib, "metadata", None) is versions:
                del importlib.metadata
    import logging

    # paramiko's transport thread logs what ended it (with a traceback) at ERROR; with no handler configured,
    # logging's last resort would print that on the user's terminal. ctl reports the failure itself, once.
    logging.getLogger("paramiko").addHandler(logging.NullHandler())


def _ssh_config(address: str) -> dict[str, Any]:
    """What ssh_config says about address (HostName, IdentityFile, ProxyJump, ProxyCommand), first match wins."""
    paramiko = _paramiko()
    paths = [p for p in (os.path.expanduser(c) for c in SSH_CONFIGS) if os.path.isfile(p)]
    if not paths:
        return {}
    config = paramiko.SSHConfig()
    for p in paths:
        try:
            with open(p) as f:
                config.parse(f)
        except OSError:
            continue
    try:
        return dict(config.lookup(address))
    except ImportError:  # `Match exec` needs invoke after all
        import invoke

        paramiko.config.invoke = invoke
        return dict(config.lookup(address))


class _UnknownHostKey(Exception):
    """A host key not in known_hosts (paramiko's RejectPolicy says so only in its message text)."""


class _RevokedHostKey(Exception):
    """The host offered a key that an `@revoked` line of known_hosts names."""

    def __init__(self, key: Any, line: int) -> None:
        super().__init__(line)
        self.key = key
        self.line = line


class _RejectUnknown:
    """paramiko's missing-host-key policy (RejectPolicy) whose refusal is a type of its own; a revoked key
    (never loaded as known, so it always arrives here) is refused as revoked."""

    def __init__(self, revoked: dict[tuple[str, bytes], int] | None = None) -> None:
        self.revoked = revoked or {}

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        line = self.revoked.get((key.get_name(), key.asbytes()))
        if line is not None:
            raise _RevokedHostKey(key, line)
        raise _UnknownHostKey(hostname)


@dataclass
class KnownHosts:
    """What ctl takes from a known_hosts file. paramiko's own loader crashes on marker lines and ignores
    `@revoked`; here `@revoked` keys are never trusted (not even when a plain line lists them too) and
    `@cert-authority` lines are kept aside: ctl (paramiko) cannot verify host certificates."""

    revoked: dict[tuple[str, bytes], int] = field(default_factory=dict)  # (key type, key blob) -> line
    cert_authorities: list[tuple[list[str], int]] = field(default_factory=list)  # (host patterns, line)


def load_known_hosts(path: str, host_keys: Any) -> KnownHosts:
    """Read known_hosts into paramiko's HostKeys `host_keys` (plain lines), and its marker lines. A line that
    cannot be parsed is skipped, as OpenSSH skips it."""
    import base64
    import binascii

    paramiko = _paramiko()
    out = KnownHosts()
    plain = []
    with open(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("@"):
                fields = line.split()
                marker = fields[0]
                if marker == "@revoked" and len(fields) >= 4:
                    try:
                        out.revoked[(fields[2], base64.b64decode(fields[3], validate=True))] = lineno
                    except (binascii.Error, ValueError):
                        continue
                elif marker == "@cert-authority" and len(fields) >= 2:
                    out.cert_authorities.append((fields[1].split(","), lineno))
                continue
            plain.append((lineno, line))
    for lineno, line in plain:
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
        except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey, ValueError):
            continue
        if entry is None or (entry.key.get_name(), entry.key.asbytes()) in out.revoked:
            continue
        for name in entry.hostnames:
            have = host_keys.lookup(name)
            if have is None or entry.key.get_name() not in have:  # the first line wins, as with paramiko's load
                host_keys.add(name, entry.key.get_name(), entry.key)
    return out


def _matches(patterns: list[str], label: str) -> bool:
    """Whether a known_hosts host pattern list (wildcards, `!` negation) names `label`."""
    import fnmatch

    hit = False
    for p in patterns:
        neg = p.startswith("!")
        if fnmatch.fnmatchcase(label, p[1:] if neg else p):
            if neg:
                return False
            hit = True
    return hit


def _active(client: SSHClient) -> bool:
    t = client.get_transport()
    return t is not None and t.is_active()


class _Keepalive:
    """Notices a silent server: every `interval` seconds (once the previous probe was answered) a
    `keepalive@openssh.com` global request that wants a reply (OpenSSH's sshd answers it with a failure, which
    is an answer); when a probe stays unanswered for `count` intervals, the endpoint records why and closes the
    transport, so that every channel reader (exec, relay, sftp) fails with ConnectionDropped. A dead link is
    noticed within interval * (count + 1) seconds. paramiko's own set_keepalive only sends, never checks."""

    def __init__(self, ep: SshEndpoint, transport: Any, interval: float, count: int) -> None:
        self.ep, self.transport, self.interval, self.count = ep, transport, interval, count
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"keepalive-{ep.name}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _probe(self, answered: threading.Event) -> None:
        try:
            self.transport.global_request("keepalive@openssh.com", wait=True)  # returns once answered (or closed)
        except Exception:
            return
        if self.transport.is_active():
            answered.set()

    def _loop(self) -> None:
        answered = threading.Event()
        answered.set()
        sent_at = time.monotonic()
        tick = min(self.interval, 1.0)
        while not self.stopped.wait(tick):
            if not self.transport.is_active():
                return
            now = time.monotonic()
            if answered.is_set():
                if now - sent_at >= self.interval:
                    answered = threading.Event()
                    sent_at = now
                    threading.Thread(target=self._probe, args=(answered,), daemon=True,
                                     name=f"keepalive-probe-{self.ep.name}").start()
            elif now - sent_at >= self.interval * self.count:
                self.ep.dropped_why = (f"no answer to keepalives for {now - sent_at:.0f}s "
                                       f"(keepalive interval {self.interval:g}s, count {self.count})")
                self.transport.close()
                return


_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only


class _AckingSocket(socket.socket):
    """The connection's TCP socket, asking the kernel after each send to ACK the next segment at once.

    sshd keeps Nagle's algorithm on a session without a terminal: a packet it sends right after another waits
    until that one is ACKed. Linux delays the ACK (~40 ms) once it takes the connection for interactive, which
    it does on the first send after a receive; TCP_QUICKACK undoes that until the next send. The stall it
    removes is on every new connection: after authentication sshd sends its host keys notice, then its answer
    to our channel open, which waited 40 ms for our ACK of the notice. The cost is a bare ACK where one would
    have ridden on our next packet, and a system call per send."""

    __slots__ = ()

    def send(self, data: Any, flags: int = 0) -> int:
        n = super().send(data, flags)
        self._ack_next()
        return n

    def sendall(self, data: Any, flags: int = 0) -> None:
        super().sendall(data, flags)
        self._ack_next()

    def _ack_next(self) -> None:
        if _QUICKACK is not None:
            with contextlib.suppress(OSError):
                self.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)


#: Ciphers asked for first when both sides have them: AES-GCM seals a packet in one call, where paramiko's
#: default (AES-CTR) adds an HMAC and a byte-by-byte compare in Python (bench/ssh_ciphers.py: 0.72x the CPU of
#: a small request and its answer). OpenSSH has offered both since 6.2; a server without them gets paramiko's
#: own order.
AEAD_FIRST = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _aead_first(*args: Any, **kwargs: Any) -> Any:
    """SSHClient.connect's transport_factory: paramiko's Transport with AEAD_FIRST in front of its ciphers
    (those of them this paramiko knows; the rest in its own order)."""
    t = _paramiko().Transport(*args, **kwargs)
    opts = t.get_security_options()
    known = [c for c in AEAD_FIRST if c in t._cipher_info]
    opts.ciphers = tuple(known) + tuple(c for c in opts.ciphers if c not in known)
    return t


def _tcp_connect(host: str, port: int, timeout: float) -> socket.socket:
    """The TCP connection paramiko's SSHClient.connect would open (every address of host in turn; refused and
    unreachable ones collected into its NoValidConnectionsError, any other error raised), with TCP_NODELAY set
    before the handshake: the handshake writes small packets back to back (KEXINIT then KEX_ECDH_INIT, NEWKEYS
    then the service request), and with Nagle's algorithm each second one waited for the server's delayed ACK
    of the first, ~40 ms each, on every connection. The socket is an _AckingSocket, for the server's side of
    that same stall."""
    paramiko = _paramiko()
    errors: dict[tuple[Any, ...], OSError] = {}
    infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    addresses = [(i[0], i[4]) for i in infos if i[1] == socket.SOCK_STREAM] or [(i[0], i[4]) for i in infos]
    for family, addr in addresses:
        sock = _AckingSocket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            if family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect(addr)
            return sock
        except OSError as e:
            sock.close()
            if e.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH):
                raise
            errors[addr] = e
    raise paramiko.ssh_exception.NoValidConnectionsError(errors)


class SshEndpoint(Transport):
    """Commands and files over one SSH connection (paramiko; ssh_config honoured)."""

    def __init__(
        self,
        name: str,
        address: str,
        *,
        port: int = 22,
        user: str = "root",
        identity_file: str | None = None,
        known_hosts: str | None = None,
        connect_timeout: float = 10.0,
        jump: list[str] | None = None,
        keepalive_interval: float = 0.0,
        keepalive_count: int = 3,
        request_timeout: float | None = None,
    ) -> None:
        self.name = name
        self.address = address
        self.port = port
        self.user = user
        self.identity_file = os.path.expanduser(identity_file) if identity_file else None
        self.known_hosts = os.path.expanduser(known_hosts or DEFAULT_KNOWN_HOSTS)
        self.connect_timeout = connect_timeout
        self.jump = jump  # ProxyJump hops still to go through (None: ask ssh_config)
        self.keepalive_interval = keepalive_interval  # 0: no keepalive
        self.keepalive_count = keepalive_count
        self.request_timeout = request_timeout
        self.dropped_why: str | None = None  # why the last connection was closed under us (keepalive)
        self.server_key: dict[str, str] | None = None  # the host key the last connection verified: label, type, key
        self._keepalive: _Keepalive | None = None
        self._jump_ep: SshEndpoint | None = None
        self._conn: SSHClient | None = None
        self._lock = threading.Lock()
        self.round_trips = 0  # exec channels opened: what the benchmarks count
        self.connects = 0  # SSH connections opened (more than one: a dropped connection was re-opened)

    # --- connection ------------------------------------------------------------------------------

    def _host_key_label(self) -> str:
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    def connection(self) -> SSHClient:
        with self._lock:
            if self._conn is not None and _active(self._conn):
                return self._conn
            if self._conn is not None:
                self._conn.close()
            if self._keepalive is not None:
                self._keepalive.stop()
            self._conn = self._open_within()
            self.dropped_why = None
            self.connects += 1
            transport = self._conn.get_transport()
            if self.keepalive_interval > 0 and transport is not None:
                self._keepalive = _Keepalive(self, transport, self.keepalive_interval, self.keepalive_count)
            return self._conn

    def connect_deadline(self) -> float:
        """Seconds a connect may take in all (_open_within): each of its phases gets connect_timeout."""
        return CONNECT_PHASES * self.connect_timeout + 5

    def _open_within(self) -> SSHClient:
        """_open, given connect_deadline() in all. paramiko bounds the TCP connect, the banner
        and each answer of the server, not what waits on this side: an ssh agent that never answers (a forwarded
        agent whose connection died: paramiko asks it for keys once the identity file is refused), a ProxyCommand
        that hangs. Past the deadline the attempt is left to itself (what it opens later is closed) and the
        command gets one line."""
        box: dict[str, Any] = {}
        lock = threading.Lock()
        done = threading.Event()

        def attempt() -> None:
            try:
                conn = self._open()
            except Exception as e:  # raised in the caller's thread below
                with lock:
                    box["error"] = e
                    done.set()
                return
            with lock:
                if box.get("abandoned"):
                    conn.close()
                    return
                box["conn"] = conn
                done.set()

        threading.Thread(target=attempt, name=f"connect-{self.name}", daemon=True).start()
        seconds = self.connect_deadline()
        if not done.wait(seconds):
            with lock:
                if not done.is_set():
                    box["abandoned"] = True
                    raise DeadlineExceeded(
                        f"{self.name}: connecting to {self.address}:{self.port} did not finish in {seconds:g}s",
                        hint="something on this side does not answer: the ssh agent (SSH_AUTH_SOCK; paramiko asks it "
                             "when the identity file is refused) or a ProxyCommand; CTL_CONNECT_TIMEOUT sets the "
                             "time")
        if "error" in box:
            raise box["error"]
        conn: SSHClient = box["conn"]
        return conn

    def _why(self) -> str:
        """What the keepalive found, for the messages of readers whose connection it closed."""
        return f" ({self.dropped_why})" if self.dropped_why else ""

    def _open(self) -> SSHClient:
        paramiko = _paramiko()
        cfg = _ssh_config(self.address)
        host = cfg.get("hostname", self.address)
        keys = [self.identity_file] if self.identity_file else []
        keys += [os.path.expanduser(k) for k in cfg.get("identityfile", [])]
        client: SSHClient = paramiko.SSHClient()
        known = KnownHosts()
        if os.path.exists(self.known_hosts):
            try:
                known = load_known_hosts(self.known_hosts, client.get_host_keys())
            except (OSError, UnicodeDecodeError) as e:
                raise HostKeyError(f"{self.name}: cannot read known_hosts {self.known_hosts}: {e}") from None
        policy: Any = _RejectUnknown(known.revoked)
        client.set_missing_host_key_policy(policy)
        accept = (
            f"check the key out of band, then add it: ssh-keyscan -p {self.port} {self.address} "
            f">> {self.known_hosts}"
        )
        try:
            sock = self._gateway(cfg, host) or _tcp_connect(host, self.port, self.connect_timeout)
            kwargs: dict[str, Any] = {"key_filename": keys} if keys else {}  # a list works (the stubs say str)
            client.connect(
                host, port=self.port, username=self.user, timeout=self.connect_timeout, sock=sock,
                allow_agent=True, look_for_keys=self.identity_file is None, banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout, channel_timeout=self.connect_timeout,
                transport_factory=_aead_first, **kwargs,
            )
        except _RevokedHostKey as e:
            client.close()
            raise HostKeyError(
                f"{self.name}: host key for {self._host_key_label()} ({e.key.get_name()} {e.key.fingerprint}) is "
                f"REVOKED ({self.known_hosts}:{e.line} @revoked); refusing to connect") from None
        except _UnknownHostKey:
            client.close()
            label = self._host_key_label()
            ca = [n for pats, n in known.cert_authorities if _matches(pats, label) or _matches(pats, self.address)]
            if ca:
                raise HostKeyError(
                    f"{self.name}: host certificates are not supported: {self.known_hosts}:{ca[0]} "
                    f"(@cert-authority) is the only trust for {label}; refusing to connect",
                    hint=f"add the host's plain key: {accept}") from None
            raise HostKeyError(
                f"{self.name}: host key for {self._host_key_label()} is unknown "
                f"(not in {self.known_hosts}); refusing to connect",
                hint=accept,
            ) from None
        except paramiko.BadHostKeyException as e:
            client.close()
            line = known.revoked.get((e.key.get_name(), e.key.asbytes()))
            if line is not None:
                raise HostKeyError(
                    f"{self.name}: host key for {self._host_key_label()} ({e.key.get_name()} {e.key.fingerprint}) "
                    f"is REVOKED ({self.known_hosts}:{line} @revoked); refusing to connect") from None
            raise HostKeyError(
                f"{self.name}: host key for {self._host_key_label()} CHANGED "
                f"(got {e.key.get_name()} {e.key.fingerprint}); refusing to connect",
                hint=f"if the host was reinstalled, remove the old line from {self.known_hosts} and {accept}",
            ) from None
        except paramiko.SSHException as e:
            # paramiko's start_client gives up silently at its timeout; what follows then fails on a session that
            # never began ("No existing session"). No banner read: the port answers TCP but no SSH server speaks.
            t = client.get_transport()
            spoke, keyed = getattr(t, "remote_version", None), getattr(t, "session_id", None)
            client.close()
            if isinstance(e, paramiko.AuthenticationException):
                raise ConnectionFailed(
                    f"{self.name}: authentication as {self.user}@{self.address}:{self.port} refused "
                    f"({e}); check identity_file or your ssh agent"
                ) from None
            if not spoke:
                raise ConnectionFailed(
                    f"{self.name}: {self.address}:{self.port} accepted the connection but no SSH server answered "
                    f"in {self.connect_timeout:g}s (no SSH banner)") from None
            if not keyed:
                raise ConnectionFailed(
                    f"{self.name}: the SSH handshake with {self.address}:{self.port} did not finish in "
                    f"{self.connect_timeout:g}s ({spoke})") from None
            raise ConnectionFailed(f"{self.name}: SSH to {self.address}:{self.port} failed: {e}") from None
        except (TimeoutError, OSError, EOFError) as e:
            client.close()
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise ConnectionFailed(f"{self.name}: cannot reach {self.address}:{self.port}: {reason}") from None
        transport = client.get_transport()
        key = transport.get_remote_server_key() if transport is not None else None
        if key is not None:  # what known_hosts vouched for, under the name paramiko looked it up by
            self.server_key = {"label": host if self.port == 22 else f"[{host}]:{self.port}",
                               "type": key.get_name(), "key": key.get_base64()}
        return client

    def _gateway(self, cfg: dict[str, Any], host: str) -> Any:
        """ssh_config's ProxyJump (each hop verified against the same known_hosts) or ProxyCommand."""
        paramiko = _paramiko()
        hops = [h for h in (self.jump if self.jump is not None else
                            cfg.get("proxyjump", "").split(",")) if h and h.lower() != "none"]
        if hops:
            user, _, rest = hops[-1].rpartition("@")
            hop_host, _, hop_port = rest.partition(":")
            if hop_host in (host, self.address):
                return None  # a wildcard Host entry naming ourselves as our own jump host
            if self._jump_ep is None:
                self._jump_ep = SshEndpoint(
                    f"{self.name} (via {hops[-1]})", hop_host, port=int(hop_port or 22), user=user or self.user,
                    identity_file=self.identity_file, known_hosts=self.known_hosts,
                    connect_timeout=self.connect_timeout, jump=hops[:-1],
                    keepalive_interval=self.keepalive_interval, keepalive_count=self.keepalive_count,
                    request_timeout=self.request_timeout,
                )
            transport = self._jump_ep.connection().get_transport()
            assert transport is not None
            return transport.open_channel("direct-tcpip", (host, self.port), ("", 0))
        if cfg.get("proxycommand"):
            return paramiko.ProxyCommand(cfg["proxycommand"])
        return None

    def close(self) -> None:
        with self._lock:
            if self._keepalive is not None:
                self._keepalive.stop()
                self._keepalive = None
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        if self._jump_ep is not None:
            self._jump_ep.close()

    def _channel(self) -> Any:
        conn = self.connection()
        transport = conn.get_transport()
        if transport is None or not transport.is_active():
            self.close()
            conn = self.connection()
            transport = conn.get_transport()
        if transport is None:
            raise ConnectionDropped(f"{self.name}: SSH connection lost{self._why()}")
        try:
            chan = transport.open_session(timeout=self.connect_timeout)
        except Exception as e:  # paramiko raises SSHException/EOFError when the peer went away
            why = self._why()
            self.close()
            raise ConnectionDropped(f"{self.name}: SSH connection lost: {e or type(e).__name__}{why}") from None
        self.round_trips += 1
        return chan

    # --- exec ------------------------------------------------------------------------------------

    def command_line(self, argv: Sequence[str]) -> str:
        """The string the remote login shell receives: quoted once, here, at the edge."""
        return shlex.join(argv)

    def run(
        self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
        max_output: int | None = None,
    ) -> Result:
        t0 = time.monotonic()
        out: list[bytes] = []
        err: list[bytes] = []
        code = -1
        size = 0
        chunks = self._exec(argv, stdin=stdin, timeout=limit(timeout, self.request_timeout))
        try:
            for kind, data in chunks:
                if kind == "out":
                    out.append(data)
                elif kind == "err":
                    err.append(data)
                else:
                    code = int(data)
                size += len(data) if kind != "exit" else 0
                if max_output is not None and size > max_output:
                    raise too_large(self.name, argv, max_output)
        finally:
            chunks.close()  # past the limit: its channel closes now, the rest is never read
        return Result(tuple(argv), code, b"".join(out), b"".join(err), time.monotonic() - t0)

    def stream(
        self, argv: Sequence[str], *, timeout: float | None = None, idle: float | None = None
    ) -> Iterator[tuple[str, bytes]]:
        """Yield ("out"|"err", chunk) as they arrive, then ("exit", b"<code>"); ("idle", b"") on silence."""
        yield from self._exec(argv, stdin=None, timeout=limit(timeout, None), idle=idle)

    def _exec(
        self, argv: Sequence[str], *, stdin: bytes | None, timeout: float | None, idle: float | None = None
    ) -> Generator[tuple[str, bytes], None, None]:
        chan = self._channel()
        deadline = None if timeout is None else time.monotonic() + timeout
        quiet_since = time.monotonic()
        try:
            chan.exec_command(self.command_line(argv))
            if stdin is not None:
                writer = threading.Thread(target=_feed, args=(chan, stdin), daemon=True)
                writer.start()
            else:
                chan.shutdown_write()
            while True:
                got = False
                while chan.recv_ready():
                    yield "out", chan.recv(_CHUNK)
                    got = True
                while chan.recv_stderr_ready():
                    yield "err", chan.recv_stderr(_CHUNK)
                    got = True
                drained = not chan.recv_ready() and not chan.recv_stderr_ready()
                if chan.exit_status_ready() and drained and (chan.eof_received or chan.closed):
                    break
                if chan.closed and not got:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(f"{self.name}: no answer to `{shlex.join(argv)[:120]}` in {timeout:g}s",
                                           hint="the host, pct or the command stopped answering (CTL_TIMEOUT, "
                                                "hosts.H.timeout)")
                if got:
                    quiet_since = time.monotonic()
                else:
                    select.select([chan], [], [], 0.05)
                    if idle is not None and time.monotonic() - quiet_since >= idle:
                        quiet_since = time.monotonic()
                        yield "idle", b""
            # paramiko reports -1 when the channel closed without an exit status: the connection went away.
            status = chan.recv_exit_status() if chan.exit_status_ready() else -1
            if status == -1:
                why = self._why()
                self.close()
                raise ConnectionDropped(f"{self.name}: SSH connection dropped while running `{argv[0]}`{why}")
            yield "exit", str(status).encode()
        except (OSError, EOFError) as e:
            why = self._why()
            self.close()
            raise ConnectionDropped(f"{self.name}: SSH connection dropped: {e or type(e).__name__}{why}") from None
        finally:
            chan.close()

    def exec_channel(self, argv: Sequence[str]) -> Any:
        """A raw paramiko channel running argv (for protocols of our own, e.g. the host relay)."""
        chan = self._channel()
        try:
            chan.exec_command(self.command_line(argv))
        except (OSError, EOFError) as e:
            self.close()
            raise ConnectionDropped(f"{self.name}: SSH connection dropped: {e or type(e).__name__}") from None
        return chan

    def open(self, argv: Sequence[str]) -> Duplex:
        return _ChannelDuplex(self, self.exec_channel(argv), tuple(argv))

    # --- files -----------------------------------------------------------------------------------

    def sftp(self) -> Any:
        """An SFTP session whose every read waits at most request_timeout (TimeoutError: a silent server)."""
        sftp = self.connection().open_sftp()
        chan = sftp.get_channel()
        if chan is not None:
            chan.settimeout(self.request_timeout)
        return sftp

    def _sftp_silent(self, what: str) -> DeadlineExceeded:
        self.close()  # the SFTP session is in an unknown state: drop it with the connection
        return DeadlineExceeded(f"{self.name}: {what}: no answer from the SFTP server in {self.request_timeout:g}s")

    def put(self, local_path: str, remote_path: str) -> None:
        """SFTP upload (not atomic: callers that need atomicity write a temp name and rename)."""
        what = f"upload of {local_path} to {remote_path}"
        try:
            with self.sftp() as sftp:
                sftp.put(local_path, remote_path)
                sftp.chmod(remote_path, stat.S_IMODE(os.stat(local_path).st_mode))  # the local mode, as before
        except TimeoutError:
            raise self._sftp_silent(what) from None
        except (OSError, EOFError) as e:
            raise ConnectionFailed(f"{self.name}: {what} failed: {e}{self._why()}") from None

    def get(self, remote_path: str, local_path: str) -> None:
        try:
            with self.sftp() as sftp:
                sftp.get(remote_path, local_path)
                mode = sftp.stat(remote_path).st_mode
            if mode is not None:
                os.chmod(local_path, stat.S_IMODE(mode))
        except FileNotFoundError:
            raise ConnectionFailed(f"{self.name}: {remote_path} does not exist") from None
        except TimeoutError:
            raise self._sftp_silent(f"download of {remote_path}") from None
        except (OSError, EOFError) as e:
            raise ConnectionFailed(f"{self.name}: download of {remote_path} failed: {e}{self._why()}") from None

    def ssh_argv(self, *, tty: bool = False) -> list[str]:
        """The OpenSSH client line for this endpoint, with the same host-key rules as ours."""
        cmd = ["ssh", *(["-t"] if tty else []), "-p", str(self.port), "-o", f"UserKnownHostsFile={self.known_hosts}",
               "-o", "StrictHostKeyChecking=yes"]
        if self.identity_file:
            cmd += ["-i", self.identity_file]
        # `-l USER -- HOST`: neither the user nor the address can be read as an option of ssh
        return [*cmd, "-l", self.user, "--", self.address]

    def script(self, argv: Sequence[str]) -> str:
        return shlex.join([*self.ssh_argv(), self.command_line(argv)])

    def interactive_argv(self, argv: Sequence[str]) -> list[str]:
        """An `ssh -t` command line for interactive use (attach): same host-key rules as ours."""
        return [*self.ssh_argv(tty=True), self.command_line(argv)]


class _ChannelDuplex(Duplex):
    def __init__(self, ep: SshEndpoint, chan: Any, argv: tuple[str, ...]) -> None:
        self.ep, self.chan, self.argv = ep, chan, argv
        self.buf = b""
        self.err = b""
        self.t0 = time.monotonic()

    def _lost(self, e: BaseException | None = None) -> ConnectionDropped:
        why = (f": {e}" if e else "") + self.ep._why()
        self.ep.close()
        return ConnectionDropped(f"{self.ep.name}: SSH connection dropped while running `{self.argv[0]}`{why}")

    def send(self, data: bytes) -> None:
        # Chunked through a memoryview: paramiko's sendall re-slices the bytes (quadratic on large bundles).
        view = memoryview(data)
        try:
            while view:
                n = self.chan.send(view[:_CHUNK])
                if n <= 0:
                    raise self._lost()
                view = view[n:]
        except (OSError, EOFError) as e:
            raise self._lost(e) from None

    def _pump(self, timeout: float) -> bool:
        got = False
        while self.chan.recv_stderr_ready():
            self.err += self.chan.recv_stderr(_CHUNK)
        if self.chan.recv_ready():
            data = self.chan.recv(_CHUNK)
            self.buf += data
            got = bool(data)
        elif not (self.chan.eof_received or self.chan.closed):
            select.select([self.chan], [], [], timeout)
        return got

    def readline(self, timeout: float | None = None) -> bytes:
        timeout = limit(timeout, self.ep.request_timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while b"\n" not in self.buf:
                if not self._pump(0.05) and (self.chan.eof_received or self.chan.closed) \
                        and not self.chan.recv_ready():
                    line, self.buf = self.buf, b""
                    return line
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(f"{self.ep.name}: no answer from `{self.argv[0]}` in {timeout:g}s")
        except (OSError, EOFError) as e:
            raise self._lost(e) from None
        line, _, self.buf = self.buf.partition(b"\n")
        return line + b"\n"

    def finish(self, timeout: float | None = None) -> Result:
        timeout = limit(timeout, self.ep.request_timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.chan.shutdown_write()
            while not (self.chan.exit_status_ready() and not self.chan.recv_ready()
                       and not self.chan.recv_stderr_ready() and (self.chan.eof_received or self.chan.closed)):
                self._pump(0.05)
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(f"{self.ep.name}: `{self.argv[0]}` did not finish in {timeout:g}s")
            status = self.chan.recv_exit_status()
        except (OSError, EOFError) as e:
            raise self._lost(e) from None
        finally:
            self.chan.close()
        if status == -1:
            raise self._lost()
        out, self.buf = self.buf, b""
        return Result(self.argv, status, out, self.err, time.monotonic() - self.t0)


def _feed(chan: Any, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            n = chan.send(view[:_CHUNK])
            if n <= 0:
                break
            view = view[n:]
        chan.shutdown_write()
    except (OSError, EOFError):
        pass
