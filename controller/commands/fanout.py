"""Run one operation on several containers at once: parallel across hosts, one connection per host, and one
exec per host for the containers that share it (ctl's host relay: Pool.share_exec). `fanout` runs a function
per container in threads; `flows` runs a conversation with each container's agent, without a thread per
container where a host session keeps staying agents."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from controller.errors import ConnectionFailed, CtlError, ExitCode
from controller.inventory import Container
from controller.remote.client import Agent
from controller.transport.base import Submitted, Transport, limit
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


class Read(NamedTuple):
    """A flow's request answered as Agent.read() answers it (a header line, then bytes): the flow is sent read()'s
    tuple (header, bytes, wire out, wire in) instead of a document."""

    verb: str
    args: Mapping[str, Any]


#: A container's conversation with its agent (flows()): it yields requests ((verb, args) for Agent.call, or a
#: Read), is sent each answer (or thrown the CtlError it met), and returns the container's value.
Step = tuple[str, Mapping[str, Any]] | Read
Flow = Generator[Step, Any, T]


def flows(pool: Pool, cts: list[Container], flow: Callable[[Container, Agent], Flow[T]],
          per_host: int = PER_HOST) -> list[Outcome[T]]:
    """flow(ct, agent) for every container, each request it yields answered by the container's agent; errors
    captured per container, order kept. Where a host session keeps staying agents, the flows of a host's
    containers (per_host at once) have their requests in flight together and each answer moves its flow on in
    the session's reader thread: no thread per container, whose GIL hand-offs cost ctl more CPU than the
    requests, and the host gets its requests in batches. Elsewhere a flow runs in fanout's threads, one
    call() at a time. A request past its transport's deadline fails its container with DeadlineExceeded."""

    def alone(ct: Container, t: Transport) -> T:
        agent = Agent.of(t)
        return _flow_here(flow(ct, agent), agent)

    if len(cts) <= 1:
        return fanout(pool, cts, alone)
    pool.share_exec(cts)
    # Whether each host keeps staying agents, asked of one container per host side by side: the question starts
    # the host's relay or session when there is none, and hosts are not started one after the other.
    firsts = {_host_of(ct): ct for ct in reversed(cts)}
    keeps = dict(zip(firsts, fanout(pool, list(firsts.values()), lambda _ct, t: t.keeps_agents()), strict=True))
    driver: _Flows[T] = _Flows(cts, flow, per_host)
    rest: list[int] = []
    for i, ct in enumerate(cts):
        probed = keeps[_host_of(ct)]
        if probed.ok and probed.value:
            try:
                driver.add(i, Agent.of(pool.container(ct)))
            except CtlError as e:
                driver.settle(i, Outcome(ct.name, None, str(e), int(e.exit_code)))
        elif probed.exit_code == int(ExitCode.CONNECTION):  # the host did not answer: its containers are told so,
            driver.settle(i, Outcome(ct.name, None, probed.error, probed.exit_code))  # not each kept waiting again
        else:
            rest.append(i)
    try:
        driver.begin()
        threaded = fanout(pool, [cts[i] for i in rest], alone, per_host) if rest else []
        for i, o in zip(rest, threaded, strict=True):
            driver.settle(i, o)
        driver.wait()
    except BaseException:
        driver.stop()
        raise
    return driver.outcomes()


def _flow_here(gen: Flow[T], agent: Agent) -> T:
    """A flow in this thread: each request a call()."""
    try:
        step = next(gen)
        while True:
            verb, args = step
            try:
                got = agent.read(verb, args) if isinstance(step, Read) else agent.call(verb, args)
            except CtlError as e:
                step = gen.throw(e)
                continue
            step = gen.send(got)
    except StopIteration as e:
        return e.value  # type: ignore[no-any-return]


class _Flows(Generic[T]):
    """flows() through staying agents: a flow is advanced by the thread that got its answer (the session's
    reader; this one for its first request and for a deadline)."""

    def __init__(self, cts: list[Container], flow: Callable[[Container, Agent], Flow[T]], per_host: int) -> None:
        self.cts, self.flow, self.per_host = cts, flow, per_host
        self.lock = threading.Lock()
        self.finished = threading.Event()
        self.out: dict[int, Outcome[T]] = {}
        self.queued: dict[str, list[tuple[int, Agent]]] = {}  # host -> flows not begun (per_host run at once)
        self.running: dict[str, int] = {}
        self.pumping: set[str] = set()  # hosts whose queue a thread is starting flows from (_pump)
        self.asked: dict[int, tuple[Submitted, float | None]] = {}  # flow -> (its request in flight, its deadline s)
        self.steps: dict[int, int] = {}  # flow -> answers it got (a late second telling of one is ignored)
        self.bug: BaseException | None = None  # an exception of a flow that is no CtlError: raised by wait()
        self.stopped = False

    def add(self, i: int, agent: Agent) -> None:
        self.queued.setdefault(_host_of(self.cts[i]), []).append((i, agent))

    def begin(self) -> None:
        for q in self.queued.values():
            q.reverse()  # popped from the end: inventory order
        for host in list(self.queued):
            self._pump(host)

    def _pump(self, host: str) -> None:
        """Start the host's queued flows while fewer than per_host run. One thread at a time per host, in a loop:
        a flow that ends at once (its host gone: every request fails as it is asked) frees its place to this
        loop, not to a call of its own, so a long queue never deepens the stack."""
        with self.lock:
            if host in self.pumping:
                return  # the thread pumping it sees the place this one's caller freed
            self.pumping.add(host)
        while True:
            with self.lock:
                q = self.queued.get(host)
                if self.stopped or not q or self.running.get(host, 0) >= self.per_host:
                    self.pumping.discard(host)
                    return
                i, agent = q.pop()
                self.running[host] = self.running.get(host, 0) + 1
            try:
                gen = self.flow(self.cts[i], agent)
            except CtlError as e:
                self._done(i, Outcome(self.cts[i].name, None, str(e), int(e.exit_code)))
                continue
            self._step(i, agent, gen, functools.partial(next, gen))

    def _step(self, i: int, agent: Agent, gen: Flow[T], move: Callable[[], Step]) -> None:
        """Move flow i on (move: its next(), send() or throw()) and ask its next request, or settle it."""
        ct = self.cts[i]
        try:
            while True:
                try:
                    step = move()
                except StopIteration as e:
                    return self._done(i, Outcome(ct.name, e.value, None, 0))
                except CtlError as e:
                    return self._done(i, Outcome(ct.name, None, str(e), int(e.exit_code)))
                if self.stopped:
                    return self._done(i, Outcome(ct.name, None, "stopped", int(ExitCode.FAILURE)))
                with self.lock:
                    n = self.steps.get(i, 0)
                answered = functools.partial(self._answered, i, agent, gen, n)
                try:
                    asked = (agent.submit_read(step.verb, step.args, answered) if isinstance(step, Read) else
                             agent.submit(step[0], step[1], answered))
                    if asked is None:
                        raise ConnectionFailed(f"{ct.name}: ctl's host session ended during the command")
                except CtlError as e:  # it never started: the flow is told here
                    move = functools.partial(gen.throw, e)
                    continue
                timeout = limit(None, agent.t.request_timeout)
                with self.lock:
                    if self.steps.get(i, 0) == n:  # not answered already (it may be, before submit returned)
                        self.asked[i] = (asked, timeout)
                return None
        except BaseException as e:  # a bug in the flow, or in ctl: raised in the caller's thread by wait()
            with self.lock:
                self.bug = self.bug or e
            self.finished.set()
            return None

    def _answered(self, i: int, agent: Agent, gen: Flow[T], n: int, got: Any) -> None:
        with self.lock:
            if self.steps.get(i, 0) != n:
                return  # told twice (an expiry meeting the answer): the first counts
            self.steps[i] = n + 1
            self.asked.pop(i, None)
        if isinstance(got, CtlError):
            self._step(i, agent, gen, functools.partial(gen.throw, got))
        else:
            self._step(i, agent, gen, functools.partial(gen.send, got))

    def _done(self, i: int, o: Outcome[T]) -> None:
        self.settle(i, o)
        host = _host_of(self.cts[i])
        with self.lock:
            self.running[host] -= 1
        self._pump(host)

    def settle(self, i: int, o: Outcome[T]) -> None:
        with self.lock:
            self.out[i] = o
            if len(self.out) == len(self.cts):
                self.finished.set()

    def wait(self) -> None:
        """Until every flow is settled, expiring requests past their deadline; a flow's bug is raised here."""
        while True:
            with self.lock:
                now = time.monotonic()
                late = [(a, t) for a, t in self.asked.values() if t is not None and now - a.t0 >= t]
                ends = [a.t0 + t - now for a, t in self.asked.values() if t is not None]
            for asked, timeout in late:
                asked.expire(timeout)  # its callback settles (or moves on) its flow
            if self.finished.wait(min([1.0, *(max(0.01, e) for e in ends)])):
                break
        if self.bug is not None:
            raise self.bug

    def stop(self) -> None:
        """The caller is interrupted: no flow goes on, and the requests in flight are dropped (K)."""
        with self.lock:
            self.stopped = True
            asked = list(self.asked.values())
        for a, _t in asked:
            a.expire(0.0)

    def outcomes(self) -> list[Outcome[T]]:
        return [self.out[i] for i in range(len(self.cts))]


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

    def one(ct: Container, agent: Agent) -> Flow[dict[str, Any]]:
        t0 = time.monotonic()
        doc = yield "hello", {}
        first = time.monotonic() - t0
        staying = doc.get("staying") is True
        served = doc.get("served")
        rtts = [first] if staying and isinstance(served, int) and not isinstance(served, bool) and served > 1 else []
        while staying and len(rtts) < 3:
            t1 = time.monotonic()
            yield "hello", {}
            rtts.append(agent.seconds or time.monotonic() - t1)
        python = doc.get("python")
        return {"first_ms": first * 1000, "rtt_ms": min(rtts or [first]) * 1000, "staying": staying,
                "python": python if isinstance(python, str) else None}

    return flows(pool, cts, one)
