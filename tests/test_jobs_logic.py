"""Runs across several containers, the parts without containers: a run's state from its nodes' states and the
node that ended it, tok/s summed over nodes, `ctl diff` node by node, the agent's rendezvous check over real
sockets (listen + nonce, refused, something else answering, port in use) and the times of log lines."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

from controller import farside
from controller.commands.reconcile import aggregate, culprit, exit_text
from controller.core.metrics import MetricPoint, combine_nodes
from controller.core.rundiff import diff_nodes
from controller.lifecycle import Lifecycle
from controller.registry import RunRecord
from tests.helpers import free_port

agent_mod = farside.load("agent")


def node(ct: str, rank: int, state: Lifecycle, *, exit_status: int | None = None, ended: float | None = None,
         **kw: object) -> RunRecord:
    return RunRecord(id=rank + 10, name="r1", ct=ct, host=None, created=1.0, started=2.0, ended=ended, state=state,
                     exit_status=exit_status, session="s", log_path="/w/r1.log", run_dir=None, command=None,
                     commit_sha="c1", dirty=False, member_of=1, node_rank=rank, **kw)  # type: ignore[arg-type]


R, F, S, X, L, ST = (Lifecycle.RUNNING, Lifecycle.FINISHED, Lifecycle.STOPPED, Lifecycle.FAILED, Lifecycle.LOST,
                     Lifecycle.STARTING)


def test_the_run_state_is_its_nodes_states_and_the_first_bad_one_ended_it() -> None:
    assert aggregate([node("a", 0, R), node("b", 1, R)]) == Lifecycle.RUNNING
    assert aggregate([node("a", 0, ST), node("b", 1, R)]) == Lifecycle.STARTING
    assert aggregate([node("a", 0, F), node("b", 1, R)]) == Lifecycle.RUNNING  # the other is finishing
    assert aggregate([node("a", 0, F), node("b", 1, F)]) == Lifecycle.FINISHED
    assert aggregate([node("a", 0, S), node("b", 1, F)]) == Lifecycle.STOPPED
    nodes = [node("a", 0, X, exit_status=1, ended=50.0), node("b", 1, X, exit_status=137, ended=40.0),
             node("c", 2, R)]
    assert aggregate(nodes) == Lifecycle.CRASHED
    first = culprit(nodes)
    assert first is not None and first.ct == "b"  # ended first: the others failed because it did
    assert aggregate([node("a", 0, L), node("b", 1, R)]) == Lifecycle.CRASHED
    assert culprit([node("a", 0, R)]) is None
    assert exit_text(137) == "exit 137 (SIGKILL)" and exit_text(1) == "exit 1" and exit_text(None) == "no exit status"


def test_tok_s_is_summed_over_the_nodes_step_by_step() -> None:
    a = [MetricPoint(1, loss=2.0, tok_s=1000.0, time=10.0), MetricPoint(2, loss=1.5, tok_s=1100.0, time=11.0)]
    b = [MetricPoint(1, tok_s=900.0, time=10.5), MetricPoint(2, tok_s=950.0, time=11.5),
         MetricPoint(2, tok_s=5.0)]  # a restarted log repeats a step: counted once
    got = combine_nodes([a, b])
    assert [(p.step, p.tok_s, p.loss, p.time) for p in got] == [(1, 1900.0, 2.0, 10.5), (2, 2050.0, 1.5, 11.5)]
    assert combine_nodes([a, []]) == [replace(p, raw="") for p in combine_nodes([a])]


def test_diff_compares_node_by_node() -> None:
    a0 = replace(node("ct200", 0, F), files={"/root/t.py": "aaa"}, vars={"steps": 8})
    a1 = replace(node("ct300", 1, F), files={"/root/t.py": "aaa"}, vars={"steps": 8})
    b0 = replace(a0, files={"/root/t.py": "bbb"}, vars={"steps": 9})
    run_a = replace(node("pair", 0, F), member_of=None, node_rank=None, nodes=2, name="r1")
    run_b = replace(run_a, name="r2")
    d = diff_nodes(run_a, [a0, a1], run_b, [b0])
    assert ("node0:/root/t.py", "aaa", "bbb") in d.files and ("node0.steps", 8, 9) in d.vars
    assert ("nodes", 2, 1) in d.vars and ("node1.ct", "ct300", None) in d.vars and not d.same
    assert diff_nodes(run_a, [a0, a1], run_b, [a0, a1]).same


# --- the agent's rendezvous check, on this machine's loopback ----------------------------------------------


def in_thread(fn, *args):  # type: ignore[no-untyped-def]
    box: dict[str, object] = {}
    th = threading.Thread(target=lambda: box.setdefault("v", fn(*args)))
    th.start()
    return th, box


def test_rendezvous_check_listens_and_each_node_reads_the_nonce() -> None:
    port = free_port()
    th, box = in_thread(agent_mod._rdzv_check, {"listen": port, "nonce": "n1", "expect": 2, "timeout": 5})
    peers = [agent_mod._rdzv_check({"connect": ["127.0.0.1", port], "nonce": "n1", "timeout": 5}) for _ in (1, 2)]
    th.join()
    assert box["v"] == {"listen": port, "bound": True, "peers": 2}
    assert all(p["ok"] for p in peers), peers
    with socket.socket() as s:  # the listener is gone and the port is free again for torchrun's store
        s.bind(("127.0.0.1", port))


def test_rendezvous_check_names_what_is_wrong() -> None:
    port = free_port()
    t0 = time.monotonic()
    refused = agent_mod._rdzv_check({"connect": ["127.0.0.1", port], "nonce": "n", "timeout": 0.6})
    assert refused["ok"] is False and refused["error"] == "Connection refused" and time.monotonic() - t0 >= 0.5
    with socket.socket() as other:  # something else listens there: it does not count as the rendezvous node
        other.bind(("127.0.0.1", port))
        other.listen()

        def answer() -> None:
            conn, _ = other.accept()
            conn.sendall(b"SSH-2.0-OpenSSH\n")
            conn.close()

        th = threading.Thread(target=answer)
        th.start()
        wrong = agent_mod._rdzv_check({"connect": ["127.0.0.1", port], "nonce": "n", "timeout": 2})
        th.join()
        assert wrong["ok"] is False and "something else answers there" in wrong["error"]
        busy = agent_mod._rdzv_check({"listen": port, "nonce": "n", "expect": 1, "timeout": 1})
    assert busy["bound"] is False and busy["in_use"] is True and busy["error"] == "Address already in use"
    unknown = agent_mod._rdzv_check({"connect": ["no-such-host.invalid", port], "nonce": "n", "timeout": 2})
    assert unknown["ok"] is False and unknown["error"].startswith("cannot resolve no-such-host.invalid")


def test_line_times_come_from_the_launchers_samples(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"one\ntwo\nthree\nfour\n")
    (tmp_path / "train.log.times").write_text("0 100.0\n8 101.0\n14,5 x\n19 102,5\n")
    got = agent_mod.tailinfo({"log": str(log), "lines": 3, "times": True})
    assert got["text"] == "two\nthree\nfour\n"
    assert got["times"][0] == 101.0  # "two\n" ends at 8: the sample at size 8
    assert got["times"][1] == 102.5 and got["times"][2] == 102.5  # a sample written with a decimal comma counts
    assert agent_mod.tailinfo({"log": str(log), "lines": 2})["text"] == "three\nfour\n"  # no times unless asked


def _pulled(run: str, *, idle_s: float) -> object:
    from controller.commands.monitor import PullResult

    return PullResult(run, 0, 0, 0, 0, 0, 0, 1, 0, None, None, None, log_mtime=1000.0, remote_now=1000.0 + idle_s)


def test_only_nodes_that_log_metrics_can_stall_a_run(tmp_path: Path) -> None:
    """The DFlash payload logs metric lines on node 0 alone; node 1's log goes quiet after its first lines by
    design, and must not make a training run STALLED. A quiet node 0 still does."""
    from controller.commands.monitor import job_status
    from controller.core.metrics import RunState
    from controller.registry import Registry

    reg = Registry(tmp_path / "r.sqlite3")
    run, (n0, n1) = reg.claim_job_run("fresh7", "pair", [("ct200", "pve1"), ("ct300", "pve2")],
                                      session="s-fresh7", log_path="/w/f7.log", run_dir="/w/runs/fresh7")
    for m in (run, n0, n1):
        reg.update_run(m.id, state=Lifecycle.RUNNING)
    run = reg.run_by_id(run.id)
    now = time.time()
    pts = [{"step": s, "loss": 5.0, "tok_s": 12800.0, "time": now - 40 + s} for s in range(1, 30)]
    assert reg.advance_cursor(n0.id, (0, None), 100, "i", b"", pts)

    def judge(idle0: float, idle1: float) -> tuple[RunState, str]:
        st = job_status(run, reg, ("fresh6", 12800.0), {n0.id: _pulled("fresh7", idle_s=idle0),  # type: ignore[dict-item]
                                                        n1.id: _pulled("fresh7", idle_s=idle1)},
                        slow_ratio=0.8, stall_after_s=300)
        return st.verdict.state, st.verdict.reason

    state, why = judge(idle0=2, idle1=3600)
    assert state == RunState.OK, why
    state, why = judge(idle0=3600, idle1=2)
    assert state == RunState.STALLED and "ct200" in why, why


def test_the_merged_tail_of_a_job_is_in_the_order_its_nodes_wrote(tmp_path: Path) -> None:
    """`ctl tail JOB`'s history (runs.history): two nodes' lines interleaved by their LOG.times (over the agent,
    through the local transport), a line without a sample after the one before it on its node, a tie broken by the
    node's rank. Plain concatenation (all of ct-a, then all of ct-b) or a sort by text fails here."""
    import yaml

    from controller.commands.runs import history
    from controller.inventory import load
    from controller.transport.pool import Pool

    written = {  # node -> [(line, when it reached the log)]; None: written after the last sample
        "ct-a": [("a1 step=1", 100.0), ("a2 step=2", 102.0), ("a3 step=3", 104.0), ("a4 step=4", 106.0)],
        "ct-b": [("b1 step=1", 101.0), ("b2 step=2", 102.0), ("b3 step=3", 105.0), ("b4 no sample", None)],
    }
    for ct, lines in written.items():
        w = tmp_path / ct / "w"
        w.mkdir(parents=True)
        text, samples = b"", []
        for line, when in lines:
            text += line.encode() + b"\n"
            if when is not None:
                samples.append(f"{len(text)} {when}\n")
        (w / "r1.log").write_bytes(text)
        (w / "r1.log.times").write_text("".join(samples))
        os.utime(w / "r1.log", (200.0, 200.0))  # the mtime stands for the last line's time
    inv_path = tmp_path / "inventory.yaml"
    inv_path.write_text(yaml.safe_dump({"containers": {ct: {"transport": "local", "root": str(tmp_path / ct)}
                                                       for ct in written}}))
    inv = load(inv_path)
    members = [replace(node("ct-a", 0, R), id=10), replace(node("ct-b", 1, R), id=11)]
    with Pool(inv) as pool:
        merged, sizes = history(inv, pool, members, 10)
        assert [text for _n, text in merged] == ["a1 step=1", "b1 step=1", "a2 step=2", "b2 step=2", "a3 step=3",
                                                 "b3 step=3", "a4 step=4", "b4 no sample"]
        assert [n for n, _t in merged] == ["ct-a", "ct-b"] * 4
        assert sizes == {10: (tmp_path / "ct-a" / "w" / "r1.log").stat().st_size,
                         11: (tmp_path / "ct-b" / "w" / "r1.log").stat().st_size}
        # the last 2 lines of each node, still merged by time
        last, _ = history(inv, pool, members, 2)
        assert [text for _n, text in last] == ["a3 step=3", "b3 step=3", "a4 step=4", "b4 no sample"]
