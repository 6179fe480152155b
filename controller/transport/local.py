"""This machine, with a directory standing for the container's `/` (the quickstart's `local` target).

Commands run here as subprocesses (no shell). Container paths are mapped under the root by
`path()`, which every caller that builds an argv from container paths goes through.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from controller.errors import ConnectionFailed
from controller.transport.base import Result, Transport


class LocalContainer(Transport):
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root

    def path(self, container_path: str) -> str:
        return str(self.root / container_path.lstrip("/"))

    def run(
        self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None
    ) -> Result:
        self.root.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                list(argv), input=stdin if stdin is not None else b"", capture_output=True,
                timeout=timeout, cwd=self.root, check=False,
            )
        except FileNotFoundError:
            return Result(tuple(argv), 127, b"", f"{argv[0]}: command not found\n".encode(), 0.0)
        except subprocess.TimeoutExpired:
            raise ConnectionFailed(f"{self.name}: `{argv[0]}` timed out after {timeout}s") from None
        return Result(tuple(argv), p.returncode, p.stdout, p.stderr, time.monotonic() - t0)

    def stream(self, argv: Sequence[str], *, timeout: float | None = None) -> Iterator[tuple[str, bytes]]:
        p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.root)
        assert p.stdout is not None and p.stderr is not None
        try:
            while True:
                chunk = os.read(p.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                yield "out", chunk
            err = p.stderr.read()
            if err:
                yield "err", err
            yield "exit", str(p.wait(timeout=timeout)).encode()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()

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
