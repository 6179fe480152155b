"""The one transport interface: run an argv, put a file, get a file.

Implementations: a Proxmox host over SSH (`ssh.HostConnection`), a container through the host's
`pct` (`pct.PctContainer`), a container over its own sshd (`ssh.SshContainer`) and this machine
(`local.LocalContainer`). Commands above this layer never import paramiko.
"""

from __future__ import annotations

import math
import shlex
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from controller.errors import CtlError, OutputTooLarge, RemoteCommandError

#: A timeout that means "no deadline": for work that is legitimately long (a cache save, a venv build). A
#: timeout of None means the endpoint's default deadline (`Transport.request_timeout`, CTL_TIMEOUT).
NO_DEADLINE = math.inf


def limit(timeout: float | None, default: float | None) -> float | None:
    """The seconds a request may take: `timeout`, else `default`; None for no deadline (NO_DEADLINE, 0)."""
    if timeout is None:
        timeout = default
    if timeout is None or math.isinf(timeout) or timeout <= 0:
        return None
    return timeout


#: What a request started without waiting comes to (Transport.submit_agent's callback): its Result or its error.
Answered = Callable[["Result | CtlError"], None]


class Submitted(Protocol):
    """A request started without waiting for it (Transport.submit_agent)."""

    t0: float  # when it was started (time.monotonic)

    def expire(self, timeout: float) -> None:
        """Past its deadline: dropped, and its callback told DeadlineExceeded (nothing, if it ended first)."""


@dataclass(frozen=True)
class Result:
    """What a finished command left: its argv, exit code and both output streams (bytes)."""

    argv: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


class Duplex(ABC):
    """A running command we converse with: send to its stdin, read lines from its stdout, then finish."""

    @abstractmethod
    def send(self, data: bytes) -> None: ...

    @abstractmethod
    def readline(self, timeout: float | None = None) -> bytes:
        """One line of stdout (with its newline); b"" when stdout ended first."""

    @abstractmethod
    def finish(self, timeout: float | None = None) -> Result:
        """Close stdin, wait for the exit; the Result holds the stdout not yet read and all stderr."""


@dataclass(frozen=True)
class AgentStart:
    """How an argv of ctl's agent (`... python3 -I -S -c BOOT N VERB ...`) may be answered by a staying agent:
    argv[at] is VERB, its stdin starts with the agent's n-byte source (sha256 `sha`), and `retry` says that the verb
    only reads (the relay may run it again when the agent it chose had ended)."""

    at: int
    n: int
    retry: bool
    sha: str = ""


def too_large(name: str, argv: Sequence[str], max_output: int) -> OutputTooLarge:
    return OutputTooLarge(f"{name}: `{shlex.join(argv[:3])} ...` wrote more than {max_output:,} bytes: stopped there, "
                          "the rest not read")


class Transport(ABC):
    """Somewhere commands run and files land: a host or a container."""

    #: Human name used in every message about this endpoint ("kpro6", "ct200 (kpro6/200)").
    name: str
    #: The deadline in seconds of a request given no timeout (run, a Duplex's readline/finish, put, get);
    #: None: none. A request past it raises DeadlineExceeded. Follows (stream) have none: keepalives guard them.
    request_timeout: float | None = None
    #: The client of ctl's agent here, made at its first use and kept with the transport (remote/'s Agent.of), so
    #: a command speaks to each container's agent through one client. Opaque to this layer.
    agent_client: object | None = None

    @abstractmethod
    def run(
        self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
        max_output: int | None = None,
    ) -> Result:
        """Run argv (no shell unless argv itself starts one) and wait for it. With `max_output`, stdout and stderr
        together past that many bytes stop it there (OutputTooLarge): what a container writes is never held
        whole before it is judged."""

    @abstractmethod
    def put(self, local_path: str, remote_path: str) -> None:
        """Copy a local file to remote_path. Implementations document their atomicity."""

    @abstractmethod
    def get(self, remote_path: str, local_path: str) -> None:
        """Copy remote_path to a local file."""

    def keeps_agents(self) -> bool:
        """Whether run_agent is answered by a staying agent here (starting the host session when there is none):
        then a request costs a message, not an exec, and a caller may split a conversation into requests."""
        return False

    def run_agent(self, argv: Sequence[str], start: AgentStart, *, stdin: bytes,
                  timeout: float | None = None, max_output: int | None = None) -> Result:
        """run(argv) for a request of ctl's agent; a transport whose host relay keeps staying agents has one of
        them answer it (the same Result, without an exec, a python3 start or a compile)."""
        return self.run(argv, stdin=stdin, timeout=timeout, max_output=max_output)

    def submit_agent(self, argv: Sequence[str], start: AgentStart, *, stdin: bytes,
                     on_done: Answered, max_output: int | None = None) -> Submitted | None:
        """run_agent without waiting, where a staying agent of a host session answers: on_done gets the Result
        (or the error) from the session's reader thread; the handle's expire() ends it past its deadline. None
        where this transport cannot (the caller runs run_agent in a thread of its own)."""
        return None

    def stream(
        self, argv: Sequence[str], *, timeout: float | None = None, idle: float | None = None
    ) -> Iterator[tuple[str, bytes]]:
        """Yield ("out"|"err", chunk) as output arrives, then ("exit", b"<code>"). With `idle`, also yield
        ("idle", b"") after that many seconds without output, so a follower can act on silence.

        The default runs to completion first; transports that can stream override it.
        """
        res = self.run(argv, timeout=timeout)
        if res.stdout:
            yield "out", res.stdout
        if res.stderr:
            yield "err", res.stderr
        yield "exit", str(res.returncode).encode()

    def open(self, argv: Sequence[str]) -> Duplex:
        """Start argv for a conversation over stdin/stdout (one exec, several exchanges)."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold a conversation")

    def path(self, container_path: str) -> str:
        """Where a container path is, as seen by commands run through this transport."""
        return container_path

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default holds none."""

    def check(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        what: str | None = None,
    ) -> Result:
        """run() and raise RemoteCommandError (where, argv, exit code, last stderr lines) on non-zero."""
        res = self.run(argv, stdin=stdin, timeout=timeout)
        if res.returncode != 0:
            raise RemoteCommandError(self.name, argv, res.returncode, res.err, what=what)
        return res

    def interactive_argv(self, argv: Sequence[str]) -> list[str]:
        """The local command line that runs argv here with the operator's terminal attached (`ctl attach`)."""
        return list(argv)

    def script(self, argv: Sequence[str]) -> str:
        """The copy-pasteable shell line that run(argv) amounts to (for --dry-run)."""
        return shlex.join(argv)
