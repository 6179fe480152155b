"""--pretrain-target and --synthetic are refused where they mean nothing. The taught target's rising accept_len
and its cache are proven on the export reference's run (test_export_reference.py), which teaches one anyway."""

from __future__ import annotations

import pytest


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

