"""Stream ids of ctl's host relay are 16 bits: a long-lived relay (a persistent session) wraps around them.

Both ends run here, over a local socket pair instead of SSH: controller/transport/relay.py's HostRelay and
controller/farside/relay/, started with the very argv ctl sends a host. Thousands of tiny commands
through one relay, across the wrap, must all finish: the relay forgets an id when its stream ends, and HostRelay
reuses free ids.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from controller.transport.relay import MAX_SID, HostRelay
from tests.relay_fakes import LocalHost


@pytest.fixture
def relay() -> Iterator[tuple[HostRelay, LocalHost]]:
    host = LocalHost()
    r = HostRelay(host)  # type: ignore[arg-type]
    assert r.available(), r.why_unavailable
    yield r, host
    r.close()
    for c in host.chans:
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait()


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_twelve_thousand_commands_through_one_relay_across_the_id_wrap(relay: tuple[HostRelay, LocalHost]) -> None:
    """Every 100th command is a real process; the others are commands that cannot start (the relay answers
    E and X 127 without a process, as a shell would), so thousands of them take seconds. The first 5,000 use ids
    1..5000; the allocator is then moved close to the wrap, so the next 7,000 run up to MAX_SID and wrap onto
    those same 5,000 ids: both ends must have forgotten each id when its stream ended (a relay that kept them,
    or a thread per stream, fails here as it would after a 70,000-command persistent session)."""
    r, host = relay
    relay_pid = host.chans[0].proc.pid
    first, second = 5_000, 7_000

    def one(i: int) -> tuple[int, bytes, str]:
        argv = ["echo", str(i)] if i % 100 == 0 else [f"/nonexistent/ctl-test-{i}"]
        res = r.open(argv).finish(timeout=60)
        return res.returncode, res.stdout, res.err

    def run(ids: range) -> int:
        threads = 0
        with ThreadPoolExecutor(4) as pool:  # a few in flight at once, as fan-out commands do
            for i, (code, out, err) in zip(ids, pool.map(one, ids), strict=True):
                if i % 100 == 0:
                    assert (code, out, err) == (0, f"{i}\n".encode(), ""), i
                else:
                    assert code == 127 and f"cannot start /nonexistent/ctl-test-{i}" in err, (i, code, err)
                if i == 1000:
                    threads = _threads(relay_pid)
        return threads

    early = run(range(first))
    assert r._next == first + 1
    r._next = MAX_SID - (second - first) + 1  # the rest: up to MAX_SID, then the ids 1..5000 again
    run(range(first, first + second))
    assert r._next == first + 1  # wrapped, and reused every id the first part used
    assert r.streams_opened == first + second
    assert not r._streams  # every finished stream freed its id on this side
    # ...and on the relay's: no thread (nor child) is kept per finished stream.
    assert _threads(relay_pid) <= early + 8


def test_ids_in_use_are_never_handed_out_twice(relay: tuple[HostRelay, LocalHost]) -> None:
    r, _host = relay
    r._next = MAX_SID - 2  # close to the wrap
    held = [r.open(["cat"]) for _ in range(5)]  # open streams straddling the wrap: MAX_SID-2 .. 2
    sids = [d.sid for d in held]  # type: ignore[attr-defined]
    assert sids == [MAX_SID - 2, MAX_SID - 1, MAX_SID, 1, 2]
    r._next = MAX_SID - 2  # wrap again while they are still open: the allocator skips them
    quick = r.open(["echo", "x"])
    assert quick.sid == 3  # type: ignore[attr-defined]
    assert quick.finish(timeout=30).stdout == b"x\n"
    for i, d in enumerate(held):
        d.send(f"stream {i}\n".encode())
    for i, d in enumerate(held):
        assert d.finish(timeout=30).stdout == f"stream {i}\n".encode()


def test_a_wrapped_id_meets_no_stale_child_on_the_relay(relay: tuple[HostRelay, LocalHost]) -> None:
    """The relay side alone: the same id, started again right after its X frame, runs the new command."""
    r, _host = relay
    for i in range(200):
        r._next = 7
        d = r.open(["echo", str(i)])
        assert d.sid == 7  # type: ignore[attr-defined]
        res = d.finish(timeout=30)
        assert (res.returncode, res.stdout, res.err) == (0, f"{i}\n".encode(), ""), i


def test_relay_exits_after_its_input_ends_with_streams_open(relay: tuple[HostRelay, LocalHost]) -> None:
    r, host = relay
    d = r.open(["cat"])
    d.send(b"last words\n")
    done = threading.Event()

    def finish() -> None:
        res = d.finish(timeout=30)
        assert res.stdout == b"last words\n"
        done.set()

    t = threading.Thread(target=finish)
    t.start()
    t.join(30)
    assert done.is_set()
    r.close()
    assert host.chans[0].proc.wait(timeout=30) == 0
