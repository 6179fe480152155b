"""End to end through torchrun on this CPU: log lines the controller parses, metrics.jsonl, checkpoints with
their hashes, a loss that goes down, and a peer crash that ends the run instead of hanging it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.core.metrics import MetricPoint, parse_line

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "remote_payload" / "train_dflash_pipeline.py"
pytestmark = pytest.mark.slow


def torchrun(out: Path, *flags: str, targets: int = 1, drafters: int = 1, env=None, timeout=150):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={targets + drafters}",
           str(SCRIPT), "--targets", str(targets), "--drafters", str(drafters), "--device", "cpu", "--model", "tiny",
           "--out", str(out), *flags]
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)


LEARN = ["--steps", "80", "--seq-len", "128", "--batch-size", "4", "--num-anchors", "16", "--drafter-layers", "2",
         "--lr", "3e-3", "--log-every", "10", "--checkpoint-every", "40", "--seed", "0"]


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return torchrun(out, *LEARN), out


def test_run_exits_0_with_parseable_lines(learned):
    proc, _ = learned
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "done steps=80"
    points = [p for p in map(parse_line, lines) if isinstance(p, MetricPoint)]
    assert [p.step for p in points] == list(range(10, 81, 10))
    for p in points:
        assert p.loss is not None and p.tok_s and p.tok_s > 0
        assert p.q_hs is not None and len(p.q_hs) == 1
        assert p.eta_s is not None and p.elapsed_s is not None


def test_metrics_jsonl_has_the_same_numbers(learned):
    proc, out = learned
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(10, 81, 10))
    keys = {"step", "loss", "lr", "tgt_bps", "dft_bps", "tok_s", "q_hs", "eta_s", "elapsed_s", "time"}
    assert all(keys <= r.keys() for r in recs)
    text = [p for p in map(parse_line, proc.stdout.splitlines()) if isinstance(p, MetricPoint)]
    for r, p in zip(recs, text, strict=True):
        assert p.loss == pytest.approx(r["loss"], abs=1e-3)
        assert p.q_hs == tuple(r["q_hs"])


def test_loss_goes_down_on_patterns(learned):
    _, out = learned
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[:2]) / 2 - sum(losses[-2:]) / 2 > 0.3, losses


def test_checkpoint_manifest_hashes_match(learned):
    _, out = learned
    manifest = json.loads((out / "checkpoints" / "manifest.json").read_text())
    assert [e["step"] for e in manifest["checkpoints"]] == [40, 80]
    for e in manifest["checkpoints"]:
        data = (out / "checkpoints" / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"] and len(data) == e["bytes"]
    import torch

    state = torch.load(out / "checkpoints" / "step_80.pt", weights_only=False)
    assert state["step"] == 80 and "fc.weight" in state["drafter"]
    assert not any(k.startswith(("embed", "lm_head")) for k in state["drafter"])


def test_two_targets_two_drafters(tmp_path):
    proc = torchrun(tmp_path, "--steps", "6", "--seq-len", "64", "--batch-size", "2", "--num-anchors", "4",
                    "--drafter-layers", "2", "--log-every", "3", "--queue-size", "2", targets=2, drafters=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = [p for p in map(parse_line, proc.stdout.splitlines()) if isinstance(p, MetricPoint)]
    assert [p.step for p in points] == [3, 6] and all(len(p.q_hs) == 2 for p in points)


def test_peer_crash_ends_the_run_non_zero(tmp_path):
    proc = torchrun(tmp_path, "--steps", "50", "--seq-len", "64", "--batch-size", "2", "--num-anchors", "4",
                    "--drafter-layers", "2", "--timeout-s", "30", env={"DFLASH_FAULT": "0:3"}, timeout=90)
    assert proc.returncode != 0
    assert "DFLASH_FAULT: rank 0 dies at step 3" in proc.stderr
    assert "done steps" not in proc.stdout


def test_max_minutes_stops_cleanly(tmp_path):
    proc = torchrun(tmp_path, "--steps", "100000", "--seq-len", "64", "--batch-size", "2", "--num-anchors", "4",
                    "--drafter-layers", "2", "--max-minutes", "0.1", "--log-every", "1000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--max-minutes 0.1 reached" in proc.stdout.splitlines()[-1]


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    proc = torchrun(tmp_path, "--seq-len", "8")
    assert proc.returncode != 0
    assert "error: --seq-len must exceed --block-size + 1" in proc.stderr


@pytest.mark.parametrize(("flags", "expect"), [((), False), (("--compile",), True),
                                               (("--compile", "--no-compile-target"), False),
                                               (("--compile-target",), True)])
def test_compile_target_follows_compile_unless_told(flags, expect):
    from remote_payload import train_dflash_pipeline as tp

    args = tp.build_parser().parse_args(list(flags))
    tp.check_args(args)
    assert args.compile_target is expect


def test_compiled_target_layers_give_the_eager_hidden_states():
    import torch

    from remote_payload import train_dflash_pipeline as tp

    m = tp.build_target("tiny", torch.device("cpu"), 0)
    layers = tp.hs_layers(m.config, 2)
    tp.truncate_target(m, max(layers))
    ids = torch.randint(2, 1000, (2, 64), generator=torch.Generator().manual_seed(0))

    def hidden():
        with torch.no_grad():
            o = m.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            return torch.cat([o.hidden_states[i + 1] for i in layers], dim=-1)

    eager = hidden()
    assert tp.compile_target_layers(m) == len(m.model.layers)
    assert torch.allclose(hidden(), eager, atol=1e-5)
