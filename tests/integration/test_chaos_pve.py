"""The fault soak of bench/chaos.py, short: every fault type it builds once, in a seeded order (CT 201 and 301
alone, CT 200 and 300 the two nodes of a job), against one
`ctl supervise --restart on-failure:N` and its `--standby`, then every invariant (one crash one relaunch,
no relaunch of an operator-stopped run, UNREACHABLE never CRASHED, resume from the newest complete checkpoint,
nothing lost, events once per sink, `ctl runs` agrees with the containers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.chaos import CTS, FAULTS, JOB, JOB_NODES, Soak, complete, free_port, soak
from tests.conftest import end_sessions
from tests.helpers import wait_for
from tests.integration.conftest import PveEnv
from tests.pvehost import PveHost

pytestmark = pytest.mark.pvehost


def test_every_fault_once_keeps_every_invariant(pvehost: PveHost, tmp_path: Path) -> None:
    seed = 42
    try:
        s = soak(pvehost, tmp_path, seed, 0, each_once=True, tag="ch" + uuid.uuid4().hex[:6], freeze_s=(20, 20),
                 rdzv_port=free_port())
    finally:
        end_sessions(tmp_path / "state")
        for vmid in (200, 201, 300, 301):
            if not pvehost.running(vmid):
                pvehost.start(vmid)
    print(s.figure())
    assert sorted(f.kind for f in s.faults) == sorted(FAULTS), s.figure()
    assert s.violations == [], s.figure()
    for f in s.faults:
        assert f.recovered is not None, f"{f.kind} on {f.target}: not recovered ({f.note})\n{s.figure()}"
        if f.kind in ("kill9", "oom", "stall", "ctstop"):
            assert f.note == "restart", f"{f.kind} on {f.run}: {f.note}"


def test_stall_sigstop_is_not_an_exit(pve_env: PveEnv) -> None:
    """A trainer stopped with SIGSTOP (a stall) is still alive: its launcher must not write an exit status for it
    (with job control on, bash's `wait` returned 147 at the stop, so ctl reported a crash and relaunched while the
    stalled process kept its GPUs). Killed afterwards, its exit is the kill's, 137."""
    doc = dict(pve_env.base_extra)
    doc["vars"] = {**doc["vars"], "steps": 100000, "interval": 0.2}
    pve_env.host.write_inventory(pve_env.inventory, **doc)
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    pve_env.ctl("launch", "ct200", "--run", "st1", check=True)
    log = pve_env.host.rootfs(200) / "workspace" / pve_env.tag / "train_stdout_st1.log"
    wait_for("the trainer's pid", lambda: log.with_name(log.name + ".pid").exists(), timeout=30)
    pid = log.with_name(log.name + ".pid").read_text().strip()
    node = pve_env.host.node_of(200).name

    def attach(*argv: str) -> str:
        return subprocess.run(["lxc-attach", "-P", str(pve_env.host.lxcpath(node)), "-n", "200", "--", *argv],
                              capture_output=True, text=True, timeout=30, check=True).stdout

    attach("kill", "-STOP", pid)
    wait_for("the trainer stopped", lambda: attach("cat", f"/proc/{pid}/stat").rsplit(") ", 1)[1][0] == "T",
             timeout=10)
    attach("kill", "-KILL", pid)
    exit_file = log.with_name(log.name + ".exit")
    wait_for("the launcher's exit file", exit_file.exists, timeout=30)
    assert exit_file.read_text().strip() == "137"
    (run,) = json.loads(pve_env.ctl("--json", "runs", check=True).stdout)
    assert run["exit_status"] == 137, run


def test_stall_sigstop_then_stop_ends_it_with_the_first_signal(pve_env: PveEnv) -> None:
    """`ctl stop` of a stalled run (its trainer SIGSTOPped, as the supervisor does before relaunching a STALLED
    run): SIGINT alone ends it, as for a running one, instead of sitting out the grace and SIGTERM's 10 s
    waiting on a process that cannot act on either until it is continued."""
    doc = dict(pve_env.base_extra)
    doc["vars"] = {**doc["vars"], "steps": 100000, "interval": 0.2}
    pve_env.host.write_inventory(pve_env.inventory, **doc)
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    pve_env.ctl("launch", "ct200", "--run", "st2", check=True)
    log = pve_env.host.rootfs(200) / "workspace" / pve_env.tag / "train_stdout_st2.log"
    wait_for("the trainer's pid", lambda: log.with_name(log.name + ".pid").exists(), timeout=30)
    pid = log.with_name(log.name + ".pid").read_text().strip()
    node = pve_env.host.node_of(200).name
    subprocess.run(["lxc-attach", "-P", str(pve_env.host.lxcpath(node)), "-n", "200", "--", "kill", "-STOP", pid],
                   check=True, timeout=30)
    pve_env.ctl("stop", "st2", "--grace", "20", check=True, timeout=120)
    shown = json.loads(pve_env.ctl("--json", "show", "st2", check=True).stdout)
    assert shown["state"] == "stopped" and "stopped by ctl stop (SIGINT)" in (shown.get("note") or ""), shown


def test_opstop_racing_a_poll_is_never_relaunched(pve_env: PveEnv) -> None:
    """The soak's race: `ctl stop`'s SIGINT ends the training, a supervisor poll sees the exit first and plans a
    relaunch of a CRASHED run, then the stop records STOPPED. When the relaunch is due, the operator's stop wins:
    refused, and no run started."""
    from controller.lifecycle import Lifecycle
    from controller.registry import Registry

    doc = dict(pve_env.base_extra)
    doc["vars"] = {**doc["vars"], "steps": 100000, "interval": 0.2}
    pve_env.host.write_inventory(pve_env.inventory, **doc)
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    pve_env.ctl("launch", "ct200", "--run", "op1", check=True)
    log = pve_env.host.rootfs(200) / "workspace" / pve_env.tag / "train_stdout_op1.log"
    wait_for("the trainer's pid", lambda: log.with_name(log.name + ".pid").exists(), timeout=30)
    pid = log.with_name(log.name + ".pid").read_text().strip()
    node = pve_env.host.node_of(200).name
    subprocess.run(["lxc-attach", "-P", str(pve_env.host.lxcpath(node)), "-n", "200", "--", "kill", "-INT", pid],
                   check=True, timeout=30)  # what ctl stop sends first
    wait_for("the exit status", log.with_name(log.name + ".exit").exists, timeout=30)
    once = ["supervise", "--once", "--restart", "on-failure:3", "--backoff", "600s"]
    first = pve_env.ctl(*once, check=True)
    assert "CRASHED" in first.stdout and "relaunch as the next run" in first.stdout, first.stdout
    reg = Registry(pve_env.state / "registry.sqlite3")
    try:
        run = reg.find_run("ct200/op1")
        reg.update_run(run.id, state=Lifecycle.STOPPED, note="stopped by ctl stop (SIGINT)")  # as ctl stop ends
        reg.set_restart(run.id, doc=json.dumps({"verdict": "crashed", "not_before": 0, "attempts": 0}))
    finally:
        reg.close()
    second = pve_env.ctl(*once, check=True)
    assert "not relaunched: refused: stopped by ctl stop (SIGINT)" in second.stdout, second.stdout
    runs = json.loads(pve_env.ctl("--json", "runs", check=True).stdout)
    assert [(r["name"], r["state"]) for r in runs] == [("op1", "stopped")]


@pytest.fixture
def pair(pvehost: PveHost, tmp_path: Path) -> Iterator[Soak]:
    """The soak's job `pair` alone (CT 200 and CT 300, tests/fakepayload/ckpt_trainer.py on each, both writing
    checkpoints every 8 steps of 0.5 s), launched and training; no supervisor: the test polls with --once."""
    s = Soak(pvehost, tmp_path, 0, tag="ch" + uuid.uuid4().hex[:6], rdzv_port=free_port())
    try:
        s.set_up([JOB])
        wait_for("both nodes training", lambda: (run := s.live_run(JOB)) is not None and all(
            s.trainer_pid(m) for m in node_runs(s, run)), timeout=120)
        yield s
    finally:
        end_sessions(tmp_path / "state")
        for ct in JOB_NODES:  # nothing of the test outlives it: its trainers, by pid
            pids = [str(p) for p in trainer_pids(s, ct)]
            if pids:
                s.attach(ct, "kill", "-9", *pids)
            pvehost.set_host_network(CTS[ct], False)


def node_runs(s: Soak, run: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(r) for r in s.rows("SELECT * FROM runs WHERE member_of=? ORDER BY node_rank", run["id"])]


def trainer_pids(s: Soak, ct: str) -> list[int]:
    """This test's trainers in `ct`, seen from the host's /proc (their pids as the container knows them)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"/root/{s.tag}/ckpt_trainer.py".encode() in (d / "cmdline").read_bytes() \
                    and f"lxc.payload.{CTS[ct]}" in (d / "cgroup").read_text():
                out.append(int((d / "status").read_text().split("NSpid:")[1].split()[-1]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def once(s: Soak, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "controller", "-i", str(s.work / "inventory.yaml"), "supervise", "--once",
            "--restart", "on-failure:3", "--backoff", "0.1s", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**s.env, **(env or {})},
                          cwd=s.work)


def test_opstop_of_a_job_racing_a_poll_is_never_relaunched(pair: Soak) -> None:
    """`ctl stop` of a job signals its nodes and records STOPPED only after every node stopped; a poll in between
    saw a node's exit 130 and relaunched the job. Here the stop dies right after its first node's signal (the
    widest form of that window): the stop was asked before any signal, so the poll settles the job STOPPED,
    stops the node still training, and plans no relaunch."""
    run = pair.live_run(JOB)
    assert run is not None
    assert once(pair).returncode == 0  # the supervisor has seen it training
    died = subprocess.run([sys.executable, "-m", "controller", "-i", str(pair.work / "inventory.yaml"), "stop",
                           f"{JOB}/{run['name']}", "--grace", "2"], capture_output=True, text=True, timeout=120,
                          env={**pair.env, "CTL_TEST_DIE_AT": "stop_signalled"}, cwd=pair.work)
    assert died.returncode == 137, died.stdout + died.stderr
    assert pair.rows("SELECT state FROM runs WHERE id=?", run["id"])[0]["state"] == "running"  # not recorded yet
    seen = once(pair)
    assert seen.returncode == 0 and "-> STOPPED" in seen.stdout and "relaunch" not in seen.stdout, seen.stdout
    assert pair.rows("SELECT * FROM restarts") == []  # not even planned: no later poll can relaunch it
    again = once(pair)
    assert again.returncode == 0 and "relaunch" not in again.stdout, again.stdout + again.stderr
    assert [(r["name"], r["state"]) for r in pair.rows("SELECT * FROM runs WHERE member_of IS NULL")] == [
        (run["name"], "stopped")]
    assert all(trainer_pids(pair, ct) == [] for ct in JOB_NODES)  # the node the stop never reached, stopped too


def test_diskfull_on_a_job_node_resumes_from_the_newest_step_every_node_holds(pair: Soak) -> None:
    """One node's checkpoint disk fills: its next checkpoint fails halfway (ENOSPC, exit 1) while the other node
    writes that step whole. The relaunch cannot copy that step to the full node; it resumes the job from the
    newest complete step that every node holds (no copy needed) instead of being refused after 3 attempts."""
    run = pair.live_run(JOB)
    assert run is not None
    full, other = (dict(m) for m in node_runs(pair, run))
    ckdir = f"{full['run_dir']}/checkpoints"

    def steps(ct: str) -> set[int]:
        return {st for d in pair.in_ct(ct, ckdir).glob("step_*") if (st := complete(d)) is not None}

    wait_for("a complete checkpoint on both nodes", lambda: steps(full["ct"]) and steps(other["ct"]), timeout=120)
    mounted = pair.fill(full["ct"], full)  # room for half a checkpoint more
    try:
        held = max(steps(full["ct"]))  # what the full node holds: the tmpfs has a copy of it
        exit_file = pair.in_ct(full["ct"], full["log_path"] + ".exit")
        wait_for("the full node's checkpoint failing", exit_file.exists, timeout=120)
        wait_for("a newer step on the other node", lambda: max(steps(other["ct"])) > held, timeout=120)
        newer = max(steps(other["ct"]))
        assert once(pair).returncode == 0  # the crash seen, the other node stopped, the relaunch planned
        relaunched = once(pair)
        why = [r["doc"] for r in pair.rows("SELECT * FROM restarts")]  # the last error of a failed attempt
        assert f"resuming from step {held} " in relaunched.stdout, (relaunched.stdout + relaunched.stderr, why)
        skipped = pair.rows("SELECT * FROM events WHERE kind='checkpoint_skipped'")
        assert len(skipped) == 1 and f"not resuming from step {newer}: " in skipped[0]["summary"], skipped
        assert "No space left on device" in skipped[0]["summary"], skipped[0]["summary"]
        new = pair.live_run(JOB)
        assert new is not None and new["resumed_step"] == held and new["parent_id"] == run["id"], new
        for m in node_runs(pair, new):
            log = pair.in_ct(m["ct"], m["log_path"])
            wait_for(f"{m['ct']} resuming", lambda log=log: log.exists() and f"resumed from step {held} "
                     in log.read_text(), timeout=60)
    finally:
        pair.unfill(full["ct"], mounted)


def test_a_leftover_agent_that_no_run_owns_is_a_violation(pair: Soak) -> None:
    """The soak's end check: with the supervisors gone and the sessions ended, an agent left in a container (its
    pid namespace) or a relay left on a node (its sshd's connection) is a violation; the agents and relays a
    poll used end with their session, so a clean end reports none."""
    assert once(pair).returncode == 0  # a poll through the session: a relay on each node, an agent in each CT
    assert pair.leftovers(), "the check sees none of the session's own agents and relays: it could never fire"
    pair.check_leftovers(settle_s=60)
    assert pair.violations == []
    sleeper = "import time; time.sleep(300)"  # argv as ctl gives its agent and relay: python3 -I -S -c BOOT N ..
    pair.attach("ct300", "sh", "-c", f"setsid -f python3 -I -S -c '{sleeper}' 0 serve </dev/null >/dev/null 2>&1")
    pair.host.ssh("pve1", "sh", "-c", f"setsid -f python3 -I -S -c '{sleeper}' 0 </dev/null >/dev/null 2>&1")
    try:
        pair.check_leftovers(settle_s=1)
        assert len(pair.violations) == 2, pair.violations
        assert any(", ct300: 0 serve, is left with no run" in v for v in pair.violations), pair.violations
        assert any(", the relay of 127.0.0.2: 0, is left" in v for v in pair.violations), pair.violations
    finally:
        for pid, _what in pair.leftovers():
            os.kill(pid, signal.SIGKILL)
