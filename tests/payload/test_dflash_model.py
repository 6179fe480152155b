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
    torch.manual_seed(1)  # the drafter's own weights: else whatever the tests before it left the generator at
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
    # Two CPU kernels, two summation orders: here they differ by ~6e-7 of the output's scale, on CI's machine by up
    # to 2e-4 of it (outputs ~2.5, 5e-4 apart). A position masked wrongly moves outputs by tenths.
    assert (a - b).abs().max() <= 1e-3 * b.abs().max(), ((a - b).abs().max(), b.abs().max())


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


MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def effective_mask(mask, q_len, kv_len):
    """What a flex kernel computes from a BlockMask: full tiles visible, partial tiles through mask_mod, the rest
    hidden; [B, q_len, kv_len]."""
    qb, kb = mask.BLOCK_SIZE
    b = mask.kv_num_blocks.shape[0]
    tiles = torch.zeros(b, mask.kv_indices.shape[-2], mask.kv_indices.shape[-1], dtype=torch.long)
    for num, idx, kind in ((mask.kv_num_blocks, mask.kv_indices, 1), (mask.full_kv_num_blocks, mask.full_kv_indices,
                                                                     2)):
        for bi in range(b):
            for qt in range(idx.shape[-2]):
                cols = idx[bi, 0, qt, : int(num[bi, 0, qt])].long()
                assert (tiles[bi, qt, cols] == 0).all()  # a tile is listed once, as partial or as full
                tiles[bi, qt, cols] = kind
    per_elem = tiles.repeat_interleave(qb, 1).repeat_interleave(kb, 2)[:, :q_len, :kv_len]
    bi = torch.arange(b)[:, None, None]
    inner = mask.mask_mod(bi, torch.zeros(1, dtype=torch.long), torch.arange(q_len)[None, :, None],
                          torch.arange(kv_len)[None, None, :])
    return (per_elem == 2) | ((per_elem == 1) & inner)


@pytest.mark.parametrize(("b", "s", "n", "bs"), [
    (2, 40, 3, 4),  # everything inside one tile, Q and KV padded
    (3, 200, 9, 16),  # context not a multiple of 128: blocks' keys straddle a tile
    (2, 256, 8, 16),  # whole tiles, no padding
    (1, 517, 20, 5),  # block size that does not divide 128
    (2, 300, 16, 32),
    (1, 64, 2, 200),  # blocks larger than a tile
])
def test_anchor_built_mask_equals_create_block_mask(b, s, n, bs):
    """dflash_mask (interval arithmetic over the anchors) against the previous create_block_mask over the dense
    mask: the same eight tile tables, tensor for tensor (so the kernels visit the same tiles in the same order),
    and element for element the dense rule, for random, also unsorted and repeated, anchors."""
    g = torch.Generator().manual_seed(b * 1000 + s)
    for trial in range(3):
        if trial == 0:
            anchors, _ = dm.sample_anchors((torch.rand(b, s, generator=g) > 0.3).long(), n, min(bs, s - 2), g)
        else:
            anchors = torch.randint(0, s + 1, (b, n), generator=g)
        new = dm.dflash_mask(anchors, s, bs)
        old = dm.dflash_mask_dense(anchors, s, bs)
        assert new.seq_lengths == old.seq_lengths and new.BLOCK_SIZE == old.BLOCK_SIZE
        for name in MASK_FIELDS:
            x, y = getattr(new, name), getattr(old, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert torch.equal(effective_mask(new, n * bs, s + n * bs), dm.dense_mask(anchors, s, bs))


def test_anchor_built_mask_at_the_recipes_shape_is_cheap():
    """512 anchors over 2,048 tokens: the dense mask has 84M elements, the tile tables 64 x 80."""
    anchors, _ = dm.sample_anchors(torch.ones(1, 2048), 512, 16, torch.Generator().manual_seed(0))
    mask = dm.dflash_mask(anchors, 2048, 16)
    assert mask.kv_indices.shape == (1, 1, 64, 80) and mask.q_indices.shape == (1, 1, 80, 64)
    # each 128-query tile (8 blocks) visits its context tiles up to its last anchor and one tile of its own keys
    visits = mask.kv_num_blocks + mask.full_kv_num_blocks
    last = anchors.view(8 * 8, 8)[:, -1]
    assert torch.equal(visits[0, 0], (last + 127) // 128 + 1)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """flex_attention refuses a CPU backward up front; its eager (math) path computes one. The tile tables are
    not used there (checked above, tensor for tensor), the mask_mod is."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)


def test_drafter_outputs_and_gradients_match_the_previous_mask(target, flex_backward_on_cpu, monkeypatch):
    """The drafter's loss and gradients through flex_attention with the anchor-built mask equal those with the
    previous create_block_mask builder exactly, and the dense SDPA path's to fp32 rounding."""
    cfg = dm.DrafterConfig.from_target(target.config, 2, 16)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(2, 1000, (2, 160), generator=g)
    lm = (torch.rand(2, 160, generator=g) > 0.2).long()
    anchors, keep = dm.sample_anchors(lm, 7, 16, g)
    hs = torch.randn(2, 160, len(cfg.target_layers) * 256, generator=g)
    results = {}
    for name in ("anchors", "dense", "sdpa"):
        torch.manual_seed(0)
        d = dm.DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())
        d.attn_backend = "sdpa" if name == "sdpa" else "flex"
        with monkeypatch.context() as m:
            if name == "dense":
                m.setattr(dm, "dflash_mask", dm.dflash_mask_dense)
            loss = d.loss(hs, ids, lm, anchors, keep)
            loss.backward()
        results[name] = (loss.detach(), [p.grad.clone() for p in d.parameters()])
    (la, ga), (ld, gd), (ls, gs) = results["anchors"], results["dense"], results["sdpa"]
    assert torch.equal(la, ld) and all(torch.equal(x, y) for x, y in zip(ga, gd, strict=True))
    assert torch.allclose(la, ls, rtol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(ga, gs, strict=True))
