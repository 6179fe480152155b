#!/usr/bin/env python3
"""Export a trained drafter in the layout of the DFlash reference implementation (z-lab/dflash,
`DFlashDraftModel`; the same layout SpecForge trains and SGLang / vLLM load):

    python dflash_export.py CKPT OUTDIR [--dtype bfloat16|float16|float32] [--num-target-layers N] [--step N]
                            [--metrics RUN_DIR/metrics.jsonl] [--json]

CKPT: a full checkpoint (checkpoints/step_N/, its manifest verified), a run's checkpoints/ or run directory
(the newest one, or step N with --step), or a weights-only checkpoints/step_N.pt. OUTDIR gets:
  config.json        Qwen3-style config: architectures ["DFlashDraftModel"], widths, num_hidden_layers (drafter
                     layers), num_target_layers, block_size and dflash_config {block_size, mask_token_id,
                     target_layer_ids}; plus "dflash_training": target name and sha256, tokenizer/data sha256,
                     checkpoint path, step and sha256.
  model.safetensors  fc, hidden_norm, norm and per layer self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
                     mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm (no embedding, no LM head:
                     the target's are used, as in training).
--metrics: the run's metrics.jsonl; the loss and accept_len logged at the exported step (else the last ones
before it, with the step they were logged at) go into the summary. --json: one JSON line on stdout summing up
what was written (step, checkpoint, each file's sha256 and size, the training provenance, those metrics): what
`ctl export` reads, checks the copied files against, and keeps beside them.
Exit 0; 2 with one `error: ...` line for a checkpoint that cannot be used or an OUTDIR that cannot be written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dflash_ckpt as ck
import dflash_model as dm

ARCHITECTURE = "DFlashDraftModel"
_MLP = re.compile(r"^layers\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MLP_REF = re.compile(r"^layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
SYNTHETIC_LAYERS = {"tiny": 8, "1b": 14}  # the pipeline's random targets (train_dflash_pipeline.TINY / ONE_B)


class OutputError(ValueError):
    """OUTDIR could not be written, said in one line."""


def to_reference(state: dict) -> dict:
    """Our parameter names -> the reference's (its MLP sits in a `mlp` submodule; everything else matches)."""
    return {_MLP.sub(r"layers.\1.mlp.\2.weight", k): v for k, v in state.items()}


def from_reference(state: dict) -> dict:
    return {_MLP_REF.sub(r"layers.\1.\2.weight", k): v for k, v in state.items()}


def export_config(c: dm.DrafterConfig, num_target_layers: int, dtype: torch.dtype, provenance: dict,
                  source: dict) -> dict:
    dtype_name = str(dtype).split(".")[-1]
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": c.block_size,
        "dflash_config": {"block_size": c.block_size, "mask_token_id": c.mask_token_id,
                          "target_layer_ids": list(c.target_layers)},
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "layer_types": ["full_attention"] * c.num_layers,
        "max_position_embeddings": provenance.get("target_max_position_embeddings") or 40960,
        "max_window_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_kv_heads,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": c.rms_eps,
        "rope_scaling": None,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": c.vocab_size,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    eos = provenance.get("eos_token_ids") or []
    if eos:
        cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    cfg["dflash_training"] = {
        "target": provenance.get("target"), "target_sha256": provenance.get("target_sha256"),
        "tokenizer_sha256": provenance.get("tokenizer_sha256"), "data_sha256": provenance.get("data_sha256"),
        "checkpoint": source.get("path"), "checkpoint_kind": source.get("kind"), "step": source.get("step"),
        "checkpoint_sha256": source.get("sha256"), "loss_gamma": c.gamma,
    }
    return cfg


def num_target_layers_of(meta: dict, override: int | None) -> int:
    if override:
        return override
    prov = meta.get("provenance") or {}
    if prov.get("target_num_layers"):
        return int(prov["target_num_layers"])
    model = (meta.get("args") or {}).get("model") or prov.get("target")
    if model in SYNTHETIC_LAYERS:
        return SYNTHETIC_LAYERS[model]
    if model and Path(model, "config.json").is_file():
        return int(json.loads(Path(model, "config.json").read_text())["num_hidden_layers"])
    raise ck.CheckpointError(f"checkpoint {meta.get('path')}: the target's layer count is unknown (target "
                             f"{model!r}); give --num-target-layers")


def export(ckpt: str, out_dir: str, dtype: torch.dtype = torch.bfloat16, num_target_layers: int | None = None) -> dict:
    """Write OUTDIR/config.json and OUTDIR/model.safetensors; returns the config."""
    from safetensors.torch import save_file

    state, cfg_dict, meta = ck.load_weights(ckpt)
    c = dm.DrafterConfig(**{**cfg_dict, "target_layers": tuple(cfg_dict["target_layers"])})
    n_target = num_target_layers_of(meta, num_target_layers)
    provenance = dict(meta.get("provenance") or {})
    if not provenance.get("target") and meta.get("args"):
        provenance["target"] = meta["args"].get("model")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_reference(state).items()}
    out = Path(out_dir)
    config = export_config(c, n_target, dtype, provenance, meta)
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    except OSError as e:  # a full disk, no permission: one line, not a traceback
        raise OutputError(f"writing {out_dir}: {e.strerror or e}") from None
    return config


def drafter_config_of(config: dict) -> dm.DrafterConfig:
    """Our DrafterConfig back from an exported (or reference) config.json."""
    d = config.get("dflash_config") or {}
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 1_000_000.0
    gamma = (config.get("dflash_training") or {}).get("loss_gamma") or 7.0
    return dm.DrafterConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        num_layers=config["num_hidden_layers"], target_layers=tuple(d["target_layer_ids"]),
        vocab_size=config["vocab_size"], mask_token_id=d["mask_token_id"],
        block_size=d.get("block_size") or config.get("block_size") or 16, rms_eps=config["rms_norm_eps"],
        rope_theta=float(rope), gamma=float(gamma))


def load_exported(out_dir: str, embed_tokens, lm_head, dtype: torch.dtype = torch.float32) -> dm.DFlashDrafter:
    """An exported drafter loaded back into our module (strict: every tensor present, nothing extra)."""
    from safetensors.torch import load_file

    config = json.loads(Path(out_dir, "config.json").read_text())
    drafter = dm.DFlashDrafter(drafter_config_of(config), embed_tokens, lm_head)
    state = from_reference(load_file(str(Path(out_dir, "model.safetensors"))))
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return drafter


def step_checkpoint(path: str, step: int) -> str:
    """checkpoints/step_N of a run directory, a checkpoints/ directory or a step directory itself; one line naming
    the steps there when N is not one of them."""
    p = Path(path)
    if ck._STEP_DIR.search(p.name):
        p = p.parent
    bases = [b for b in (p, p / "checkpoints") if b.is_dir()]
    for base in bases:
        if (base / f"step_{step}").is_dir():
            return str(base / f"step_{step}")
    steps = sorted({int(m.group(1)) for b in bases for d in b.glob("step_*")
                    if d.is_dir() and (m := ck._STEP_DIR.search(d.name))})
    there = ", ".join(map(str, steps)) if steps else "none"
    raise ck.CheckpointError(f"checkpoint {path}: no step {step} (steps there: {there})")


def metrics_at(path: str, step: int) -> dict:
    """The loss and accept_len of metrics.jsonl at `step`, else the last logged before it (with its step): a run
    logs every --log-every steps and evaluates every --eval-every, so the exported step may fall between them."""
    found: dict = {}
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            rec = json.loads(line)
            s = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash, or not ours
        if s > step:
            continue
        for key in ("loss", "accept_len"):
            if isinstance(rec.get(key), (int, float)) and s >= found.get(f"{key}_step", -1):
                found[key], found[f"{key}_step"] = float(rec[key]), s
    return found


def file_facts(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"sha256": h.hexdigest(), "bytes": path.stat().st_size}


def summary(cfg: dict, out_dir: str, dtype: str, metrics: dict) -> dict:
    t = cfg["dflash_training"]
    return {"ok": True, "step": t["step"], "checkpoint": t["checkpoint"], "checkpoint_kind": t["checkpoint_kind"],
            "checkpoint_sha256": t["checkpoint_sha256"], "dtype": dtype,
            "files": {n: file_facts(Path(out_dir, n)) for n in ("config.json", "model.safetensors")},
            "provenance": {k: t.get(k) for k in ("target", "target_sha256", "tokenizer_sha256", "data_sha256")},
            "drafter": {"layers": cfg["num_hidden_layers"], "num_target_layers": cfg["num_target_layers"],
                        "target_layer_ids": cfg["dflash_config"]["target_layer_ids"], "block_size": cfg["block_size"],
                        "mask_token_id": cfg["dflash_config"]["mask_token_id"]},
            "metrics": metrics}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--num-target-layers", type=int, default=None,
                   help="the target's layer count, when the checkpoint does not record it (old weights-only ones)")
    p.add_argument("--step", type=int, default=None, help="export step N of a run or checkpoints directory")
    p.add_argument("--metrics", default=None, help="the run's metrics.jsonl: loss and accept_len at the step")
    p.add_argument("--json", action="store_true", help="one JSON line on stdout summing up what was written")
    args = p.parse_args(argv)
    try:
        ckpt = step_checkpoint(args.ckpt, args.step) if args.step is not None else args.ckpt
        cfg = export(ckpt, args.out_dir, getattr(torch, args.dtype), args.num_target_layers)
        if args.json:
            step = cfg["dflash_training"]["step"]
            found = metrics_at(args.metrics, int(step)) if args.metrics and step is not None else {}
            print(json.dumps(summary(cfg, args.out_dir, args.dtype, found)), flush=True)
            return 0
    except (ck.CheckpointError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = cfg["dflash_training"]
    print(f"exported step {t['step']} of {t['checkpoint']} to {args.out_dir}: {ARCHITECTURE}, "
          f"{cfg['num_hidden_layers']} layers, target layers {cfg['dflash_config']['target_layer_ids']} of "
          f"{cfg['num_target_layers']}, block {cfg['block_size']}, mask token {cfg['dflash_config']['mask_token_id']}, "
          f"{args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
