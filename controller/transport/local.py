"""This machine, with a directory standing for the container's `/` (the quickstart's `local` target).

Commands run here as subprocesses (no shell). Container paths are mapped under the root by
`path()`, which every caller that builds an argv from container paths goes through.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from controller.errors import ConnectionFailed
from controller.transport.base import Duplex, Result, Transport, limit, too_large


class LocalContainer(Transport):
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root

    def path(self, container_path: str) -> str:
        return str(self.root / container_path.lstrip("/"))

    def _env(self) -> dict[str, str]:
        """The agent keeps its compiled code under this stand-in's root, as a container keeps it in its /run/ctl:
        never in the operator's own /run."""
        return {**os.environ, "CTL_AGENT_CODE_DIR": str(self.root / "run" / "ctl")}

    def run(
        self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
        max_output: int | None = None,
    ) -> Result:
        self.root.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        timeout = limit(timeout, self.request_timeout)  # NO_DEADLINE -> None (subprocess wants a number)
        try:
            p = subprocess.run(
                list(argv), input=stdin if stdin is not None else b"", capture_output=True,
                timeout=timeout, cwd=self.root, check=False, env=self._env(),
            )
        except FileNotFoundError:
            return Result(tuple(argv), 127, b"", f"{argv[0]}: command not found\n".encode(), 0.0)
        except subprocess.TimeoutExpired:
            raise ConnectionFailed(f"{self.name}: `{argv[0]}` timed out after {timeout}s") from None
        if max_output is not None and len(p.stdout) + len(p.stderr) > max_output:
            raise too_large(self.name, argv, max_output)  # the operator's own machine: judged once it is all here
        return Result(tuple(argv), p.returncode, p.stdout, p.stderr, time.monotonic() - t0)

    def stream(
        self, argv: Sequence[str], *, timeout: float | None = None, idle: float | None = None
    ) -> Iterator[tuple[str, bytes]]:
        p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.root,
                             env=self._env())
        assert p.stdout is not None and p.stderr is not None
        try:
            while True:
                ready, _, _ = select.select([p.stdout], [], [], idle if idle is not None else None)
                if not ready:
                    yield "idle", b""
                    continue
                chunk = os.read(p.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                yield "out", chunk
            err = p.stderr.read()
            if err:
                yield "err", err
            yield "exit", str(p.wait(timeout=limit(timeout, None))).encode()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()

    def open(self, argv: Sequence[str]) -> Duplex:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            p = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 cwd=self.root, env=self._env())
        except FileNotFoundError:
            raise ConnectionFailed(f"{self.name}: {argv[0]} not found") from None
        return _PopenDuplex(p, tuple(argv))

    def put(self, local_path: str, remote_path: str) -> None:
        dest = Path(self.path(remote_path))
        tmp = dest.with_name(f".{dest.name}.ctl-tmp-{os.getpid()}")
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, dest)

    def get(self, remote_path: str, local_path: str) -> None:
        try:
            shutil.copyfile(self.path(remote_path), local_path)
        except FileNotFoundError:
            raise ConnectionFailed(f"{self.name}: {remote_path} does not exist") from None


class _PopenDuplex(Duplex):
    def __init__(self, p: subprocess.Popen[bytes], argv: tuple[str, ...]) -> None:
        self.p, self.argv = p, argv
        self.t0 = time.monotonic()

    def send(self, data: bytes) -> None:
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(data)
            self.p.stdin.flush()
        except BrokenPipeError:
            pass  # the command ended early; finish() reports why

    def readline(self, timeout: float | None = None) -> bytes:
        assert self.p.stdout is not None
        return self.p.stdout.readline()

    def finish(self, timeout: float | None = None) -> Result:
        # communicate() closes stdin (the command sees EOF), then drains stdout and stderr.
        try:
            out, err = self.p.communicate(timeout=limit(timeout, None))
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise ConnectionFailed(f"`{self.argv[0]}` did not finish in {timeout}s") from None
        return Result(self.argv, self.p.returncode, out, err, time.monotonic() - self.t0)
