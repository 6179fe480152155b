"""Where a pipeline process sits in a run of one or several nodes, and how it leaves when the run is broken.

torchrun starts the same command line on every node (`--nnodes N --rdzv-backend c10d`, or `--standalone` for one
node). Each node runs `--targets T` + `--drafters D` processes: local ranks 0..T-1 are targets, T..T+D-1 drafters,
and global rank = node * (T + D) + local rank (torchrun numbers the ranks of a node contiguously). Only torchrun's
environment is read: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK; MASTER_ADDR/PORT reach
init_process_group through the env:// default.

A run ends within seconds when it can no longer finish (`Watchdog`):
- every process watches its parent, torchrun's agent: torchrun starts workers in sessions of their own, so a
  SIGKILL to the agent (or to its process group) leaves them running as orphans, still answering their peers;
- one process per node (local rank 0) exchanges a heartbeat with the same process of every other node over a
  gloo group of their own: a node whose processes died closes its sockets and the pending receive fails at once;
  a node that went silent (host down, network cut, stopped) is given up after --peer-timeout-s.
Either way the process exits 3; torchrun's agent on that node then stops the node's other processes. Without
this, the survivors' NCCL collectives wait until the process group's timeout (--timeout-s, 15 minutes).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

EXIT_PEER = 3
TAG_BEAT = 9


class UsageError(Exception):
    """Bad arguments, or a launch that does not match them; one line for the log."""


class Mismatch(UsageError):
    """Nodes that disagree (arguments, checkpoint, data, model): every process finds it, each node says it once."""


@dataclass(frozen=True)
class Topo:
    rank: int
    world: int
    targets: int  # per node
    drafters: int  # per node
    device: torch.device
    node: int = 0
    nodes: int = 1

    @property
    def per_node(self) -> int:
        return self.targets + self.drafters

    @property
    def base(self) -> int:
        """Global rank of this node's local rank 0."""
        return self.node * self.per_node

    @property
    def local(self) -> int:
        return self.rank - self.base

    @property
    def is_target(self) -> bool:
        return self.local < self.targets

    @property
    def lead(self) -> bool:
        """The one process that logs metrics, evaluates and writes checkpoints: node 0's first drafter."""
        return self.rank == self.targets

    @property
    def drafter_index(self) -> int:
        """0..drafters_total-1 over the whole run: which slice of every step's samples this drafter trains on."""
        return self.node * self.drafters + self.local - self.targets

    @property
    def drafters_total(self) -> int:
        return self.nodes * self.drafters

    @property
    def targets_total(self) -> int:
        return self.nodes * self.targets

    @property
    def drafter_ranks(self) -> list[int]:
        """Every drafter of every node: the gradient all-reduce group."""
        return [n * self.per_node + self.targets + d for n in range(self.nodes) for d in range(self.drafters)]

    def node_drafter_ranks(self, node: int) -> list[int]:
        return [node * self.per_node + self.targets + d for d in range(self.drafters)]

    def target_rank(self, t: int) -> int:
        """Global rank of this node's local target t."""
        return self.base + t

    def drafter_rank(self, d: int) -> int:
        """Global rank of this node's local drafter d."""
        return self.base + self.targets + d

    @property
    def leaders(self) -> list[int]:
        return [n * self.per_node for n in range(self.nodes)]


def placement(targets: int, drafters: int) -> tuple[int, int, int, int]:
    """(rank, world, node, nodes) from torchrun's environment, checked against --targets/--drafters."""
    per_node = targets + drafters
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if local_world != per_node:
        raise UsageError(f"torchrun started {local_world} processes on this node, but --targets {targets} + "
                         f"--drafters {drafters} = {per_node}: set --nproc-per-node to the sum")
    if world % per_node:
        raise UsageError(f"WORLD_SIZE {world} is not a multiple of --targets + --drafters = {per_node}: every node "
                         f"must run --nproc-per-node {per_node}")
    node = rank // per_node
    group = os.environ.get("GROUP_RANK")
    if local != rank - node * per_node or (group is not None and int(group) != node):
        raise UsageError(f"rank {rank} is local rank {local} of node {group}, not of node {node}: the nodes run "
                         f"different --nproc-per-node; every node must run {per_node}")
    return rank, world, node, world // per_node


def agree(topo: Topo, group, what: dict, subject: str) -> None:
    """Raise Mismatch, on every rank, when a node saw something else than node 0 (keys starting with `_` describe,
    None means 'not known here'): the same command line must mean the same training on every node."""
    views: list = [None] * topo.world
    dist.all_gather_object(views, what, group=group)
    ref = views[0]
    for r, view in enumerate(views):
        for key in sorted(set(ref) | set(view)):
            a, b = ref.get(key), view.get(key)
            if key.startswith("_") or a is None or b is None or a == b:
                continue
            node = r // topo.per_node
            raise Mismatch(f"node {node} ({view.get('_host')}) and node 0 ({ref.get('_host')}) differ in {subject}: "
                           f"{key} is {b!r} there, {a!r} on node 0; every node must run the same command on the "
                           "same files")


class Watchdog:
    """Exit (code 3, one line on stderr) when torchrun's agent is gone or another node is lost (module doc)."""

    def __init__(self, topo: Topo, group, peer_timeout_s: float, who: str, interval_s: float = 1.0):
        self.topo, self.group, self.peer_timeout_s, self.who = topo, group, peer_timeout_s, who
        self.interval_s = min(interval_s, peer_timeout_s / 4)
        self.parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self.peers = [r for r in topo.leaders if r != topo.rank] if topo.local == 0 else []
        self.heard = {p: time.monotonic() for p in self.peers}
        self.closing = threading.Event()
        self.sends: list = []

    def start(self) -> None:
        if self.parent is None and not self.peers:
            return
        for p in self.peers:
            threading.Thread(target=self._listen, args=(p,), name=f"dflash-watch-{p}", daemon=True).start()
        threading.Thread(target=self._watch, name="dflash-watch", daemon=True).start()

    def close(self) -> None:
        """After the run's last collective (or on this process's own error): a peer that leaves now is not lost."""
        self.closing.set()

    def _lost(self, why: str, grace_s: float = 0.0) -> None:
        """`grace_s`: a peer whose connection closes may have finished the run's last collective a moment before
        this process: wait that long for this process to finish too before calling it lost."""
        end = time.monotonic() + grace_s
        while not self.closing.is_set() and time.monotonic() < end:
            time.sleep(0.05)
        if self.closing.is_set():
            return
        print(f"error: {self.who}: peer lost: {why}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER)

    def _node(self, rank: int) -> str:
        return f"node {rank // self.topo.per_node} (rank {rank})"

    def _listen(self, peer: int) -> None:
        buf = torch.zeros(1, dtype=torch.int64)
        try:
            while not self.closing.is_set():
                dist.recv(buf, src=peer, group=self.group, tag=TAG_BEAT)
                self.heard[peer] = time.monotonic()
        except Exception as e:  # its sockets closed: the process is gone
            first = str(e).splitlines()[0] if str(e) else ""
            self._lost(f"{self._node(peer)} closed its connection ({type(e).__name__}: {first[:160]})", 2.0)

    def _watch(self) -> None:
        beat = 0
        next_beat = 0.0
        while not self.closing.is_set():
            now = time.monotonic()
            if self.parent is not None and os.getppid() != self.parent:
                self._lost(f"torchrun's agent (pid {self.parent}) on this node is gone")
            if self.peers and now >= next_beat:
                beat += 1
                msg = torch.tensor([beat], dtype=torch.int64)
                self.sends = [w for w in self.sends if not w.is_completed()]  # an isend's work is kept until done
                try:
                    self.sends += [dist.isend(msg, p, group=self.group, tag=TAG_BEAT) for p in self.peers]
                except Exception as e:
                    self._lost(f"a heartbeat could not be sent ({type(e).__name__})", 2.0)
                next_beat = now + self.interval_s
            for p in self.peers:
                if now - self.heard[p] > self.peer_timeout_s:
                    self._lost(f"no heartbeat from {self._node(p)} for {now - self.heard[p]:.0f}s "
                               f"(--peer-timeout-s {self.peer_timeout_s:g})")
            time.sleep(min(0.5, self.interval_s))


def host() -> str:
    return socket.gethostname()
