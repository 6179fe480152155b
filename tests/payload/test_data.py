"""The pipeline's data: generated patterns for tiny/1b; JSONL conversations / text tokenised with a real chat
template (loss on assistant tokens and their end-of-turn only), cached memory-mapped, one sample per row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remote_payload import dflash_data as dd
from remote_payload import train_dflash_pipeline as tp
from tests.payload.chat_tokenizer import DEMO, TAGGED, make_chat_tokenizer

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 plus 2 is 4."}, {"role": "user", "content": "And 3 + 2?"},
        {"role": "assistant", "content": "3 plus 2 is 5."}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_chat_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def test_patterns_are_deterministic_per_sample():
    d = tp.Data(1024, 64, seed=3)
    a, ma = d.rows(14, 2)
    b, _ = tp.Data(1024, 64, seed=3).rows(14, 2)
    assert torch.equal(a, b) and a.shape == (2, 64) and ma.all()
    assert not torch.equal(a, d.rows(16, 2)[0])
    assert not torch.equal(d.rows(1, 1)[0], d.rows(-1, 1)[0])  # held-out patterns are not training ones
    assert int(a.max()) < 1023  # never the MASK id


def test_conversation_mask_is_the_assistant_turns_and_their_end_of_turn(tok):
    ids, mask = dd.encode_conversation(tok, CONV, dd.stop_token_ids(tok))
    assert tok.decode(ids) == tok.apply_chat_template(CONV, tokenize=False)
    learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert learned == "2 plus 2 is 4.<|im_end|>3 plus 2 is 5.<|im_end|>"
    assert ids[-2] == tok.eos_token_id and mask[-2] == 1 and mask[-1] == 0  # the "\n" after it is not learned


def test_generation_tagged_template_gives_the_same_mask(tok, tmp_path):
    from transformers import AutoTokenizer

    make_chat_tokenizer(tmp_path, TAGGED)
    tagged = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert dd.encode_conversation(tagged, CONV, dd.stop_token_ids(tagged)) == \
        dd.encode_conversation(tok, CONV, dd.stop_token_ids(tok))


def test_text_ends_with_the_real_eos(tok):
    ids, mask = dd.encode_text(tok, "plain words here", dd.stop_token_ids(tok))
    assert ids[-1] == tok.eos_token_id and all(mask)


def test_cache_is_built_once_then_hit(tok, tmp_path):
    c1, info1 = dd.load_corpus(str(DEMO), tok, 96, tmp_path)
    c2, info2 = dd.load_corpus(str(DEMO), tok, 96, tmp_path)
    assert (info1["cache"], info2["cache"]) == ("built", "hit") and info1["key"] == info2["key"]
    assert len(c1) == len(c2) == len(DEMO.read_text().splitlines())
    assert all((c2.sample(i)[0] == c1.sample(i)[0]).all() for i in range(len(c1)))
    _, other = dd.load_corpus(str(DEMO), tok, 64, tmp_path)  # another max length: another key
    assert other["cache"] == "built" and other["key"] != info1["key"]


def test_rows_are_one_sample_each_never_packed(tok, tmp_path):
    corpus, _ = dd.load_corpus(str(DEMO), tok, 128, tmp_path)
    data = tp.Data(1024, 128, 0, corpus, pad_id=tok.pad_token_id, eval_samples=8)
    assert len(data.heldout_idx) == 8 and not set(data.heldout_idx) & set(data.train_idx)
    ids, mask = data.rows(20, 4)
    starts = {int(corpus.sample(int(i))[0][0]) for i in data.train_idx}
    for row, m in zip(ids, mask, strict=True):
        assert int(row[0]) in starts  # a row is a sample's beginning
        pad = row == tok.pad_token_id
        assert not m[pad].any()  # padding carries no loss
        if pad.any():
            first_pad = int(pad.nonzero()[0])
            assert pad[first_pad:].all()
    again, _ = tp.Data(1024, 128, 0, corpus, tok.pad_token_id, 8).rows(20, 4)
    assert torch.equal(ids, again)  # the data position is the sample index alone
    assert torch.equal(torch.cat([data.rows(20, 1)[0], data.rows(21, 3)[0]]), ids)  # however it is split
    prompts = data.heldout_prompts(3)
    assert len(prompts) == 3 and all(p[-1] != tok.eos_token_id for p in prompts)


def test_txt_file_one_sample_per_document(tok, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("first document\nstill the first\n\nsecond one\n\n\nthird\n")
    records = list(dd.read_records(str(f)))
    assert [r[2] for r in records] == ["first document\nstill the first", "second one", "third"]
    corpus, info = dd.load_corpus(str(f), tok, 64, tmp_path / "c")
    assert len(corpus) == 3 and info["texts"] == 3


def test_bad_jsonl_names_the_line(tok, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"question": "no"}\n')
    with pytest.raises(dd.DataError, match=r"bad.jsonl:2: needs messages, text, or prompt\+response"):
        dd.load_corpus(str(bad), tok, 16, tmp_path / "c")
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(dd.DataError, match=r"bad.jsonl:1: messages must be"):
        list(dd.read_records(str(bad)))


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "/models/qwen"], "--model /models/qwen needs --data"),
    (["--model", "tiny", "--data", str(DEMO)], "--data with --model tiny needs --tokenizer DIR"),
    (["--model", "tiny", "--data", "/nope.jsonl", "--tokenizer", "/t"], "--data /nope.jsonl: no such file"),
])
def test_real_models_refuse_to_start_without_data_and_tokenizer(argv, message):
    args = tp.build_parser().parse_args(argv)
    with pytest.raises(tp.UsageError, match=message.replace("+", r"\+")):
        tp.check_args(args)


def test_a_missing_tokenizer_is_one_clear_error(tmp_path):
    args = tp.build_parser().parse_args(["--model", str(tmp_path), "--data", str(DEMO)])
    with pytest.raises(tp.UsageError, match=rf"--tokenizer {tmp_path}: no tokenizer could be loaded"):
        tp.load_tokenizer(args)


def test_source_names_data_tokenizer_and_model_with_hashes(tok_dir, tmp_path):
    args = tp.build_parser().parse_args(["--model", "tiny", "--data", str(DEMO), "--tokenizer", str(tok_dir),
                                         "--seq-len", "96", "--out", str(tmp_path)])
    tp.check_args(args)
    cfg = tp.target_config("tiny")
    src = tp.load_source(args, cfg, tp.cache_dir_of(args))
    data_line, tok_line, model_line = src.lines
    assert data_line.startswith(f"data: {DEMO} sha256={dd.sha256_file(DEMO)} ") and "cache=built" in data_line
    assert tok_line.startswith(f"tokenizer: {tok_dir} sha256=") and "mask_token_id=400" in tok_line
    assert model_line.startswith("model: tiny (random init, seed 0) sha256=")
    assert src.mask_token_id == 400 and src.provenance["data_sha256"] == dd.sha256_file(DEMO)
    assert "cache=hit" in tp.load_source(args, cfg, tp.cache_dir_of(args)).lines[0]


def test_model_hash_is_remembered(tmp_path):
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    (m / "model.safetensors").write_bytes(b"\0" * 100)
    first = dd.model_sha256(str(m), tmp_path / "cache")
    assert dd.model_sha256(str(m), tmp_path / "cache") == first
    assert json.loads((tmp_path / "cache" / "model_sha256.json").read_text())[str(m.resolve())]["sha256"] == first
    (m / "model.safetensors").write_bytes(b"\1" * 100)
    assert dd.model_sha256(str(m), tmp_path / "cache") != first


def test_demo_data_is_documented_conversations():
    lines = DEMO.read_text().splitlines()
    assert 50 <= len(lines) <= 200
    assert all(json.loads(x)["messages"][-1]["role"] == "assistant" for x in lines)
    assert Path(DEMO.parent / "make_demo_chat.py").is_file()
