"""Metric lines of the training pipeline: parsing, crash signatures, and the throughput verdict.

The seeds' 4.6 Ktok/s run looked healthy for 23 minutes because nobody compared it with the 12.8 and
21.5 Ktok/s runs before it. This module turns log text into `MetricPoint`s and judges them against a
baseline, so that comparison is made by the controller every time. Everything here is pure: no I/O,
no clock, no torch; the caller supplies bytes, `now` and the baseline.

A log line is never an error: whatever does not parse is kept as a `TextLine`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, Required, TypedDict, Unpack

from controller.errors import ExitCode, InputError


def median(values: Sequence[float]) -> float:
    """statistics.median of a non-empty sequence, without importing statistics (and with it fractions and
    decimal: ~6 ms of every `ctl status`)."""
    s = sorted(values)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2

# --------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class MetricPoint:
    """One logged training step. Fields the line did not carry are None.

    `tgt_bps` / `dft_bps` are the target and drafter batch rates (batches/s); `q_hs` the depths of
    the hidden-state queues between them; `time` the wall-clock epoch seconds when the point was
    logged (JSON `time`) or received (`LogCursor.feed(..., now=...)`).
    """

    step: int
    loss: float | None = None
    lr: float | None = None
    elapsed_s: float | None = None
    tgt_bps: float | None = None
    dft_bps: float | None = None
    tok_s: float | None = None
    eta_s: float | None = None
    q_hs: tuple[int, ...] | None = None
    time: float | None = None
    accept_len: float | None = None  # acceptance length tau of the drafter (draft tokens accepted per block + 1)
    extra: dict[str, str] = field(default_factory=dict, hash=False)
    raw: str = field(default="", compare=False, repr=False)

    def record(self) -> dict[str, Any]:
        """The JSON-lines form (None fields left out); `parse_line` reads it back to an equal point."""
        out: dict[str, Any] = {"step": self.step}
        for name in _JSON_FLOATS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.q_hs is not None:
            out["q_hs"] = list(self.q_hs)
        if self.extra:
            out["extra"] = dict(self.extra)
        return out


@dataclass(frozen=True)
class TextLine:
    """A log line that is not a metric point; `crash` names its crash signature, if any."""

    text: str
    crash: str | None = None


ParsedLine = MetricPoint | TextLine

# --------------------------------------------------------------------------------------------
# Numbers with units

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_FLOAT = re.compile(rf"(?:{_NUM}|[-+]?(?:nan|inf|infinity))", re.IGNORECASE)
_SUFFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}
_RATE = re.compile(rf"({_NUM})\s*([kKMG]?)\s*(tok(?:ens)?/s|b/s|/s)?")
_DURATION_UNITS = re.compile(
    r"(?:(\d+(?:\.\d+)?)d)?\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?"
)
_HMS = re.compile(r"(\d+):(\d{2}):(\d{2}(?:\.\d+)?)")
_PLAIN = re.compile(r"\d+(?:\.\d+)?")
_MAX_DIGITS = 18  # int() refuses very long digit strings; no step count is that large


def parse_float(text: str) -> float | None:
    """A plain float (`3.0e-04`, `nan`); None for anything else, never an exception."""
    if len(text) > 64 or not _FLOAT.fullmatch(text):
        return None
    return float(text)


def parse_rate(text: str, unit: str | None = None) -> float | None:
    """`4.6K`, `4.6Ktok/s`, `1.2M`, `4600`, `0.11b/s` -> per-second value; `unit` demands that unit."""
    if len(text) > 64:
        return None
    m = _RATE.fullmatch(text.strip())
    if m is None:
        return None
    found = "tok/s" if m.group(3) == "tokens/s" else m.group(3)
    if unit is not None and found not in (None, "/s", unit):
        return None
    value = float(m.group(1)) * _SUFFIX[m.group(2)]
    return value if math.isfinite(value) else None


def parse_duration(text: str) -> float | None:
    """`36.9d`, `1h05m`, `75s`, `23m`, `1:05:30`, plain seconds -> seconds; None if not a duration."""
    t = text.strip().lower()
    if not t or len(t) > 64:
        return None
    if _PLAIN.fullmatch(t):
        return float(t)
    m = _HMS.fullmatch(t)
    if m:
        return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    m = _DURATION_UNITS.fullmatch(t)
    if m is None or not any(m.groups()):
        return None
    days, hours, minutes, seconds = (float(g) if g else 0.0 for g in m.groups())
    return days * 86400 + hours * 3600 + minutes * 60 + seconds


# --------------------------------------------------------------------------------------------
# Text metric lines: `[23m] step=14 loss=10.6894 lr=3.0e-04 tgt=0.11b/s dft=0.11b/s (4.6Ktok/s) q_hs=[0] | ETA=36.9d`

_KV = re.compile(r"(?<![\w./-])([A-Za-z_][\w./-]*)=(\[[^\]\n]*\]|[^\s,;()|\[]+)")
_ELAPSED = re.compile(r"(?<![=\w])\[\s*([0-9][0-9.:dhms ]*?)\s*\]")
_TOK_S = re.compile(rf"(?<![\w.])({_NUM})\s*([kKMG]?)\s*tok(?:ens)?/s\b")
_STEP = re.compile(rf"(\d{{1,{_MAX_DIGITS}}})(?:/(\d{{1,{_MAX_DIGITS}}}))?")
_QLIST = re.compile(r"\[\s*(\d{1,18}(?:\s*,\s*\d{1,18})*)?\s*,?\s*\]")
_TOK_KEYS = {"tok_s", "tok/s", "tokens/s", "tps", "toks"}
_RATE_ROLES = {"tgt": "tgt_bps", "dft": "dft_bps", "tgt_bps": "tgt_bps", "dft_bps": "dft_bps"}


def _parse_text(line: str) -> MetricPoint | None:
    pairs: dict[str, str] = {}
    for m in _KV.finditer(line):
        pairs[m.group(1)] = m.group(2)
    step_text = pairs.pop("step", None)
    step_m = _STEP.fullmatch(step_text) if step_text is not None else None
    if step_m is None:
        return None
    fields: dict[str, Any] = {}
    extra: dict[str, str] = {}
    if step_m.group(2):
        extra["total_steps"] = step_m.group(2)
    for key, value in pairs.items():
        low = key.lower()
        parsed: object = None
        target: str | None = None
        if low in ("loss", "lr", "accept_len"):
            target, parsed = low, parse_float(value)
        elif low in _RATE_ROLES:
            target, parsed = _RATE_ROLES[low], parse_rate(value, "b/s")
        elif low in _TOK_KEYS:
            target, parsed = "tok_s", parse_rate(value, "tok/s")
        elif low in ("eta", "eta_s"):
            target, parsed = "eta_s", parse_duration(value)
        elif low in ("elapsed", "elapsed_s"):
            target, parsed = "elapsed_s", parse_duration(value)
        elif low == "q_hs":
            target, parsed = "q_hs", _parse_queue(value)
        elif value.endswith("tok/s") and parse_rate(value, "tok/s") is not None:
            target, parsed = "tok_s", parse_rate(value, "tok/s")
        if target is not None and parsed is not None:
            fields[target] = parsed
        else:
            extra[key] = value
    if "tok_s" not in fields:
        tm = _TOK_S.search(line)
        if tm:
            rate = float(tm.group(1)) * _SUFFIX[tm.group(2)]
            if math.isfinite(rate):
                fields["tok_s"] = rate
    if "elapsed_s" not in fields:
        for em in _ELAPSED.finditer(line):
            seconds = parse_duration(em.group(1).replace(" ", ""))
            if seconds is not None and not _PLAIN.fullmatch(em.group(1).strip()):
                fields["elapsed_s"] = seconds
                break
    return MetricPoint(step=int(step_m.group(1)), extra=extra, raw=line, **fields)


def _parse_queue(value: str) -> tuple[int, ...] | None:
    m = _QLIST.fullmatch(value)
    if m is None:
        return None
    return tuple(int(x) for x in m.group(1).split(",")) if m.group(1) else ()


# --------------------------------------------------------------------------------------------
# JSON-lines metrics: {"step": 14, "loss": 10.69, "tok_s": 4600, ...}

_JSON_FLOATS = ("loss", "lr", "elapsed_s", "tgt_bps", "dft_bps", "tok_s", "eta_s", "time", "accept_len")
_FLOAT_KEYS = frozenset(_JSON_FLOATS)


def _parse_json(line: str) -> MetricPoint | None:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    return point_of(obj, raw=line)


def point_of(obj: dict[str, Any], raw: str = "") -> MetricPoint | None:
    """A JSON-lines record already decoded (the registry's stored points) -> its MetricPoint, as `parse_line`
    reads that record's line; None when it has no valid step."""
    step = obj.get("step")
    if isinstance(step, float) and step.is_integer() and 0 <= step < 10**_MAX_DIGITS:
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**_MAX_DIGITS:
        return None
    fields: dict[str, Any] = {}
    extra: dict[str, str] = {}
    for key, value in obj.items():
        if type(value) is float and key in _FLOAT_KEYS:  # the common case (every stored point): kept as it is
            fields[key] = value
            continue
        if key == "step":
            continue
        parsed: object = None
        if key in _FLOAT_KEYS:
            if isinstance(value, int | float) and not isinstance(value, bool):
                parsed = float(value)
            elif isinstance(value, str) and key == "tok_s":
                parsed = parse_rate(value, "tok/s")
            elif isinstance(value, str) and key in ("eta_s", "elapsed_s"):
                parsed = parse_duration(value)
        elif key == "q_hs" and isinstance(value, list):
            if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                parsed = tuple(value)
        elif key == "extra" and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            extra.update(value)
            continue
        if parsed is not None:
            fields[key] = parsed
        else:
            extra[key] = value if isinstance(value, str) else json.dumps(value)
    return MetricPoint(step=step, extra=extra, raw=raw, **fields)


# --------------------------------------------------------------------------------------------
# Public parsing API


def parse_line(line: str) -> MetricPoint | TextLine:
    """One log line -> a MetricPoint, or a TextLine when it carries no `step`. Never raises."""
    text = line.rstrip("\r\n")
    stripped = text.strip()
    point: MetricPoint | None = None
    if stripped.startswith("{"):
        point = _parse_json(stripped)
    elif "step=" in text:
        point = _parse_text(text)
    return point if point is not None else TextLine(text, detect_crash(text))


def _split(text: str) -> list[str]:
    """Lines as a terminal shows them: `\\n` ends a line; a `\\r` inside one (progress bars) does too."""
    out: list[str] = []
    for line in text.split("\n"):
        out.extend(seg for seg in line.split("\r") if seg.strip())
    return out


def parse_lines(text: str) -> list[MetricPoint | TextLine]:
    """A whole log's text -> one parsed entry per non-blank line (a missing final newline is fine)."""
    return [parse_line(line) for line in _split(text)]


def points_of(parsed: Iterable[MetricPoint | TextLine]) -> list[MetricPoint]:
    """Only the metric points of parsed lines."""
    return [p for p in parsed if isinstance(p, MetricPoint)]


class LogCursor:
    """Incremental parser for a growing log: feed it the new bytes, get the new points.

    Only complete lines are decoded, so a chunk that ends inside a line or inside a UTF-8 character
    loses nothing: the tail waits for the next feed. `offset` is the byte position after the last
    complete line, the place to resume from with a fresh cursor (`LogCursor(offset=...)`).
    """

    def __init__(self, *, offset: int = 0, max_line_bytes: int = 1 << 20) -> None:
        self.offset = offset
        self.max_line_bytes = max_line_bytes
        self.lines = 0
        self.last_point: MetricPoint | None = None
        self.crash: str | None = None
        self.crash_line: str | None = None
        self._partial = b""

    def feed(self, data: bytes, *, now: float | None = None) -> list[MetricPoint]:
        """New bytes -> the metric points of the lines they complete."""
        return points_of(self.feed_lines(data, now=now))

    def feed_lines(self, data: bytes, *, now: float | None = None) -> list[MetricPoint | TextLine]:
        """Like `feed`, but text lines too (a live view shows them; crash signatures come from them)."""
        buf = self._partial + data
        cut = buf.rfind(b"\n")
        if cut < 0:
            if len(buf) <= self.max_line_bytes:
                self._partial = buf
                return []
            cut = len(buf) - 1  # a runaway line with no newline: take it as a line of its own
        complete, self._partial = buf[: cut + 1], buf[cut + 1 :]
        self.offset += len(complete)
        return self._take(complete.decode("utf-8", "replace"), now)

    def flush(self, *, now: float | None = None) -> list[MetricPoint | TextLine]:
        """At end of file: the last line even without its newline."""
        rest, self._partial = self._partial, b""
        self.offset += len(rest)
        return self._take(rest.decode("utf-8", "replace"), now)

    def _take(self, text: str, now: float | None) -> list[MetricPoint | TextLine]:
        out: list[MetricPoint | TextLine] = []
        for entry in parse_lines(text):
            self.lines += 1
            if isinstance(entry, MetricPoint):
                if now is not None and entry.time is None:
                    entry = replace(entry, time=now)
                self.last_point = entry
            elif entry.crash is not None and (self.crash is None or self.crash == "traceback"):
                # The first specific signature wins over the bare "Traceback" line that precedes it.
                self.crash, self.crash_line = entry.crash, entry.text
            out.append(entry)
        return out


# --------------------------------------------------------------------------------------------
# Crash signatures

_CRASHES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("cuda-oom", re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")),
    (
        "nccl",
        re.compile(
            r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|ncclInvalidUsage"
            r"|ncclRemoteError|NCCL WARN.*fail|NCCL communicator was aborted|Watchdog caught collective"
        ),
    ),
    (
        "fx-tracing",
        re.compile(r"is_fx_symbolic_tracing|symbolically trace a dynamo-optimized function|CURRENT_PATCHER is None"),
    ),
    ("segfault", re.compile(r"Segmentation fault|core dumped|SIGSEGV")),
    ("cuda-error", re.compile(r"CUDA error:|illegal memory access|device-side assert")),
    ("traceback", re.compile(r"Traceback \(most recent call last\)")),
)


def detect_crash(line: str) -> str | None:
    """The crash signature a line shows: "cuda-oom", "nccl", "fx-tracing", "segfault", "cuda-error",
    "traceback", or None. Specific names come before "traceback" so the cause line names the crash."""
    if len(line) > 100_000:
        line = line[:100_000]
    for name, pattern in _CRASHES:
        if pattern.search(line):
            return name
    return None


# --------------------------------------------------------------------------------------------
# Throughput judgement

DEFAULT_WARMUP_STEPS = 3
DEFAULT_WARMUP_FRACTION = 0.1


def steady_points(
    points: Sequence[MetricPoint],
    *,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    warmup_fraction: float = DEFAULT_WARMUP_FRACTION,
) -> list[MetricPoint]:
    """The points after the compile warm-up, with a finite positive tok/s, in step order.

    Rule: drop the first max(warmup_steps, ceil(warmup_fraction * n)) logged points (log lines, not
    step numbers: the first logging window holds torch.compile and cache loading, and a windowed
    rate needs another window or two to forget it). The fraction makes a long run's judgement rest on
    its later part even if its logging interval is short.
    """
    ordered = sorted(points, key=lambda p: p.step)
    skip = warmup_skip(len(ordered), warmup_steps=warmup_steps, warmup_fraction=warmup_fraction)
    return [p for p in ordered[skip:] if has_rate(p)]


def has_rate(p: MetricPoint) -> bool:
    """Whether the point's tok/s can be judged: present, finite and positive."""
    return p.tok_s is not None and math.isfinite(p.tok_s) and p.tok_s > 0


def warmup_skip(n: int, *, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                warmup_fraction: float = DEFAULT_WARMUP_FRACTION) -> int:
    """How many of a run's first `n` logged points (in step order) are its warm-up (see `steady_points`)."""
    if warmup_steps < 0 or not 0.0 <= warmup_fraction < 1.0:
        raise InputError(
            f"warm-up must be >= 0 steps and a fraction in [0, 1): got {warmup_steps}, {warmup_fraction}"
        )
    return max(warmup_steps, math.ceil(warmup_fraction * n))


def steady_state(
    points: Sequence[MetricPoint],
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    warmup_fraction: float = DEFAULT_WARMUP_FRACTION,
    window: int | None = None,
) -> float | None:
    """Median tok/s after the warm-up (see `steady_points`), over the last `window` steady points if
    given; None when no steady point exists yet. The median ignores one-off spikes (checkpoints, eval)."""
    steady = steady_points(points, warmup_steps=warmup_steps, warmup_fraction=warmup_fraction)
    if window is not None:
        steady = steady[-window:] if window > 0 else []
    rates = [p.tok_s for p in steady if p.tok_s is not None]
    return median(rates) if rates else None


def combine_nodes(per_node: Sequence[Sequence[MetricPoint]]) -> list[MetricPoint]:
    """The points of a run across several containers, one per step: tok/s summed over the nodes that logged
    that step (each node logs its own throughput; a node that logs none adds nothing), the other fields from
    the first node that has them (loss, lr, ETA are global: rank 0 logs them), the latest time."""
    by_step: dict[int, list[MetricPoint]] = {}
    for points in per_node:
        seen: set[int] = set()
        for p in points:
            if p.step not in seen:  # a node's restarted log repeats steps: count each node once per step
                seen.add(p.step)
                by_step.setdefault(p.step, []).append(p)
    out = []
    for step in sorted(by_step):
        ps = by_step[step]
        rates = [p.tok_s for p in ps if p.tok_s is not None]
        times = [p.time for p in ps if p.time is not None]

        def first(name: str, ps: list[MetricPoint] = ps) -> Any:
            return next((getattr(p, name) for p in ps if getattr(p, name) is not None), None)

        out.append(MetricPoint(step, loss=first("loss"), lr=first("lr"), elapsed_s=first("elapsed_s"),
                               tgt_bps=first("tgt_bps"), dft_bps=first("dft_bps"),
                               tok_s=sum(rates) if rates else None, eta_s=first("eta_s"), q_hs=first("q_hs"),
                               time=max(times) if times else None, accept_len=first("accept_len")))
    return out


class RunState(IntEnum):
    """A run's state, ordered by severity so that the worst of several runs is `max()`.

    FINISHED < OK: a finished run can no longer go wrong. WARMUP and NO_BASELINE cannot be judged
    (NO_BASELINE above WARMUP: it stays that way, the blind spot of the seeds). SLOW < STALLED (no
    progress at all, maybe a hung compile holding eight GPUs) < UNREACHABLE (its host did not answer: nothing is
    known, and it may hide anything short of a crash that is already known) < CRASHED (certain, needs a relaunch).
    UNREACHABLE is never concluded from a run's log: `ctl status` sets it when the container could not be asked
    (exit 5); the registry keeps the run's recorded state.
    The exit codes are not in this order (RUN_FAILED=20 < SLOW=21), so never take max() of them.
    """

    FINISHED = 0
    OK = 1
    WARMUP = 2
    NO_BASELINE = 3
    SLOW = 4
    STALLED = 5
    UNREACHABLE = 6
    CRASHED = 7

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @property
    def exit_code(self) -> ExitCode:
        return _EXIT.get(self, ExitCode.OK)


_EXIT = {RunState.SLOW: ExitCode.SLOW, RunState.STALLED: ExitCode.STALLED, RunState.UNREACHABLE: ExitCode.CONNECTION,
         RunState.CRASHED: ExitCode.RUN_FAILED}


@dataclass(frozen=True)
class Verdict:
    """A judgement of one run; `reason` is the one line a user reads."""

    state: RunState
    reason: str
    tok_s: float | None = None
    baseline_tok_s: float | None = None
    baseline_name: str | None = None
    ratio: float | None = None
    step: int | None = None
    steady_points: int = 0
    idle_s: float | None = None
    crash: str | None = None

    @property
    def exit_code(self) -> ExitCode:
        return self.state.exit_code


def worst(verdicts: Iterable[Verdict]) -> Verdict | None:
    """The most severe verdict (the first of equals); None for none."""
    best: Verdict | None = None
    for v in verdicts:
        if best is None or v.state > best.state:
            best = v
    return best


def exit_code_for(verdicts: Iterable[Verdict]) -> ExitCode:
    """The exit code of the worst verdict: what `ctl status` / `ctl metrics` return."""
    w = worst(verdicts)
    return ExitCode.OK if w is None else w.exit_code


class Judging(TypedDict, total=False):
    """What a verdict judges besides the points: the baseline, the clock, how the run ended, and the thresholds
    (SLOW below `slow_ratio` x the baseline, STALLED after `stall_after_s` without log output, WARMUP until
    `min_steady_points` steady points). `last_step_time`: when the log last grew; `exit_status`: None while the
    run is alive."""

    baseline_tok_s: Required[float | None]
    now: Required[float]
    last_step_time: Required[float | None]
    exit_status: Required[int | None]
    crash: Required[str | None]
    slow_ratio: float  # 0.8
    stall_after_s: float  # 600.0
    min_steady_points: int  # 3
    baseline_name: str | None


def verdict(
    points: Sequence[MetricPoint],
    *,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    warmup_fraction: float = DEFAULT_WARMUP_FRACTION,
    window: int = 20,
    **judging: Unpack[Judging],
) -> Verdict:
    """Judge a run: CRASHED, FINISHED, STALLED, WARMUP, NO_BASELINE, SLOW or OK, checked in that order.

    A `last_step_time` of None falls back to the newest point's `time`. tok/s is the median of the last
    `window` steady points, so a run that degrades mid-way is caught within one window.
    """
    min_steady_points = judging.get("min_steady_points", 3)
    if min_steady_points < 1 or window < min_steady_points:
        raise InputError(f"need 1 <= min_steady_points <= window, got {min_steady_points}, {window}")
    steady = steady_points(points, warmup_steps=warmup_steps, warmup_fraction=warmup_fraction)[-window:]
    step = max((p.step for p in points), default=None)
    if judging["last_step_time"] is None:
        judging["last_step_time"] = max((p.time for p in points if p.time is not None), default=None)
    return verdict_of_window([p.tok_s for p in steady if p.tok_s is not None], step=step, **judging)


def verdict_of_window(steady: Sequence[float], *, step: int | None, **judging: Unpack[Judging]) -> Verdict:
    """`verdict` from what it reads of the points: the tok/s of the last window of steady points
    (`steady_points(...)[-window:]`), the highest step and when the log last grew. A registry run is judged this
    way without decoding every point it ever logged (commands/monitor.point_window)."""
    baseline_tok_s, now, last_step_time = judging["baseline_tok_s"], judging["now"], judging["last_step_time"]
    exit_status, crash, baseline_name = judging["exit_status"], judging["crash"], judging.get("baseline_name")
    slow_ratio = judging.get("slow_ratio", 0.8)
    stall_after_s = judging.get("stall_after_s", 600.0)
    min_steady_points = judging.get("min_steady_points", 3)
    if baseline_tok_s is not None and not (math.isfinite(baseline_tok_s) and baseline_tok_s > 0):
        raise InputError(f"baseline throughput must be a positive number of tok/s, got {baseline_tok_s!r}")
    if not 0.0 < slow_ratio <= 1.0:
        raise InputError(f"slow ratio must be in (0, 1], got {slow_ratio!r}")
    if not stall_after_s > 0:
        raise InputError(f"stall time must be positive seconds, got {stall_after_s!r}")
    if min_steady_points < 1:
        raise InputError(f"need min_steady_points >= 1, got {min_steady_points}")
    tok_s = median(steady) if steady else None
    ratio = tok_s / baseline_tok_s if tok_s is not None and baseline_tok_s else None
    idle = now - last_step_time if last_step_time is not None else None
    base = _baseline_text(baseline_tok_s, baseline_name)
    rate = _rate_text(tok_s, ratio, base)

    def make(state: RunState, reason: str) -> Verdict:
        return Verdict(
            state, reason, tok_s, baseline_tok_s, baseline_name, ratio, step, len(steady), idle, crash
        )

    if crash is not None or (exit_status is not None and exit_status != 0):
        what = f"crashed ({crash})" if crash else f"exited {exit_status}"
        if crash and exit_status not in (None, 0):
            what += f", exit {exit_status}"
        return make(RunState.CRASHED, f"{what} at step {step if step is not None else '-'}")
    if exit_status == 0:
        return make(RunState.FINISHED, f"finished at step {step}" + (f"; {rate}" if rate else ""))
    if idle is not None and idle >= stall_after_s:
        where = f"step {step}" if step is not None else "start-up"
        return make(RunState.STALLED, f"no log output for {format_eta(idle)} since {where}")
    if len(steady) < min_steady_points:
        return make(
            RunState.WARMUP,
            f"warming up: {len(steady)}/{min_steady_points} steady points"
            + (f" at step {step}" if step is not None else ", no metric line yet"),
        )
    assert tok_s is not None
    if ratio is None:
        return make(RunState.NO_BASELINE, f"{format_rate(tok_s)} tok/s, no baseline to compare with")
    if ratio < slow_ratio:
        return make(RunState.SLOW, f"{rate} (slow below {slow_ratio:.2f}x)")
    return make(RunState.OK, rate)


def _baseline_text(tok_s: float | None, name: str | None) -> str:
    if tok_s is None:
        return ""
    return f"{format_rate(tok_s)}" + (f" ({name})" if name else "")


def _rate_text(tok_s: float | None, ratio: float | None, base: str) -> str:
    if tok_s is None:
        return ""
    if ratio is None:
        return f"{format_rate(tok_s)} tok/s"
    return f"{format_rate(tok_s)} tok/s is {ratio:.2f}x the baseline {base}"


# --------------------------------------------------------------------------------------------
# Display helpers

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int = 20) -> str:
    """The last `width` values as bars scaled min..max; a gap for a missing value; mid bars if flat."""
    if width <= 0:
        return ""
    tail = list(values)[-width:]
    finite = [v for v in tail if v is not None and math.isfinite(v)]
    if not finite:
        return " " * len(tail)
    lo, hi = min(finite), max(finite)
    out = []
    for v in tail:
        if v is None or not math.isfinite(v):
            out.append(" ")
        elif hi == lo:
            out.append(_BARS[3])
        else:
            out.append(_BARS[min(7, int((v - lo) / (hi - lo) * 8))])
    return "".join(out)


def format_rate(tok_s: float | None) -> str:
    """4600 -> "4.6K", 12800 -> "12.8K", 1.2e6 -> "1.2M", 950 -> "950": one decimal of the unit below 100
    of it, none from 100 up (the pipeline's own style)."""
    if tok_s is None or not math.isfinite(tok_s):
        return "-"
    sign = "-" if tok_s < 0 else ""
    value = abs(tok_s)
    for suffix, scale in (("", 1.0), ("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        scaled = value / scale
        text = f"{scaled:.0f}" if scale == 1.0 or scaled >= 99.95 else f"{scaled:.1f}"
        if float(text) < 1000 or suffix == "T":
            return f"{sign}{text}{suffix}"
    return f"{sign}{value:.0f}"  # pragma: no cover


def format_eta(seconds: float | None) -> str:
    """Seconds -> "45s", "12.5m", "3.2h", "36.9d" (the pipeline's ETA style)."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    if round(seconds) < 60:
        return f"{seconds:.0f}s"
    for unit, scale, limit in (("m", 60.0, 60.0), ("h", 3600.0, 24.0), ("d", 86400.0, math.inf)):
        text = f"{seconds / scale:.1f}"
        if float(text) < limit:
            return f"{text}{unit}"
    return "-"  # pragma: no cover
