"""One run across two containers on two Proxmox nodes (CT 200 on pve1, CT 300 on pve2), end to end: the shipped
start_training.sh template rendered per node, torchrun's real c10d rendezvous and a real gloo all-reduce
(tests/fakepayload/allreduce.py, with the torch of the venv running these tests), through `ctl`.

CT 200 and CT 300 share the host's network namespace for this module (`PveHost.set_host_network`), so node 0's
rendezvous address 127.0.0.12 is reachable from CT 300 as a real network would make it; CT 201 keeps its own
namespace, so a job whose rendezvous is there cannot be reached from CT 300: a firewall, as far as ctl can tell.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from controller.errors import ExitCode
from tests.helpers import wait_for
from tests.integration.jobnet import Job  # its fixtures (job, shared_net): conftest.py

pytestmark = pytest.mark.pvehost

def both_training(job: Job, run: str, steps: int = 3) -> None:
    wait_for(f"both nodes of {run} at step {steps}", lambda: all(
        max(job.steps(v, run), default=0) >= steps for v in (200, 300)), timeout=150)


def test_two_nodes_train_agree_tail_and_stop(job: Job) -> None:
    job.ok("deploy", "pair", "--allow-dirty")
    out = job.ok("launch", "pair", "--run", "two1")
    assert f"ct300      rendezvous ok     reaches 127.0.0.12:{job.port}" in out
    assert "ct200      rendezvous ok     listens on port" in out
    assert "launched two1 on 2 node(s) of pair (ct200, ct300)" in out
    both_training(job, "two1")
    a, b = job.steps(200, "two1"), job.steps(300, "two1")
    for step in set(a) & set(b):  # every rank sums 1 + 2 = 3 on every node, every step
        assert a[step][:2] == b[step][:2] == (3.0, 2)
    assert {a[1][2], b[1][2]} == {0, 1}  # one global rank on each node

    merged = job.ok("tail", "two1", "-n", "30").splitlines()
    assert {line.split("]")[0] + "]" for line in merged} == {"[ct200]", "[ct300]"}
    for node in ("ct200", "ct300"):  # each node's own lines keep their order in the merge
        steps = [int(m.group(1)) for line in merged if line.startswith(f"[{node}]")
                 and (m := re.search(r"step=(\d+)", line))]
        assert steps == sorted(steps) and steps
    only = job.ok("tail", "pair", "--node", "1", "-n", "5").splitlines()
    assert only and all(line.startswith("[ct300]") for line in only)

    runs = json.loads(job.ok("--json", "runs"))
    assert [(r["ct"], r["name"], r["nodes"], r["state"]) for r in runs] == [("pair", "two1", 2, "running")]
    r = job.ctl("--json", "status", "pair")
    assert r.returncode == 0, r.stderr
    (st,) = json.loads(r.stdout)
    assert st["run"] == "two1" and [n["ct"] for n in st["nodes"]] == ["ct200", "ct300"]
    assert st["reason"].startswith("2 nodes: ")

    out = job.ok("stop", "two1", "--grace", "10")
    assert "pair/two1: stopped" in out
    wait_for("no trainer left", lambda: not job.trainers(200) and not job.trainers(300), timeout=20)
    shown = json.loads(job.ok("--json", "show", "two1"))
    assert shown["state"] == "stopped" and [m["state"] for m in shown["members"]] == ["stopped", "stopped"]


JOB_RUNBOOK = """\
name: pair-run
steps:
  - deploy: {containers: [pair], allow_dirty: true}
  - launch: {ct: pair}
  - watch: {run: "{{ run }}", until_step: 8, for: 120s, every: 0.5s}
    on:
      CRASHED: [{fail: "{{ run }} crashed"}]
  - mark-good: {run: "{{ run }}"}
  - stop: {run: "{{ run }}", grace: 10}
"""


def test_a_runbook_launches_watches_and_stops_a_run_across_the_jobs_nodes(job: Job) -> None:
    """A runbook's `launch: {ct: JOB}` starts the run on every node of the job (as `ctl launch JOB` does), its
    watch judges the run whole, mark-good asks its nodes how it does, and its stop ends every node."""
    rb = job.dir / "pair.yaml"
    rb.write_text(JOB_RUNBOOK)
    dry = job.ok("runbook", "run", str(rb), "--dry-run")
    assert "would launch mn1 on the 2 nodes of pair" in dry, dry
    out = job.ok("runbook", "run", str(rb))
    lines = out.splitlines()
    assert any("launch pair" in ln and "mn1: 2 nodes of pair (ct200, ct300)" in ln for ln in lines), out
    assert any("watch mn1" in ln and "reached step" in ln for ln in lines), out
    assert any("mark-good mn1" in ln and "pair/mn1: marked good" in ln for ln in lines), out  # live, judged whole
    assert any("stop mn1" in ln and "pair/mn1: stopped" in ln for ln in lines), out
    assert lines[-1] == "runbook pair-run: ok (5 steps)", out
    wait_for("no trainer left", lambda: not job.trainers(200) and not job.trainers(300), timeout=20)
    shown = json.loads(job.ok("--json", "show", "mn1"))
    assert shown["state"] == "stopped" and [m["state"] for m in shown["members"]] == ["stopped", "stopped"]


def test_a_node_killed_crashes_the_run_and_nothing_is_left(job: Job) -> None:
    job.ok("deploy", "pair", "--allow-dirty")
    job.ok("launch", "pair", "--run", "kill1")
    both_training(job, "kill1", steps=2)
    # `ctl tail -f` is what notices here (status and supervise settle a run the same way: see the supervise test)
    follow = subprocess.Popen([sys.executable, "-m", "controller", "-i", str(job.dir / "inventory.yaml"), "tail",
                               "kill1", "-f", "-n", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=job.env)
    try:
        wait_for("the follow to print both nodes' lines", lambda: max(job.steps(200, "kill1")) >= 4, timeout=60)
        time.sleep(1)
        pid = int(job.log(300, "kill1", ".pid").read_text())
        assert job.attach(300, "kill", "-9", str(pid)).returncode == 0
        t0 = time.monotonic()
        out, err = follow.communicate(timeout=15)
    finally:
        follow.kill()
    assert follow.returncode == int(ExitCode.RUN_FAILED), err
    assert "[ct200] [0m] step=" in out and "[ct300] [0m] step=" in out
    assert "run kill1: crashed: ct300: exit 137 (SIGKILL)" in out
    wait_for("no trainer on either node", lambda: not job.trainers(200) and not job.trainers(300),
             timeout=max(0.1, 15 - (time.monotonic() - t0)), every=0.2)
    assert time.monotonic() - t0 <= 15
    r = job.ctl("--json", "status", "pair")
    (st,) = json.loads(r.stdout)
    assert r.returncode == int(ExitCode.RUN_FAILED) and st["verdict"] == "crashed"
    assert "ct300: exit 137 (SIGKILL)" in st["reason"]
    (run,) = json.loads(job.ok("--json", "runs"))
    assert run["state"] == "crashed" and run["crash"] == "ct300: exit 137 (SIGKILL)" and run["exit_status"] == 137
    shown = json.loads(job.ok("--json", "show", "kill1"))
    assert [(m["ct"], m["state"]) for m in shown["members"]] == [("ct200", "stopped"), ("ct300", "failed")]
    assert "stopped by ctl: ct300: exit 137 (SIGKILL)" in shown["members"][0]["note"]


def test_an_unreachable_rendezvous_is_refused_before_anything_starts(job: Job) -> None:
    job.write(nodes=(201, 300))  # the rendezvous on CT 201, in a network namespace CT 300 cannot reach
    job.ok("deploy", "pair", "--allow-dirty")
    r = job.ctl("launch", "pair", "--run", "far1")
    assert r.returncode == int(ExitCode.CONNECTION), r.stderr
    assert f"ct300 cannot reach the rendezvous endpoint 127.0.0.11:{job.port}" in r.stderr
    assert "nothing was started" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert json.loads(job.ok("--json", "runs")) == []
    for vmid in (201, 300):
        assert not job.log(vmid, "far1").exists() and not job.log(vmid, "far1", ".ctl.json").exists()
        assert not job.trainers(vmid)


def test_a_busy_node_is_refused_and_nothing_is_claimed_anywhere(job: Job) -> None:
    job.ok("deploy", "pair", "--allow-dirty")
    assert job.attach(300, "tmux", "new-session", "-d", "-s", f"{job.tag}-busy1", "sleep", "600").returncode == 0
    r = job.ctl("launch", "pair", "--run", "busy1")
    assert r.returncode == int(ExitCode.BUSY), r.stderr
    assert f"pair: ct300: tmux session '{job.tag}-busy1' already exists" in r.stderr
    assert "nothing was started or claimed" in r.stderr
    assert json.loads(job.ok("--json", "runs")) == []
    for vmid in (200, 300):
        assert not job.log(vmid, "busy1").exists() and not job.log(vmid, "busy1", ".ctl.json").exists()
    job.attach(300, "tmux", "kill-session", "-t", f"={job.tag}-busy1")


def test_a_node_that_fails_to_start_gets_the_others_stopped(job: Job) -> None:
    job.ok("deploy", "pair", "--allow-dirty")
    record = job.log(300, "half1", ".ctl.json")  # a record of that name on CT 300: its start is refused
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("{}")
    r = job.ctl("launch", "pair", "--run", "half1")
    assert r.returncode == int(ExitCode.CLOBBER), r.stderr
    assert "pair: " in r.stderr and "half1.log.ctl.json already exists" in r.stderr
    assert "stopped the node(s) that had started (ct200)" in r.stderr
    wait_for("no trainer on ct200", lambda: not job.trainers(200), timeout=20)
    (run,) = json.loads(job.ok("--json", "runs"))
    assert run["state"] == "failed" and "ct300 did not start" in run["note"]


def test_supervise_restarts_the_whole_run_from_the_newest_checkpoint_on_every_node(job: Job) -> None:
    job.write(**{"ckpt-every": 3})
    job.ok("deploy", "pair", "--allow-dirty")
    job.ok("launch", "pair", "--run", "sup1")

    def ckpt(vmid: int, run: str = "sup1") -> list[int]:
        d = job.host.rootfs(vmid) / "workspace" / job.tag / "runs" / run / "checkpoints"
        return sorted(int(p.parent.name[5:]) for p in d.glob("step_*/manifest.json"))

    holder = wait_for("a checkpoint", lambda: next((v for v in (200, 300) if ckpt(v)), None), timeout=150)
    assert ckpt(500 - holder) == []  # only global rank 0 writes them: one node has them, the other not
    victim = 500 - holder
    assert job.attach(victim, "kill", "-9", job.log(victim, "sup1", ".pid").read_text().strip()).returncode == 0
    once = ("supervise", "--once", "--restart", "on-failure:1", "--backoff", "1s")
    job.ok(*once)  # sees the crash (and stops the survivor): the restart is planned
    (crashed,) = json.loads(job.ok("--json", "runs"))
    assert crashed["state"] == "crashed" and crashed["crash"].startswith(f"ct{victim}: exit 137")
    time.sleep(1.2)
    job.ok(*once)  # relaunches the whole run, every node from its own copy of the newest checkpoint
    step = max(ckpt(holder))
    assert ckpt(victim) == [step]  # carried to the node that lacked it, verified by its manifest
    tree = json.loads(job.ok("--json", "runs", "--tree"))
    assert [[(r["run"], r["state"], r["resumed_step"]) for r in chain] for chain in tree] == [
        [("sup1", "crashed", None), ("mn1", "running", step)]]
    both_training(job, "mn1", steps=step + 2)
    assert min(min(job.steps(v, "mn1")) for v in (200, 300)) == step + 1  # both continued where it left off
    resumed = [v for v in (200, 300) if f"resumed from step {step}" in job.log(v, "mn1").read_text()]
    assert len(resumed) == 1  # said once, by global rank 0
    job.ok("stop", "mn1", "--grace", "5")
