"""Training data for the DFlash drafter: chat conversations or plain text, tokenised once, memory-mapped.

Input (`--data FILE`):
  *.jsonl  one record per line, each one sample (never packed with another):
             {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
             {"text": "..."}                       plain text, loss on every token
             {"prompt": "...", "response": "..."}  read as a user/assistant conversation
  *.txt    plain text; documents separated by blank lines, one sample each

Conversations are rendered with the target tokenizer's own chat template; the loss mask covers the
assistant turns only, each with the end-of-turn token that closes it (what the model must learn to emit).
When the template marks assistant text with `{% generation %}`, transformers' assistant mask is used;
otherwise the spans come from diffing renders: the conversation cut before assistant turn i and rendered
with the generation prompt is a prefix of the whole render, and the turn's text follows it. Text samples end
with the tokenizer's EOS.

The tokenised corpus is cached under CACHE_DIR/<key>/ (numpy .npy files opened memory-mapped), the key being
sha256(data file) x sha256(tokenizer) x max length x format version: a restarted run finds it and does not
tokenise again. A lock file keeps concurrent ranks from building it twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class DataError(ValueError):
    """A problem with --data or the tokenizer, phrased as one line for the operator."""


# --------------------------------------------------------------------------------------------- hashes


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_hash(tok) -> str:
    """sha256 over what decides the token ids: the vocabulary/merges, special tokens, chat template, EOS."""
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    extra = {"class": type(tok).__name__, "chat_template": getattr(tok, "chat_template", None),
             "special": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
             "eos": tok.eos_token_id, "bos": tok.bos_token_id, "pad": tok.pad_token_id, "len": len(tok)}
    h = hashlib.sha256(body.encode())
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def stop_token_ids(tok, model_dir: str | None = None) -> list[int]:
    """The ids that end a reply: the tokenizer's EOS plus the model's generation_config eos_token_id(s)."""
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    gen = Path(model_dir, "generation_config.json") if model_dir else None
    if gen is not None and gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return ids


# -------------------------------------------------------------------------------------------- records


def read_records(path: str) -> Iterator[tuple[int, str, object]]:
    """(line or document number, "messages" | "text", payload) for each sample of a .jsonl or .txt file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--data {path}: no such file")
    if p.suffix == ".txt":
        doc: list[str] = []
        n = 0
        with open(p, encoding="utf-8") as f:
            for line in [*f, ""]:
                if line.strip():
                    doc.append(line)
                elif doc:
                    n += 1
                    yield n, "text", "".join(doc).rstrip("\n")
                    doc = []
        return
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"--data {path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"--data {path}:{n}: expected an object with messages, text or prompt+response")
            if "messages" in rec:
                msgs = rec["messages"]
                ok = isinstance(msgs, list) and msgs and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs)
                if not ok:
                    raise DataError(f"--data {path}:{n}: messages must be a non-empty list of "
                                    "{role: str, content: str}")
                yield n, "messages", [{"role": m["role"], "content": m["content"]} for m in msgs]
            elif "text" in rec:
                yield n, "text", str(rec["text"])
            elif "prompt" in rec and "response" in rec:
                yield n, "messages", [{"role": "user", "content": str(rec["prompt"])},
                                      {"role": "assistant", "content": str(rec["response"])}]
            else:
                raise DataError(f"--data {path}:{n}: needs messages, text, or prompt+response fields")


# ----------------------------------------------------------------------------------------- tokenising


def _render(tok, messages, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _extend_to_stop(ids: list[int], mask: list[int], stops: set[int]) -> None:
    """Every run of assistant tokens also learns the end-of-turn token right after it (when there is one)."""
    for i in range(1, len(ids)):
        if mask[i - 1] and not mask[i] and ids[i] in stops:
            mask[i] = 1


def encode_conversation(tok, messages: list[dict], stops: list[int]) -> tuple[list[int], list[int]]:
    """Token ids of the chat-template render and a mask: 1 on assistant tokens (and their end-of-turn)."""
    template = getattr(tok, "chat_template", None)
    if not template:
        raise DataError("the tokenizer has no chat_template: conversations need one (or use text records)")
    if _GENERATION_TAG.search(template if isinstance(template, str) else json.dumps(template)):
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
        if any(mask):
            _extend_to_stop(ids, mask, set(stops))
            return ids, mask
    full = _render(tok, messages, False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tok, messages[:i], True) if i else ""
        start = len(prefix) if i and full.startswith(prefix) else cursor
        content = m["content"].strip()
        at = full.find(content, start) if content else start
        if at < 0:
            raise DataError("assistant text not found in the chat-template render (a template that rewrites it)")
        spans.append((start, at + len(content)))
        cursor = at + len(content)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    for j, (a, b) in enumerate(enc["offset_mapping"]):
        if b > a and any(a < e and b > s for s, e in spans):
            mask[j] = 1
    _extend_to_stop(ids, mask, set(stops))
    return ids, mask


def encode_text(tok, text: str, stops: list[int]) -> tuple[list[int], list[int]]:
    ids = list(tok(text, add_special_tokens=True)["input_ids"])
    if not stops:
        raise DataError("the tokenizer has no eos_token: text samples must end with one")
    if not ids or ids[-1] != stops[0]:
        ids.append(stops[0])
    return ids, [1] * len(ids)


# -------------------------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """Samples as slices of one flat memory-mapped token array (ids uint32, mask uint8, offsets int64)."""

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    meta: dict

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.mask[a:b]


def cache_key(data_sha: str, tok_sha: str, max_len: int) -> str:
    raw = f"v{FORMAT_VERSION}:{data_sha}:{tok_sha}:{max_len}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _tokenise(path: str, tok, max_len: int, stops: list[int]) -> tuple[list[int], list[int], list[int], dict]:
    all_ids, all_mask, offsets = [], [], [0]
    kinds = {"messages": 0, "text": 0}
    truncated = dropped = 0
    for n, kind, payload in read_records(path):
        try:
            ids, mask = (encode_conversation(tok, payload, stops) if kind == "messages"
                         else encode_text(tok, payload, stops))
        except DataError as e:
            raise DataError(f"--data {path}:{n}: {e}") from None
        if len(ids) > max_len:
            ids, mask = ids[:max_len], mask[:max_len]
            truncated += 1
        if sum(mask[1:]) == 0:  # nothing to learn (e.g. the reply starts past max_len)
            dropped += 1
            continue
        kinds[kind] += 1
        all_ids.extend(ids)
        all_mask.extend(mask)
        offsets.append(len(all_ids))
    if len(offsets) < 2:
        raise DataError(f"--data {path}: no sample with assistant/text tokens within {max_len} tokens")
    meta = {"samples": len(offsets) - 1, "conversations": kinds["messages"], "texts": kinds["text"],
            "tokens": len(all_ids), "loss_tokens": int(sum(all_mask)), "truncated": truncated, "dropped": dropped,
            "max_id": max(all_ids)}
    return all_ids, all_mask, offsets, meta


def load_corpus(path: str, tok, max_len: int, cache_dir: str | Path, model_dir: str | None = None,
                data_sha: str | None = None, tok_sha: str | None = None) -> tuple[Corpus, dict]:
    """The tokenised corpus from the cache, built first when missing. info: hashes, key, hit or built."""
    data_sha = data_sha or sha256_file(path)
    tok_sha = tok_sha or tokenizer_hash(tok)
    key = cache_key(data_sha, tok_sha, max_len)
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    info = {"data_sha256": data_sha, "tokenizer_sha256": tok_sha, "key": key, "dir": str(final)}
    t0 = time.time()
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank building the same key: wait, then hit
        if (final / "meta.json").is_file():
            info["cache"] = "hit"
        else:
            stops = stop_token_ids(tok, model_dir)
            ids, mask, offsets, meta = _tokenise(path, tok, max_len, stops)
            tmp = root / f".{key}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            np.save(tmp / "ids.npy", np.asarray(ids, dtype=np.uint32))
            np.save(tmp / "mask.npy", np.asarray(mask, dtype=np.uint8))
            np.save(tmp / "offsets.npy", np.asarray(offsets, dtype=np.int64))
            meta.update(info, source=str(path), max_len=max_len, stop_ids=stops, format=FORMAT_VERSION,
                        tokenize_s=round(time.time() - t0, 2))
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")  # last: marks it complete
            os.replace(tmp, final)
            info["cache"] = "built"
    meta = json.loads((final / "meta.json").read_text())
    corpus = Corpus(np.load(final / "ids.npy", mmap_mode="r"), np.load(final / "mask.npy", mmap_mode="r"),
                    np.load(final / "offsets.npy", mmap_mode="r"), meta)
    info.update(meta, cache=info["cache"], seconds=round(time.time() - t0, 2))
    return corpus, info


def split_heldout(n: int, n_eval: int, salt: int = 20260206) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): a fixed draw, the same whatever --seed, at most a tenth of the data."""
    n_eval = min(n_eval, n // 10)
    order = np.random.default_rng(salt).permutation(n)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def prompt_length(mask: np.ndarray) -> int:
    """Where the last assistant turn starts (the eval's prompt ends there); text: half of it, at most 64."""
    m = np.asarray(mask)
    if m.all():
        return max(1, min(64, len(m) // 2))
    starts = np.flatnonzero((m[1:] == 1) & (m[:-1] == 0)) + 1
    return int(starts[-1]) if len(starts) else max(1, len(m) // 2)


def model_sha256(model_dir: str, cache_dir: str | Path) -> str:
    """sha256 over a model directory's config and weight files (name, then bytes, sorted by name).

    Hashing a 16 GB checkpoint takes a while: the result is remembered in CACHE_DIR/model_sha256.json, keyed on
    the files' names, sizes and modification times, so a restart does not hash again."""
    root = Path(model_dir)
    files = sorted(f for f in root.iterdir() if f.is_file() and (
        f.name == "config.json" or f.suffix in (".safetensors", ".bin", ".pt") or f.name.endswith(".index.json")))
    stamp = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    memo_path = Path(cache_dir) / "model_sha256.json"
    key = str(root.resolve())
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    hit = memo.get(key)
    if hit and hit.get("files") == stamp:
        return hit["sha256"]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    digest = h.hexdigest()
    memo[key] = {"files": stamp, "sha256": digest}
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(memo, indent=1) + "\n")
    os.replace(tmp, memo_path)
    return digest
