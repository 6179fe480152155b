"""How a fan-out schedules its containers (controller/commands/fanout.py): every host at once, at most PER_HOST
of one host at a time, results in the order asked, errors per container. A real Pool over a real inventory;
the function run per container never connects (it only records when it ran)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from controller import inventory
from controller.commands.fanout import _round_robin, fanout, flows
from controller.errors import ExitCode, InputError
from controller.transport.pool import Pool

INVENTORY = """\
hosts:
  pve1: {address: 127.0.0.2, known_hosts: kh}
  pve2: {address: 127.0.0.3, known_hosts: kh}
containers:
  a1: {host: pve1, vmid: 201}
  a2: {host: pve1, vmid: 202}
  a3: {host: pve1, vmid: 203}
  a4: {host: pve1, vmid: 204}
  a5: {host: pve1, vmid: 205}
  b1: {host: pve2, vmid: 301}
  b2: {host: pve2, vmid: 302}
  s1: {transport: ssh, address: 127.0.0.4, known_hosts: kh}
"""


@pytest.fixture
def inv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> inventory.Inventory:
    monkeypatch.setenv("CTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CTL_PERSIST", "0")  # nothing here starts a session either way: fn never connects
    (tmp_path / "kh").write_text("")
    p = tmp_path / "inventory.yaml"
    p.write_text(INVENTORY)
    return inventory.load(p)


def test_each_host_gets_a_turn_in_order(inv: inventory.Inventory) -> None:
    cts = [inv.container(n) for n in ("a1", "a2", "a3", "b1", "s1", "b2", "a4")]
    assert [cts[i].name for i in _round_robin(cts)] == ["a1", "b1", "s1", "a2", "b2", "a3", "a4"]


def test_hosts_run_side_by_side_and_each_within_its_limit(inv: inventory.Inventory) -> None:
    """pve1's five containers come first in the inventory; with two of a host at a time, pve2's two start with
    pve1's first two (they all meet at one barrier), and pve1 never has more than two running."""
    cts = [inv.container(n) for n in ("a1", "a2", "a3", "a4", "a5", "b1", "b2")]
    first_wave = threading.Barrier(4, timeout=10)
    lock = threading.Lock()
    running = {"pve1": 0, "pve2": 0}
    most = {"pve1": 0, "pve2": 0}

    def fn(ct: inventory.Container, _t: object) -> str:
        host = ct.host_name
        assert host is not None
        with lock:
            running[host] += 1
            most[host] = max(most[host], running[host])
        try:
            if ct.name in ("a1", "a2", "b1", "b2"):
                first_wave.wait()  # a BrokenBarrierError here: pve2 waited behind pve1's containers
            else:
                time.sleep(0.02)
            return ct.name
        finally:
            with lock:
                running[host] -= 1

    with Pool(inv) as pool:
        out = fanout(pool, cts, fn, per_host=2)
    assert [o.value for o in out] == [ct.name for ct in cts]
    assert all(o.ok for o in out)
    assert most == {"pve1": 2, "pve2": 2}


def test_a_failure_stays_with_its_container(inv: inventory.Inventory) -> None:
    cts = [inv.container(n) for n in ("a1", "b1", "a2")]

    def fn(ct: inventory.Container, _t: object) -> str:
        if ct.name == "b1":
            raise InputError("b1: no such thing")
        return ct.name

    with Pool(inv) as pool:
        out = fanout(pool, cts, fn)
    assert [(o.ct, o.value, o.error) for o in out] == [("a1", "a1", None), ("b1", None, "b1: no such thing"),
                                                        ("a2", "a2", None)]
    assert out[1].exit_code == int(InputError.exit_code)


def test_a_bug_in_one_container_s_work_is_raised_and_nothing_more_begins(inv: inventory.Inventory) -> None:
    """Not a container's failure (an Outcome) but an exception of ctl's own: raised to the caller once the work
    already begun has ended, as a thread pool's map raised it; the containers not begun are never touched."""
    cts = [inv.container(n) for n in ("a1", "a2", "a3", "a4", "a5")]
    begun: list[str] = []
    ended: list[str] = []
    a2_runs = threading.Event()

    def fn(ct: inventory.Container, _t: object) -> str:
        begun.append(ct.name)
        if ct.name == "a1":
            assert a2_runs.wait(10)
            raise ZeroDivisionError("a bug")
        a2_runs.set()
        time.sleep(0.3)  # still running when a1 fails: it ends before the caller sees the bug
        ended.append(ct.name)
        return ct.name

    with Pool(inv) as pool, pytest.raises(ZeroDivisionError, match="a bug"):
        fanout(pool, cts, fn, per_host=2)
    assert sorted(begun) == ["a1", "a2"] and ended == ["a2"]


def test_side_by_side_keeps_the_order_and_ends_its_threads() -> None:
    from controller.commands.fanout import _side_by_side

    before = threading.active_count()
    assert _side_by_side(lambda i: i * i, [3, 1, 0, 2], 3) == [0, 1, 4, 9]
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before  # no thread left waiting for work


def test_no_container_is_no_work(inv: inventory.Inventory) -> None:
    """What is left of a job's nodes but the one holding the checkpoint can be none (a job of one node)."""
    with Pool(inv) as pool:
        assert fanout(pool, [], lambda ct, t: ct.name) == []


def test_a_host_that_does_not_answer_is_asked_once_for_all_its_containers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flows() asks one container per host whether it keeps staying agents (which connects). When the host does
    not answer, each of its containers is told so then: none of them waits out another connect of its own (a
    `ctl status` of a host that is down took two connect timeouts)."""
    monkeypatch.setenv("CTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CTL_PERSIST", "0")
    accepted: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as srv:  # takes the connection and hangs up: no SSH server here
        port = srv.getsockname()[1]

        def serve() -> None:
            srv.settimeout(0.2)
            while not done.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                accepted.append(1)
                conn.close()

        done = threading.Event()
        t = threading.Thread(target=serve)
        t.start()
        try:
            (tmp_path / "kh").write_text("")
            p = tmp_path / "inventory.yaml"
            p.write_text(f"hosts:\n  down: {{address: 127.0.0.1, port: {port}, known_hosts: kh, connect_timeout: 5}}\n"
                         "containers:\n" + "".join(f"  c{i}: {{host: down, vmid: {201 + i}}}\n" for i in range(4)))
            inv = inventory.load(p)
            cts = [inv.container(f"c{i}") for i in range(4)]

            def flow(_ct: object, _agent: object) -> object:
                yield "hello", {}
                return "answered"

            with Pool(inv) as pool:
                out = flows(pool, cts, flow)  # type: ignore[arg-type]
        finally:
            done.set()
            t.join()
    assert [o.ct for o in out] == ["c0", "c1", "c2", "c3"]
    assert all(not o.ok and o.exit_code == int(ExitCode.CONNECTION) for o in out), out
    assert len({o.error for o in out}) == 1 and "down:" in str(out[0].error), out
    assert len(accepted) == 1

