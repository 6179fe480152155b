"""Parsing of metric lines: the seeds' format, JSON lines, crash signatures, incremental reads."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.metrics import (
    LogCursor,
    MetricPoint,
    TextLine,
    detect_crash,
    format_eta,
    format_rate,
    median,
    parse_duration,
    parse_line,
    parse_lines,
    parse_rate,
    point_of,
    points_of,
)

EMIT = Path(__file__).parent / "fakepayload" / "emit_metrics.py"
SEED = "[23m] step=14 loss=10.6894 ... tgt=0.11b/s dft=0.11b/s (4.6Ktok/s) | ETA=36.9d"


def test_seed_line() -> None:
    p = parse_line(SEED)
    assert isinstance(p, MetricPoint)
    assert (p.step, p.loss, p.elapsed_s) == (14, 10.6894, 23 * 60)
    assert (p.tgt_bps, p.dft_bps, p.tok_s) == (0.11, 0.11, 4600.0)
    assert p.eta_s == pytest.approx(36.9 * 86400)
    assert p.q_hs is None and p.extra == {}
    assert p.raw == SEED


def test_full_line_with_queues_and_extras() -> None:
    line = (
        "[1h05m] step=140/5000 epoch=2 loss=9.1 lr=3.0e-04 some words here grad_norm=1.25 "
        "tgt=0.31b/s dft=0.29b/s ver=0.5b/s (12.8Ktok/s) q_hs=[3, 1, 0] | ETA=1h05m30s"
    )
    p = parse_line(line)
    assert isinstance(p, MetricPoint)
    assert p.step == 140 and p.elapsed_s == 3900 and p.lr == pytest.approx(3e-4)
    assert p.q_hs == (3, 1, 0) and p.tok_s == 12800.0
    assert p.eta_s == 3600 + 5 * 60 + 30
    assert p.extra == {"total_steps": "5000", "epoch": "2", "grad_norm": "1.25", "ver": "0.5b/s"}


@pytest.mark.parametrize(
    ("text", "tok_s"),
    [("(4600tok/s)", 4600.0), ("(4.6Ktok/s)", 4600.0), ("(4.6ktok/s)", 4600.0), ("(1.25Mtok/s)", 1.25e6),
     ("(2Gtok/s)", 2e9), ("4.6K tok/s", 4600.0), ("(950 tokens/s)", 950.0), ("tok_s=4.6K", 4600.0),
     ("tok/s=12800", 12800.0), ("tps=21.5K", 21500.0)],
)
def test_throughput_suffixes(text: str, tok_s: float) -> None:
    p = parse_line(f"step=3 {text} loss=1.0")
    assert isinstance(p, MetricPoint)
    assert p.tok_s == pytest.approx(tok_s)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("75s", 75), ("23m", 1380), ("1h05m", 3900), ("1h", 3600), ("36.9d", 36.9 * 86400), ("2d03h", 183600),
     ("1h05m30s", 3930), ("1:05:30", 3930), ("90", 90), ("0.5s", 0.5)],
)
def test_duration_suffixes(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    p = parse_line(f"[{text}] step=1 | ETA={text}")
    assert isinstance(p, MetricPoint)
    assert p.eta_s == pytest.approx(seconds)
    if text != "90":  # a bare number in brackets is not an elapsed time ([0] could be anything)
        assert p.elapsed_s == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "abc", "1x", "m", "1:2", "--", "h1", "1e999999d"])
def test_bad_durations(bad: str) -> None:
    assert parse_duration(bad) is None


def test_rates_refuse_the_wrong_unit() -> None:
    assert parse_rate("0.11b/s", "b/s") == 0.11
    assert parse_rate("0.11b/s", "tok/s") is None
    assert parse_rate("4.6K") == 4600.0
    assert parse_rate("fast") is None


def test_garbled_known_fields_go_to_extra() -> None:
    p = parse_line("step=5 loss=oops q_hs=[1, x] ETA=? tgt=fast")
    assert isinstance(p, MetricPoint)
    assert p.loss is None and p.q_hs is None and p.eta_s is None and p.tgt_bps is None
    assert p.extra == {"loss": "oops", "q_hs": "[1, x]", "ETA": "?", "tgt": "fast"}


@pytest.mark.parametrize(
    "line",
    ["", "Loading target models ...", "step=abc loss=1", "step= 14", "mystep=14", "{not json", '{"loss": 1}',
     '{"step": "14"}', '{"step": true}', '{"step": -1}', "[1, 2, 3]", "{" * 5000 + "}" * 5000,
     "step=" + "9" * 5000],
)
def test_non_metric_lines_are_text(line: str) -> None:
    assert isinstance(parse_line(line), TextLine)


def test_empty_queue_and_trailing_comma() -> None:
    p = parse_line("step=2 q_hs=[] loss=1.5,")
    assert isinstance(p, MetricPoint)
    assert p.q_hs == () and p.loss == 1.5


def test_json_line() -> None:
    rec = {"step": 7, "loss": 9.5, "lr": 6e-4, "tgt_bps": 0.3, "dft_bps": 0.28, "tok_s": 12800, "q_hs": [2, 0],
           "eta_s": 3600, "elapsed_s": 120.5, "time": 1_700_000_000.5, "gpu": "H200", "mem": {"a": 1}}
    p = parse_line(json.dumps(rec))
    assert isinstance(p, MetricPoint)
    assert (p.step, p.loss, p.lr, p.tgt_bps, p.dft_bps, p.tok_s) == (7, 9.5, 6e-4, 0.3, 0.28, 12800.0)
    assert (p.q_hs, p.eta_s, p.elapsed_s, p.time) == ((2, 0), 3600.0, 120.5, 1_700_000_000.5)
    assert p.extra == {"gpu": "H200", "mem": '{"a": 1}'}
    q = parse_line('{"step": 3, "tok_s": "4.6K", "eta_s": "36.9d", "loss": null}')
    assert q == MetricPoint(step=3, tok_s=4600.0, eta_s=parse_duration("36.9d"), extra={"loss": "null"})


def test_record_round_trips_through_json() -> None:
    p = parse_line(SEED.replace("...", "lr=3.0e-04 q_hs=[1, 2] foo=bar"))
    assert isinstance(p, MetricPoint)
    assert parse_line(json.dumps(p.record())) == p


@pytest.mark.parametrize(
    ("line", "name"),
    [
        ("Traceback (most recent call last):", "traceback"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "cuda-oom"),
        ("RuntimeError: CUDA error: out of memory", "cuda-oom"),
        ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970", "nccl"),
        ("ncclInternalError: Internal check failed.", "nccl"),
        ("kpro6:1234:1301 [5] NCCL WARN Call to ibv_modify_qp failed", "nccl"),
        ("    if is_fx_symbolic_tracing():", "fx-tracing"),
        ("RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function.",
         "fx-tracing"),
        ("AssertionError: CURRENT_PATCHER is None in finally block", "fx-tracing"),
        ("Segmentation fault (core dumped)", "segfault"),
        ("bash: line 1: 4242 Aborted (core dumped) python3 train.py", "segfault"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda-error"),
        (SEED, None),
        ("NCCL INFO Channel 00/24 : 0 1 2 3", None),
        ("Compiling flex_attention ...", None),
    ],
)
def test_crash_signatures(line: str, name: str | None) -> None:
    assert detect_crash(line) == name
    parsed = parse_line(line)
    if name is not None:
        assert parsed == TextLine(line, name)


def test_cursor_keeps_the_most_specific_crash() -> None:
    cur = LogCursor()
    cur.feed(b"Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    assert cur.crash == "cuda-oom"
    assert cur.crash_line is not None and "CUDA out of memory" in cur.crash_line


def test_cursor_partial_line_and_split_utf8() -> None:
    data = "step=1 loss=1.0 note=héllo\nstep=2 loss=0.9 (4.6Ktok/s)\nstep=3".encode()
    cut = data.index("é".encode()) + 1  # inside the two-byte character
    cur = LogCursor()
    first = cur.feed(data[:cut], now=100.0)
    assert first == []
    second = cur.feed(data[cut:], now=101.0)
    assert [p.step for p in second] == [1, 2]
    assert second[0].extra == {"note": "héllo"} and second[0].time == 101.0
    assert cur.offset == data.rindex(b"\n") + 1
    tail = points_of(cur.flush())
    assert [p.step for p in tail] == [3] and cur.offset == len(data)


def test_cursor_resumes_from_offset() -> None:
    data = b"step=1\nstep=2\nstep=3\n"
    cur = LogCursor()
    cur.feed(data[:10])
    again = LogCursor(offset=cur.offset)
    assert [p.step for p in again.feed(data[cur.offset :])] == [2, 3]


def test_carriage_returns_split_progress_bars() -> None:
    parsed = parse_lines("10%|#  |\r50%|### |\rstep=4 loss=2.0\r\n")
    assert [type(p).__name__ for p in parsed] == ["TextLine", "TextLine", "MetricPoint"]


def test_emitter_output_parses() -> None:
    out = subprocess.run(
        [sys.executable, str(EMIT), "--tok-s", "4600", "--steps", "14", "--interval", "0"],
        capture_output=True, text=True, check=True,
    ).stdout
    points = points_of(parse_lines(out))
    assert [p.step for p in points] == list(range(1, 15))
    last = points[-1]
    assert last.tok_s is not None and 4500 <= last.tok_s <= 4700
    assert last.eta_s is not None and 35 * 86400 < last.eta_s < 39 * 86400
    assert last.elapsed_s is not None and last.q_hs == (0,)


@pytest.mark.parametrize(("kind", "rc"), [("traceback", 1), ("cuda-oom", 1), ("nccl", 1), ("fx-tracing", 1),
                                           ("segfault", 139)])
def test_emitter_crashes(kind: str, rc: int) -> None:
    proc = subprocess.run([sys.executable, str(EMIT), "--steps", "2", "--interval", "0", "--crash", kind],
                          capture_output=True)
    assert proc.returncode == rc
    cur = LogCursor()
    cur.feed(proc.stdout)
    assert cur.crash == kind


def test_emitter_json() -> None:
    out = subprocess.run([sys.executable, str(EMIT), "--steps", "3", "--interval", "0", "--json"],
                         capture_output=True, check=True).stdout
    cur = LogCursor()
    points = cur.feed(out)
    assert [p.step for p in points] == [1, 2, 3] and all(p.time is not None for p in points)


# --------------------------------------------------------------------------------------------
# Properties

finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
suffix_style = st.sampled_from(["plain", "ctl", "K", "M"])


def _tok_text(v: float, style: str) -> str:
    if style == "plain":
        return f"{v:.0f}"
    if style == "K":
        return f"{v / 1e3:.3f}K"
    if style == "M":
        return f"{v / 1e6:.6f}M"
    return format_rate(v)


def _tolerance(style: str, v: float) -> float:
    if style == "ctl":  # format_rate: one decimal of the unit below 100 of it (4.6K), none above (128K)
        a = abs(v)
        for scale in (1e12, 1e9, 1e6, 1e3):
            if a >= scale * 0.9995:
                return (0.5 if a / scale >= 99.95 else 0.05) * scale + 1e-9 * a
        return 0.5 + 1e-9

    return {"plain": 0.5, "K": 0.5, "M": 0.5}[style] + 1e-9 * abs(v)


def _eta_tolerance(eta: float) -> float:
    """format_eta keeps one decimal of its unit: half of 0.1 min / h / d."""
    for limit, half in ((59.5, 0.5), (3600, 3.0), (86400, 180.0)):
        if eta < limit:
            return half + 1e-6
    return 4320.0 + eta * 1e-12


@given(
    step=st.integers(min_value=0, max_value=10**12),
    elapsed_min=st.integers(min_value=0, max_value=10**5),
    loss=st.floats(min_value=0, max_value=100, allow_nan=False),
    lr=st.floats(min_value=1e-8, max_value=1.0),
    tgt=st.floats(min_value=0, max_value=1000),
    dft=st.floats(min_value=0, max_value=1000),
    tok=finite,
    style=suffix_style,
    eta=st.floats(min_value=0, max_value=1e9),
    q_hs=st.lists(st.integers(min_value=0, max_value=10**6), max_size=8),
    extras=st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True),
                           st.from_regex(r"[A-Za-z0-9.:+-]{1,12}", fullmatch=True), max_size=4),
    noise=st.booleans(),
)
def test_formatted_lines_round_trip(
    step: int, elapsed_min: int, loss: float, lr: float, tgt: float, dft: float, tok: float, style: str,
    eta: float, q_hs: list[int], extras: dict[str, str], noise: bool,
) -> None:
    known = {"step", "loss", "lr", "tgt", "dft", "q_hs", "eta", "elapsed", "tok_s", "tps", "toks", "tgt_bps",
             "dft_bps", "eta_s", "elapsed_s"}
    extras = {k: v for k, v in extras.items() if k not in known}
    h, m = divmod(elapsed_min, 60)
    elapsed = f"{h}h{m:02d}m" if h else f"{m}m"
    words = " ... and more words" if noise else ""
    tail = " ".join(f"{k}={v}" for k, v in extras.items())
    line = (f"[{elapsed}] step={step} loss={loss:.4f}{words} lr={lr:.1e} tgt={tgt:.2f}b/s dft={dft:.2f}b/s "
            f"({_tok_text(tok, style)}tok/s) q_hs={q_hs} {tail} | ETA={format_eta(eta)}")
    p = parse_line(line)
    assert isinstance(p, MetricPoint), line
    assert p.step == step and p.elapsed_s == elapsed_min * 60
    assert p.loss == pytest.approx(loss, abs=5e-5)
    assert p.lr == pytest.approx(lr, rel=0.051)
    assert p.tgt_bps == pytest.approx(tgt, abs=0.005 + 1e-9) and p.dft_bps == pytest.approx(dft, abs=0.005 + 1e-9)
    assert p.tok_s is not None and abs(p.tok_s - tok) <= _tolerance(style, tok), (line, p.tok_s)
    assert p.eta_s is not None and abs(p.eta_s - eta) <= _eta_tolerance(eta), (line, p.eta_s)
    assert p.q_hs == tuple(q_hs)
    assert p.extra == extras


@given(st.text(max_size=300))
def test_arbitrary_text_never_raises(text: str) -> None:
    for entry in parse_lines(text):
        assert isinstance(entry, MetricPoint | TextLine)
    detect_crash(text)


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    cur = LogCursor()
    cur.feed(data)
    cur.flush()
    assert cur.offset == len(data)


_log_line = st.one_of(
    st.builds(lambda s, t, loss: f"[{s % 90}m] step={s} loss={loss:.3f} (é{format_rate(t)}tok/s) q_hs=[{s % 4}]",
              st.integers(0, 10**6), finite, st.floats(0, 20)),
    st.builds(lambda s, t: json.dumps({"step": s, "tok_s": t, "note": "ünïcode ✓"}), st.integers(0, 10**6), finite),
    st.text(max_size=40).filter(lambda t: "\n" not in t and "\r" not in t),
    st.sampled_from(["Traceback (most recent call last):", "Segmentation fault (core dumped)", "", "  "]),
)


@settings(max_examples=150)
@given(lines=st.lists(_log_line, max_size=30), final_newline=st.booleans(), data=st.data())
def test_cursor_chunking_matches_whole_parse(lines: list[str], final_newline: bool, data: st.DataObject) -> None:
    text = "\n".join(lines) + ("\n" if final_newline else "")
    blob = text.encode()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=12)))
    cur = LogCursor()
    got: list[MetricPoint | TextLine] = []
    prev = 0
    for c in [*cuts, len(blob)]:
        got.extend(cur.feed_lines(blob[prev:c]))
        prev = c
    got.extend(cur.flush())
    assert repr(got) == repr(parse_lines(text))
    assert cur.offset == len(blob)


def test_format_rate_and_eta() -> None:
    assert [format_rate(v) for v in (4600, 12800, 21500, 950, 999.6, 123456, 99960, 1.2e6, math.nan, None)] == [
        "4.6K", "12.8K", "21.5K", "950", "1.0K", "123K", "100K", "1.2M", "-", "-"]
    assert [format_eta(v) for v in (45, 59.7, 750, 3 * 3600, 36.9 * 86400, -1, None)] == [
        "45s", "1.0m", "12.5m", "3.0h", "36.9d", "-", "-"]


def test_acceptance_length_is_a_metric_of_its_own() -> None:
    """The payload's eval steps log accept_len (DFlash's tau) between q_hs and the ETA."""
    p = parse_line("[3m] step=40 loss=6.1234 lr=3.0e-04 tgt=2.10b/s dft=1.05b/s (4.6Ktok/s) q_hs=[0] "
                   "accept_len=3.21 | ETA=12.3m")
    assert isinstance(p, MetricPoint)
    assert p.accept_len == 3.21 and p.tok_s == 4600 and "accept_len" not in p.extra
    assert parse_line(json.dumps(p.record())) == p


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32) | st.integers(-10**6, 10**6), min_size=1))
@settings(max_examples=300, deadline=None)
def test_median_is_statistics_median(values: list[float]) -> None:
    import statistics

    assert median(values) == statistics.median(values)
    assert type(median(values)) is type(statistics.median(values))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-10**20, max_value=10**20) | st.floats(allow_nan=False) |
    st.text(max_size=8), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                     max_size=3), max_leaves=6)
_records = st.dictionaries(
    st.sampled_from(["step", "loss", "lr", "elapsed_s", "tgt_bps", "dft_bps", "tok_s", "eta_s", "time", "accept_len",
                     "q_hs", "extra", "other"]) | st.text(max_size=5),
    _json_values | st.sampled_from(["12.8K", "3h2m", "1.5d", "x"]) | st.integers(min_value=0, max_value=10**6),
    max_size=8)


@settings(max_examples=600, deadline=None)
@given(_records)
def test_a_decoded_record_is_the_point_its_line_is(rec: dict[str, object]) -> None:
    """point_of (the registry's stored points, already decoded) reads a record as parse_line reads its line."""
    line = parse_line(json.dumps(rec))
    assert point_of(rec) == (line if isinstance(line, MetricPoint) else None)
