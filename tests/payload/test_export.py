"""Export to the reference DFlash layout (z-lab/dflash `DFlashDraftModel`): tensor names and shapes against a
table derived from the reference's modules, config fields as published drafters carry them, and a round trip
that gives the same logits. Full and weights-only checkpoints both export; a damaged one is refused."""

from __future__ import annotations

import json

import pytest
import torch

from remote_payload import dflash_ckpt as ck
from remote_payload import dflash_export as ex
from remote_payload import dflash_model as dm

TINY = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000}


def reference_table(c: dm.DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the reference's state dict, read off its modules: DFlashDraftModel has fc
    (Linear k*H -> H, no bias), hidden_norm and norm (RMSNorm H), and per decoder layer self_attn with
    q/k/v/o_proj (no bias) and q_norm/k_norm (RMSNorm head_dim), mlp (Qwen3MLP: gate/up H -> I, down I -> H),
    input_layernorm and post_attention_layernorm; rotary inv_freq is a non-persistent buffer."""
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    table = {"fc.weight": (h, len(c.target_layers) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(c.num_layers):
        p = f"layers.{n}."
        table.update({
            p + "self_attn.q_proj.weight": (c.num_heads * d, h), p + "self_attn.k_proj.weight": (c.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (c.num_kv_heads * d, h), p + "self_attn.o_proj.weight": (h, c.num_heads * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    return table


def test_names_and_shapes_follow_the_reference_for_qwen3_8b():
    from transformers import Qwen3Config

    c = dm.DrafterConfig.from_target(Qwen3Config(**QWEN3_8B), 5, 16, mask_token_id=151669)
    with torch.device("meta"):
        d = dm.DFlashDrafter(c, None, None)
    ours = {k: tuple(v.shape) for k, v in ex.to_reference(d.state_dict()).items()}
    assert ours == reference_table(c)
    assert len(ours) == 3 + 11 * 5 and ours["fc.weight"] == (4096, 5 * 4096)
    assert ex.from_reference(ex.to_reference(d.state_dict())).keys() == d.state_dict().keys()


def test_config_carries_what_published_drafters_carry():
    """The fields of z-lab's Qwen3-8B drafter (and SpecForge's qwen3-8b-dflash.json) for the same widths."""
    from transformers import Qwen3Config

    c = dm.DrafterConfig.from_target(Qwen3Config(**QWEN3_8B), 5, 16, mask_token_id=151669)
    cfg = ex.export_config(c, 36, torch.bfloat16, {"target": "Qwen/Qwen3-8B", "target_sha256": "ab" * 32,
                                                    "eos_token_ids": [151645]}, {"step": 7})
    expect = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "hidden_size": 4096,
              "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "num_hidden_layers": 5, "num_target_layers": 36, "vocab_size": 151936, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "tie_word_embeddings": False, "dtype": "bfloat16", "eos_token_id": 151645}
    assert {k: cfg[k] for k in expect} == expect
    assert cfg["dflash_config"] == {"block_size": 16, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert cfg["dflash_training"]["target_sha256"] == "ab" * 32 and cfg["dflash_training"]["step"] == 7
    Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})  # loads as one


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(Qwen3Config(**TINY), dtype=torch.float32).eval()
    c = dm.DrafterConfig.from_target(target.config, 2, 16)
    torch.manual_seed(1)
    d = dm.DFlashDrafter(c, target.get_input_embeddings(), target.get_output_embeddings())
    with torch.no_grad():  # weights that are not their init values (norms start at 1)
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return target, d


def logits(target, d):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 1000, (1, 40), generator=g)
    hs = torch.randn(1, 40, len(d.c.target_layers) * 256, generator=g)
    with torch.no_grad():
        return target.get_output_embeddings()(d(hs, ids, torch.tensor([[5, 20]])))


def full_checkpoint(tmp_path, d, step=3):
    opt = torch.optim.AdamW(d.parameters())
    prov = {"target": "tiny", "target_sha256": "cd" * 32, "target_num_layers": 8}
    return ck.save_full(tmp_path / "checkpoints", step, d, opt, scheduler={}, data={}, args={"model": "tiny"},
                        provenance=prov)


def test_full_checkpoint_round_trip_gives_the_same_logits(tiny, tmp_path):
    target, d = tiny
    path = full_checkpoint(tmp_path, d)
    assert ex.main([str(tmp_path), str(tmp_path / "out"), "--dtype", "float32"]) == 0  # the run dir: newest step
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dflash_training"]["checkpoint"] == str(path) and cfg["num_target_layers"] == 8
    assert cfg["dflash_training"]["target_sha256"] == "cd" * 32
    back = ex.load_exported(str(tmp_path / "out"), target.get_input_embeddings(), target.get_output_embeddings())
    assert torch.equal(logits(target, back), logits(target, d))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == reference_table(d.c)


def test_weights_only_checkpoint_exports_too_in_bf16(tiny, tmp_path):
    target, d = tiny
    old = tmp_path / "step_5.pt"
    torch.save({"step": 5, "drafter": d.state_dict(), "config": d.c.to_dict(), "args": {"model": "tiny"}}, old)
    assert ex.main([str(old), str(tmp_path / "out")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["num_target_layers"] == 8 and cfg["dflash_training"]["step"] == 5
    back = ex.load_exported(str(tmp_path / "out"), target.get_input_embeddings(), target.get_output_embeddings())
    assert torch.allclose(logits(target, back), logits(target, d), atol=0.1)  # bf16 weights


def test_damaged_checkpoint_is_refused_in_one_line(tiny, tmp_path, capsys):
    _, d = tiny
    path = full_checkpoint(tmp_path, d)
    with open(path / ck.WEIGHTS, "ab") as f:
        f.write(b"x")
    assert ex.main([str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drafter.pt sha256" in err[0] and err[0].endswith("refused")
    (path / ck.MANIFEST).unlink()
    assert ex.main([str(path), str(tmp_path / "out")]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_step_metrics_and_summary_for_ctl(tiny, tmp_path, capsys):
    """What `ctl export` runs: --step N of a run directory (one line naming the steps there when N is not one),
    the loss and accept_len of metrics.jsonl at that step (else the last before it), one JSON line summing up."""
    import hashlib

    _, d = tiny
    full_checkpoint(tmp_path, d, step=3)
    full_checkpoint(tmp_path, d, step=6)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 2, "loss": 4.0, "accept_len": 1.5}, {"step": 3, "loss": 3.0}, {"step": 5, "loss": 2.0},
        {"step": 6, "loss": 1.0, "accept_len": 7.25})) + '{"step": 7, "loss"')  # a line cut short by a crash
    assert ex.main([str(tmp_path), str(tmp_path / "out"), "--step", "3", "--metrics", str(metrics), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["ok"] and doc["step"] == 3 and doc["checkpoint"].endswith("checkpoints/step_3")
    assert doc["metrics"] == {"loss": 3.0, "loss_step": 3, "accept_len": 1.5, "accept_len_step": 2}
    assert doc["provenance"]["target_sha256"] == "cd" * 32 and doc["dtype"] == "bfloat16"
    for name in ("config.json", "model.safetensors"):
        data = (tmp_path / "out" / name).read_bytes()
        assert doc["files"][name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert ex.main([str(tmp_path / "checkpoints"), str(tmp_path / "o2"), "--metrics", str(metrics), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["step"] == 6 and doc["metrics"] == {"loss": 1.0, "loss_step": 6, "accept_len": 7.25,
                                                    "accept_len_step": 6}
    assert ex.main([str(tmp_path), str(tmp_path / "o3"), "--step", "4", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("no step 4 (steps there: 3, 6)") and not (tmp_path / "o3").exists()
    (tmp_path / "full").write_text("")  # OUTDIR under a file: cannot be written, one line
    assert ex.main([str(tmp_path), str(tmp_path / "full" / "out"), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: writing {tmp_path / 'full' / 'out'}: ")
