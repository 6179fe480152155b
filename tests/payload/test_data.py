"""The pipeline's data: generated patterns by default, jsonl prompt/response (loss on the response) or text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from remote_payload import train_dflash_pipeline as tp

SAMPLE = Path(__file__).resolve().parents[2] / "remote_payload" / "data" / "sample.jsonl"


def test_patterns_are_deterministic_per_global_batch():
    d = tp.Data(None, 1024, 64, seed=3)
    a, ma = d.batch(7, 2)
    b, _ = tp.Data(None, 1024, 64, seed=3).batch(7, 2)
    assert torch.equal(a, b) and a.shape == (2, 64) and ma.all()
    assert not torch.equal(a, d.batch(8, 2)[0])
    assert int(a.max()) < 1023  # never the MASK id


def test_jsonl_masks_the_prompt():
    d = tp.Data(str(SAMPLE), 1024, 48, seed=0)
    ids, mask = d.batch(0, 3)
    assert ids.shape == mask.shape == (3, 48)
    assert 0 < int(d.mask.sum()) < len(d.mask)  # prompts carry no loss, responses and text do
    first_prompt = len(b"What does a drafter do?")
    assert d.mask[:first_prompt].sum() == 0 and d.mask[first_prompt] == 1


def test_bad_jsonl_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"question": "no"}\n')
    with pytest.raises(tp.UsageError, match=r"bad.jsonl:2"):
        tp.Data(str(bad), 1024, 16, seed=0)
