"""Runs as `ctl tail`, `ctl runs` and `ctl show` see them: a run's log followed (one container's, or a job's
nodes' merged in the order their lines were written, `[node]` first) until the run ends or crashes, and the
registry's runs listed.

Starting and stopping runs is launcher.py's; asking containers what became of them, reconcile.py's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controller.commands.fanout import fanout
from controller.commands.reconcile import ended_at, runstate, settle_now, state_from
from controller.core.loglines import LineSplitter
from controller.errors import ConnectionFailed, ExitCode, InputError
from controller.inventory import Container, Inventory
from controller.lifecycle import Lifecycle
from controller.registry import Registry, RunRecord
from controller.remote.client import Agent
from controller.settings import follow_reconnect
from controller.transport.base import Transport
from controller.transport.pool import Pool


@dataclass
class FollowEnd:
    exit_status: int | None
    crash: str | None
    state: Lifecycle

    @property
    def exit_code(self) -> int:
        if self.crash or (self.exit_status not in (None, 0)) or self.state in (Lifecycle.LOST, Lifecycle.FAILED):
            return int(ExitCode.RUN_FAILED)
        return 0


def follow(
    t: Transport, reg: Registry, run: RunRecord, *, lines: int, follow: bool, emit: Callable[[str], None],
    detect: Callable[[str], str | None], reconnect_s: float | None = None, crash_grace: float = 3.0,
    note: Callable[[str], None] | None = None, start_offset: int | None = None, launched_pid: int | None = None,
) -> FollowEnd:
    """Print the last `lines` lines (all of them when negative), then (with follow) new ones until the run
    ends or crashes.

    A dropped connection (an SSH connection cut, or one the keepalive found silent: ConnectionDropped), or a
    request past its deadline, is resumed from the last byte offset received: no line is lost or repeated.
    Reconnecting goes on for `reconnect_s` seconds after the failure (CTL_FOLLOW_RECONNECT, 300), then the last
    error is raised (exit 5) and the registry keeps the run's state. `note` hears of each drop and reconnection.
    `launched_pid`: the run was just launched by this command, whose answer named the training's pid and made
    its log; the stream then starts at once instead of after a runstate round trip (`ctl launch -f`).
    """
    if reconnect_s is None:
        reconnect_s = follow_reconnect()
    assert run.log_path is not None
    crash = None
    offset = 0  # lines < 0: the whole log, from its first byte
    # Following all of it (`launch -f`) needs no history first: the first runstate below says whether the log exists.
    if start_offset is not None:  # the caller showed the history (several nodes' logs merged)
        offset = start_offset
    elif lines >= 0 or not follow:
        agent = Agent.of(t)
        info = agent.call("tailinfo", {"log": run.log_path, "lines": max(lines, 0)}, check=False)
        if not info.get("ok"):
            raise InputError(f"{run.ct}: cannot read {run.log_path}: {info.get('error')}")
        for line in agent.need(info, "text", str).splitlines():
            emit(line)
            crash = _named(crash, detect(line))
        offset = agent.need(info, "size", int) if lines >= 0 else 0
    if not follow:
        return FollowEnd(run.exit_status, crash, run.state)
    splitter = LineSplitter()  # holds at most LINE_CAP bytes of an unfinished line, however long it gets
    crash_at: float | None = None
    tries = 0
    failing_since: float | None = None
    first = True
    while True:
        try:
            if first and launched_pid is not None and offset == 0:
                st = {"pid": launched_pid, "alive": True, "log_size": 0}
            else:
                st = runstate(t, run)
            if first and st.get("log_size") is None:
                raise InputError(f"{run.ct}: cannot read {run.log_path}: it does not exist")
            first = False
            if failing_since is not None:
                if note is not None:
                    note(f"{run.ct}: reconnected after {time.monotonic() - failing_since:.0f}s; "
                         f"following {run.name} from byte {offset}")
                failing_since, tries = None, 0
            if not st.get("alive") and st.get("log_size") == offset and crash_at is None:
                break
            argv = ["tail", "-c", f"+{offset + 1}"]
            if st.get("pid") and st.get("alive"):
                argv += ["-F", f"--pid={st['pid']}", "-s", "0.2"]  # tail ends when the training does
            argv.append(t.path(run.log_path))
            for kind, data in t.stream(argv, idle=0.5):
                if kind == "out":
                    offset += len(data)
                    for raw in splitter.feed(data):
                        line = raw.decode("utf-8", "replace")
                        emit(line)
                        crash = _named(crash, detect(line))
                        if crash is not None and crash_at is None:
                            crash_at = time.monotonic()
                if crash_at is not None and time.monotonic() - crash_at > crash_grace:
                    break
                if kind == "exit":
                    break
            break
        except ConnectionFailed as e:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                if note is not None:
                    note(f"{e}; reconnecting (for up to {reconnect_s:g}s)")
            tries += 1
            if now - failing_since >= reconnect_s:
                raise
            time.sleep(min(2.0, 0.2 * tries))
    for raw in splitter.flush():
        emit(raw.decode("utf-8", "replace"))
    st = runstate(t, run)
    state, code = state_from(st)
    if crash is not None and state == Lifecycle.RUNNING:
        state = Lifecycle.CRASHED
    # Recorded only if nothing else recorded its end meanwhile (`ctl stop`, or the teardown of a run across
    # several containers, says STOPPED: the exit status that stop caused is no failure of its own)
    if state not in (Lifecycle.RUNNING, Lifecycle.CRASHED) and reg.run_by_id(run.id).state.live:
        reg.update_run(run.id, state=state, exit_status=code, ended=ended_at(st) or time.time())
    if crash:
        reg.update_run(run.id, crash=crash)
    return FollowEnd(code, crash, state)


_follow_one = follow  # follow_job's own `follow` flag hides the function's name there


def _named(crash: str | None, found: str | None) -> str | None:
    """The crash so far, renamed when a traceback's cause line (OOM, NCCL, ...) names it better."""
    if found is None or (crash is not None and crash != "traceback"):
        return crash
    return found


def recorded(inv: Inventory, reg: Registry, container: str | None, *, limit: int) -> list[RunRecord]:
    """The registry's runs, newest first: all, or of one container or group. A name that is neither in the
    inventory nor in the registry is refused as every other command refuses it (exit 4), never an empty list;
    a container gone from the inventory still shows its history."""
    if container is None:
        return reg.runs(None, limit=limit)
    m = inv.model
    if container in m.containers or container in m.groups:
        names = [ct.name for ct in inv.select([container])]
    elif container in m.jobs or reg.names(container):
        names = [container]
    else:
        inv.container(container)  # raises: unknown container, naming the known ones
        names = []
    return whole_runs(reg, [r for n in names for r in reg.runs(n, limit=limit)])[:limit]


def whole_runs(reg: Registry, recs: list[RunRecord]) -> list[RunRecord]:
    """Records as runs: a node's row of a run across several containers stands for that run (once), newest
    first."""
    out: dict[int, RunRecord] = {}
    for r in recs:
        w = reg.whole(r)
        out.setdefault(w.id, w)
    return sorted(out.values(), key=lambda r: r.created, reverse=True)


# --- runs across several containers ------------------------------------------------------------------------


@dataclass
class JobFollowEnd:
    state: Lifecycle
    crash: str | None
    exit_status: int | None

    @property
    def exit_code(self) -> int:
        if self.crash or self.state in (Lifecycle.CRASHED, Lifecycle.FAILED, Lifecycle.LOST) or (
                self.exit_status not in (None, 0)):
            return int(ExitCode.RUN_FAILED)
        return 0


def history(inv: Inventory, pool: Pool, members: list[RunRecord], lines: int) -> tuple[list[tuple[str, str]],
                                                                                        dict[int, int]]:
    """The nodes' last `lines` lines, merged in the order they were written (the launcher's LOG.times; a line
    with no sample keeps its place after the one before it): [(node, line)], and each node's log size then."""
    def one(ct: Container, t: Transport) -> dict[str, Any]:
        m = next(x for x in members if x.ct == ct.name)
        return Agent.of(t).call("tailinfo", {"log": m.log_path, "lines": max(lines, 0), "times": True}, check=False)

    got = fanout(pool, [inv.container(m.ct) for m in members], one)
    merged: list[tuple[float, int, int, str, str]] = []
    sizes: dict[int, int] = {}
    for m, o in zip(members, got, strict=True):
        info = o.value or {}
        if not o.ok or not info.get("ok"):
            raise InputError(f"{m.ct}: cannot read {m.log_path}: {o.error or info.get('error')}")
        sizes[m.id] = int(info.get("size") or 0)
        texts = str(info.get("text") or "").splitlines()
        raw = info.get("times")
        times: list[Any] = raw if isinstance(raw, list) else []
        last = float("-inf")
        for i, text in enumerate(texts):
            t = times[i] if i < len(times) and isinstance(times[i], int | float) else None
            last = max(last, float(t)) if t is not None else last
            merged.append((last, m.node_rank or 0, i, m.ct, text))
    merged.sort(key=lambda x: (x[0], x[1], x[2]))
    return [(node, text) for _t, _r, _i, node, text in merged], sizes


def follow_job(
    inv: Inventory, pool: Pool, reg: Registry, run: RunRecord, *, lines: int, follow: bool,
    emit: Callable[[str, str], None], detect: Callable[[str], str | None], node: str | None = None,
    note: Callable[[str], None] | None = None,
) -> JobFollowEnd:
    """Show the nodes' logs merged (history first, then with `follow` every node's new lines as they come) until
    the run ends; a node that ends badly makes the run CRASHED and its survivors are stopped (settle)."""
    members = reg.members(run.id)
    if node is not None:
        members = [m for m in members if m.ct == node or str(m.node_rank) == node]
        if not members:
            names = ", ".join(f"{m.node_rank}={m.ct}" for m in reg.members(run.id))
            raise InputError(f"run {run.name} has no node {node!r} (nodes: {names})")
    missing = [m.ct for m in members if m.ct not in inv.model.containers]
    if missing:
        raise InputError(f"run {run.name}: node(s) {', '.join(missing)} are no longer in {inv.path}")
    crash: str | None = None
    past, sizes = history(inv, pool, members, lines if lines >= 0 else 1 << 30)
    for n, text in past:
        emit(n, text)
    if not follow:
        return JobFollowEnd(run.state, run.crash, run.exit_status)
    lines_q: queue.Queue[tuple[str, str | None]] = queue.Queue()
    ends: dict[str, FollowEnd | BaseException] = {}
    lock = threading.Lock()

    def follow_one(m: RunRecord) -> None:
        t = pool.container(inv.container(m.ct))
        try:
            end = _follow_one(t, reg, m, lines=0, follow=True, emit=lambda text: lines_q.put((m.ct, text)),
                              detect=detect, note=note, start_offset=sizes.get(m.id, 0))
            with lock:
                ends[m.ct] = end
        except BaseException as e:  # reported below
            with lock:
                ends[m.ct] = e
        finally:
            lines_q.put((m.ct, None))

    threads = [threading.Thread(target=follow_one, args=(m,), name=f"follow-{m.ct}", daemon=True) for m in members]
    for th in threads:
        th.start()
    open_ = len(threads)
    settled = False
    while open_:
        try:
            n, got = lines_q.get(timeout=1.0)
        except queue.Empty:
            continue
        if got is None:
            open_ -= 1
            with lock:
                end = ends.get(n)
            if isinstance(end, FollowEnd) and (end.crash or end.exit_code) and not settled:
                settled = True  # a node ended badly: settle now, so the survivors' follows end with them
                run = settle_now(inv, reg, pool, run)
            continue
        found = detect(got)
        if found is not None and (crash is None or crash.endswith(": traceback")):
            crash = f"{n}: {found}"
        emit(n, got)
    for m in members:
        e = ends.get(m.ct)
        if isinstance(e, BaseException):
            raise e
    run = settle_now(inv, reg, pool, run)
    return JobFollowEnd(run.state, run.crash or crash, run.exit_status)
