"""The fault soak of bench/chaos.py, short: every fault type it builds once, in a seeded order (CT 201 and 301
alone, CT 200 and 300 the two nodes of a job), against one
`ctl supervise --restart on-failure:N` and its `--standby`, then every invariant (one crash one relaunch,
no relaunch of an operator-stopped run, UNREACHABLE never CRASHED, resume from the newest complete checkpoint,
nothing lost, events once per sink, `ctl runs` agrees with the containers)."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from bench.chaos import FAULTS, free_port, soak
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
