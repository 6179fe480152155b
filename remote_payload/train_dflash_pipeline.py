#!/usr/bin/env python3
"""DFlash drafter training: frozen target(s) produce hidden states, drafter(s) train on them.

    torchrun --standalone --nproc-per-node=N train_dflash_pipeline.py --targets T --drafters D ...

One OS process per role instance (ranks 0..T-1 targets, T..T+D-1 drafters): torch.compile state is never
shared between threads (torch 2.11-2.13 keep the FX-tracing flag process-global).

Schedule. Global batch g goes to drafter g % D (its step g // D) and is made by target g % T, so every
process knows whom it talks to and in which order; nobody dispatches. A target keeps at most --queue-size
batches per drafter that the drafter has not finished with (the bounded queue); a drafter finishing a batch
sends the target an ack, which frees that slot.

Transport (target -> drafter), --transport:
  ipc   (CUDA default) each target keeps a ring of --queue-size GPU slots per drafter and exports them once
        through CUDA IPC; per batch only a 64-byte header travels (gloo), and the drafter copies the slot on
        its own GPU (or over NVLink from a peer GPU). No host copy, and it works when a target and a drafter
        share one GPU, where NCCL cannot connect a GPU to itself.
  gloo  (CPU default) tensors through gloo: on CUDA a device->pinned host copy, TCP on loopback, host->device.
Drafters average gradients with all_reduce on a drafter-only group: NCCL when their GPUs are distinct, else
gloo (drafters sharing a GPU: slower, host copies).

Log (drafter rank 0), one line per --log-every steps, and the same numbers in RUN_DIR/metrics.jsonl:
  [3m] step=14 loss=6.1234 lr=3.0e-04 tgt=2.10b/s dft=1.05b/s (4.6Ktok/s) q_hs=[0] | ETA=12.3m
tgt/dft are the batches per second each role would do if never kept waiting (role count / mean busy time per
batch), so the smaller one is the bottleneck; tok/s is what went through end to end (D*B*S tokens per step);
q_hs the batches ready and waiting per drafter when it asked for the next one (0: starved by the targets).

Exit: 0 after `done steps=S`; 1 an error in this process (`error: ...` one line on stderr); 3 a peer was
lost or a collective timed out (--timeout-s); 2 bad arguments. torchrun stops the other ranks when one
fails and then exits 1 itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import queue
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dflash_model as dm

EXIT_ERROR, EXIT_USAGE, EXIT_PEER = 1, 2, 3
TAG_HEADER, TAG_META, TAG_HS, TAG_ACK, TAG_IPC = 1, 2, 3, 4, 5
HEADER_LEN = 8  # [global batch, slot, target busy us, target rank, 0...]

TINY = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
# ~1.02B parameters (tied embeddings), Qwen3-1.7B's widths with 14 layers.
ONE_B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 14,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
         "max_position_embeddings": 40960}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--targets", type=int, default=1)
    a("--drafters", type=int, default=1)
    a("--device", choices=["cpu", "cuda"], default="cpu")
    a("--gpus", default=None, help="CUDA ordinal per rank, e.g. 0,0 (targets first); may repeat")
    a("--model", default="tiny", help="tiny | 1b | PATH (local checkpoint directory)")
    a("--steps", type=int, default=100)
    a("--max-minutes", type=float, default=None, help="stop cleanly after this many minutes")
    a("--seq-len", type=int, default=256)
    a("--batch-size", type=int, default=4)
    a("--block-size", type=int, default=16)
    a("--num-anchors", type=int, default=64)
    a("--lr", type=float, default=6e-4)
    a("--warmup-ratio", type=float, default=0.04)
    a("--grad-clip", type=float, default=1.0)
    a("--log-every", type=int, default=10)
    a("--out", default="runs/dflash", help="run directory")
    a("--compile", action=argparse.BooleanOptionalAction, default=False, help="compile the drafter (CUDA)")
    a("--compile-mode", choices=list(dm.COMPILE_MODES), default="layers",
      help="layers: each decoder layer, the context projection and the LM-head loss; flex: flex_attention alone")
    a("--compile-target", action=argparse.BooleanOptionalAction, default=None,
      help="compile the target's decoder layers too (CUDA; default: as --compile)")
    a("--compile-cache", default=None, help="portable compile cache file: loaded when present, else written")
    a("--data", default=None, help="jsonl with prompt/response or text fields; default: generated patterns")
    a("--seed", type=int, default=0)
    a("--checkpoint-every", type=int, default=0, help="0: only at the end")
    a("--drafter-layers", type=int, default=5)
    a("--queue-size", type=int, default=4)
    a("--transport", choices=["auto", "ipc", "gloo"], default="auto")
    a("--timeout-s", type=float, default=900.0, help="longest wait on a peer before giving up (exit 3)")
    return p


def check_args(args) -> None:
    world = args.targets + args.drafters
    problems = []
    if args.targets < 1 or args.drafters < 1:
        problems.append("--targets and --drafters must be >= 1")
    if args.seq_len < args.block_size + 2:
        problems.append("--seq-len must exceed --block-size + 1")
    for name in ("steps", "batch_size", "block_size", "num_anchors", "log_every", "queue_size", "drafter_layers"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.gpus is not None:
        try:
            args.gpu_list = [int(x) for x in args.gpus.split(",")]
        except ValueError:
            problems.append(f"--gpus must be comma-separated integers, got {args.gpus!r}")
        else:
            if len(args.gpu_list) != world:
                problems.append(f"--gpus names {len(args.gpu_list)} GPUs for {world} ranks")
    else:
        args.gpu_list = None
    if args.transport == "ipc" and args.device != "cuda":
        problems.append("--transport ipc needs --device cuda")
    if args.compile_target is None:
        args.compile_target = args.compile
    if problems:
        raise UsageError("; ".join(problems))


class UsageError(Exception):
    pass


class PeerLost(Exception):
    pass


# ----------------------------------------------------------------------------------------------- models


def target_config(spec: str):
    from transformers import AutoConfig, Qwen3Config

    if spec == "tiny":
        return Qwen3Config(**TINY)
    if spec == "1b":
        return Qwen3Config(**ONE_B)
    if not Path(spec, "config.json").is_file():
        raise UsageError(f"--model {spec!r}: not tiny, 1b, or a directory with config.json")
    return AutoConfig.from_pretrained(spec)


def build_target(spec: str, device: torch.device, seed: int):
    """Frozen target, truncated after the last layer the drafter reads (its LM head is never run)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec in ("tiny", "1b"):
        torch.manual_seed(seed)  # the same random target for the same seed
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(target_config(spec), dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").to(device)
    model.eval().requires_grad_(False)
    return model


def truncate_target(model, last_layer: int) -> None:
    """Keep layers 0..last_layer+1: hidden_states[last_layer+1] must stay a raw layer output (HF norms the last)."""
    layers = model.model.layers
    keep = min(len(layers), last_layer + 2)
    model.model.layers = layers[:keep]


def compile_target_layers(model) -> int:
    """Regional compilation of the frozen target: every decoder layer compiled (one graph, reused by all), the
    embedding, rotary tables and mask set-up left eager. Returns the number of layers compiled."""
    for layer in model.model.layers:
        layer.compile(dynamic=False)
    return len(model.model.layers)


# ------------------------------------------------------------------------------------------------- data


class Data:
    """Token rows for global batch g, the same whichever target builds it (seeded by g).

    Default: generated patterns (a motif of 2..12 tokens out of 64 repeated): learnable, so the loss visibly goes
    down within a minute on a CPU even with a random target (whose frozen random LM head caps how low it goes).
    With --data: a jsonl of {"prompt", "response"} (loss on the response) or {"text"} records, tokenised,
    packed into one stream, rows cut at random offsets.
    """

    def __init__(self, path: str | None, vocab: int, seq_len: int, seed: int, tokenizer=None):
        self.vocab, self.s, self.seed = vocab, seq_len, seed
        self.stream = self.mask = None
        if path:
            self._load(path, tokenizer)

    def _encode(self, text: str, tokenizer) -> list[int]:
        if tokenizer is not None:
            return tokenizer.encode(text, add_special_tokens=False)
        return [2 + b for b in text.encode("utf-8") if 2 + b < self.vocab - 1]  # bytes; 0 pad, vocab-1 MASK

    def _load(self, path: str, tokenizer) -> None:
        ids: list[int] = []
        mask: list[int] = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"--data {path}:{n}: not JSON ({e.msg})") from None
                if "prompt" in rec and "response" in rec:
                    p, r = self._encode(str(rec["prompt"]), tokenizer), self._encode(str(rec["response"]), tokenizer)
                    ids += [*p, *r, 1]
                    mask += [0] * len(p) + [1] * (len(r) + 1)
                elif "text" in rec:
                    t = self._encode(str(rec["text"]), tokenizer)
                    ids += [*t, 1]
                    mask += [1] * (len(t) + 1)
                else:
                    raise UsageError(f"--data {path}:{n}: needs prompt+response or text fields")
        if len(ids) < self.s + 1:
            reps = (self.s + 1) // max(1, len(ids)) + 1
            ids, mask = ids * reps, mask * reps
        self.stream, self.mask = torch.tensor(ids), torch.tensor(mask)

    def batch(self, g: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = random.Random(self.seed * 1_000_003 + g)
        if self.stream is None:
            rows = []
            hi = min(self.vocab - 2, 66)
            for _ in range(b):
                motif = [rng.randrange(2, hi) for _ in range(rng.randint(2, 12))]
                rows.append((motif * (self.s // len(motif) + 1))[: self.s])
            ids = torch.tensor(rows)
            return ids, torch.ones_like(ids)
        starts = [rng.randrange(0, len(self.stream) - self.s) for _ in range(b)]
        return (torch.stack([self.stream[i:i + self.s] for i in starts]),
                torch.stack([self.mask[i:i + self.s] for i in starts]))


def tokenizer_for(spec: str):
    if spec in ("tiny", "1b"):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec)
    except Exception:  # a checkpoint without tokenizer files: bytes
        return None


# ------------------------------------------------------------------------------------------- transport


@dataclass
class Topo:
    rank: int
    world: int
    targets: int
    drafters: int
    device: torch.device

    @property
    def is_target(self) -> bool:
        return self.rank < self.targets

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.targets, self.world))


def payload_shapes(args, hs_width: int, hs_dtype):
    b, s, n = args.batch_size, args.seq_len, args.num_anchors
    return {"meta": ((b, 2 * s + 2 * n), torch.int64), "hs": ((b, s, hs_width), hs_dtype)}


def pack_meta(ids, loss_mask, anchors, keep):
    return torch.cat([ids, loss_mask.long(), anchors, keep.long()], dim=1)


def unpack_meta(meta, s: int, n: int):
    # Contiguous: compiled graphs (and the portable cache) are keyed on strides; the warm-up uses fresh tensors.
    parts = meta[:, :s], meta[:, s:2 * s], meta[:, 2 * s:2 * s + n], meta[:, 2 * s + n:].bool()
    return tuple(p.contiguous() for p in parts)


class Outbox:
    """Target side of one target->drafter link: a ring of queue-size slots, reused after the drafter's ack."""

    def __init__(self, args, topo: Topo, dst: int, shapes, mode: str):
        self.dst, self.mode, self.q = dst, mode, args.queue_size
        dev = topo.device if mode == "ipc" else torch.device("cpu")
        pin = topo.device.type == "cuda" and mode == "gloo"
        self.slots = [{k: torch.empty(shape, dtype=dt, device=dev, pin_memory=pin) for k, (shape, dt) in shapes.items()}
                      for _ in range(self.q)]
        self.ack_buf = [torch.zeros(2, dtype=torch.int64) for _ in range(self.q)]
        self.acks: list = []  # pending ack requests, oldest first
        self.sends: list = []
        self.n = 0
        if mode == "ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            handles = pickle.dumps([{k: reduce_tensor(t) for k, t in slot.items()} for slot in self.slots])
            blob = torch.frombuffer(bytearray(handles), dtype=torch.uint8)
            dist.send(torch.tensor([blob.numel()]), dst, tag=TAG_IPC)
            dist.send(blob, dst, tag=TAG_IPC)

    def acquire(self) -> int | None:
        """The next free slot (waits for the drafter's ack when all are in use); None when the drafters stop."""
        if len(self.acks) == self.q:
            work, buf = self.acks.pop(0)
            work.wait()  # the process group's timeout bounds it; a dead peer fails it at once
            if int(buf[1]):
                return None
        return self.n % self.q

    def send(self, slot: int, g: int, busy_us: int, rank: int) -> None:
        header = torch.tensor([g, slot, busy_us, rank] + [0] * (HEADER_LEN - 4), dtype=torch.int64)
        self.sends = [w for w in self.sends if not w.is_completed()]
        self.sends.append(dist.isend(header, self.dst, tag=TAG_HEADER))
        if self.mode == "gloo":
            self.sends.append(dist.isend(self.slots[slot]["meta"], self.dst, tag=TAG_META))
            self.sends.append(dist.isend(self.slots[slot]["hs"], self.dst, tag=TAG_HS))
        self.acks.append((dist.irecv(self.ack_buf[slot], self.dst, tag=TAG_ACK), self.ack_buf[slot]))
        self.n += 1

    def flush(self) -> None:
        """Wait for the batches in flight: with gloo an isend whose work is garbage-collected before it
        completes can vanish, and the drafter then waits for that batch forever."""
        for w in self.sends:
            w.wait()
        self.sends = []


def serves(t: int, d: int, targets: int, drafters: int) -> bool:
    """Does target t ever make batches for drafter d (global batch g = step*D + d comes from target g % T)?"""
    return any((s * drafters + d) % targets == t for s in range(targets))


class Inbox:
    """Drafter side. A receiver thread (communication only, never compiled code) takes the batches of the next
    steps in order into `queue-size` slots; `depth` = batches received and not yet taken by the training loop."""

    def __init__(self, args, topo: Topo, shapes, mode: str, steps: int):
        self.args, self.topo, self.mode, self.steps = args, topo, mode, steps
        self.d = topo.rank - topo.targets
        self.q = args.queue_size
        pin = topo.device.type == "cuda"
        self.host = [{k: torch.empty(shape, dtype=dt, pin_memory=pin) for k, (shape, dt) in shapes.items()}
                     for _ in range(self.q)] if mode == "gloo" else None
        self.local = {k: torch.empty(shape, dtype=dt, device=topo.device) for k, (shape, dt) in shapes.items()}
        self.remote: dict[int, list] = {}
        if mode == "ipc":  # open each serving target's slots once
            for t in range(topo.targets):
                if serves(t, self.d, topo.targets, topo.drafters):
                    n = torch.zeros(1, dtype=torch.int64)
                    dist.recv(n, t, tag=TAG_IPC)
                    blob = torch.empty(int(n), dtype=torch.uint8)
                    dist.recv(blob, t, tag=TAG_IPC)
                    self.remote[t] = [{k: fn(*a) for k, (fn, a) in slot.items()}
                                      for slot in pickle.loads(blob.numpy().tobytes())]
        self.ready: queue.Queue = queue.Queue()
        self.acks: list = []  # isend works of acks in flight: a dropped work can lose its message (gloo)
        self.free = threading.Semaphore(self.q)
        self.stopping = threading.Event()
        threading.Thread(target=self._receive, name="dflash-inbox", daemon=True).start()

    def source(self, step: int) -> int:
        return (step * self.topo.drafters + self.d) % self.topo.targets

    def _receive(self) -> None:
        try:
            for step in range(self.steps):
                self.free.acquire()
                if self.stopping.is_set():
                    return
                src = self.source(step)
                header = torch.zeros(HEADER_LEN, dtype=torch.int64)
                works = [dist.irecv(header, src, tag=TAG_HEADER)]
                if self.mode == "gloo":
                    buf = self.host[step % self.q]
                    works += [dist.irecv(buf["meta"], src, tag=TAG_META), dist.irecv(buf["hs"], src, tag=TAG_HS)]
                for w in works:
                    w.wait()
                self.ready.put((step, header))
        except Exception as e:  # handed to the training loop, which raises it
            self.ready.put((-1, e))

    def depth(self) -> int:
        return self.ready.qsize()

    def get(self, step: int) -> tuple[dict, torch.Tensor]:
        """The step's batch, copied into this drafter's device tensors (then `release` it)."""
        try:
            got, header = self.ready.get(timeout=self.args.timeout_s)
        except queue.Empty:
            raise PeerLost(f"no batch from target rank {self.source(step)} within {self.args.timeout_s:.0f}s") from None
        if got < 0:
            raise header
        src = self.remote[self.source(step)][int(header[1])] if self.mode == "ipc" else self.host[step % self.q]
        for k, t in self.local.items():
            t.copy_(src[k], non_blocking=True)
        if self.topo.device.type == "cuda":  # `release` waits for these copies only, not for the whole step
            self.copied = torch.cuda.Event(enable_timing=True)  # also the start of the step's GPU time
            self.copied.record()
        return self.local, header

    def release(self, step: int) -> None:
        """Once the step's copy is done: the target's slot and ours are free again."""
        if self.topo.device.type == "cuda":
            self.copied.synchronize()
        self._ack(torch.tensor([step, 0], dtype=torch.int64), self.source(step))
        self.free.release()

    def _ack(self, msg: torch.Tensor, target: int) -> None:
        """Send an ack and keep its work (and tensor) alive until it completes: with gloo an isend whose
        work is garbage-collected early can vanish, and its target then waits for a slot forever."""
        self.acks = [w for w in self.acks if not w.is_completed()]
        self.acks.append(dist.isend(msg, target, tag=TAG_ACK))

    def flush(self) -> None:
        """Wait for the acks in flight (before the process group goes away)."""
        for w in self.acks:
            w.wait()
        self.acks = []

    def stop(self) -> None:
        """Stopping early: every serving target gets queue-size 'stop' acks, whatever it is waiting for."""
        self.stopping.set()
        self.free.release()
        for t in range(self.topo.targets):
            if serves(t, self.d, self.topo.targets, self.topo.drafters):
                for _ in range(self.q):
                    self._ack(torch.tensor([-1, 1], dtype=torch.int64), t)


# ----------------------------------------------------------------------------------------------- roles


def hs_layers(cfg, drafter_layers: int) -> list[int]:
    return dm.target_layer_ids(cfg.num_hidden_layers, drafter_layers)


def share_frozen(topo: Topo, group, model=None):
    """Target rank 0 sends the target config and its embedding / LM head weights to every drafter."""
    if topo.rank == 0:
        cfg = model.config
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        tied = head.data_ptr() == emb.data_ptr()
        info = [{"config": cfg.to_dict(), "tied": tied, "dtype": str(emb.dtype).split(".")[-1]}]
        dist.broadcast_object_list(info, src=0, group=group)
        for w in [emb] if tied else [emb, head]:
            dist.broadcast(w.detach().to("cpu").contiguous(), src=0, group=group)
        return None
    info = [None]
    dist.broadcast_object_list(info, src=0, group=group)
    from transformers import Qwen3Config

    meta = info[0]
    cfg = Qwen3Config(**{k: v for k, v in meta["config"].items() if k not in ("architectures", "model_type")})
    dtype = getattr(torch, meta["dtype"])
    weights = []
    for _ in range(1 if meta["tied"] else 2):
        w = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        dist.broadcast(w, src=0, group=group)
        weights.append(w.to(topo.device))
    embed = torch.nn.Embedding.from_pretrained(weights[0], freeze=True)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=topo.device, dtype=dtype)
    head.weight = torch.nn.Parameter(weights[-1], requires_grad=False)
    return cfg, embed, head


def run_target(args, topo: Topo, groups) -> None:
    t0 = time.time()
    model = build_target(args.model, topo.device, args.seed)
    if topo.rank == 0:
        share_frozen(topo, groups["share"], model)
    cfg = model.config
    layers = hs_layers(cfg, args.drafter_layers)
    truncate_target(model, max(layers))
    compiled_layers = compile_target_layers(model) if args.compile_target and topo.device.type == "cuda" else 0
    tok = tokenizer_for(args.model)
    data = Data(args.data, cfg.vocab_size, args.seq_len, args.seed, tok)
    hs_dtype = torch.bfloat16 if topo.device.type == "cuda" else torch.float32
    shapes = payload_shapes(args, len(layers) * cfg.hidden_size, hs_dtype)
    mode = transport(args)
    out = {d: Outbox(args, topo, topo.targets + d, shapes, mode) for d in range(topo.drafters)
           if serves(topo.rank, d, topo.targets, topo.drafters)}
    if topo.rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"target: {args.model} {n / 1e6:.1f}M params (layers {layers} of {cfg.num_hidden_layers}) "
              f"on {topo.device}, {args.targets} target(s), transport {mode}, "
              f"{f'{compiled_layers} layers compiled, ' if compiled_layers else ''}ready in {time.time() - t0:.1f}s",
              flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    stopped = False
    for g in range(topo.rank, args.steps * topo.drafters, topo.targets):
        d = g % topo.drafters
        slot = out[d].acquire()
        if slot is None:
            stopped = True
            break
        maybe_crash(topo.rank, g // topo.drafters)
        t = time.perf_counter()
        ids, loss_mask = data.batch(g, args.batch_size)
        gen.manual_seed(args.seed * 7919 + g)
        anchors, keep = dm.sample_anchors(loss_mask, args.num_anchors, args.block_size, gen)
        buf = out[d].slots[slot]
        buf["meta"].copy_(pack_meta(ids, loss_mask, anchors, keep), non_blocking=True)
        with torch.no_grad():
            o = model.model(input_ids=ids.to(topo.device, non_blocking=True), output_hidden_states=True,
                            use_cache=False)
            hs = [o.hidden_states[i + 1] for i in layers]
            if buf["hs"].device == hs[0].device:
                torch.cat(hs, dim=-1, out=buf["hs"])
            else:
                buf["hs"].copy_(torch.cat(hs, dim=-1), non_blocking=True)
            del o, hs
        if topo.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the slot must be complete before the drafter is told
        out[d].send(slot, g, int((time.perf_counter() - t) * 1e6), topo.rank)
    if not stopped:  # every batch sent has its drafter's receive coming; after a stop, nobody takes them
        for ob in out.values():
            ob.flush()


def transport(args) -> str:
    if args.transport != "auto":
        return args.transport
    return "ipc" if args.device == "cuda" else "gloo"


def maybe_crash(rank: int, step: int) -> None:
    """Fault injection for tests: DFLASH_FAULT=RANK:STEP kills that rank hard (no cleanup) at that step."""
    spec = os.environ.get("DFLASH_FAULT")
    if spec and spec == f"{rank}:{step}":
        print(f"DFLASH_FAULT: rank {rank} dies at step {step}", file=sys.stderr, flush=True)
        os._exit(17)


def fmt_rate(v: float) -> str:
    for suffix, scale in (("", 1.0), ("K", 1e3), ("M", 1e6), ("G", 1e9)):
        x = v / scale
        text = f"{x:.0f}" if scale == 1.0 or x >= 99.95 else f"{x:.1f}"
        if float(text) < 1000 or suffix == "G":
            return text + suffix
    return f"{v:.0f}"


def fmt_elapsed(s: float) -> str:
    m = int(s // 60)
    return f"{int(s)}s" if m == 0 else f"{m}m" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def fmt_eta(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    if s < 60:
        return f"{s:.0f}s"
    for unit, scale, limit in (("m", 60.0, 60.0), ("h", 3600.0, 24.0), ("d", 86400.0, math.inf)):
        if s / scale < limit:
            return f"{s / scale:.1f}{unit}"
    return "-"


class Checkpoints:
    """RUN_DIR/checkpoints/step_N.pt (drafter state only) and manifest.json with each file's sha256."""

    def __init__(self, out: Path):
        self.dir = out / "checkpoints"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = self.dir / "manifest.json"

    def save(self, step: int, drafter: dm.DFlashDrafter, extra: dict) -> Path:
        path = self.dir / f"step_{step}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"step": step, "drafter": drafter.state_dict(), "config": drafter.c.to_dict(), **extra}, tmp)
        digest = hashlib.sha256()
        with open(tmp, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        os.replace(tmp, path)
        entries = json.loads(self.manifest.read_text())["checkpoints"] if self.manifest.exists() else []
        entries = [e for e in entries if e["step"] != step]
        entries.append({"step": step, "file": path.name, "sha256": digest.hexdigest(), "bytes": path.stat().st_size})
        mtmp = self.manifest.with_suffix(".tmp")
        mtmp.write_text(json.dumps({"checkpoints": sorted(entries, key=lambda e: e["step"])}, indent=1) + "\n")
        os.replace(mtmp, self.manifest)
        return path


def load_compile_cache(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return "none"
    with open(path, "rb") as f:
        blob = f.read()
    torch.compiler.load_cache_artifacts(blob)
    return f"loaded {len(blob) / 1e6:.1f} MB"


def save_compile_cache(path: str) -> int:
    """Write the portable cache artifacts (atomically); returns bytes written (0: nothing compiled)."""
    res = torch.compiler.save_cache_artifacts()
    if res is None:
        return 0
    blob = res[0]
    tmp = f"{path}.tmp.{os.getpid()}"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)
    return len(blob)


def run_drafter(args, topo: Topo, groups, t_start: float) -> None:
    lead = topo.rank == topo.targets
    cfg, embed, head = share_frozen(topo, groups["share"])
    dc = dm.DrafterConfig.from_target(cfg, args.drafter_layers, args.block_size)
    torch.manual_seed(args.seed + 1)  # identical initial drafters
    drafter = dm.DFlashDrafter(dc, embed, head, compiled=args.compile and topo.device.type == "cuda",
                               compile_mode=args.compile_mode)
    drafter.to(topo.device).train()
    cache_state = load_compile_cache(args.compile_cache) if drafter.compiled else "unused"
    # fused: one kernel over all 273M parameters on CUDA instead of a foreach chain (the default elsewhere).
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=topo.device.type == "cuda")
    params = [p for p in drafter.parameters()]
    hs_dtype = torch.bfloat16 if topo.device.type == "cuda" else torch.float32
    shapes = payload_shapes(args, len(dc.target_layers) * dc.hidden_size, hs_dtype)
    inbox = Inbox(args, topo, shapes, transport(args), args.steps)
    out = Path(args.out)
    ckpt = Checkpoints(out) if lead else None
    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8") if lead else None  # noqa: SIM115 (closed below)
    if lead:
        compile_note = "off" if not args.compile else (
            f"{'flex_attention' if args.compile_mode == 'flex' else 'layers, context, loss'} compiled, "
            f"cache {cache_state}" if drafter.compiled
            else "skipped on cpu (flex_attention has no CPU backward; SDPA with a dense mask)")
        print(f"drafter: {dm.param_count(drafter) / 1e6:.1f}M params, {dc.num_layers} layers, target layers "
              f"{list(dc.target_layers)}, block {dc.block_size}, {args.drafters} drafter(s) on {topo.device}, "
              f"compile {compile_note}", flush=True)
    cuda = topo.device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    s_len, n, nd = args.seq_len, args.num_anchors, args.drafters
    me = topo.rank - topo.targets
    grad_dev = topo.device if groups["drafters_backend"] == "nccl" else torch.device("cpu")
    win = {"t": time.perf_counter(), "steps": 0, "busy": 0.0, "tgt_us": 0.0, "gpu": [],
           "loss": torch.zeros((), device=topo.device)}
    first_step = True
    prev_end = None
    done = 0
    stop_all = False
    for step in range(args.steps):
        depth = inbox.depth()
        batch, header = inbox.get(step)
        t_busy = time.perf_counter()
        ids, loss_mask, anchors, keep = unpack_meta(batch["meta"], s_len, n)
        lr = dm.lr_at(step, args.steps, args.lr, args.warmup_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            loss = drafter.loss(batch["hs"], ids, loss_mask, anchors, keep)
        loss.backward()
        over_time = lead and args.max_minutes is not None and time.time() - t_start >= args.max_minutes * 60
        # [loss, stop, target busy us, depth per drafter]: summed over drafters with the gradients.
        stats = torch.zeros(3 + nd)
        stats[1:3] = torch.tensor([float(over_time), float(header[2])])
        stats[3 + me] = depth
        if nd > 1:
            flat = torch.cat([p.grad.reshape(-1).to(grad_dev, torch.float32) for p in params]
                             + [loss.detach().float().reshape(1).to(grad_dev), stats[1:].to(grad_dev)])
            dist.all_reduce(flat, group=groups["drafters"])
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad), non_blocking=True)
                off += p.numel()
            for p in params:
                p.grad.div_(nd)
            stats = flat[off:].cpu()
            stats[1:3] /= torch.tensor([1.0, nd])
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if cuda:  # no drain per step: the host queues step N+1 while the GPU runs step N, never further ahead
            ended, prev_end = prev_end, torch.cuda.Event(enable_timing=True)
            prev_end.record()
            (prev_end if first_step or ended is None else ended).synchronize()
            if lead:
                win["gpu"].append((inbox.copied, prev_end))  # busy = GPU time, read when the window is logged
        inbox.release(step)
        done = step + 1
        if not cuda:
            win["busy"] += time.perf_counter() - t_busy
        win["steps"] += 1
        win["tgt_us"] += float(stats[2])
        win["loss"] += float(stats[0]) / nd if nd > 1 else loss.detach()  # mean over the window, no sync here
        stop_all = float(stats[1]) > 0
        if first_step:
            first_step = False
            if lead:
                print(f"first step done {time.time() - t_start:.1f}s after start", flush=True)
                if drafter.compiled and args.compile_cache and not os.path.exists(args.compile_cache):
                    print(f"compile cache: wrote {save_compile_cache(args.compile_cache) / 1e6:.1f} MB to "
                          f"{args.compile_cache}", flush=True)
        if lead and (done % args.log_every == 0 or done == args.steps or stop_all):
            loss_v = float(win["loss"]) / win["steps"]
            if win["gpu"]:
                win["gpu"][-1][1].synchronize()
                win["busy"] += sum(a.elapsed_time(b) for a, b in win["gpu"]) / 1e3
            log_step(args, metrics, win, done, lr, loss_v, [int(x) for x in stats[3:]], t_start, topo, stop_all)
            win.update(t=time.perf_counter(), steps=0, busy=0.0, tgt_us=0.0, gpu=[],
                       loss=torch.zeros((), device=topo.device))
        if lead and args.checkpoint_every and done % args.checkpoint_every == 0:
            ckpt.save(done, drafter, {"args": vars(args)})
        if stop_all:
            break
    if done < args.steps:
        inbox.stop()
    else:
        inbox.flush()  # every ack has its target's receive posted (one per batch): none may be left behind
    if lead:
        if not (args.checkpoint_every and done % args.checkpoint_every == 0):
            ckpt.save(done, drafter, {"args": vars(args)})
        metrics.close()
        why = f" (--max-minutes {args.max_minutes:g} reached)" if stop_all and done < args.steps else ""
        print(f"done steps={done}{why}", flush=True)


def log_step(args, metrics, win, step, lr, loss, depths, t_start, topo, stopping) -> None:
    dt = max(1e-9, time.perf_counter() - win["t"])
    n = max(1, win["steps"])
    tok_s = win["steps"] * topo.drafters * args.batch_size * args.seq_len / dt
    dft_bps = topo.drafters / max(1e-9, win["busy"] / n)
    tgt_bps = topo.targets / max(1e-9, win["tgt_us"] / n / 1e6)
    elapsed = time.time() - t_start
    eta = (args.steps - step) * dt / n
    if args.max_minutes is not None:
        eta = min(eta, max(0.0, args.max_minutes * 60 - elapsed))
    if stopping:
        eta = 0.0
    print(f"[{fmt_elapsed(elapsed)}] step={step} loss={loss:.4f} lr={lr:.1e} tgt={tgt_bps:.2f}b/s "
          f"dft={dft_bps:.2f}b/s ({fmt_rate(tok_s)}tok/s) q_hs={depths} | ETA={fmt_eta(eta)}", flush=True)
    rec = {"step": step, "loss": round(loss, 5), "lr": lr, "tgt_bps": round(tgt_bps, 4), "dft_bps": round(dft_bps, 4),
           "tok_s": round(tok_s, 1), "q_hs": depths, "eta_s": round(eta, 1), "elapsed_s": round(elapsed, 2),
           "time": round(time.time(), 3)}
    metrics.write(json.dumps(rec) + "\n")
    metrics.flush()


# ------------------------------------------------------------------------------------------------- main


def setup(args) -> tuple[Topo, dict]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.targets + args.drafters:
        raise UsageError(f"torchrun started {world} processes, but --targets {args.targets} + --drafters "
                         f"{args.drafters} = {args.targets + args.drafters}: set --nproc-per-node to the sum")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but torch sees no CUDA device")
        ordinal = args.gpu_list[rank] if args.gpu_list else rank % torch.cuda.device_count()
        torch.cuda.set_device(ordinal)
        device = torch.device("cuda", ordinal)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    topo = Topo(rank, world, args.targets, args.drafters, device)
    dgpus = args.gpu_list[args.targets:] if args.gpu_list else None
    distinct = args.device == "cuda" and (dgpus is None or len(set(dgpus)) == len(dgpus))
    backend = "nccl" if distinct and args.drafters > 1 else "gloo"
    # Every rank creates every group, in the same order.
    groups = {"share": dist.new_group([0, *topo.drafter_ranks], backend="gloo", timeout=timeout),
              "exit": dist.new_group(list(range(world)), backend="gloo", timeout=timeout),
              "drafters": dist.new_group(topo.drafter_ranks, backend=backend, timeout=timeout),
              "drafters_backend": backend}
    return topo, groups


def main(argv=None) -> int:
    t_start = time.time()
    parser = build_parser()
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    role = "target" if rank < args.targets else "drafter"
    try:
        check_args(args)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        topo, groups = setup(args)
        if topo.is_target:
            run_target(args, topo, groups)
        else:
            run_drafter(args, topo, groups, t_start)
        # Nobody exits (freeing IPC-shared memory) while a peer may still read it. Its own group: the default
        # one still holds receives nobody will answer after an early stop.
        dist.all_reduce(torch.zeros(1), group=groups["exit"])
        code = 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_USAGE
    except Exception as e:  # one line for the controller; the traceback with DFLASH_TRACEBACK=1
        peer = isinstance(e, (PeerLost, dist.DistError)) or any(
            s in str(e) for s in ("Connection closed by peer", "Connection reset", "Timed out", "timed out"))
        print(f"error: rank {rank} ({role}): {'peer lost: ' if peer else ''}{type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr, flush=True)
        if os.environ.get("DFLASH_TRACEBACK"):
            traceback.print_exc()
        code = EXIT_PEER if peer else EXIT_ERROR
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pending receives a stopped peer will never answer must not hold the exit


if __name__ == "__main__":
    main()
