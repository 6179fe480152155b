"""Requests submitted without waiting (HostRelay.submit): ctl's real host relay (controller/farside/relay/),
run here over a socket pair as tests/test_relay_ids.py does, with the real agent and the failure-mode stand-in of
tests/test_staying_agent.py. Each request's callback is called once, whatever ends it: its answer, a source the
relay lacks (sent again), a deadline, a cap, the relay's end."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from controller.commands.fanout import Read, _flow_here, _Flows
from controller.errors import ConnectionFailed, CtlError, DeadlineExceeded, OutputTooLarge
from controller.remote.client import VERB_AT, Agent, agent_argv, agent_sha, agent_source
from controller.transport.base import AgentStart, Result
from controller.transport.mux.client import MuxRelay
from controller.transport.relay import HostRelay
from tests.helpers import wait_for
from tests.relay_fakes import FAKE, FAKE_AT, LocalHost, fake


@pytest.fixture
def relay() -> Iterator[tuple[HostRelay, LocalHost]]:
    host = LocalHost()
    r = HostRelay(host)  # type: ignore[arg-type]
    assert r.available() and r.staying, r.why_unavailable
    yield r, host
    r.closing = True
    for c in host.chans:
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait()
    r.close()


class Calls:
    """What callbacks got, with the thread each ran in."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.got: dict[int, list[tuple[Result | CtlError, str]]] = {}

    def cb(self, key: int) -> Any:
        def done(got: Result | CtlError) -> None:
            with self.cond:
                self.got.setdefault(key, []).append((got, threading.current_thread().name))
                self.cond.notify_all()
        return done

    def wait(self, n: int, timeout: float = 30.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout), self.got


HELLO = agent_argv("hello", json.dumps({"root": "/"}))
SOURCE = agent_source()


def hello_start() -> AgentStart:
    return AgentStart(VERB_AT, len(SOURCE), True, agent_sha())


def test_forty_requests_in_flight_from_one_thread_are_each_answered_once_by_the_reader(
        relay: tuple[HostRelay, LocalHost]) -> None:
    r, _host = relay
    calls = Calls()
    threads = threading.active_count()
    for i in range(40):
        r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(i))
    assert threading.active_count() <= threads + 1  # nothing per request (at most a K sender)
    calls.wait(40)
    # every stream ended and its id freed: no frame can reach a callback again, so a second answer would be here
    wait_for("every stream's end", lambda: not r._streams, 30)
    assert sorted(calls.got) == list(range(40)) and all(len(v) == 1 for v in calls.got.values())
    for (got, thread), in calls.got.values():
        assert isinstance(got, Result) and got.returncode == 0, got
        assert json.loads(got.stdout)["ok"] is True
        assert thread in (r._reader.name, threading.main_thread().name)  # type: ignore[union-attr]
    assert not r._streams  # every id freed
    assert agent_sha() in r.sources_sent  # the next requests leave the source out


def test_requests_in_flight_together_carry_the_agents_source_once(relay: tuple[HostRelay, LocalHost]) -> None:
    """A fresh relay, 40 requests at once: the first carries the 77 KB source, the relay keeps it as soon as that
    request is all in, and the 39 behind it leave it out (none is told U)."""
    r, _host = relay
    sent: list[int] = []
    send_raw = r._send_raw

    def counting(chan: Any, data: bytes) -> None:
        sent.append(len(data))
        send_raw(chan, data)

    r._send_raw = counting  # type: ignore[method-assign]
    calls = Calls()
    for i in range(40):
        r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(i))
    calls.wait(40)
    assert all(isinstance(got, Result) and got.returncode == 0 for (got, _t), in calls.got.values()), calls.got
    assert not r.sources_missing
    assert len(SOURCE) < sum(sent) < len(SOURCE) + 40 * 2000, sent  # the source once, then the requests alone


def test_a_request_that_leaves_the_source_out_after_one_that_carries_it_is_never_told_u(
        relay: tuple[HostRelay, LocalHost]) -> None:
    """run() with the source (more than one frame) counts it as sent: a request after that point leaves it out,
    so the carrying request must be closed by then (the relay keeps a source at its close), or the one behind
    it is told U and sent again. Here the second request runs right at that point, before the first waits."""
    r, _host = relay
    went = r._source_went
    second: list[Result] = []
    asked: list[bool] = []

    def then_another(agent: AgentStart | None) -> None:
        went(agent)
        if not asked:
            asked.append(True)
            second.append(r.run(HELLO, agent=hello_start(), stdin=SOURCE, timeout=30))

    r._source_went = then_another  # type: ignore[method-assign]
    first = r.run(HELLO, agent=hello_start(), stdin=SOURCE, timeout=30)
    assert first.returncode == 0 and second and second[0].returncode == 0
    assert not r.sources_missing  # no U: the second found the source the first brought


def test_a_deadline_met_twice_sends_one_k_and_one_met_after_the_end_frees_the_id(
        relay: tuple[HostRelay, LocalHost]) -> None:
    r, _host = relay
    ks: list[int] = []
    send = r._send

    def counting(kind: bytes, sid: int, data: bytes = b"") -> None:
        if kind == b"K":
            ks.append(sid)
        send(kind, sid, data)

    r._send = counting  # type: ignore[method-assign]
    hung = r.open(["cat"])  # its input never closes: it runs until a K
    hung._late("reading", 0.1)  # type: ignore[attr-defined]
    hung._late("waiting for", 0.1)  # type: ignore[attr-defined]  # (a read, then finish's clean-up)
    deadline = time.monotonic() + 10
    while (r._k_due or hung.sid in r._streams) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.02)
    assert ks == [hung.sid] and not r._k_due  # type: ignore[attr-defined]
    assert hung.sid not in r._streams  # type: ignore[attr-defined]  # the relay's X after the K freed it
    quick = r.open(["echo", "x"])
    while quick.st.code is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.02)
    quick._late("waiting for", 0.1)  # type: ignore[attr-defined]  # its X came first: nothing to end
    assert quick.sid not in r._streams and ks == [hung.sid]  # type: ignore[attr-defined]


def test_a_source_the_relay_does_not_keep_goes_again_and_is_answered_once(relay: tuple[HostRelay, LocalHost]) -> None:
    r, _host = relay
    r.sources_sent.add(agent_sha())  # believed kept: the request leaves it out, the relay answers U
    calls = Calls()
    r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(0))
    calls.wait(1)
    wait_for("the stream's end", lambda: not r._streams, 30)  # after it, no second answer can come
    ((got, _thread),) = calls.got[0]
    assert isinstance(got, Result) and json.loads(got.stdout)["staying"] is True
    assert agent_sha() in r.sources_missing


def test_a_request_past_its_deadline_is_told_once_and_the_relay_goes_on(relay: tuple[HostRelay, LocalHost]) -> None:
    r, _host = relay
    calls = Calls()
    hung = r.submit(fake("hang"), agent=AgentStart(FAKE_AT, len(FAKE), True, ""), stdin=FAKE, on_done=calls.cb(0))
    time.sleep(0.3)
    assert calls.got == {}
    hung.expire(0.3)
    calls.wait(1)
    ((got, _thread),) = calls.got[0]
    assert isinstance(got, DeadlineExceeded) and "no answer in 0.3s" in got.message
    hung.expire(0.3)  # again: nothing more
    r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(1))
    calls.wait(2)
    assert isinstance(calls.got[1][0][0], Result) and len(calls.got[0]) == 1


def test_an_id_whose_k_has_not_gone_yet_is_not_handed_out_again(relay: tuple[HostRelay, LocalHost]) -> None:
    """A request past its deadline gets a K from a thread of its own. Were that K held up (here: the channel's send
    lock held, as a relay that stopped reading would hold it) while the request's X came, the id would be free
    again; after a wrap a new stream would take it and the late K would end that stream instead. The id stays
    reserved until the K has gone."""
    r, _host = relay
    calls = Calls()
    slow = r.submit(fake("slow"), agent=AgentStart(FAKE_AT, len(FAKE), True, ""), stdin=FAKE, on_done=calls.cb(0))
    assert slow.st is not None
    sid = slow.st.sid
    with r._send_lock:
        slow.expire(0.1)  # its K now waits for the lock
        calls.wait(1)
        deadline = time.monotonic() + 10
        while sid in r._streams and time.monotonic() < deadline:  # the agent answers after 1.5 s: X frees it
            time.sleep(0.02)
        assert sid not in r._streams
        with r._cond:
            r._next = sid
            assert r._free_sid() != sid
    deadline = time.monotonic() + 10
    while r._k_due and time.monotonic() < deadline:
        time.sleep(0.02)
    with r._cond:
        assert not r._k_due
        r._next = sid
        assert r._free_sid() == sid
    ((got, _thread),) = calls.got[0]
    assert isinstance(got, DeadlineExceeded)
    r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(1))  # the relay goes on after the late K
    calls.wait(2)
    assert isinstance(calls.got[1][0][0], Result)


def test_a_callback_that_raises_is_shown_and_the_reader_goes_on(relay: tuple[HostRelay, LocalHost],
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    r, _host = relay
    calls = Calls()

    def broken(got: Result | CtlError) -> None:
        raise KeyError("a bug in the caller")

    r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=broken)
    r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(0))
    calls.wait(1)
    assert isinstance(calls.got[0][0][0], Result)
    deadline = time.monotonic() + 10
    err = ""
    while "a bug in the caller" not in err and time.monotonic() < deadline:
        err += capfd.readouterr().err
        time.sleep(0.02)
    assert "ctl: bug: the callback of `python3 -I -S ...` raised" in err
    assert "KeyError: 'a bug in the caller'" in err


def test_an_answer_past_its_cap_is_refused_once(relay: tuple[HostRelay, LocalHost]) -> None:
    r, _host = relay
    calls = Calls()
    r.submit(fake("big"), agent=AgentStart(FAKE_AT, len(FAKE), True, ""), stdin=FAKE, on_done=calls.cb(0),
             max_output=1000)
    calls.wait(1)
    time.sleep(0.5)
    ((got, _thread),) = calls.got[0]
    assert isinstance(got, OutputTooLarge)


def test_every_request_in_flight_is_told_once_when_the_relay_ends(relay: tuple[HostRelay, LocalHost]) -> None:
    r, host = relay
    calls = Calls()
    for i in range(3):
        r.submit(fake("hang"), agent=AgentStart(FAKE_AT, len(FAKE), True, ""), stdin=FAKE, on_done=calls.cb(i))
    time.sleep(0.3)
    host.chans[0].proc.kill()
    calls.wait(3)
    time.sleep(0.3)
    for i in range(3):
        ((got, _thread),) = calls.got[i]
        assert isinstance(got, ConnectionFailed), got
    with pytest.raises(ConnectionFailed):  # a request after the end never starts: raised, no callback
        r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(9))
    assert 9 not in calls.got


# --- flows() over a relay that ends: fanout._Flows driven as flows() drives it, each container's one request going
# to the real relay (the fake agent hangs in it, so the relay's end is what answers).

class _LocalMux(MuxRelay):
    """MuxRelay (its open, reconnect and end handling) over a local relay process instead of a session socket."""

    _start = HostRelay._start


class _Here:
    """What Agent needs of a Transport, every request going to the real agent through the local relay."""

    name = "ct"
    request_timeout = 60.0

    def __init__(self, relay: HostRelay) -> None:
        self.relay = relay

    def path(self, p: str) -> str:
        return p

    def submit_agent(self, argv: Any, start: Any, *, stdin: bytes, on_done: Any, max_output: Any = None) -> Any:
        return self.relay.submit(argv, agent=start, stdin=stdin, on_done=on_done, max_output=max_output)

    def run_agent(self, argv: Any, start: Any, *, stdin: bytes, timeout: Any = None, max_output: Any = None) -> Any:
        return self.relay.run(argv, agent=start, stdin=stdin, timeout=timeout, max_output=max_output)


class _Hanging(_Here):
    """Its requests go to the relay, to an agent that never answers."""

    def submit_agent(self, argv: Any, start: Any, *, stdin: bytes, on_done: Any, max_output: Any = None) -> Any:
        return self.relay.submit(fake("hang"), agent=AgentStart(FAKE_AT, len(FAKE), True, ""), stdin=FAKE,
                                 on_done=on_done, max_output=max_output)


def _flows_over(relay: HostRelay, host: LocalHost, n: int, per_host: int, *, end_first: bool) -> list[Any]:
    cts = [SimpleNamespace(name=f"ct{i}", host_name="h", spec=SimpleNamespace(transport="pct")) for i in range(n)]

    def flow(_ct: Any, _agent: Any) -> Any:
        yield "hello", {}
        return "answered"

    driver: _Flows[str] = _Flows(cts, flow, per_host)  # type: ignore[arg-type]
    for i in range(n):
        driver.add(i, Agent(_Hanging(relay)))  # type: ignore[arg-type]
    if end_first:
        host.chans[0].proc.kill()
        host.chans[0].proc.wait()
        time.sleep(0.3)
    driver.begin()
    if not end_first:
        time.sleep(0.5)
        host.chans[0].proc.kill()  # the relay (or the session) ends under the requests in flight
    driver.wait()
    return driver.outcomes()


@pytest.mark.parametrize("cls", [HostRelay, _LocalMux])
def test_flows_under_a_relay_that_ends_fail_each_container_and_start_the_queued_ones(cls: type[HostRelay]) -> None:
    """per_host 1: each failure starts the next queued container from the reader thread, whose request then
    fails as it is asked; a session's reader must not try to replace its own session (it would wait for
    itself)."""
    host = LocalHost()
    r = cls(host, 60) if cls is _LocalMux else cls(host)  # type: ignore[call-arg]
    assert r.available() and r.staying
    try:
        out = _flows_over(r, host, 3, 1, end_first=False)
    finally:
        r.closing = True
    assert [o.ok for o in out] == [False, False, False]
    assert all("SSH connection" in str(o.error) or "relay exited" in str(o.error) for o in out), out


def test_a_long_queue_behind_an_ended_relay_does_not_deepen_the_stack(relay: tuple[HostRelay, LocalHost]) -> None:
    """Every request fails as it is asked: 400 containers at 16 a time settle in a loop, not in nested calls."""
    r, host = relay
    out = _flows_over(r, host, 400, 16, end_first=True)
    assert len(out) == 400 and not any(o.ok for o in out)


def test_a_flow_reads_header_and_bytes_answers_in_flight_and_in_a_thread_alike(
        relay: tuple[HostRelay, LocalHost], tmp_path: Any) -> None:
    """A Read step (what `ctl status` polls with) is answered with read()'s tuple, the bytes after the header
    intact, whether the flow's requests are in flight together (_Flows) or called one by one (_flow_here)."""
    r, _host = relay
    logs = []
    for i in range(3):
        log = tmp_path / f"train{i}.log"
        log.write_bytes(b"step=1 loss=2.5\n" * (i + 1) + b"\xff\x00 no newline")
        logs.append(log)

    def flow(ct: Any, agent: Agent) -> Any:
        head, data, _wire_out, _wire_in = yield Read("logread", {"log": str(logs[int(ct.name[2:])]), "offset": 0,
                                                                 "max_bytes": 1 << 20})
        doc = yield "hello", {}
        return head["length"], data, doc["ok"]

    cts = [SimpleNamespace(name=f"ct{i}", host_name="h", spec=SimpleNamespace(transport="pct")) for i in range(3)]
    driver: _Flows[Any] = _Flows(cts, flow, 16)  # type: ignore[arg-type]
    for i in range(3):
        driver.add(i, Agent(_Here(r)))  # type: ignore[arg-type]
    driver.begin()
    driver.wait()
    together = [o.value for o in driver.outcomes()]
    one_by_one = [_flow_here(flow(ct, agent), agent) for ct in cts for agent in [Agent(_Here(r))]]  # type: ignore
    want = [(len(log.read_bytes()), log.read_bytes(), True) for log in logs]
    assert together == want and one_by_one == want

