"""One exception tree for ctl, and the exit codes the CLI turns it into.

Every error carries what the user needs to act (the file and key, the host, the command and the
last lines of its output); `cli.main` catches `CtlError` in one place and prints one line.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from enum import IntEnum


class ExitCode(IntEnum):
    """Documented exit codes of `ctl` (docs/reference/exit-codes.md). Runbooks branch on these."""

    OK = 0
    FAILURE = 1  # an operation failed (a remote command, a verify, one of several containers)
    USAGE = 2  # bad command line (typer/click uses 2 as well)
    INVENTORY = 3  # inventory file missing, unparsable or invalid
    INPUT = 4  # bad user input: a name, a path, a payload source, a template variable
    CONNECTION = 5  # SSH / API unreachable, authentication refused, connection dropped
    HOST_KEY = 6  # host key unknown or changed: refused
    NOT_RUNNING = 7  # the container is stopped (or does not exist on its host)
    DRIFT = 8  # deployed files differ from the pinned manifest
    BUSY = 9  # GPUs busy, tmux session exists, run name taken
    CLOBBER = 10  # the operation would overwrite a log, cache or record: refused
    ENV_MISMATCH = 11  # environment differs from its lock
    DISK = 12  # not enough free disk
    VERIFY = 13  # content verification failed after a transfer
    GPU_SETUP = 14  # `ctl doctor` found a failing check; `ctl launch` refused a broken GPU setup
    RUN_FAILED = 20  # a followed run ended non-zero or with a crash signature
    SLOW = 21  # a run's throughput is below its baseline
    STALLED = 22  # a run's log stopped moving
    API = 30  # Proxmox API error or failed UPID task


class CtlError(Exception):
    """Base of every error ctl reports to the user."""

    exit_code: ExitCode = ExitCode.FAILURE

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class InventoryError(CtlError):
    """The inventory is unreadable or invalid. The message names file, line and key."""

    exit_code = ExitCode.INVENTORY

    def __init__(self, path: str, message: str, *, line: int | None = None, key: str | None = None) -> None:
        where = path if line is None else f"{path}:{line}"
        text = f"{where}: {message}" if key is None else f"{where}: {key}: {message}"
        super().__init__(text)
        self.path = path
        self.line = line
        self.key = key


class InputError(CtlError):
    """A user-supplied value is invalid (name, path, option); refused before any command is built."""

    exit_code = ExitCode.INPUT


class ConnectionFailed(CtlError):
    exit_code = ExitCode.CONNECTION


# How a connection that was up ended under a running command. Same exit code as ConnectionFailed; the type
# is what code branches on (the message is only for the user).


class ConnectionDropped(ConnectionFailed):
    """The SSH connection (or the socket of ctl's persistent session) went away unasked."""


class RelayExited(ConnectionFailed):
    """ctl's host relay exited by itself while streams were still open."""


class SessionEnded(ConnectionFailed):
    """ctl's persistent session ended on purpose (`ctl mux stop`, idle timeout) under a client."""


class DeadlineExceeded(ConnectionFailed):
    """A request got no (complete) answer within its deadline: the host, the relay, `pct` or the agent (or
    ctl's session process) stopped answering while the SSH connection itself may still be up. The message
    names the host, what was asked and how long ctl waited. Nothing about the run is concluded from it."""


class HostKeyError(CtlError):
    """The host's key is not in known_hosts, or differs from it: the connection is refused (exit 6)."""

    exit_code = ExitCode.HOST_KEY


class NotRunning(CtlError):
    """The container is stopped, or does not exist on its host (exit 7)."""

    exit_code = ExitCode.NOT_RUNNING


class DriftError(CtlError):
    """The container's deployed files differ from the pinned payload (exit 8); `ctl deploy` fixes it."""

    exit_code = ExitCode.DRIFT


class BusyError(CtlError):
    """Something already holds what the command needs: a GPU, a tmux session, a run name (exit 9)."""

    exit_code = ExitCode.BUSY


class RegistryLocked(BusyError):
    """Another writer held the registry past SQLite's wait (CTL_REGISTRY_WAIT_S, 30 s unless set): nothing was
    written (exit 9)."""


class ClobberError(CtlError):
    """The command would overwrite a log, cache, record or checkpoint: refused, whatever --force says (exit 10)."""

    exit_code = ExitCode.CLOBBER


class EnvMismatch(CtlError):
    """The container's environment differs from its lock (exit 11)."""

    exit_code = ExitCode.ENV_MISMATCH


class DiskError(CtlError):
    """Not enough free disk where the command writes (exit 12)."""

    exit_code = ExitCode.DISK


class VerifyError(CtlError):
    """What arrived is not what was sent: a hash differs after a transfer (exit 13)."""

    exit_code = ExitCode.VERIFY


class GpuSetupError(CtlError):
    """A container's GPUs cannot work as set up (a device node, the user space against the driver)."""

    exit_code = ExitCode.GPU_SETUP


class ApiError(CtlError):
    """The Proxmox API refused a request, or its UPID task failed (exit 30)."""

    exit_code = ExitCode.API


class OutputTooLarge(CtlError):
    """A command wrote more than its caller would hold (a reply of ctl's agent is bounded): it was stopped there,
    and the rest never read, let alone kept in memory."""


class RemoteCommandError(CtlError):
    """A remote command exited non-zero. Shows where, what, the exit code and the last lines of stderr."""

    exit_code = ExitCode.FAILURE

    def __init__(
        self, where: str, argv: Sequence[str], returncode: int, stderr: str = "", *, what: str | None = None
    ) -> None:
        tail = " | ".join(line for line in stderr.strip().splitlines()[-3:] if line.strip())
        if len(tail) > 600:  # stderr is the far side's: one error line stays one readable line
            tail = tail[:600] + f" ... [cut: {len(tail) - 600} chars]"
        cmd = shlex.join(argv)
        if len(cmd) > 160:
            cmd = cmd[:157] + "..."
        head = f"{where}: {what}: " if what else f"{where}: "
        text = f"{head}`{cmd}` exited {returncode}"
        if tail:
            text += f": {tail}"
        super().__init__(text)
        self.where = where
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
