"""One run over several nodes: real torchrun processes meeting through the c10d rendezvous on 127.0.0.1 (each
`torchrun --nnodes 2` a node, in a directory of its own, all with the same command line), gloo on CPU.

What is proven: two one-drafter nodes train exactly as one node with the doubled batch (the data split); only node
0 writes checkpoints, metrics and the summary; both nodes resume from one checkpoint and still match; nodes that
disagree are refused; a node killed with SIGKILL takes every process of the run down within seconds."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from remote_payload import train_dflash_pipeline as tp
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "remote_payload" / "train_dflash_pipeline.py"
dx = tp.dx  # the module object the pipeline itself uses
SMALL = ["--seq-len", "64", "--num-anchors", "4", "--drafter-layers", "1", "--log-every", "1", "--seed", "0"]
TOL = 5e-4  # float noise of a [4, S] batch vs two [2, S] ones is ~1e-5 here; another split of the data gives ~5e-3


# ------------------------------------------------------------------------------------------ placement and data


def test_placement_reads_torchruns_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert dx.placement(1, 1) == (3, 4, 1, 2)
    topo = dx.Topo(3, 4, 1, 1, torch.device("cpu"), node=1, nodes=2)
    assert (topo.local, topo.is_target, topo.lead, topo.drafter_index) == (1, False, False, 1)
    assert topo.drafter_ranks == [1, 3] and topo.leaders == [0, 2] and topo.target_rank(0) == 2
    assert dx.Topo(1, 4, 1, 1, torch.device("cpu"), node=0, nodes=2).lead


@pytest.mark.parametrize(("env", "message"), [
    ({"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6"},
     "torchrun started 3 processes on this node, but --targets 1 + --drafters 1 = 2: set --nproc-per-node to the sum"),
    ({"WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"},
     "WORLD_SIZE 5 is not a multiple of --targets + --drafters = 2: every node must run --nproc-per-node 2"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "GROUP_RANK": "0"},
     "rank 2 is local rank 0 of node 0, not of node 1: the nodes run different --nproc-per-node; every node must "
     "run 2"),
])
def test_placement_refuses_a_launch_that_does_not_fit_the_arguments(monkeypatch, env, message):
    for k in ("RANK", "LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(dx.UsageError) as e:
        dx.placement(1, 1)
    assert str(e.value) == message


def test_a_steps_samples_are_split_over_every_nodes_drafters_once():
    """Step s of 2 nodes x 2 drafters x batch 3 covers samples 12s..12s+11, each once, in drafter order; resuming
    continues at the checkpoint's samples_seen whatever topology wrote it."""
    args = tp.build_parser().parse_args(["--batch-size", "3"])
    args.sample0, args.start_step = 0, 0
    topo = dx.Topo(0, 8, 2, 2, torch.device("cpu"), node=0, nodes=2)
    seen = []
    for step in range(3):
        for k in range(topo.drafters_total):
            first = tp.first_sample(args, topo, step, k)
            seen += range(first, first + 3)
    assert seen == list(range(36))
    args.sample0, args.start_step = 100, 7  # a checkpoint at step 7 that had seen 100 samples
    assert tp.first_sample(args, topo, 7, 0) == 100 and tp.first_sample(args, topo, 8, 1) == 115


def test_rows_and_anchors_do_not_depend_on_how_a_step_is_split():
    args = tp.build_parser().parse_args(["--num-anchors", "4", "--block-size", "8"])
    data = tp.Data(1024, 48, seed=5)
    ids, mask = data.rows(40, 4)
    halves = [data.rows(40, 2), data.rows(42, 2)]
    assert torch.equal(ids, torch.cat([h[0] for h in halves]))
    a, k = tp.row_anchors(mask, 40, args)
    parts = [tp.row_anchors(h[1], first, args) for h, first in zip(halves, (40, 42), strict=True)]
    assert torch.equal(a, torch.cat([p[0] for p in parts])) and torch.equal(k, torch.cat([p[1] for p in parts]))
    assert not torch.equal(a[:2], a[2:])


# ------------------------------------------------------------------------------------------ real nodes


@dataclass
class Node:
    proc: subprocess.Popen
    cwd: Path

    @property
    def log(self) -> str:
        return (self.cwd / "torchrun.log").read_text(errors="replace")

    @property
    def index(self) -> int:
        """The node rank the rendezvous gave it (c10d sorts the agents; --node-rank does not decide it)."""
        m = re.search(r"^node (\d+) of \d+ ", self.log, re.M)
        assert m, self.log[-3000:]
        return int(m.group(1))

    @property
    def run(self) -> Path:
        return self.cwd / "run"


def env(extra: dict | None = None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_CPU_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


def start_nodes(base: Path, *flags: str, per_node: tuple = ((), ()), extra_env=None) -> list[Node]:
    """Two `torchrun --nnodes 2` processes on one rendezvous endpoint; the same command line in node0/, node1/
    (--out is relative: each node writes its own run directory), `per_node` flags appended to each."""
    port = free_port()
    nodes = []
    for i, own in enumerate(per_node):
        cwd = base / f"node{i}"
        cwd.mkdir(parents=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(per_node)), "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "mn",
               "--rdzv-conf", "join_timeout=90", str(SCRIPT), "--targets", "1", "--drafters", "1", "--device", "cpu",
               "--model", "tiny", "--out", "run", *flags, *own]
        with open(cwd / "torchrun.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env(extra_env),
                                    start_new_session=True)
        nodes.append(Node(proc, cwd))
    return nodes


def stop(nodes: list[Node]) -> None:
    """Whatever a test left running (its workers follow their agent within a second: dflash_dist.Watchdog)."""
    for n in nodes:
        if n.proc.poll() is None:
            os.killpg(n.proc.pid, signal.SIGKILL)
            n.proc.wait()


def finish(nodes: list[Node], timeout: float = 240, ordered: bool = True) -> list[Node]:
    """Wait for both nodes; return them ordered by node rank (`ordered`: they got as far as saying it)."""
    try:
        for n in nodes:
            n.proc.wait(timeout=timeout)
    finally:
        stop(nodes)
    return sorted(nodes, key=lambda n: n.index) if ordered else nodes


def weights(run: Path, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step_{step}" / "drafter.pt", weights_only=False)["drafter"]


def close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_two_nodes_train_like_one_node_with_the_doubled_batch_and_resume_together(tmp_path):
    """1 node x batch 4 for 4 steps == 2 nodes x batch 2 for 2 steps, then both nodes resumed from node 0's
    checkpoint for 2 more: the same losses at every step and the same drafter weights at steps 2 and 4."""
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(SCRIPT), "--targets", "1", "--drafters", "1", "--device", "cpu", "--model", "tiny",
                          "--out", str(tmp_path / "one"), *SMALL, "--steps", "4", "--batch-size", "4",
                          "--ckpt-every", "2"], capture_output=True, text=True, timeout=240, env=env(), cwd=ROOT)
    assert one.returncode == 0, one.stderr[-3000:]

    first = finish(start_nodes(tmp_path / "split", *SMALL, "--steps", "4", "--batch-size", "2",
                               "--stop-at-step", "2"))
    assert [n.proc.returncode for n in first] == [0, 0], first[0].log[-3000:] + first[1].log[-3000:]
    lead, other = first
    assert lead.log.splitlines()[-1] == "done steps=2 (--stop-at-step 2 reached)"
    assert "done steps" not in other.log and "step=" not in other.log  # metrics and summary: node 0 alone
    assert (lead.run / "checkpoints" / "step_2" / "manifest.json").is_file()
    assert not (other.run / "checkpoints").exists() and not (other.run / "metrics.jsonl").exists()
    assert close(weights(tmp_path / "one", 2), weights(lead.run, 2)) < TOL

    ckpt = lead.run / "checkpoints" / "step_2"
    resumed = finish(start_nodes(tmp_path / "resumed", *SMALL, "--steps", "4", "--batch-size", "2",
                                 extra_env={"CTL_RESUME_FROM": str(ckpt)}))
    assert [n.proc.returncode for n in resumed] == [0, 0], resumed[0].log[-3000:] + resumed[1].log[-3000:]
    assert f"resumed from step 2 ({ckpt})" in resumed[0].log and resumed[0].log.splitlines()[-1] == "done steps=4"
    assert not (resumed[1].run / "checkpoints").exists()
    assert close(weights(tmp_path / "one", 4), weights(resumed[0].run, 4)) < TOL
    joined = losses(lead.run) + losses(resumed[0].run)
    assert [s for s, _ in joined] == [1, 2, 3, 4]
    assert [v for _, v in joined] == pytest.approx([v for _, v in losses(tmp_path / "one")], abs=1e-3)
    state = torch.load(resumed[0].run / "checkpoints" / "step_4" / "train_state.pt", weights_only=False)
    assert state["data"]["samples_seen"] == 16 and state["data"]["nodes"] == 2 and state["data"]["drafters"] == 2


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


@pytest.mark.slow
def test_a_node_killed_with_sigkill_takes_the_whole_run_down_within_seconds(tmp_path):
    """SIGKILL to one node's torchrun process group (what stopping a launcher's group does): torchrun starts its
    workers in sessions of their own, so they outlive it unless they watch it; the other node's processes must
    notice and end too, long before any collective's timeout (--timeout-s 300 here)."""
    nodes = start_nodes(tmp_path, *SMALL, "--steps", "100000", "--batch-size", "2", "--timeout-s", "300")
    try:
        deadline = time.monotonic() + 180
        while "step=2 " not in "".join(n.log for n in nodes):
            assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes), \
                nodes[0].log[-2000:] + nodes[1].log[-2000:]
            time.sleep(0.5)
        victim, survivor = sorted(nodes, key=lambda n: -n.index)  # node 1 dies, node 0 (rank 0) survives
        pids = [p for n in nodes for p in [n.proc.pid, *children(n.proc.pid)]]
        assert len(pids) == 6, pids  # two agents, four workers
        t0 = time.monotonic()
        os.killpg(victim.proc.pid, signal.SIGKILL)
        while any(alive(p) for p in pids) and time.monotonic() - t0 < 30:
            survivor.proc.poll()
            victim.proc.poll()
            time.sleep(0.1)
        gone_after = time.monotonic() - t0
        left = [p for p in pids if alive(p)]
    finally:
        stop(nodes)
    assert not left and gone_after < 15, f"{left} still running after {gone_after:.1f}s\n{survivor.log[-3000:]}"
    assert survivor.proc.returncode != 0
    # Its workers say so, or, when the dead node hosted the rendezvous store (the first agent to bind the port:
    # either one on a shared address), its agent does first and stops them (seen on torch 2.11).
    assert re.search(r"^error: rank \d \((target|drafter)\): peer lost: ", survivor.log, re.M) or \
        "RendezvousConnectionError: The connection to the C10d store has failed" in survivor.log, survivor.log[-3000:]
    # Its orphaned workers say why they left: their agent was gone, or (when the other node's agent lost the
    # rendezvous store the dead node hosted and stopped its workers first) a peer was; either line is theirs.
    assert "torchrun's agent" in victim.log or \
        re.search(r"^error: rank \d \((target|drafter)\): peer lost: ", victim.log, re.M), victim.log[-3000:]


@pytest.mark.slow
def test_nodes_that_disagree_are_refused_before_training(tmp_path):
    nodes = finish(start_nodes(tmp_path, *SMALL, "--steps", "4", per_node=(("--lr", "1e-3"), ("--lr", "2e-3"))),
                   ordered=False)
    for n in nodes:
        assert n.proc.returncode != 0
        errors = [x for x in n.log.splitlines() if x.startswith("error:")]
        assert len(errors) == 1, n.log[-3000:]
        assert re.fullmatch(r"error: node 1 \(.+\) and node 0 \(.+\) differ in their command lines: lr is "
                            r"0\.00[12] there, 0\.00[12] on node 0; every node must run the same command on the "
                            r"same files", errors[0]), errors[0]
    assert not any((n.run / "checkpoints").exists() for n in nodes)
