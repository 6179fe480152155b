"""The drafter's pieces: the BlockMask against a dense reference, loss weights, borrowed embedding/LM head."""

from __future__ import annotations

import math

import pytest
import torch

from remote_payload import dflash_model as dm

TINY = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(**TINY), dtype=torch.float32).eval()


def drafter_for(target, layers=2, bs=16):
    cfg = dm.DrafterConfig.from_target(target.config, layers, bs)
    return dm.DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())


def test_target_layers_spread_from_1_to_l_minus_3():
    assert dm.target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as in the paper
    assert dm.target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert dm.target_layer_ids(64, 10)[0] == 1 and dm.target_layer_ids(64, 10)[-1] == 61


def reference(anchors, s, bs, b, q, kv):
    """The rule, spelled out one element at a time."""
    if kv < s:
        return kv < anchors[b][q // bs]
    return (kv - s) // bs == q // bs


@pytest.mark.parametrize(("s", "n", "bs"), [(40, 3, 4), (64, 5, 16), (200, 9, 16)])
def test_block_mask_matches_dense_reference(s, n, bs):
    g = torch.Generator().manual_seed(s)
    anchors, _ = dm.sample_anchors(torch.ones(2, s), n, bs, g)
    dense = dm.dense_mask(anchors, s, bs)
    # The dense tensor against the rule, element by element (a sample of them for the big case).
    for b in range(2):
        for q in range(0, n * bs, 3):
            for kv in range(0, s + n * bs, 5):
                assert bool(dense[b, q, kv]) == reference(anchors.tolist(), s, bs, b, q, kv)
    mask = dm.dflash_mask(anchors, s, bs, "cpu")
    bi = torch.arange(2)[:, None, None]
    qi = torch.arange(n * bs)[None, :, None]
    ki = torch.arange(s + n * bs)[None, None, :]
    assert torch.equal(mask.mask_mod(bi, torch.zeros(1, dtype=torch.long), qi, ki), dense)
    # Block-level sparsity: a (128 x 128) tile is listed iff some element in it is visible.
    blocks = mask.to_dense()[:, 0].bool()  # [B, q tiles, kv tiles]
    qb, kb = mask.BLOCK_SIZE
    pad = torch.zeros(2, blocks.shape[1] * qb, blocks.shape[2] * kb, dtype=torch.bool)
    pad[:, : n * bs, : s + n * bs] = dense
    tiles = pad.view(2, blocks.shape[1], qb, blocks.shape[2], kb).any(dim=(2, 4))
    assert torch.equal(blocks, tiles)


def test_block_is_bidirectional_and_blocks_are_isolated():
    anchors = torch.tensor([[5, 9]])
    m = dm.dense_mask(anchors, 12, 4)[0]
    assert m[0, 12:16].all() and m[3, 12:16].all()  # every key of its own block, also later positions
    assert not m[0, 16:20].any() and not m[4, 12:16].any()  # never another block
    assert m[0, :5].all() and not m[0, 5:12].any()  # context strictly before its anchor
    assert m[4, :9].all() and not m[4, 9:12].any()


def test_flex_attention_equals_dense_sdpa(target):
    d = drafter_for(target)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 1000, (2, 96), generator=g)
    anchors, _ = dm.sample_anchors(torch.ones_like(ids), 4, 16, g)
    hs = torch.randn(2, 96, 2 * 256, generator=g)
    with torch.no_grad():
        d.attn_backend = "flex"
        a = d(hs, ids, anchors)
        d.attn_backend = "sdpa"
        b = d(hs, ids, anchors)
    assert (a - b).abs().max() < 1e-4


def test_loss_weights_decay_with_gamma():
    w = dm.block_loss_weights(16, 7.0)
    assert w[0] == 0  # the anchor itself is given, not predicted
    assert w[1] == pytest.approx(1.0)
    for k in range(1, 16):
        assert w[k] == pytest.approx(math.exp(-(k - 1) / 7.0))


def test_weighted_ce_is_the_weighted_mean_and_chunking_changes_nothing():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(50, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 30, bias=False)
    labels = torch.randint(0, 30, (50,), generator=g)
    w = torch.rand(50, generator=g)
    per = torch.nn.functional.cross_entropy(head(h), labels, reduction="none")
    expect = (per * w).sum() / w.sum()
    whole = dm.weighted_ce(h, head, labels, w, 1000)
    chunked = dm.weighted_ce(h, head, labels, w, 7)
    assert whole.item() == pytest.approx(expect.item(), rel=1e-5)
    assert chunked.item() == pytest.approx(expect.item(), rel=1e-5)
    (ga,) = torch.autograd.grad(chunked, h)
    (gb,) = torch.autograd.grad(expect, h)
    assert torch.allclose(ga, gb, atol=1e-6)


def test_loss_masks_positions_past_the_end_and_dropped_blocks(target):
    d = drafter_for(target)
    ids = torch.randint(2, 1000, (1, 40))
    anchors = torch.tensor([[30, 35]])  # the second block runs past the sequence's end
    keep = torch.tensor([[True, False]])
    hs = torch.randn(1, 40, 2 * 256)
    loss = d.loss(hs, ids, torch.ones_like(ids), anchors, keep)
    assert torch.isfinite(loss)


def test_drafter_borrows_the_targets_embedding_and_lm_head(target):
    d = drafter_for(target)
    assert d.embed_tokens is target.get_input_embeddings()
    assert d.lm_head is target.get_output_embeddings()
    assert not any(isinstance(m, torch.nn.Embedding) for m in d.modules())
    vocab_shaped = [n for n, p in d.named_parameters() if 1024 in p.shape]
    assert vocab_shaped == []
    assert not any(k.startswith(("embed", "lm_head")) for k in d.state_dict())
    before = target.get_input_embeddings().weight.clone()
    target.requires_grad_(False)
    ids = torch.randint(2, 1000, (1, 48))
    anchors, keep = dm.sample_anchors(torch.ones_like(ids), 2, 16)
    d.loss(torch.randn(1, 48, 2 * 256), ids, torch.ones_like(ids), anchors, keep).backward()
    assert target.get_input_embeddings().weight.grad is None
    assert torch.equal(before, target.get_input_embeddings().weight)
    assert d.fc.weight.grad is not None


def test_sample_anchors_are_sorted_in_range_and_on_loss_positions():
    mask = torch.zeros(3, 64)
    mask[0, 10:40] = 1
    mask[1] = 1
    mask[2, 5:8] = 1  # only 3 candidates for 8 anchors
    anchors, keep = dm.sample_anchors(mask, 8, 16, torch.Generator().manual_seed(0))
    assert anchors.shape == keep.shape == (3, 8)
    for row in range(3):
        kept = anchors[row][keep[row]]
        assert torch.all(kept[1:] > kept[:-1])
        assert torch.all((kept >= 1) & (kept <= 64 - 16))
        assert torch.all(mask[row, kept] == 1)
    assert keep[2].sum() == 3 and keep[0].all() and keep[1].all()


def test_lr_warms_up_then_decays():
    lrs = [dm.lr_at(s, 100, 6e-4, 0.04) for s in range(100)]
    assert lrs[0] < lrs[3] == pytest.approx(6e-4)
    assert lrs[-1] < lrs[50] < lrs[4]


def test_the_anchor_position_never_reaches_the_lm_head_and_the_loss_is_unchanged(target):
    """loss() drops block position 0 (weight 0) before the LM head: same value as the CE over every position."""
    d = drafter_for(target)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 1000, (2, 64), generator=g)
    anchors, keep = dm.sample_anchors(torch.ones_like(ids), 3, 16, g)
    hs = torch.randn(2, 64, 2 * 256, generator=g)
    rows = []

    def counting_ce(h, weight, labels, w):
        rows.append(h.shape[0])
        return dm._ce_chunk(h, weight, labels, w)

    d._ce = counting_ce
    loss = d.loss(hs, ids, torch.ones_like(ids), anchors, keep)
    assert rows == [2 * 3 * 15]  # 3 blocks of 16 in 2 rows, the anchor of each left out
    out = d(hs, ids, anchors).reshape(2 * 3 * 16, -1)
    idx = (anchors[:, :, None] + torch.arange(16)).clamp(max=63)
    labels = torch.gather(ids[:, None, :].expand(2, 3, 64), 2, idx).reshape(-1)
    w = (dm.block_loss_weights(16, d.c.gamma) * keep[:, :, None] * (anchors[:, :, None] + torch.arange(16) < 64))
    every = dm.weighted_ce(out, d.lm_head, labels, w.reshape(-1).float(), 8192)
    assert loss.item() == pytest.approx(every.item(), rel=1e-5)


def test_unknown_compile_mode_is_refused(target):
    cfg = dm.DrafterConfig.from_target(target.config, 1, 16)
    with pytest.raises(ValueError, match="compile_mode 'whole'"):
        dm.DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings(), compile_mode="whole")


def test_compiled_block_mask_equals_the_eager_one():
    g = torch.Generator().manual_seed(3)
    for _ in range(2):  # the second call reuses the compiled graph (new anchors, same shapes)
        anchors, _keep = dm.sample_anchors(torch.ones(2, 256, dtype=torch.long), 8, 16, g)
        eager = dm.dflash_mask(anchors, 256, 16, "cpu", compiled=False)
        comp = dm.dflash_mask(anchors, 256, 16, "cpu", compiled=True)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(eager, name), getattr(comp, name)), name


def test_regionally_compiled_drafter_matches_eager(target):
    """compile_mode='layers' (what --compile runs on a GPU) gives the eager loss and gradients, through the
    checkpointed LM-head chunks too; on CPU through the SDPA path, as torch.compile runs anywhere."""
    cfg = dm.DrafterConfig.from_target(target.config, 1, 16)
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 1000, (2, 48), generator=g)
    anchors, keep = dm.sample_anchors(torch.ones_like(ids), 2, 16, g)
    hs = torch.randn(2, 48, len(cfg.target_layers) * 256, generator=g)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        d = dm.DFlashDrafter(cfg, emb, head, compiled=compiled)
        assert d.compile_mode == "layers"
        # 60 LM-head rows in chunks of 32 and 28: the checkpointed path (a big run's) with the compiled loss
        loss = d.loss(hs, ids, torch.ones_like(ids), anchors, keep, chunk_tokens=32)
        loss.backward()
        results.append((loss.item(), d.fc.weight.grad.clone(), d.layers[0].down_proj.weight.grad.clone()))
    (l0, f0, g0), (l1, f1, g1) = results
    assert l1 == pytest.approx(l0, rel=1e-5)
    assert torch.allclose(f0, f1, atol=1e-5) and torch.allclose(g0, g1, atol=1e-5)


def test_large_block_masks_are_built_eagerly(monkeypatch):
    """Only masks up to MASK_COMPILE_MAX_ELEMENTS go through the compiled builder (the sizes measured)."""
    asked = []
    real = dm._block_mask_builder
    monkeypatch.setattr(dm, "_block_mask_builder", lambda compiled: asked.append(compiled) or real(False))
    small, _ = dm.sample_anchors(torch.ones(2, 256, dtype=torch.long), 8, 16, torch.Generator().manual_seed(0))
    dm.dflash_mask(small, 256, 16, "cpu", compiled=True)  # 2 x 128 x 384 elements
    monkeypatch.setattr(dm, "MASK_COMPILE_MAX_ELEMENTS", 2 * 128 * 384 - 1)
    dm.dflash_mask(small, 256, 16, "cpu", compiled=True)
    assert asked == [True, False]
