#!/usr/bin/env python3
"""DFlash drafter training: frozen target(s) produce hidden states, drafter(s) train on them.

    torchrun --standalone --nproc-per-node=T+D train_dflash_pipeline.py --targets T --drafters D ...
    torchrun --nnodes N --nproc-per-node=T+D --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN \
        train_dflash_pipeline.py --targets T --drafters D ...          (the same line on every node)

One OS process per role instance (on each node, local ranks 0..T-1 targets, T..T+D-1 drafters): torch.compile
state is never shared between threads (torch 2.11-2.13 keep the FX-tracing flag process-global).

Several nodes (dflash_dist.py): data-parallel. Each node's targets feed only that node's drafters (hidden
states never cross nodes); the drafters of all nodes average their gradients in one all-reduce; step s trains
on the next N*D*B samples of the stream, drafter k (over all nodes) on the k-th slice of B, so N nodes train
exactly as one node with N times the batch would, and no two drafters see the same sample. Node 0's first
drafter alone logs metrics, evaluates, writes checkpoints and the summary; every other node logs one `node K
of N` line. Nodes that disagree (arguments, checkpoint, data, tokenizer or model hashes) are refused (exit 2),
and a lost node ends the run on every node within seconds (exit 3; --peer-timeout-s for a silent one).

Schedule. On a node, batch l (= step * D + d) goes to local drafter d and is made by local target l % T, so every
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

Log (the lead drafter, node 0's first), one line per --log-every steps, and the same in RUN_DIR/metrics.jsonl:
  [3m] step=14 loss=6.1234 lr=3.0e-04 tgt=2.10b/s dft=1.05b/s (4.6Ktok/s) q_hs=[0] | ETA=12.3m
tgt/dft are the batches per second each role would do if never kept waiting (role count / mean busy time per
batch), so the smaller one is the bottleneck; tok/s is what went through end to end, every node's (N*D*B*S
tokens per step); q_hs the batches ready and waiting per drafter (all nodes') when it asked for the next one (0:
starved by its targets).

Data: --data FILE (required with --model PATH): JSONL conversations / text, or .txt, tokenised with the target's
chat template, loss on assistant tokens only, cached memory-mapped under --cache-dir (dflash_data.py). tiny and
1b train on generated tokens (--synthetic patterns | progressions) unless given --data and --tokenizer, and
--pretrain-target N first teaches their random target that language (class Pretrain: what a random target
predicts no drafter can learn). The log opens with provenance lines:
  data: FILE sha256=<64 hex> samples=N (T train, E held out) tokens=N loss_tokens=N truncated=N cache=hit|built key=K
  tokenizer: DIR sha256=<64 hex> class=NAME vocab=N eos=[ids] chat_template=yes|no mask_token_id=M
  model: SPEC sha256=<64 hex> layers=L vocab=V
--eval-every N: the lead drafter decodes --eval-samples held-out prompts with a full target copy and logs the
acceptance length (tau, tokens per block: accepted drafts + 1, dflash_eval.py) in that step's line as
`accept_len=X.XX` (before ` | ETA`), and in metrics.jsonl as "accept_len".
Checkpoints (dflash_ckpt.py): a full one every --ckpt-every steps and at the end, RUN_DIR/checkpoints/step_N/
(weights, optimizer, schedule, RNG states, data position; manifest.json of sha256s written last). --resume PATH
(or env CTL_RESUME_FROM) continues one: `resumed from step N (PATH)`; a checkpoint without its manifest or with a
wrong hash is refused (exit 2, one line).

Exit: 0 after `done steps=S`; 1 an error in this process (`error: ...` one line on stderr); 3 a peer was
lost (another node, or this node's torchrun agent) or a collective timed out (--timeout-s); 2 bad arguments
or nodes that disagree. torchrun stops the node's other ranks when one fails and then exits 1 itself.
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
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dflash_ckpt as ck
import dflash_data as dd
import dflash_dist as dx
import dflash_eval as de
import dflash_model as dm

EXIT_ERROR, EXIT_USAGE, EXIT_PEER = 1, 2, dx.EXIT_PEER
TAG_HEADER, TAG_META, TAG_HS, TAG_ACK, TAG_IPC = 1, 2, 3, 4, 5
HEADER_LEN = 8  # [first sample, slot, target busy us, target rank, 0...]

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
    a("--data", default=None, help="JSONL of messages / text / prompt+response records, or .txt; required with "
      "--model PATH (tiny and 1b default to generated patterns)")
    a("--synthetic", choices=["patterns", "progressions"], default="patterns",
      help="tiny/1b without --data: patterns (a motif of 2..12 tokens repeated) or progressions (x + k*s mod 40)")
    a("--pretrain-target", type=int, default=0, metavar="N",
      help="tiny/1b: first teach the random target the synthetic language for N steps (cached per node in "
      "--cache-dir), so its next tokens are ones a drafter can learn and accept_len can reward; ~80 teach tiny "
      "progressions at --seq-len 64")
    a("--tokenizer", default=None, help="tokenizer directory (default: the --model directory)")
    a("--cache-dir", default=None, help="tokenised-data cache (default RUN_DIR/cache)")
    a("--seed", type=int, default=0)
    a("--ckpt-every", "--checkpoint-every", dest="ckpt_every", type=int, default=0,
      help="full checkpoint every N steps (0: only at the end)")
    a("--resume", default=None, help="continue from a full checkpoint: checkpoints/step_N, or a run or checkpoints "
      "directory (its newest); default: env CTL_RESUME_FROM")
    a("--stop-at-step", type=int, default=None,
      help="stop cleanly after this step (checkpoint written), as if preempted; the schedule still spans --steps")
    a("--eval-every", type=int, default=0, help="acceptance length on held-out prompts every N steps (0: off); "
      "the lead drafter loads a full copy of the target for it")
    a("--eval-samples", type=int, default=8, help="held-out prompts per eval (at most a tenth of --data)")
    a("--eval-tokens", type=int, default=64, help="tokens decoded per held-out prompt")
    a("--drafter-layers", type=int, default=5)
    a("--queue-size", type=int, default=4)
    a("--transport", choices=["auto", "ipc", "gloo"], default="auto")
    a("--timeout-s", type=float, default=900.0, help="longest wait on a peer before giving up (exit 3)")
    a("--peer-timeout-s", type=float, default=60.0, help="several nodes: a node silent this long (no heartbeat) is "
      "lost, and the others exit 3; a node whose processes died is noticed at once")
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
    synthetic = args.model in ("tiny", "1b")
    if not synthetic and not args.data:
        problems.append(f"--model {args.model} needs --data (JSONL conversations or text): only tiny and 1b "
                        "train on generated patterns")
    if synthetic and args.data and not args.tokenizer:
        problems.append(f"--data with --model {args.model} needs --tokenizer DIR (a local tokenizer whose ids fit "
                        "the model's vocabulary)")
    if (args.pretrain_target or args.synthetic != "patterns") and (not synthetic or args.data):
        problems.append("--pretrain-target and --synthetic are for --model tiny or 1b without --data")
    if args.pretrain_target < 0:
        problems.append("--pretrain-target must be >= 0")
    threads = os.environ.get("DFLASH_CPU_THREADS", "")
    if threads and not (threads.isdigit() and int(threads) >= 1):
        problems.append(f"DFLASH_CPU_THREADS must be a whole number >= 1, got {threads!r}")
    if args.data and not Path(args.data).is_file():
        problems.append(f"--data {args.data}: no such file")
    for name in ("ckpt_every", "eval_every"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if args.peer_timeout_s <= 0:
        problems.append("--peer-timeout-s must be > 0")
    if args.eval_samples < 1 or args.eval_tokens < 1:
        problems.append("--eval-samples and --eval-tokens must be >= 1")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.steps:
        problems.append("--stop-at-step must be within 1..--steps")
    if problems:
        raise UsageError("; ".join(problems))
    args.resume = args.resume or os.environ.get("CTL_RESUME_FROM") or None
    args.start_step = 0
    args.resume_manifest = None
    if args.resume:
        try:
            path = ck.resolve(args.resume)
            if path.is_file():
                raise ck.CheckpointError(f"checkpoint {path}: weights only (no optimizer, RNG or data state): it "
                                         "cannot resume a run; refused")
            args.resume_manifest = ck.read_manifest(path)
            args.start_step = args.resume_manifest["step"]
        except ck.CheckpointError as e:
            raise UsageError(f"--resume: {e}") from None
        args.resume_path = str(path)
        if args.start_step >= args.steps:
            raise AlreadyDone(f"the checkpoint {path} is at step {args.start_step}, --steps is {args.steps}: nothing "
                              "left to train")


UsageError = dx.UsageError


class AlreadyDone(Exception):
    """Resumed from a checkpoint at the last step: the run is complete (a relaunch after a crash at the very end
    must finish, not fail and be relaunched again)."""


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


def build_target(spec: str, device: torch.device, seed: int, pretrain: Pretrain | None = None):
    """The frozen target (tiny/1b: random for the seed, then taught `pretrain` if given)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec in ("tiny", "1b"):
        torch.manual_seed(seed)  # the same random target for the same seed
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(target_config(spec), dtype=dtype, attn_implementation="sdpa")
        if pretrain and pretrain.steps:
            pretrain.apply(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").to(device)
    model.eval().requires_grad_(False)
    return model


@dataclass
class Pretrain:
    """--pretrain-target: the random tiny/1b target is first trained on the synthetic language, as a real target
    was trained on real text. A random target's greedy next token follows no rule a drafter can learn (accept_len
    stays 1); a taught one continues the language, which is what DFlash drafts. Done once per node: the first
    process to take the lock trains and stores the weights in the cache, the others (the node's other targets,
    the evaluator) load them, so every rank holds the same bytes. Batch 16 of --seq-len, AdamW at 3e-3, fp32."""

    steps: int
    data: Data
    cache_dir: Path
    target_sha256: str
    state: str = ""  # 'built' or 'hit' after apply()
    loss: float | None = None
    seconds: float = 0.0
    batch: int = 16
    lr: float = 3e-3

    def apply(self, model) -> None:
        import fcntl

        t0 = time.time()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.cache_dir / f"target-{self.target_sha256[:16]}.pt"
        with open(self.cache_dir / f"{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.is_file():
                self.state = "hit"
                saved = torch.load(path, map_location="cpu", weights_only=True)
            else:
                self.state = "built"
                saved = {"loss": self._train(model), "weights": {k: v.cpu() for k, v in model.state_dict().items()}}
                tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
                torch.save(saved, tmp)
                os.replace(tmp, path)
        model.load_state_dict(saved["weights"])  # also after training: every rank the stored (cast) bytes
        self.loss, self.seconds = float(saved["loss"]), time.time() - t0

    def _train(self, model) -> float:
        dtype = next(model.parameters()).dtype
        model.float().train().requires_grad_(True)
        opt = torch.optim.AdamW(model.parameters(), lr=self.lr)
        dev = next(model.parameters()).device
        threads = torch.get_num_threads()
        # The node's other processes wait on the lock meanwhile: on a CPU, this one takes their threads too.
        pooled = threads * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(threads, min(pooled, len(os.sched_getaffinity(0)))))
        loss = torch.zeros(())
        try:
            for i in range(self.steps):
                ids = self.data.synthetic_rows(f"pretrain/{i}", self.batch).to(dev)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            torch.set_num_threads(threads)
        model.to(dtype).eval().requires_grad_(False)
        return float(loss.detach())


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
    """Row i of the run's sample stream, a pure function of seed and i: the same whichever target, drafter or node
    handles it, so how a step's samples are split over drafters and nodes changes nothing (sample_index()).

    Default (tiny/1b): generated patterns (a motif of 2..12 tokens out of 64 repeated): learnable, so the loss
    visibly goes down within a minute on a CPU even with a random target (whose frozen random LM head caps how
    low it goes). With a corpus (dflash_data): one sample per row, never packed, truncated to seq_len and padded
    (pad carries no loss); the stream walks through an epoch-wise shuffle of the training samples, so the data
    position is one number, the samples seen (a checkpoint records it).
    """

    def __init__(self, vocab: int, seq_len: int, seed: int, corpus: dd.Corpus | None = None, pad_id: int = 0,
                 eval_samples: int = 8, synthetic: str = "patterns"):
        self.vocab, self.s, self.seed, self.corpus, self.pad_id = vocab, seq_len, seed, corpus, pad_id
        self.synthetic = synthetic
        self.train_idx = self.heldout_idx = None
        self._perm: tuple[int, object] | None = None
        if corpus is not None:
            self.train_idx, self.heldout_idx = dd.split_heldout(len(corpus), eval_samples)

    def _order(self, epoch: int):
        if self._perm is None or self._perm[0] != epoch:
            import numpy as np

            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.train_idx))
        return self._perm[1]

    def rows(self, first: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, loss mask) [b, seq_len] of samples first..first+b-1 (negative: patterns no training step uses)."""
        if self.corpus is None:
            ids = torch.cat([self.synthetic_rows(str(i), 1) for i in range(first, first + b)])
            return ids, torch.ones_like(ids)
        ids = torch.full((b, self.s), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, self.s), dtype=torch.long)
        n = len(self.train_idx)
        for j in range(b):
            pos = first + j
            i = int(self._order(pos // n)[pos % n])
            t, m = self.corpus.sample(i)
            k = min(self.s, len(t))
            ids[j, :k] = torch.from_numpy(t[:k].astype("int64"))
            mask[j, :k] = torch.from_numpy(m[:k].astype("int64"))
        return ids, mask

    def synthetic_rows(self, key: str, b: int) -> torch.Tensor:
        """b rows [b, seq_len] of the synthetic language, a pure function of (seed, key, row): patterns, a motif of
        2..12 tokens out of 64 repeated; progressions, 2 + (x + k*s) mod 40 with x in 0..39 and s in 1..3."""
        rows = []
        for j in range(b):
            rng = random.Random(f"{self.seed}/{key}" if b == 1 else f"{self.seed}/{key}/{j}")  # str: -i != i
            if self.synthetic == "progressions":
                x, step = rng.randrange(40), rng.randint(1, 3)
                rows.append([2 + (x + k * step) % 40 for k in range(self.s)])
            else:
                motif = [rng.randrange(2, min(self.vocab - 2, 66)) for _ in range(rng.randint(2, 12))]
                rows.append((motif * (self.s // len(motif) + 1))[: self.s])
        return torch.tensor(rows)

    def heldout_prompts(self, n: int) -> list[torch.Tensor]:
        """Prompts of held-out samples: everything before their last assistant turn (text: its first half)."""
        if self.corpus is None:  # patterns of batches no training step uses (negative g)
            return [self.rows(-1 - i, 1)[0][0, : max(2, self.s // 4)] for i in range(n)]
        out = []
        for i in self.heldout_idx[:n]:
            t, m = self.corpus.sample(int(i))
            out.append(torch.from_numpy(t[: dd.prompt_length(m)].astype("int64")))
        return out


def first_sample(args, topo: dx.Topo, step: int, drafter: int) -> int:
    """Index of the first row that drafter (0..drafters_total-1, over all nodes) trains on at `step`.

    Step s takes the next drafters_total * batch_size samples of the stream, drafter k the k-th slice of
    batch_size: two nodes of one drafter each train, at every step, on exactly the rows one drafter with twice
    the batch would, and no two drafters of the run ever get the same sample. The stream continues where the
    resumed checkpoint left it (its samples_seen), whatever the checkpoint's node and drafter counts were."""
    return args.sample0 + ((step - args.start_step) * topo.drafters_total + drafter) * args.batch_size


def row_anchors(loss_mask: torch.Tensor, first: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors of rows first.., each drawn from its own sample's seed (not the batch's): a row gets the same
    anchors whichever batch, drafter or node it lands in."""
    gen = torch.Generator()
    parts = []
    for j in range(loss_mask.shape[0]):
        gen.manual_seed((args.seed * 7919 + first + j) % (1 << 62))
        parts.append(dm.sample_anchors(loss_mask[j:j + 1], args.num_anchors, args.block_size, gen))
    return torch.cat([a for a, _ in parts]), torch.cat([k for _, k in parts])


@dataclass
class Source:
    """What a run trains on, and the provenance lines that say so."""

    data: Data
    tokenizer: object | None
    mask_token_id: int
    stop_ids: list[int]
    lines: list[str]
    provenance: dict


def load_tokenizer(args):
    src = args.tokenizer or (None if args.model in ("tiny", "1b") else args.model)
    if src is None:
        return None, None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise UsageError(f"--tokenizer {src}: no tokenizer could be loaded ({type(e).__name__}: {first[:200]})"
                         ) from None
    return tok, src


def load_source(args, cfg, cache_dir: Path, describe: bool = True) -> Source:
    """Tokenizer, data (through the cache) and the provenance of data, tokenizer and model (the model's hash
    only when `describe`: one rank hashes a large checkpoint, not every one)."""
    vocab = cfg.vocab_size
    tok, tok_src = load_tokenizer(args)
    prov: dict = {"target": args.model, "target_num_layers": cfg.num_hidden_layers, "vocab_size": vocab,
                  "target_max_position_embeddings": getattr(cfg, "max_position_embeddings", None)}
    if args.model in ("tiny", "1b"):
        spec = {"config": cfg.to_dict(), "seed": args.seed}
        if args.pretrain_target:
            spec["pretrain"] = {"steps": args.pretrain_target, "language": args.synthetic, "seq_len": args.seq_len,
                                "batch": Pretrain.batch, "lr": Pretrain.lr, "v": 1}
        prov["target_sha256"] = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()
        taught = f", taught {args.synthetic} for {args.pretrain_target} steps" if args.pretrain_target else ""
        model_line = (f"model: {args.model} (random init, seed {args.seed}{taught}) sha256={prov['target_sha256']} "
                      f"layers={cfg.num_hidden_layers} vocab={vocab}")
    else:
        prov["target_sha256"] = dd.model_sha256(args.model, cache_dir) if describe else None
        model_line = f"model: {args.model} sha256={prov['target_sha256']} layers={cfg.num_hidden_layers} vocab={vocab}"
    if tok is None:
        mask_id = vocab - 1
        lines = [f"data: synthetic {args.synthetic} (seed {args.seed})",
                 f"tokenizer: none (synthetic token ids) mask_token_id={mask_id}", model_line]
        prov.update(mask_token_id=mask_id, data=f"synthetic {args.synthetic}")
        return Source(Data(vocab, args.seq_len, args.seed, synthetic=args.synthetic), None, mask_id, [], lines, prov)
    if len(tok) >= vocab:
        raise UsageError(f"--tokenizer {tok_src}: {len(tok)} tokens do not fit the model's vocabulary of {vocab} "
                         "(no free id for the MASK token)")
    mask_id = len(tok)  # the first id the tokenizer never produces (Qwen3: 151669, as z-lab's drafters use)
    try:
        corpus, info = dd.load_corpus(args.data, tok, args.seq_len, cache_dir / "data",
                                      model_dir=args.model if args.model not in ("tiny", "1b") else None)
    except dd.DataError as e:
        raise UsageError(str(e)) from None
    if info["max_id"] >= vocab:
        raise UsageError(f"--data {args.data}: token id {info['max_id']} >= the model's vocabulary {vocab}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else (info["stop_ids"] or [0])[0]
    data = Data(vocab, args.seq_len, args.seed, corpus, pad, args.eval_samples)
    tok_sha = info["tokenizer_sha256"]
    lines = [f"data: {args.data} sha256={info['data_sha256']} samples={len(corpus)} ({len(data.train_idx)} train, "
             f"{len(data.heldout_idx)} held out) tokens={info['tokens']} loss_tokens={info['loss_tokens']} "
             f"truncated={info['truncated']} cache={info['cache']} key={info['key']}",
             f"tokenizer: {tok_src} sha256={tok_sha} class={type(tok).__name__} vocab={len(tok)} "
             f"eos={info['stop_ids']} chat_template={'yes' if getattr(tok, 'chat_template', None) else 'no'} "
             f"mask_token_id={mask_id}", model_line]
    prov.update(mask_token_id=mask_id, data=args.data, data_sha256=info["data_sha256"], data_key=info["key"],
                tokenizer=tok_src, tokenizer_sha256=tok_sha, eos_token_ids=info["stop_ids"])
    return Source(data, tok, mask_id, list(info["stop_ids"]), lines, prov)


def pretrain_of(args, src: Source) -> Pretrain | None:
    if not args.pretrain_target:
        return None
    return Pretrain(args.pretrain_target, src.data, cache_dir_of(args) / "target", src.provenance["target_sha256"])


def cache_dir_of(args) -> Path:
    return Path(args.cache_dir) if args.cache_dir else Path(args.out) / "cache"


# ------------------------------------------------------------------------------------------- transport


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

    def __init__(self, args, topo: dx.Topo, dst: int, shapes, mode: str):
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

    def __init__(self, args, topo: dx.Topo, shapes, mode: str, start: int, steps: int):
        self.args, self.topo, self.mode, self.start, self.steps = args, topo, mode, start, steps
        self.d = topo.local - topo.targets  # this node's drafter d; its targets are this node's
        self.q = args.queue_size
        pin = topo.device.type == "cuda"
        self.host = [{k: torch.empty(shape, dtype=dt, pin_memory=pin) for k, (shape, dt) in shapes.items()}
                     for _ in range(self.q)] if mode == "gloo" else None
        self.local = {k: torch.empty(shape, dtype=dt, device=topo.device) for k, (shape, dt) in shapes.items()}
        self.remote: dict[int, list] = {}
        if mode == "ipc":  # open each serving target's slots once
            for t in range(topo.targets):
                if serves(t, self.d, topo.targets, topo.drafters):
                    src = topo.target_rank(t)
                    n = torch.zeros(1, dtype=torch.int64)
                    dist.recv(n, src, tag=TAG_IPC)
                    blob = torch.empty(int(n), dtype=torch.uint8)
                    dist.recv(blob, src, tag=TAG_IPC)
                    self.remote[src] = [{k: fn(*a) for k, (fn, a) in slot.items()}
                                      for slot in pickle.loads(blob.numpy().tobytes())]
        self.ready: queue.Queue = queue.Queue()
        self.acks: list = []  # isend works of acks in flight: a dropped work can lose its message (gloo)
        self.free = threading.Semaphore(self.q)
        self.stopping = threading.Event()
        threading.Thread(target=self._receive, name="dflash-inbox", daemon=True).start()

    def source(self, step: int) -> int:
        """Global rank of the target (of this node) that makes this drafter's batch of `step`."""
        return self.topo.target_rank((step * self.topo.drafters + self.d) % self.topo.targets)

    def _receive(self) -> None:
        try:
            for step in range(self.start, self.steps):
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
                    self._ack(torch.tensor([-1, 1], dtype=torch.int64), self.topo.target_rank(t))


# ----------------------------------------------------------------------------------------------- roles


def hs_layers(cfg, drafter_layers: int) -> list[int]:
    return dm.target_layer_ids(cfg.num_hidden_layers, drafter_layers)


def share_frozen(topo: dx.Topo, group, model=None, extra: dict | None = None):
    """A node's target 0 sends the target config, `extra` (MASK id, provenance) and its embedding / LM head
    weights to the node's drafters (nothing crosses nodes); a drafter gets (config, embedding, LM head, extra)."""
    if topo.local == 0:
        cfg = model.config
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        tied = head.data_ptr() == emb.data_ptr()
        info = [{"config": cfg.to_dict(), "tied": tied, "dtype": str(emb.dtype).split(".")[-1], "extra": extra}]
        dist.broadcast_object_list(info, src=topo.base, group=group)
        for w in [emb] if tied else [emb, head]:
            dist.broadcast(w.detach().to("cpu").contiguous(), src=topo.base, group=group)
        return None
    info = [None]
    dist.broadcast_object_list(info, src=topo.base, group=group)
    meta = info[0]
    # The fields as the target serialised them (DrafterConfig.from_target reads a few): no transformers import in
    # a drafter, a second or two less of start-up in every one.
    cfg = SimpleNamespace(**meta["config"])
    dtype = getattr(torch, meta["dtype"])
    weights = []
    for _ in range(1 if meta["tied"] else 2):
        w = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        dist.broadcast(w, src=topo.base, group=group)
        weights.append(w.to(topo.device))
    embed = torch.nn.Embedding.from_pretrained(weights[0], freeze=True)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=topo.device, dtype=dtype)
    head.weight = torch.nn.Parameter(weights[-1], requires_grad=False)
    return cfg, embed, head, meta.get("extra") or {}


def run_target(args, topo: dx.Topo, groups) -> None:
    t0 = time.time()
    # Data, tokenizer and model are named (with hashes) before the model loads: the log's first lines.
    src = load_source(args, target_config(args.model), cache_dir_of(args), describe=topo.local == 0)
    if topo.rank == 0:
        for line in src.lines:
            print(line, flush=True)
    data = src.data
    pre = pretrain_of(args, src)
    model = build_target(args.model, topo.device, args.seed, pre)
    if pre and topo.rank == 0:
        print(f"target: taught {args.synthetic} for {pre.steps} steps, loss {pre.loss:.4f} (cache {pre.state}, "
              f"{pre.seconds:.1f}s)", flush=True)
    if topo.local == 0:
        share_frozen(topo, groups["share"], model, {"mask_token_id": src.mask_token_id, "stop_ids": src.stop_ids,
                                                     "provenance": src.provenance})
    dx.agree(topo, groups["exit"], same_inputs(src.provenance), "data, tokenizer or model")
    cfg = model.config
    layers = hs_layers(cfg, args.drafter_layers)
    truncate_target(model, max(layers))
    compiled_layers = compile_target_layers(model) if args.compile_target and topo.device.type == "cuda" else 0
    hs_dtype = torch.bfloat16 if topo.device.type == "cuda" else torch.float32
    shapes = payload_shapes(args, len(layers) * cfg.hidden_size, hs_dtype)
    mode = transport(args)
    out = {d: Outbox(args, topo, topo.drafter_rank(d), shapes, mode) for d in range(topo.drafters)
           if serves(topo.local, d, topo.targets, topo.drafters)}
    if topo.rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"target: {args.model} {n / 1e6:.1f}M params (layers {layers} of {cfg.num_hidden_layers}) "
              f"on {topo.device}, {args.targets} target(s){per_node(topo)}, transport {mode}, "
              f"{f'{compiled_layers} layers compiled, ' if compiled_layers else ''}ready in {time.time() - t0:.1f}s",
              flush=True)
    stopped = False
    # This node's batches in order: l = step * D + d goes to local drafter d and is made by local target l % T.
    n0 = args.start_step * topo.drafters
    for nb in range(n0 + (topo.local - n0) % topo.targets, args.steps * topo.drafters, topo.targets):
        step, d = divmod(nb, topo.drafters)
        slot = out[d].acquire()
        if slot is None:
            stopped = True
            break
        maybe_crash(topo.rank, step)
        t = time.perf_counter()
        first = first_sample(args, topo, step, topo.node * topo.drafters + d)
        ids, loss_mask = data.rows(first, args.batch_size)
        anchors, keep = row_anchors(loss_mask, first, args)
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
        out[d].send(slot, first, int((time.perf_counter() - t) * 1e6), topo.rank)
    if not stopped:  # every batch sent has its drafter's receive coming; after a stop, nobody takes them
        for ob in out.values():
            ob.flush()


def same_inputs(prov: dict) -> dict:
    """What every node's target must agree on (dx.agree): the data, tokenizer and model by content, not path.
    A node's other targets do not hash the model (None: not compared)."""
    keys = ("data_sha256", "data_key", "tokenizer_sha256", "target_sha256", "mask_token_id", "vocab_size")
    return {"_host": dx.host(), **{k: prov.get(k) for k in keys}}


def per_node(topo: dx.Topo) -> str:
    return f" per node x {topo.nodes} nodes" if topo.nodes > 1 else ""


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


class Evaluator:
    """Acceptance length on held-out prompts, on the lead drafter: a full (untruncated) copy of the target
    verifies the drafter's blocks greedily (dflash_eval). Built before the drafter: building a tiny/1b target
    reseeds torch, as the target ranks do."""

    def __init__(self, args, device: torch.device, stop_ids: list[int]):
        t0 = time.time()
        src = load_source(args, target_config(args.model), cache_dir_of(args), describe=False)
        self.target = build_target(args.model, device, args.seed, pretrain_of(args, src))
        self.prompts = [p.to(device) for p in src.data.heldout_prompts(args.eval_samples)]
        self.args, self.stop_ids, self.device = args, stop_ids, device
        self.ready_s = time.time() - t0

    def __call__(self, drafter) -> de.EvalResult:
        drafter.eval()
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                return de.acceptance_length(self.target, de.drafter_proposer(drafter), self.prompts,
                                            drafter.c.target_layers, drafter.c.block_size, self.args.eval_tokens,
                                            self.stop_ids)
        finally:
            drafter.train()


def run_drafter(args, topo: dx.Topo, groups, t_start: float) -> Inbox:
    lead = topo.lead
    cfg, embed, head, shared = share_frozen(topo, groups["share"])
    prov = shared.get("provenance") or {}
    dx.agree(topo, groups["exit"], same_inputs(prov), "data, tokenizer or model")
    dc = dm.DrafterConfig.from_target(cfg, args.drafter_layers, args.block_size, shared.get("mask_token_id"))
    evaluator = Evaluator(args, topo.device, shared.get("stop_ids") or []) if lead and args.eval_every else None
    torch.manual_seed(args.seed + 1)  # identical initial drafters
    drafter = dm.DFlashDrafter(dc, embed, head, compiled=args.compile and topo.device.type == "cuda",
                               compile_mode=args.compile_mode)
    drafter.to(topo.device).train()
    cache_state = load_compile_cache(args.compile_cache) if drafter.compiled else "unused"
    # fused: one kernel over all 273M parameters on CUDA instead of a foreach chain (the default elsewhere).
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=topo.device.type == "cuda")
    start = args.start_step
    if args.resume:
        # Rank 0 verified every sha256 before the process group formed; here the files are only read.
        weights, state = ck.load_full(Path(args.resume_path), map_location=topo.device, verified=True)
        if weights["config"] != dc.to_dict():
            raise UsageError(f"--resume {args.resume_path}: its drafter config differs from this run's "
                             f"({weights['config']} vs {dc.to_dict()})")
        drafter.load_state_dict(weights["drafter"])
        opt.load_state_dict(state["optimizer"])
        ck.set_rng_state(state["rng"])
        start = int(state["step"])
        if lead:
            sched = state.get("scheduler") or {}
            note = (f"; --steps {args.steps} replaces the checkpoint's {sched['total_steps']} in the lr schedule"
                    if sched.get("total_steps") not in (None, args.steps) else "")
            was = state.get("data") or {}
            per_step = topo.drafters_total * args.batch_size
            if was.get("drafters") is not None and was["drafters"] * was.get("batch_size", 0) != per_step:
                note += (f"; {was['drafters']} drafter(s) x batch {was.get('batch_size')} per step in the checkpoint, "
                         f"{topo.drafters_total} x {args.batch_size} now: the data continues at sample {args.sample0}")
            print(f"resumed from step {start} ({args.resume_path}){note}", flush=True)
    params = [p for p in drafter.parameters()]
    hs_dtype = torch.bfloat16 if topo.device.type == "cuda" else torch.float32
    shapes = payload_shapes(args, len(dc.target_layers) * dc.hidden_size, hs_dtype)
    inbox = Inbox(args, topo, shapes, transport(args), start, args.steps)
    out = Path(args.out)
    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8") if lead else None  # noqa: SIM115 (closed below)
    if lead:
        compile_note = "off" if not args.compile else (
            f"{'flex_attention' if args.compile_mode == 'flex' else 'layers, context, loss'} compiled, "
            f"cache {cache_state}" if drafter.compiled
            else "skipped on cpu (flex_attention has no CPU backward; SDPA with a dense mask)")
        print(f"drafter: {dm.param_count(drafter) / 1e6:.1f}M params, {dc.num_layers} layers, target layers "
              f"{list(dc.target_layers)}, block {dc.block_size}, mask token {dc.mask_token_id}, {args.drafters} "
              f"drafter(s){per_node(topo)} on {topo.device}, compile {compile_note}", flush=True)
        if evaluator:
            print(f"eval: accept_len every {args.eval_every} steps on {len(evaluator.prompts)} held-out prompts, "
                  f"{args.eval_tokens} tokens each, block {dc.block_size} (target copy ready in "
                  f"{evaluator.ready_s:.1f}s)", flush=True)
    cuda = topo.device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    s_len, n, nd = args.seq_len, args.num_anchors, topo.drafters_total
    me = topo.drafter_index
    grad_dev = topo.device if groups["drafters_backend"] == "nccl" else torch.device("cpu")
    win = {"t": time.perf_counter(), "steps": 0, "busy": 0.0, "tgt_us": 0.0, "gpu": [],
           "loss": torch.zeros((), device=topo.device)}
    first_step = True
    prev_end = None
    done = start
    saved = -1
    stop_all = False

    def save(step: int) -> None:
        sched = {"kind": "dflash_model.lr_at (linear warm-up, cosine to 10%)", "total_steps": args.steps,
                 "peak_lr": args.lr, "warmup_ratio": args.warmup_ratio, "next_step": step}
        position = {"next_global_batch": step * nd, "batch_size": args.batch_size, "drafters": nd,
                    "samples_seen": first_sample(args, topo, step, 0), "data_key": prov.get("data_key"),
                    "nodes": topo.nodes, "targets_per_node": topo.targets, "drafters_per_node": topo.drafters}
        ck.save_full(out / "checkpoints", step, drafter, opt, scheduler=sched, data=position,
                     args={k: v for k, v in vars(args).items() if k != "gpu_list"}, provenance=prov)

    for step in range(start, args.steps):
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
        over_time = lead and ((args.max_minutes is not None and time.time() - t_start >= args.max_minutes * 60)
                              or (args.stop_at_step is not None and step + 1 >= args.stop_at_step))
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
        result = None
        if evaluator and done % args.eval_every == 0:
            t_eval = time.perf_counter()
            result = evaluator(drafter)
            win["t"] += time.perf_counter() - t_eval  # the window's rates leave the eval out
        if lead and (done % args.log_every == 0 or done == args.steps or stop_all or result is not None):
            loss_v = float(win["loss"]) / win["steps"]
            if win["gpu"]:
                win["gpu"][-1][1].synchronize()
                win["busy"] += sum(a.elapsed_time(b) for a, b in win["gpu"]) / 1e3
            log_step(args, metrics, win, done, lr, loss_v, [int(x) for x in stats[3:]], t_start, topo, stop_all,
                     result)
            win.update(t=time.perf_counter(), steps=0, busy=0.0, tgt_us=0.0, gpu=[],
                       loss=torch.zeros((), device=topo.device))
        if lead and args.ckpt_every and done % args.ckpt_every == 0:
            save(done)
            saved = done
        if stop_all:
            break
    if done < args.steps:
        inbox.stop()
    else:
        inbox.flush()  # every ack has its target's receive posted (one per batch): none may be left behind
    if lead:
        if saved != done:
            save(done)
        metrics.close()
        why = ""
        if stop_all and done < args.steps:
            why = (f" (--stop-at-step {args.stop_at_step} reached)" if args.stop_at_step == done
                   else f" (--max-minutes {args.max_minutes:g} reached)")
        print(f"done steps={done}{why}", flush=True)
    # After an early stop the 'stop' acks are not waited for (those beyond the targets' posted receives never
    # complete); the caller keeps the inbox, and so their works, alive until the exit barrier: with gloo a send
    # whose work is garbage-collected before it completes can vanish, and its target then waits in acquire()
    # for good (a hang seen in CI: target in Outbox.acquire, drafter in the exit all_reduce).
    return inbox


def log_step(args, metrics, win, step, lr, loss, depths, t_start, topo, stopping, result=None) -> None:
    dt = max(1e-9, time.perf_counter() - win["t"])
    n = max(1, win["steps"])
    tok_s = win["steps"] * topo.drafters_total * args.batch_size * args.seq_len / dt  # every node's tokens
    dft_bps = topo.drafters_total / max(1e-9, win["busy"] / n)
    tgt_bps = topo.targets_total / max(1e-9, win["tgt_us"] / n / 1e6)
    elapsed = time.time() - t_start
    eta = (args.steps - step) * dt / n
    if args.max_minutes is not None:
        eta = min(eta, max(0.0, args.max_minutes * 60 - elapsed))
    if stopping:
        eta = 0.0
    acc = f" accept_len={result.tau:.2f}" if result is not None else ""
    print(f"[{fmt_elapsed(elapsed)}] step={step} loss={loss:.4f} lr={lr:.1e} tgt={tgt_bps:.2f}b/s "
          f"dft={dft_bps:.2f}b/s ({fmt_rate(tok_s)}tok/s) q_hs={depths}{acc} | ETA={fmt_eta(eta)}", flush=True)
    rec = {"step": step, "loss": round(loss, 5), "lr": lr, "tgt_bps": round(tgt_bps, 4), "dft_bps": round(dft_bps, 4),
           "tok_s": round(tok_s, 1), "q_hs": depths, "eta_s": round(eta, 1), "elapsed_s": round(elapsed, 2),
           "time": round(time.time(), 3)}
    if result is not None:
        rec.update(accept_len=round(result.tau, 4), eval_blocks=result.blocks)
    metrics.write(json.dumps(rec) + "\n")
    metrics.flush()


# ------------------------------------------------------------------------------------------------- main


NODE_LOCAL_ARGS = {"out", "cache_dir", "compile_cache", "resume", "resume_path", "resume_manifest", "gpus",
                   "gpu_list", "data", "tokenizer"}  # paths may differ between nodes; contents are compared


def same_command(args) -> dict:
    """What every node's command line must agree on (dx.agree): the arguments that shape the training, and the
    resumed checkpoint by its files' hashes."""
    view = {k: v for k, v in sorted(vars(args).items()) if k not in NODE_LOCAL_ARGS}
    if args.model not in ("tiny", "1b"):
        view.pop("model")
    if args.resume_manifest:
        view["resume_files"] = {k: f.get("sha256") for k, f in args.resume_manifest["files"].items()}
    return {"_host": dx.host(), **view}


def setup(args) -> tuple[dx.Topo, dict]:
    rank, world, node, nodes = dx.placement(args.targets, args.drafters)
    local = rank - node * (args.targets + args.drafters)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but torch sees no CUDA device")
        ordinal = args.gpu_list[local] if args.gpu_list else local % torch.cuda.device_count()
        torch.cuda.set_device(ordinal)
        device = torch.device("cuda", ordinal)
    else:
        device = torch.device("cpu")
        # The cores this process may run on (a container's cpuset, taskset), not the host's: os.cpu_count(), shared
        # by the node's processes. torchrun's OMP_NUM_THREADS=1 is its default, not a choice, so it cannot say
        # "fewer": DFLASH_CPU_THREADS does (several runs on one machine, as a test suite starts them; 6 runs of 8
        # threads each on 16 cores ran 15x slower than alone).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(int(os.environ.get("DFLASH_CPU_THREADS") or 0)
                              or max(1, cores // (args.targets + args.drafters)))
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    topo = dx.Topo(rank, world, args.targets, args.drafters, device, node, nodes)
    dgpus = args.gpu_list[args.targets:] if args.gpu_list else None
    distinct = args.device == "cuda" and (dgpus is None or len(set(dgpus)) == len(dgpus))
    backend = "nccl" if distinct and topo.drafters_total > 1 else "gloo"
    # Every rank creates every group, in the same order. Hidden states stay on their node (targets send to the
    # node's drafters over the default group); the gradient all-reduce spans every node's drafters.
    shares = [dist.new_group([n * topo.per_node, *topo.node_drafter_ranks(n)], backend="gloo", timeout=timeout)
              for n in range(nodes)]
    groups = {"share": shares[node],
              "exit": dist.new_group(list(range(world)), backend="gloo", timeout=timeout),
              "drafters": dist.new_group(topo.drafter_ranks, backend=backend, timeout=timeout),
              "drafters_backend": backend,
              "watch": dist.new_group(topo.leaders, backend="gloo", timeout=timeout) if nodes > 1 else None}
    dx.agree(topo, groups["exit"], same_command(args), "their command lines")
    seen = ((args.resume_manifest or {}).get("data") or {}).get("samples_seen")
    args.sample0 = int(seen) if seen is not None else args.start_step * topo.drafters_total * args.batch_size
    if nodes > 1 and topo.local == 0:
        print(f"node {node} of {nodes} ({dx.host()}): ranks {topo.base}..{topo.base + topo.per_node - 1}, "
              f"targets {[topo.target_rank(t) for t in range(topo.targets)]}, drafters "
              f"{[topo.drafter_rank(d) for d in range(topo.drafters)]} (slices {node * topo.drafters}.."
              f"{(node + 1) * topo.drafters - 1} of {topo.drafters_total} per step); metrics, checkpoints and the "
              f"summary {'here' if node == 0 else 'on node 0'}", flush=True)
    return topo, groups


def main(argv=None) -> int:
    t_start = time.time()
    parser = build_parser()
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    role = "target" if local < args.targets else "drafter"
    everywhere = True  # until the process group forms, every rank of a node finds the same problems: its first says
    watchdog = None
    try:
        check_args(args)
        if args.resume and local == 0:  # each node its own copy of the checkpoint
            try:
                ck.verify(Path(args.resume_path))
            except ck.CheckpointError as e:
                raise UsageError(f"--resume: {e}") from None
        Path(args.out).mkdir(parents=True, exist_ok=True)
        everywhere = False
        topo, groups = setup(args)
        watchdog = dx.Watchdog(topo, groups["watch"], args.peer_timeout_s, f"rank {rank} ({role})")
        watchdog.start()
        if topo.is_target:
            run_target(args, topo, groups)
        else:
            inbox = run_drafter(args, topo, groups, t_start)  # noqa: F841 - its ack works live to the barrier
        # Nobody exits (freeing IPC-shared memory) while a peer may still read it. Its own group: the default
        # one still holds receives nobody will answer after an early stop.
        dist.all_reduce(torch.zeros(1), group=groups["exit"])
        watchdog.close()
        code = 0
    except AlreadyDone as e:
        if rank == 0:
            print(f"done steps={args.steps} ({e})", flush=True)
        code = 0
    except UsageError as e:
        if watchdog:
            watchdog.close()
        if local == 0 or not (everywhere or isinstance(e, dx.Mismatch)):
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # exiting first would have torchrun stop the node's first process before it says why
            time.sleep(5)
        code = EXIT_USAGE
    except Exception as e:  # one line for the controller; the traceback with DFLASH_TRACEBACK=1
        if watchdog:
            watchdog.close()
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
