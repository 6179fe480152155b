"""A transport that counts what crosses it: exec calls and bytes each way (benchmarks and tests)."""

from __future__ import annotations

from collections.abc import Sequence

from controller.transport.base import Result, Transport


class Counting(Transport):
    """Wraps a transport; `sent` counts argv + stdin bytes, `received` stdout + stderr bytes."""

    def __init__(self, inner: Transport) -> None:
        self.inner, self.name = inner, inner.name
        self.sent = self.received = self.calls = 0

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
            max_output: int | None = None) -> Result:
        res = self.inner.run(argv, stdin=stdin, timeout=timeout, max_output=max_output)
        self.calls += 1
        self.sent += len(stdin or b"") + sum(len(a.encode()) for a in argv)
        self.received += len(res.stdout) + len(res.stderr)
        return res

    def put(self, local_path: str, remote_path: str) -> None:
        self.inner.put(local_path, remote_path)

    def get(self, remote_path: str, local_path: str) -> None:
        self.inner.get(remote_path, local_path)

    def path(self, container_path: str) -> str:
        return self.inner.path(container_path)

    def reset(self) -> None:
        self.sent = self.received = self.calls = 0
