"""Run one operation on several containers at once: parallel across hosts, one connection per host, and one
exec per host for the containers that share it (ctl's host relay: Pool.share_exec)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from controller.errors import CtlError, ExitCode
from controller.inventory import Container
from controller.remote.client import Agent
from controller.transport.base import Transport
from controller.transport.pool import Pool

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What one container of a fan-out gave: its value, or its error and exit code."""

    ct: str
    value: T | None
    error: str | None
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.error is None


#: Containers of one host at once (each may be an agent start there: lxc-attach and a python3), and threads in all.
PER_HOST = 16
MOST_THREADS = 64


def _host_of(ct: Container) -> str:
    """What a container's exec runs on: its Proxmox host, or for an ssh or local target the target itself."""
    if ct.spec.transport == "pct" and ct.host_name is not None:
        return "host:" + ct.host_name
    return "ct:" + ct.name


def _round_robin(cts: list[Container]) -> list[int]:
    """Indices of cts taking one container of each host in turn: the first workers go to every host at once,
    not to the first host's containers in inventory order while the other hosts wait."""
    by_host: dict[str, list[int]] = {}
    for i, ct in enumerate(cts):
        by_host.setdefault(_host_of(ct), []).append(i)
    queues = list(by_host.values())
    order: list[int] = []
    for k in range(max(map(len, queues), default=0)):
        order.extend(q[k] for q in queues if k < len(q))
    return order


def fanout(pool: Pool, cts: list[Container], fn: Callable[[Container, Transport], T],
           per_host: int = PER_HOST) -> list[Outcome[T]]:
    """fn(ct, transport) for every container; errors are captured per container, order kept. Hosts run side
    by side, each with at most `per_host` of its containers at once."""

    def one(ct: Container) -> Outcome[T]:
        try:
            return Outcome(ct.name, fn(ct, pool.container(ct)), None, 0)
        except CtlError as e:
            return Outcome(ct.name, None, str(e), int(e.exit_code))

    if len(cts) <= 1:
        return [one(ct) for ct in cts]
    pool.share_exec(cts)  # several containers of one host: one exec (and one login shell) for them all
    hosts = {_host_of(ct) for ct in cts}
    gates = {h: threading.BoundedSemaphore(per_host) for h in hosts}

    def gated(i: int) -> Outcome[T]:
        with gates[_host_of(cts[i])]:
            return one(cts[i])

    return _side_by_side(gated, _round_robin(cts), min(len(cts), per_host * len(hosts), MOST_THREADS))


def _side_by_side(work: Callable[[int], Outcome[T]], order: list[int], workers: int) -> list[Outcome[T]]:
    """work(i) for every i, in `order`, on `workers` threads; the outcomes by index. An exception of work (a bug:
    a container's failure is an Outcome) is raised here once the work begun ends, as is one of this thread (a
    Ctrl-C): nothing more is begun, and what was begun ends first. Workers take the next index themselves and
    end when none is left: no future, queue or shutdown wake-up per container, and no concurrent.futures (nor
    logging) to import."""
    if not order:
        return []
    done: dict[int, Outcome[T]] = {}
    todo = iter(order)
    lock = threading.Lock()
    finished, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                i = None if stop.is_set() else next(todo, None)
            if i is None:
                return
            try:
                out = work(i)
            except BaseException as e:  # raised in the caller's thread (below)
                with lock:
                    failed.append(e)
                stop.set()
                finished.set()
                return
            with lock:
                done[i] = out
                if len(done) == len(order):
                    finished.set()

    threads = [threading.Thread(target=worker, name=f"fanout-{n}") for n in range(workers)]
    for t in threads:
        t.start()
    try:
        finished.wait()
    except BaseException:
        stop.set()
        raise
    finally:
        if stop.is_set():
            for t in threads:
                t.join()
    if failed:
        raise failed[0]
    return [done[i] for i in range(len(order))]


def worst(outcomes: list[Outcome[T]]) -> int:
    """Non-zero if any failed: the exit code of the first failure (runbooks branch on it)."""
    for o in outcomes:
        if not o.ok:
            return o.exit_code or int(ExitCode.FAILURE)
    return 0


def ping(pool: Pool, cts: list[Container]) -> list[Outcome[dict[str, Any]]]:
    """ctl's agent in each container, the way every ctl command reaches it: the first answer (with the connection,
    and `pct exec` unless a staying agent of the host session answers) and the best of three requests to a staying
    agent (what each further request of a command costs; without one, every request is an exec like the first,
    which is then the answer). A staying agent that was up before the first request (it says it took others)
    gave one of the three with it. Says which python answered and whether it was a staying agent."""

    def one(ct: Container, t: Transport) -> dict[str, Any]:
        agent = Agent(t)
        t0 = time.monotonic()
        doc = agent.call("hello", {})
        first = time.monotonic() - t0
        staying = doc.get("staying") is True
        served = doc.get("served")
        rtts = [first] if staying and isinstance(served, int) and not isinstance(served, bool) and served > 1 else []
        while staying and len(rtts) < 3:
            t1 = time.monotonic()
            agent.call("hello", {})
            rtts.append(time.monotonic() - t1)
        python = doc.get("python")
        return {"first_ms": first * 1000, "rtt_ms": min(rtts or [first]) * 1000, "staying": staying,
                "python": python if isinstance(python, str) else None}

    return fanout(pool, cts, one)
