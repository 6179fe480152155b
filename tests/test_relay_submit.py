"""Requests submitted without waiting (HostRelay.submit): ctl's real host relay (controller/remote/hostrelay.py),
run here over a socket pair as tests/test_relay_ids.py does, with the real agent and the failure-mode stand-in of
tests/test_staying_agent.py. Each request's callback is called once, whatever ends it: its answer, a source the
relay lacks (sent again), a deadline, a cap, the relay's end."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from controller.errors import ConnectionFailed, CtlError, DeadlineExceeded, OutputTooLarge
from controller.remote.client import VERB_AT, agent_argv, agent_sha, agent_source
from controller.transport.base import AgentStart, Result
from controller.transport.relay import HostRelay
from tests.test_relay_ids import _LocalHost
from tests.test_staying_agent import FAKE, FAKE_AT, fake


@pytest.fixture
def relay() -> Iterator[tuple[HostRelay, _LocalHost]]:
    host = _LocalHost()
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
        relay: tuple[HostRelay, _LocalHost]) -> None:
    r, _host = relay
    calls = Calls()
    threads = threading.active_count()
    for i in range(40):
        r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(i))
    assert threading.active_count() <= threads + 1  # nothing per request (at most a K sender)
    calls.wait(40)
    time.sleep(0.2)
    assert sorted(calls.got) == list(range(40)) and all(len(v) == 1 for v in calls.got.values())
    for (got, thread), in calls.got.values():
        assert isinstance(got, Result) and got.returncode == 0, got
        assert json.loads(got.stdout)["ok"] is True
        assert thread in (r._reader.name, threading.main_thread().name)  # type: ignore[union-attr]
    assert not r._streams  # every id freed
    assert agent_sha() in r.sources_sent  # the next requests leave the source out


def test_a_source_the_relay_does_not_keep_goes_again_and_is_answered_once(relay: tuple[HostRelay, _LocalHost]) -> None:
    r, _host = relay
    r.sources_sent.add(agent_sha())  # believed kept: the request leaves it out, the relay answers U
    calls = Calls()
    r.submit(HELLO, agent=hello_start(), stdin=SOURCE, on_done=calls.cb(0))
    calls.wait(1)
    time.sleep(0.3)
    ((got, _thread),) = calls.got[0]
    assert isinstance(got, Result) and json.loads(got.stdout)["staying"] is True
    assert agent_sha() in r.sources_missing


def test_a_request_past_its_deadline_is_told_once_and_the_relay_goes_on(relay: tuple[HostRelay, _LocalHost]) -> None:
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


def test_an_answer_past_its_cap_is_refused_once(relay: tuple[HostRelay, _LocalHost]) -> None:
    r, _host = relay
    calls = Calls()
    r.submit(fake("big"), agent=AgentStart(FAKE_AT, len(FAKE), True, ""), stdin=FAKE, on_done=calls.cb(0),
             max_output=1000)
    calls.wait(1)
    time.sleep(0.5)
    ((got, _thread),) = calls.got[0]
    assert isinstance(got, OutputTooLarge)


def test_every_request_in_flight_is_told_once_when_the_relay_ends(relay: tuple[HostRelay, _LocalHost]) -> None:
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
