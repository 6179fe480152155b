"""DFlash drafter (arXiv 2602.06036): a few Qwen3-style layers that fill a block of masked tokens in one pass.

The drafter owns no embedding and no LM head: it borrows the frozen target's `embed_tokens` and `lm_head`
(kept as plain attributes, so they are neither trained nor saved). It is conditioned on the hidden states of
a few target layers spread from 1 to L-3, concatenated and projected by `fc` (k*H -> H) + RMSNorm. In every
layer K/V come from [target context ; noise block] and Q from the noise block only.

Training (as SpecForge does it): per sequence, `num_anchors` anchor positions; block j is
[token at anchor_j, MASK x (bs-1)] and its position k predicts token anchor_j + k. A query sees the context
keys strictly before its anchor plus every key of its own block (`dflash_mask`). Loss: cross-entropy at
k >= 1 weighted by exp(-(k-1)/gamma).

Plain torch + flex_attention: runs on torch 2.11 (CUDA) to 2.13+ (CPU), compiled or eager.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# How a compiled drafter is compiled: "layers" (each decoder layer, the context projection and the LM-head
# cross-entropy compiled as regions; flex_attention is traced inside its layer) or "flex" (flex_attention
# alone, everything around it eager: the first version, kept for the benchmark's comparison).
COMPILE_MODES = ("layers", "flex")


@functools.cache
def compiled_once(fn):
    """torch.compile(fn), made once per process on first use and shared by every caller."""
    return torch.compile(fn, dynamic=False)


def flex_attention_fn(compiled: bool):
    """flex_attention, compiled when asked (the eager one materialises scores)."""
    return compiled_once(flex_attention) if compiled else flex_attention


def target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """k layers spread evenly over 1..L-3 (Qwen3-8B, 36 layers, k=5 -> [1, 9, 17, 25, 33])."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if k == 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + i * (hi - lo) / (k - 1)) for i in range(k)})


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    target_layers: tuple[int, ...]
    vocab_size: int
    mask_token_id: int
    block_size: int = 16
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    gamma: float = 7.0

    @classmethod
    def from_target(cls, cfg, num_layers: int = 5, block_size: int = 16, mask_token_id: int | None = None):
        """Same widths as the target (a Qwen3 config); `num_layers` decoder layers."""
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
        return cls(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                   num_layers=num_layers, target_layers=tuple(target_layer_ids(cfg.num_hidden_layers, num_layers)),
                   vocab_size=cfg.vocab_size,
                   mask_token_id=cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
                   block_size=block_size, rms_eps=getattr(cfg, "rms_norm_eps", 1e-6),
                   rope_theta=float(rope or 1_000_000.0))

    def to_dict(self) -> dict:
        return asdict(self)


# flex_attention's tile (Q and KV): the BlockMask lists, per 128-query tile, the 128-key tiles it must visit.
MASK_TILE = 128


def _mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int):
    """The rule, per element: a query of block j sees context keys < anchors[b, j] and every key of block j."""
    n = anchors.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        anchor = anchors[b, q_block.clamp(max=n - 1)]  # clamp: padded query indices must stay in range
        ctx = (kv_idx < ctx_len) & (kv_idx < anchor)
        own = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == q_block)
        return ctx | own

    return mask_mod


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] 0/1 -> (count per row, column indices listed ones first, ascending): create_block_mask's
    own encoding, so the kernels visit the same tiles in the same order."""
    tiles = tiles.to(torch.int32)
    return tiles.sum(-1, dtype=torch.int32), tiles.argsort(dim=-1, descending=True, stable=True).to(torch.int32)


def dflash_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, device=None) -> BlockMask:
    """BlockMask over Q = N blocks, KV = [context (ctx_len) ; N blocks]; anchors [B, N] (on the device).

    Built from the anchors, never from the dense [B, Q, KV] mask: every query of block j sees exactly two key
    intervals, [0, min(anchor_j, ctx_len)) and block j's own [ctx_len + j*bs, ctx_len + (j+1)*bs), so the
    number of keys a query row sees in a key tile is interval arithmetic over [B, Q, KV/128] (1/128 of the
    dense mask's elements, a handful of small kernels, nothing compiled, no host sync). A tile is full when all
    128 x 128 elements are visible (no padding), partial when some are (flex applies `mask_mod` inside it).
    Equal, tensor for tensor, to create_block_mask over `_mask_mod` (tests/payload/test_dflash_model.py).
    """
    if device is not None and anchors.device != torch.device(device):
        anchors = anchors.to(device)
    b, n = anchors.shape
    bs, t = block_size, MASK_TILE
    q_len, kv_len = n * bs, ctx_len + n * bs
    nq, nk = -(-q_len // t), -(-kv_len // t)
    dev = anchors.device
    q = torch.arange(nq * t, device=dev)  # query rows, padded to whole tiles
    q_block = (q // bs).clamp(max=n - 1)
    ctx_end = anchors.gather(1, q_block.expand(b, -1)).clamp(0, ctx_len)  # [B, R]: context keys [0, ctx_end)
    own_lo = ctx_len + q_block * bs  # [R]: own block's keys [own_lo, own_lo + bs)
    k_lo = torch.arange(nk, device=dev) * t  # key tile [k_lo, k_hi), the part inside KV_LEN
    k_hi = (k_lo + t).clamp(max=kv_len)
    ctx_seen = (torch.minimum(ctx_end[:, :, None], k_hi) - k_lo).clamp(min=0)  # [B, R, nk]
    own_seen = (torch.minimum(own_lo[:, None] + bs, k_hi) - torch.maximum(own_lo[:, None], k_lo)).clamp(min=0)
    seen = (ctx_seen + own_seen) * (q < q_len)[:, None]  # padded rows see nothing
    seen = seen.view(b, 1, nq, t, nk)
    full = (seen == t).all(dim=3)  # [B, 1, nq, nk]
    partial = (seen > 0).any(dim=3) & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(t, t),
                                    mask_mod=_mask_mod(anchors, ctx_len, bs), seq_lengths=(q_len, kv_len),
                                    compute_q_blocks=False)
    # The transposed lists (the backward's) straight from the tile tables, as from_kv_blocks would derive them.
    mask.q_num_blocks, mask.q_indices = _ordered(partial.transpose(-2, -1))
    mask.full_q_num_blocks, mask.full_q_indices = _ordered(full.transpose(-2, -1))
    return mask


def dflash_mask_dense(anchors: torch.Tensor, ctx_len: int, block_size: int, device=None,
                      compiled: bool = False) -> BlockMask:
    """The previous builder: create_block_mask evaluating `_mask_mod` over the dense [B, Q, KV] mask (84M elements
    at 512 anchors x 2048; compiled, minutes of ptxas per new shape). Kept as the tests' and benchmark's reference."""
    n = anchors.shape[1]
    build = compiled_once(create_block_mask) if compiled else create_block_mask
    return build(_mask_mod(anchors, ctx_len, block_size), B=anchors.shape[0], H=None, Q_LEN=n * block_size,
                 KV_LEN=ctx_len + n * block_size, device=device if device is not None else anchors.device)


def dense_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """The same rule as a dense bool tensor [B, Q, KV]: the CPU path (flex has no CPU backward) and tests' reference."""
    n = anchors.shape[1]
    q = torch.arange(n * block_size, device=anchors.device)
    kv = torch.arange(ctx_len + n * block_size, device=anchors.device)
    anchor_of_q = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    ctx = (kv[None, None, :] < ctx_len) & (kv[None, None, :] < anchor_of_q[:, :, None])
    own = (kv[None, :] >= ctx_len) & ((kv[None, :] - ctx_len).div(block_size, rounding_mode="floor")
                                      == (q[:, None] // block_size))
    return ctx | own[None]


def block_loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Weight of block position k: 0 for the anchor (k=0), exp(-(k-1)/gamma) after it."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k == 0, 0.0, torch.exp(-(k - 1) / gamma))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        """Computed in fp32, returned in the input's dtype (bf16 activations stay bf16 under autocast)."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def rope(x, cos, sin):
    """x [B, H, T, D]; cos/sin [B, T, D] (fp32, cast to x's dtype)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None].to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin[:, None].to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps)

    def forward(self, x, ctx, cos, sin, mask: BlockMask | torch.Tensor, compiled: bool):
        b, q_len, _ = x.shape
        d = self.c.head_dim
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], -1, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], -1, d).transpose(1, 2)
        q = rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = rope(k, cos, sin)
        gqa = self.c.num_heads != self.c.num_kv_heads
        if isinstance(mask, BlockMask):
            out = flex_attention_fn(compiled)(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DecoderLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)

    def forward(self, x, ctx, cos, sin, mask, compiled):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask, compiled)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashDrafter(nn.Module):
    """The trainable drafter; `embed_tokens` and `lm_head` are the target's modules, not registered here."""

    def __init__(self, c: DrafterConfig, embed_tokens: nn.Module, lm_head: nn.Module, compiled: bool = False,
                 compile_mode: str = "layers"):
        super().__init__()
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode {compile_mode!r}: expected one of {', '.join(COMPILE_MODES)}")
        self.c = c
        self.compiled = compiled
        self.compile_mode = compile_mode
        self.attn_backend = "auto"  # "flex", "sdpa" (dense mask) or "auto": flex except on CPU
        self.fc = nn.Linear(len(c.target_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        # Borrowed, frozen, outside parameters() and state_dict(): the target owns them.
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "lm_head", lm_head)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.apply(self._init)
        self._context = self._context_eager
        self._ce = _ce_chunk
        if compiled and compile_mode == "layers":
            # Regional compilation: the five layers are one graph compiled once and reused (their parameters
            # are graph inputs), so cold start stays near one layer's compile while every elementwise op
            # (fp32 RMSNorm, RoPE, casts, SiLU*up, residual adds) is fused around the matmuls.
            for layer in self.layers:
                layer.compile(dynamic=False)
            self._context = torch.compile(self._context_eager, dynamic=False)  # bound to this drafter
            self._ce = compiled_once(_ce_chunk)

    @property
    def _flex_in_layer(self) -> bool:
        """Whether Attention must call a separately compiled flex_attention (not when its layer is compiled)."""
        return self.compiled and self.compile_mode == "flex"

    def _context_eager(self, hidden):
        return self.hidden_norm(self.fc(hidden))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def use_flex(self, device) -> bool:
        return self.attn_backend == "flex" or (self.attn_backend == "auto" and torch.device(device).type != "cpu")

    def _rope_tables(self, pos):
        freqs = pos.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                block_size: int | None = None):
        """hidden [B, S, k*H] (target layers, concatenated); input_ids [B, S]; anchors [B, N] sorted.

        Returns the drafter's final hidden states [B, N*bs, H] (no LM head: see `loss`). `block_size` below the
        configured one drafts a shorter block (decoding's last block, cut to the token budget): its mask tokens
        attend to one another, so a shorter block is a different input, not a prefix of the full one's output.
        """
        c = self.c
        b, s = input_ids.shape
        n, bs = anchors.shape[1], block_size or c.block_size
        dev = input_ids.device
        ctx = self._context(hidden)
        noise = torch.full((b, n, bs), c.mask_token_id, dtype=torch.long, device=dev)
        noise[:, :, 0] = torch.gather(input_ids, 1, anchors)
        with torch.no_grad():
            x = self.embed_tokens(noise.view(b, n * bs)).float()  # fp32 residual stream
        offs = torch.arange(bs, device=dev)
        pos = torch.cat([torch.arange(s, device=dev).expand(b, s), (anchors[:, :, None] + offs).view(b, -1)], dim=1)
        cos, sin = self._rope_tables(pos)
        # flex_attention on CUDA; on CPU it has no backward, so SDPA with the same mask, dense.
        mask = dflash_mask(anchors, s, bs) if self.use_flex(dev) else dense_mask(anchors, s, bs)
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, mask, self._flex_in_layer)
        return self.norm(x)

    def loss(self, hidden, input_ids, loss_mask, anchors, keep, chunk_tokens: int = 8192):
        """Weighted CE over the blocks; `keep` [B, N] switches whole blocks off (too few anchors)."""
        c = self.c
        out = self(hidden, input_ids, anchors)
        b, s = input_ids.shape
        n, bs = anchors.shape[1], c.block_size
        idx = anchors[:, :, None] + torch.arange(bs, device=anchors.device)
        inside = idx < s
        idx = idx.clamp(max=s - 1)
        labels = torch.gather(input_ids[:, None, :].expand(b, n, s), 2, idx)
        w = block_loss_weights(bs, c.gamma, anchors.device) * inside * keep[:, :, None]
        w = w * torch.gather(loss_mask[:, None, :].expand(b, n, s), 2, idx).float()
        # Position 0 of a block is its anchor (weight 0): it never reaches the 151,936-wide LM head.
        out = out.view(b, n, bs, -1)[:, :, 1:].reshape(b * n * (bs - 1), -1)
        return weighted_ce(out, self.lm_head, labels[:, :, 1:].reshape(-1), w[:, :, 1:].reshape(-1), chunk_tokens,
                           self._ce)


def _ce_chunk(h, weight, labels, w):
    logits = F.linear(h, weight).float()
    return (F.cross_entropy(logits, labels, reduction="none") * w).sum()


def weighted_ce(h, lm_head: nn.Module, labels, w, chunk_tokens: int, ce=_ce_chunk):
    """sum(w * CE) / sum(w), the LM head applied in checkpointed chunks so [T, vocab] logits never exist at once.

    `ce` is `_ce_chunk` or its compiled form (the drafter's, when compiled)."""
    total = h.new_zeros((), dtype=torch.float32)
    weight = lm_head.weight
    for i in range(0, h.shape[0], chunk_tokens):
        sl = slice(i, i + chunk_tokens)
        if h.requires_grad and h.shape[0] > chunk_tokens:
            total = total + torch.utils.checkpoint.checkpoint(ce, h[sl], weight, labels[sl], w[sl],
                                                              use_reentrant=False)
        else:
            total = total + ce(h[sl], weight, labels[sl], w[sl])
    return total / w.sum().clamp_min(1e-6)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator=None):
    """Up to `num_anchors` sorted anchors per row among positions with loss (1 <= p <= S - bs).

    Fixed shape [B, N] (compile-friendly); rows with fewer candidates repeat position 1 and get keep=False.
    """
    b, s = loss_mask.shape
    valid = loss_mask.bool().clone()
    valid[:, 0] = False
    valid[:, max(1, s - block_size + 1):] = False
    score = torch.rand(b, s, generator=generator, device=loss_mask.device)
    score = torch.where(valid, score, torch.full_like(score, 2.0))
    n = min(num_anchors, s)
    top = score.topk(n, dim=1, largest=False)
    keep = top.values < 2.0
    anchors = torch.where(keep, top.indices, torch.ones_like(top.indices))
    order = torch.where(keep, anchors, torch.full_like(anchors, s)).argsort(dim=1)
    return torch.gather(anchors, 1, order), torch.gather(keep, 1, order)


def param_count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def lr_at(step: int, total: int, peak: float, warmup_ratio: float) -> float:
    """Linear warm-up over warmup_ratio*total steps, then cosine to 10% of the peak."""
    warm = max(1, math.ceil(warmup_ratio * total))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))
