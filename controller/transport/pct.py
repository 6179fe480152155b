"""A container reached through its Proxmox host's `pct`.

`pct exec VMID -- argv` runs argv with no shell inside the container; the argv is quoted once, for
the host's login shell, by SshEndpoint. pct's own failures (missing CT, stopped CT) are told apart
from the command's exit status by their messages (shared/pve-facts.md) and raised as such.
`pct push` is neither atomic nor honest about failure, so `put` verifies the content afterwards.

With a relay (the user's persistent host session, or the one exec several containers share) every request
goes through it: exec, conversations, follows (`stream`), `pct status`, put and get; the host's own SSH
connection is opened only when there is none (or the host cannot run it).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Literal

from controller.errors import (
    ConnectionFailed,
    CtlError,
    DeadlineExceeded,
    NotRunning,
    RemoteCommandError,
    VerifyError,
)
from controller.files import file_sha256
from controller.transport.base import AgentStart, Answered, Duplex, Result, Submitted, Transport
from controller.transport.ssh import SshEndpoint

if TYPE_CHECKING:
    from controller.transport.relay import HostRelay

_NOT_RUNNING = re.compile(r"container '(\d+)' not running!|can only (push|pull) files (to|from) a running")
_NO_CONFIG = re.compile(r"Configuration file '([^']+)' does not exist")

Status = Literal["running", "stopped", "missing"]


class PctContainer(Transport):
    def __init__(self, name: str, host: SshEndpoint, vmid: int, *, pct: str = "pct", stage_dir: str = "/tmp",
                 relay: HostRelay | None = None):
        self.name = name
        self.host = host
        self.vmid = vmid
        self.pct = pct
        self.stage_dir = stage_dir
        self.relay = relay  # several containers of this host share one exec (run/open go through it)
        self.request_timeout = host.request_timeout  # the host's deadline: one SSH connection, one setting

    # --- pct-level ------------------------------------------------------------------------------

    def pct_argv(self, *args: str) -> list[str]:
        return [self.pct, *args]

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """`pct exec VMID -- argv`: the `--` keeps options of argv away from pct."""
        return [self.pct, "exec", str(self.vmid), "--", *argv]

    def interactive_argv(self, argv: Sequence[str]) -> list[str]:
        """`ssh -t host pct exec VMID -- argv`."""
        return self.host.interactive_argv(self.exec_argv(argv))

    def _relay(self) -> HostRelay | None:
        return self.relay if self.relay is not None and self.relay.available() else None

    def _host_run(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
                  max_output: int | None = None) -> Result:
        """argv on the host: through the relay when there is one, else over the host's own exec."""
        relay = self._relay()
        if relay is not None:
            return relay.run(argv, stdin=stdin, timeout=timeout, max_output=max_output)
        return self.host.run(argv, stdin=stdin, timeout=timeout, max_output=max_output)

    def _host_stream(self, argv: Sequence[str], *, timeout: float | None = None,
                     idle: float | None = None) -> Iterator[tuple[str, bytes]]:
        relay = self._relay()
        if relay is not None:
            return relay.stream(argv, timeout=timeout, idle=idle)
        return self.host.stream(argv, timeout=timeout, idle=idle)

    def status(self) -> Status:
        res = self._host_run(self.pct_argv("status", str(self.vmid)))
        if res.returncode == 0:
            return "running" if "status: running" in res.out else "stopped"
        if _NO_CONFIG.search(res.err):
            return "missing"
        raise RemoteCommandError(self.host.name, res.argv, res.returncode, res.err, what=f"status of {self.name}")

    def _raise_pct(self, res: Result) -> None:
        """Turn pct's own refusals into the errors users act on; leave command failures alone."""
        if res.returncode == 0:
            return
        if _NO_CONFIG.search(res.err):
            raise NotRunning(
                f"{self.name}: CT {self.vmid} does not exist on host {self.host.name}",
                hint="check vmid/host in the inventory (`pct list` on the host)",
            )
        if _NOT_RUNNING.search(res.err):
            raise NotRunning(
                f"{self.name}: CT {self.vmid} on {self.host.name} is stopped",
                hint=f"start it with `pct start {self.vmid}` on the host",
            )

    # --- Transport ------------------------------------------------------------------------------

    def run(
        self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
        max_output: int | None = None,
    ) -> Result:
        return self._own(argv, self._host_run(self.exec_argv(argv), stdin=stdin, timeout=timeout,
                                              max_output=max_output))

    def _own(self, argv: Sequence[str], res: Result) -> Result:
        """What `pct exec VMID -- argv` gave, as argv's own Result; pct's refusals raised (NotRunning)."""
        self._raise_pct(res)
        return Result(tuple(argv), res.returncode, res.stdout, res.stderr, res.seconds)

    def _shifted(self, start: AgentStart) -> AgentStart:
        """An agent request's AgentStart, counted in `pct exec VMID -- argv` rather than argv."""
        return AgentStart(len(self.exec_argv(())) + start.at, start.n, start.retry, start.sha)

    def keeps_agents(self) -> bool:
        relay = self._relay()
        return relay is not None and relay.staying

    def run_agent(self, argv: Sequence[str], start: AgentStart, *, stdin: bytes,
                  timeout: float | None = None, max_output: int | None = None) -> Result:
        """Through the host relay's staying agent for this container when it keeps them (no `pct exec` per
        request); pct's refusals still surface as NotRunning (the relay runs the exec when none can start)."""
        relay = self._relay()
        if relay is None or not relay.staying:
            return self.run(argv, stdin=stdin, timeout=timeout, max_output=max_output)
        return self._own(argv, relay.run(self.exec_argv(argv), stdin=stdin, timeout=timeout,
                                         agent=self._shifted(start), max_output=max_output))

    def submit_agent(self, argv: Sequence[str], start: AgentStart, *, stdin: bytes,
                     on_done: Answered, max_output: int | None = None) -> Submitted | None:
        """run_agent without waiting, through the host session's staying agent; pct's refusals reach on_done
        as NotRunning, as run_agent raises them."""
        relay = self._relay()
        if relay is None or not relay.staying:
            return None

        def done(got: Result | CtlError) -> None:
            if isinstance(got, Result):
                try:
                    got = self._own(argv, got)
                except CtlError as e:
                    got = e
            on_done(got)

        return relay.submit(self.exec_argv(argv), agent=self._shifted(start), stdin=stdin, on_done=done,
                            max_output=max_output)

    def stream(
        self, argv: Sequence[str], *, timeout: float | None = None, idle: float | None = None
    ) -> Iterator[tuple[str, bytes]]:
        err = b""
        for kind, data in self._host_stream(self.exec_argv(argv), timeout=timeout, idle=idle):
            if kind == "err":
                err += data[:4096]
            if kind == "exit" and data != b"0":
                self._raise_pct(Result(tuple(argv), int(data), b"", err))
            yield kind, data

    def open(self, argv: Sequence[str]) -> Duplex:
        relay = self._relay()
        if relay is not None:
            return _PctDuplex(self, relay.open(self.exec_argv(argv)), tuple(argv))
        return _PctDuplex(self, self.host.open(self.exec_argv(argv)), tuple(argv))

    def script(self, argv: Sequence[str]) -> str:
        """`ssh ... host 'pct exec VMID -- argv'`, runnable from the operator's machine."""
        return self.host.script(self.exec_argv(argv))

    def put(self, local_path: str, remote_path: str) -> None:
        """Stage on the host (private dir), `pct push`, then verify the sha256 inside the container. Through a
        relay the file travels on the stdin of that one host command; without one, over SFTP first."""
        stage = f"{self.stage_dir.rstrip('/')}/ctl-stage-{os.urandom(16).hex()}"
        staged = f"{stage}/file"
        push = shlex.join(self.pct_argv("push", str(self.vmid), staged, remote_path))
        verify = shlex.join(self.exec_argv(["sha256sum", "--", remote_path]))
        script = f"{push}; rc=$?; rm -rf {shlex.quote(stage)}; [ $rc -eq 0 ] || exit $rc; {verify}"
        relay = self._relay()
        if relay is not None:
            receive = (f"mkdir -m 700 -- {shlex.quote(stage)} || exit 1; cat > {shlex.quote(staged)} "
                       f"|| {{ rm -rf {shlex.quote(stage)}; exit 1; }}; ")
            d = relay.open(["sh", "-c", receive + script])
            with open(local_path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    d.send(block)
            res = d.finish()
        else:
            try:
                with self.host.sftp() as sftp:
                    sftp.mkdir(stage, mode=0o700)
                    sftp.put(local_path, staged)
            except TimeoutError:
                raise self.host._sftp_silent(f"staging {local_path} in {stage}") from None
            except OSError as e:
                raise ConnectionFailed(f"{self.host.name}: staging {local_path} in {stage} failed: {e}") from None
            res = self.host.run(["sh", "-c", script])
        self._raise_pct(res)
        want = file_sha256(local_path)
        got = res.out.split(" ", 1)[0] if res.returncode == 0 else ""
        if got != want:
            detail = res.err.strip().splitlines()[-1] if res.err.strip() else "content differs"
            raise VerifyError(
                f"{self.name}: pct push of {local_path} to {remote_path} did not land intact ({detail}); "
                f"sha256 wanted {want[:12]}, found {got[:12] or 'nothing'}"
            )

    def get(self, remote_path: str, local_path: str) -> None:
        """Stream the file through `pct exec -- cat` (one round trip; avoids pull's empty-file trap)."""
        err = b""
        code = b"-1"
        quiet = self.request_timeout  # a download may be long; silence longer than the deadline is not
        with open(local_path, "wb") as f:
            for kind, data in self._host_stream(self.exec_argv(["cat", "--", remote_path]), idle=quiet):
                if kind == "idle":
                    raise DeadlineExceeded(f"{self.name}: download of {remote_path}: no data for {quiet:g}s")
                if kind == "out":
                    f.write(data)
                elif kind == "err":
                    err += data
                else:
                    code = data
        if code != b"0":
            res = Result(("cat", remote_path), int(code), b"", err)
            self._raise_pct(res)
            raise RemoteCommandError(self.name, res.argv, res.returncode, res.err, what="download")


class _PctDuplex(Duplex):
    """A conversation through `pct exec`: pct's own refusals surface as NotRunning at finish()."""

    def __init__(self, ct: PctContainer, inner: Duplex, argv: tuple[str, ...]) -> None:
        self.ct, self.inner, self.argv = ct, inner, argv

    def send(self, data: bytes) -> None:
        self.inner.send(data)

    def readline(self, timeout: float | None = None) -> bytes:
        return self.inner.readline(timeout)

    def finish(self, timeout: float | None = None) -> Result:
        return self.ct._own(self.argv, self.inner.finish(timeout))
