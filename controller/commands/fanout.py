"""Run one operation on several containers at once: parallel across hosts, one connection per host, and one
exec per host for the containers that share it (ctl's host relay: Pool.share_exec)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from controller.errors import CtlError, ExitCode, RemoteCommandError
from controller.inventory import Container
from controller.transport.base import Transport
from controller.transport.pool import Pool

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    ct: str
    value: T | None
    error: str | None
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.error is None


def fanout(pool: Pool, cts: list[Container], fn: Callable[[Container, Transport], T],
           max_workers: int = 16) -> list[Outcome[T]]:
    """fn(ct, transport) for every container; errors are captured per container, order kept."""

    def one(ct: Container) -> Outcome[T]:
        try:
            return Outcome(ct.name, fn(ct, pool.container(ct)), None, 0)
        except CtlError as e:
            return Outcome(ct.name, None, str(e), int(e.exit_code))

    if len(cts) == 1:
        return [one(cts[0])]
    pool.share_exec(cts)  # several containers of one host: one exec (and one login shell) for them all
    with ThreadPoolExecutor(max_workers=min(max_workers, len(cts))) as ex:
        return list(ex.map(one, cts))


def worst(outcomes: list[Outcome[T]]) -> int:
    """Non-zero if any failed: the exit code of the first failure (runbooks branch on it)."""
    for o in outcomes:
        if not o.ok:
            return o.exit_code or int(ExitCode.FAILURE)
    return 0


def ping(pool: Pool, cts: list[Container]) -> list[Outcome[dict[str, float]]]:
    """`cat` in each container, ONE exec each: the first answer (the exec's start, with the connection and pct,
    what every ctl command pays) and the best of three more round trips of a line through it (the wire's own
    latency). One exec per container, not one per round trip: pinging many containers costs their hosts one
    `pct exec` each."""

    def one(ct: Container, t: Transport) -> dict[str, float]:
        t0 = time.monotonic()
        chat = t.open(["cat"])
        times = []
        for i in range(4):
            t1 = time.monotonic()
            chat.send(b"ctl ping %d\n" % i)
            line = chat.readline()
            if line != b"ctl ping %d\n" % i:
                res = chat.finish()  # a refusal of pct (a stopped CT) raises here, as the exec ended
                if res.returncode != 0:
                    raise RemoteCommandError(t.name, ["cat"], res.returncode, res.err, what="ping")
                raise CtlError(f"{t.name}: ping: `cat` answered {line[:40]!r}, not the line it was sent")
            times.append(time.monotonic() - (t0 if i == 0 else t1))
        res = chat.finish()
        if res.returncode != 0:
            raise RemoteCommandError(t.name, ["cat"], res.returncode, res.err, what="ping")
        return {"first_ms": times[0] * 1000, "rtt_ms": min(times[1:]) * 1000}

    return fanout(pool, cts, one)
