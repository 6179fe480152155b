"""Acceptance length (tau) under greedy verification: an oracle drafter reaches the block size, and a drafter
trained on a tiny target's predictable language clearly beats an untrained one."""

from __future__ import annotations

import time

import pytest
import torch

from remote_payload import dflash_eval as de
from remote_payload import dflash_model as dm

V = 48  # ids 2..41 carry the language; 47 is the MASK


def language(n: int, length: int, g: torch.Generator) -> torch.Tensor:
    """x_{t+1} = x_t + s (mod 40), s in {1, 2, 3} per sequence: predictable once two tokens are seen."""
    x0 = torch.randint(0, 40, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    return 2 + (x0 + step * torch.arange(length)) % 40


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: more threads only spin against each other
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained_target(one_thread):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(80):
        x = language(16, 32, g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval().requires_grad_(False)


def prompts(n=4, length=10):
    return list(language(n, length, torch.Generator().manual_seed(99)))


def test_oracle_drafter_reaches_the_block_size(trained_target):
    """Proposing the target's own greedy continuation: every draft token accepted, tau == block size."""
    for bs in (16, 4):
        r = de.acceptance_length(trained_target, de.target_proposer(trained_target), prompts(2), [1], bs,
                                 max_new_tokens=33)
        # 1 token from the prompt's read, then 32 more in blocks of bs
        assert r.tau == bs and r.blocks == 2 * (32 // bs) and set(r.per_block) == {bs}


def test_the_last_block_counts_only_the_tokens_within_the_budget(trained_target):
    """As z-lab's dflash_generate counts it: 20 new tokens are 1 from the prompt's read, a block of 16, then 3 of
    the next block (its verify step cut to the budget there), not a second 16 past max_new_tokens."""
    r = de.acceptance_length(trained_target, de.target_proposer(trained_target), prompts(1), [1], 16,
                             max_new_tokens=20)
    assert r.per_block == [16, 3] and r.tokens == 20 and r.tau == 9.5


def test_the_last_block_is_drafted_cut_to_the_budget(trained_target):
    """The reference drafts its last verify step at the budget's size (verify_size = min(block, what is left)):
    the drafter's mask tokens see one another, so 3 drafts of a 4-token block differ from the first 3 of a 16-token
    block, and accept_len must ask for the 3."""
    asked = []
    oracle = de.target_proposer(trained_target)

    def recording(feats, seq, n):
        asked.append(n)
        return oracle(feats, seq, n)

    r = de.acceptance_length(trained_target, recording, prompts(1), [1], 16, max_new_tokens=20)
    assert asked == [15, 3] and r.per_block == [16, 3]


def test_a_wrong_drafter_gets_only_the_bonus_token(trained_target):
    """Drafts the target never agrees with: each block yields 1 token (the target's own): tau == 1."""
    def contrary(feats, seq, n):
        return torch.full((1, n), 45, dtype=torch.long)  # never produced: the language stays in 2..41

    r = de.acceptance_length(trained_target, contrary, prompts(2), [1], 16, max_new_tokens=9)
    assert r.tau == 1.0 and r.blocks == 2 * 8


def test_stop_token_ends_a_block_and_the_prompt(trained_target):
    p = prompts(1)[0]
    greedy = de.target_proposer(trained_target)(None, p.view(1, -1), 15)[0]
    stop = int(greedy[4])  # greedy[0] is read off the prompt's pass; the first block drafts greedy[1:]
    r = de.acceptance_length(trained_target, de.target_proposer(trained_target), [p], [1], 16,
                             max_new_tokens=64, stop_ids=[stop])
    first = [int(t) for t in greedy].index(stop)  # it may occur earlier than position 4
    assert first >= 1 and r.blocks == 1 and r.per_block == [first]  # greedy[1..first], the stop included


@pytest.mark.slow
def test_trained_drafter_beats_untrained(trained_target, capsys):
    t0 = time.time()
    cfg = dm.DrafterConfig.from_target(trained_target.config, 2, 16)
    torch.manual_seed(1)
    d = dm.DFlashDrafter(cfg, trained_target.get_input_embeddings(), trained_target.get_output_embeddings())
    evals = prompts(4)
    before = de.acceptance_length(trained_target, de.drafter_proposer(d.eval()), evals, cfg.target_layers, 16, 24)
    d.train()
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    for _ in range(300):
        x = language(8, 40, g)
        with torch.no_grad():
            out = trained_target.model(input_ids=x, output_hidden_states=True)
        hs = de.context_features(out, cfg.target_layers)
        anchors, keep = dm.sample_anchors(torch.ones_like(x), 6, 16, g)
        d.loss(hs, x, torch.ones_like(x), anchors, keep).backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    after = de.acceptance_length(trained_target, de.drafter_proposer(d.eval()), evals, cfg.target_layers, 16, 24)
    with capsys.disabled():
        print(f"\ntau untrained={before.tau:.2f} ({before.blocks} blocks)  trained={after.tau:.2f} "
              f"({after.blocks} blocks)  {time.time() - t0:.0f}s")
    assert before.tau < 2.0
    assert after.tau > 4.0 and after.tau > 3 * before.tau
