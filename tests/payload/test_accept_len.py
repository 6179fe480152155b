"""accept_len against a taught target: the quickstart's recipe, shorter. In a file of its own so that xdist runs
it beside test_pipeline_run.py's other runs instead of after them."""

from __future__ import annotations

import json

import pytest

from tests.payload.test_pipeline_run import torchrun

pytestmark = pytest.mark.slow

TAUGHT = ["--synthetic", "progressions", "--pretrain-target", "80", "--seq-len", "64", "--batch-size", "4",
          "--num-anchors", "16", "--drafter-layers", "2", "--lr", "3e-3", "--eval-tokens", "48", "--eval-samples", "4"]


def test_a_taught_target_gives_a_rising_accept_len_and_is_built_once(tmp_path):
    """The quickstart's recipe, shorter: the tiny target is taught progressions (a random target's next tokens
    follow no rule: accept_len stays 1), then the drafter trains on them and accept_len climbs. The taught target
    is stored in --cache-dir: the next run loads the same weights (same sha256) instead of teaching it again."""
    cache = tmp_path / "cache"
    # timeout: a hang detector, wide on purpose (teaching the target beside another training on 2 cores took
    # 338 s of the old 400), never a measure of speed
    first = torchrun(tmp_path / "a", *TAUGHT, "--steps", "100", "--log-every", "50", "--eval-every", "50",
                     "--cache-dir", str(cache), timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "data: synthetic progressions (seed 0)" in first.stdout
    taught = [x for x in first.stdout.splitlines() if x.startswith("target: taught progressions for 80 steps")]
    assert len(taught) == 1 and "(cache built," in taught[0], first.stdout
    model = next(x for x in first.stdout.splitlines() if x.startswith("model: tiny"))
    assert "taught progressions for 80 steps" in model
    taus = [json.loads(x).get("accept_len") for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    taus = [t for t in taus if t is not None]
    assert len(taus) == 2 and taus[1] >= taus[0] + 0.5 and taus[1] >= 2.0, taus
    assert len(list((cache / "target").glob("target-*.pt"))) == 1

    again = torchrun(tmp_path / "b", *TAUGHT, "--steps", "1", "--cache-dir", str(cache), timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(cache hit," in next(x for x in again.stdout.splitlines() if x.startswith("target: taught"))
    assert model in again.stdout.splitlines()  # the same target, by its sha256


def test_pretrain_and_synthetic_are_refused_with_real_data(tmp_path):
    from remote_payload import train_dflash_pipeline as tp

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    for flags in (["--pretrain-target", "5", "--data", str(data), "--tokenizer", str(tmp_path)],
                  ["--model", str(tmp_path), "--synthetic", "progressions", "--data", str(data)]):
        args = tp.build_parser().parse_args(flags)
        with pytest.raises(tp.UsageError, match="--pretrain-target and --synthetic are for --model tiny or 1b"):
            tp.check_args(args)
    with pytest.raises(tp.UsageError, match="--pretrain-target must be >= 0"):
        tp.check_args(tp.build_parser().parse_args(["--pretrain-target", "-1"]))

