"""Acceptance length (tau) of a DFlash drafter under greedy verification by its target.

Decoding as DFlash does it (z-lab/dflash `dflash_generate`, temperature 0): the target reads the prompt and
picks the first new token greedily; then, per block, the drafter fills [last token, MASK x (bs-1)] in one
forward conditioned on the target's hidden states of everything before that last token, the target runs
once over [context ; block] and its argmax at each block position is its own next token. The drafted tokens
that agree with it, up to the first disagreement, are accepted; the target's token after them is kept too
(the bonus token). Convention (the reference's): a block counts `accepted + 1` tokens, so tau is in
[1, block_size], 1 meaning no draft token ever accepted and block_size every one (a perfect drafter). A block
cut short by a stop token counts the tokens up to and including it; decoding of a prompt ends there or after
`max_new_tokens`, the last block drafted cut to that budget and counting only the tokens within it (z-lab's
`dflash_generate` does the same: tests/payload/test_export_reference.py checks the two measures against each other).

The target here is a full causal LM (with its LM head), run without a KV cache (simple, exact; eval is short).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# (features [1, P, kH] of positions < P, tokens [1, P + 1], n) -> n draft tokens [1, n], n <= block_size - 1
Proposer = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class EvalResult:
    tau: float  # mean tokens per block (accepted draft tokens + 1 bonus)
    blocks: int
    tokens: int  # tokens produced in all
    per_block: list[int]


def context_features(out, layer_ids: Sequence[int]) -> torch.Tensor:
    """Hidden states of the drafter's target layers, concatenated; layer i is hidden_states[i + 1]."""
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def drafter_proposer(drafter) -> Proposer:
    """The drafter's greedy block of n drafts: [last token, MASK x n] (n + 1 = the block size, or fewer in the
    last block of a prompt, as the reference drafts it).

    Runs eagerly with a dense mask (`set_stance('force_eager')`: compiled regions of a --compile drafter are
    traced for the training shapes only and would recompile for every eval length)."""

    def propose(feats: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
        p = seq.shape[1] - 1
        hidden = torch.cat([feats, feats.new_zeros(1, 1, feats.shape[-1])], dim=1)  # position p: never seen
        anchors = torch.tensor([[p]], device=seq.device)
        backend = drafter.attn_backend
        drafter.attn_backend = "sdpa"
        stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") \
            else contextlib.nullcontext()
        try:
            with stance:
                h = drafter(hidden.to(feats.dtype), seq, anchors, block_size=n + 1)
        finally:
            drafter.attn_backend = backend
        return drafter.lm_head(h[:, 1:].to(drafter.lm_head.weight.dtype)).argmax(-1)

    return propose


def target_proposer(target) -> Proposer:
    """An oracle: the target's own greedy continuation (what a perfect drafter would propose)."""

    def propose(feats: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
        s = seq
        for _ in range(n):
            nxt = target(input_ids=s, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            s = torch.cat([s, nxt], dim=1)
        return s[:, seq.shape[1]:]

    return propose


@torch.no_grad()
def acceptance_length(target, propose: Proposer, prompts: Sequence[torch.Tensor], layer_ids: Sequence[int],
                      block_size: int = 16, max_new_tokens: int = 64, stop_ids: Sequence[int] = ()) -> EvalResult:
    """tau over `prompts` (1-D token tensors on the target's device), greedy verification by `target`."""
    per_block: list[int] = []
    produced_total = 0
    for prompt in prompts:
        seq = prompt.view(1, -1)
        out = target(input_ids=seq, output_hidden_states=True, use_cache=False)
        feats = context_features(out, layer_ids)  # positions 0 .. P-1
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, first], dim=1)
        produced = 1
        stopped = int(first) in stop_ids
        while produced < max_new_tokens and not stopped:
            start = seq.shape[1] - 1  # the last token: the block's anchor, its hidden state not yet computed
            # The last block of a prompt is drafted cut to the budget, as the reference's verify step is there: n
            # drafts, and of them and the bonus token it counts only what fits within max_new_tokens.
            n = min(block_size - 1, max_new_tokens - produced)
            draft = propose(feats, seq, n).to(seq.dtype)
            block = torch.cat([seq[:, start:], draft], dim=1)  # [1, n + 1]
            out = target(input_ids=torch.cat([seq[:, :start], block], dim=1), output_hidden_states=True,
                         use_cache=False)
            posterior = out.logits[0, start:start + n + 1].argmax(-1)  # the target's token after each
            agree = (draft[0] == posterior[:-1]).long().cumprod(0)
            accepted = int(agree.sum())
            new = torch.cat([draft[0, :accepted], posterior[accepted:accepted + 1]])[: max_new_tokens - produced]
            hits = [i for i, t in enumerate(new.tolist()) if t in stop_ids]
            if hits:
                new, stopped = new[: hits[0] + 1], True
            per_block.append(len(new))
            produced += len(new)
            # The block's accepted positions (anchor + accepted drafts) now have exact target hidden states.
            feats = torch.cat([feats, context_features(out, layer_ids)[:, start:start + accepted + 1]], dim=1)
            seq = torch.cat([seq, new.view(1, -1)], dim=1)
        produced_total += produced
    tau = sum(per_block) / len(per_block) if per_block else float("nan")
    return EvalResult(tau=tau, blocks=len(per_block), tokens=produced_total, per_block=per_block)
