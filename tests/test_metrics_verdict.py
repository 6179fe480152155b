"""The throughput verdict: the seeds' 4.6K run against its 12.8K baseline must be SLOW, early."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from controller.core.metrics import (
    LogCursor,
    MetricPoint,
    RunState,
    Verdict,
    exit_code_for,
    sparkline,
    steady_points,
    steady_state,
    verdict,
    worst,
)
from controller.errors import ExitCode, InputError

EMIT = Path(__file__).parent / "fakepayload" / "emit_metrics.py"
NOW = 1_800_000_000.0


def run(tok_s: float, steps: int, *, warmup: int = 3, warmup_tok_s: float = 500.0) -> list[MetricPoint]:
    return [
        MetricPoint(step=i + 1, tok_s=warmup_tok_s if i < warmup else tok_s, loss=11.0 - i * 0.01, time=NOW)
        for i in range(steps)
    ]


def judge(points: list[MetricPoint], baseline: float | None = 12800.0, **kw: Any) -> Verdict:
    args: dict[str, Any] = {"now": NOW, "last_step_time": NOW, "exit_status": None, "crash": None,
                               "baseline_name": "fresh5"}
    args.update(kw)
    return verdict(points, baseline_tok_s=baseline, **args)


def test_steady_state_skips_the_warmup() -> None:
    points = run(4600, 10)
    assert steady_state(points) == 4600
    assert [p.step for p in steady_points(points)] == list(range(4, 11))
    # the fraction takes over for long runs: 10% of 100 points
    assert len(steady_points(run(4600, 100))) == 90
    assert steady_state(run(4600, 3)) is None
    assert steady_state(run(4600, 10), window=2) == 4600


def test_steady_state_is_a_median_not_a_mean() -> None:
    points = [*run(12800, 8), MetricPoint(step=9, tok_s=100.0), MetricPoint(step=10, tok_s=12900.0)]
    assert steady_state(points) == 12800


def test_slow_within_the_first_steady_window() -> None:
    """The seeds' case: 4.6K vs 12.8K. Three warm-up lines, then SLOW at the third steady line."""
    points = run(4600, 6)
    assert judge(points[:5]).state is RunState.WARMUP
    v = judge(points)
    assert v.state is RunState.SLOW
    assert v.ratio == pytest.approx(4600 / 12800)
    assert v.tok_s == 4600 and v.baseline_tok_s == 12800 and v.step == 6
    assert v.reason.startswith("4.6K tok/s is 0.36x the baseline 12.8K (fresh5)")
    assert v.exit_code is ExitCode.SLOW


def test_slow_from_the_emitter_through_the_cursor() -> None:
    out = subprocess.run(
        [sys.executable, str(EMIT), "--tok-s", "4600", "--steps", "6", "--interval", "0",
         "--warmup-steps", "3", "--warmup-tok-s", "500"], capture_output=True, check=True,
    ).stdout
    cur = LogCursor()
    points = cur.feed(out, now=NOW)
    v = judge(points)
    assert v.state is RunState.SLOW and v.ratio is not None and 0.34 < v.ratio < 0.38


def test_ok_near_the_baseline() -> None:
    v = judge(run(12500, 10))
    assert v.state is RunState.OK
    assert v.ratio == pytest.approx(12500 / 12800)
    assert v.reason == "12.5K tok/s is 0.98x the baseline 12.8K (fresh5)"
    assert v.exit_code is ExitCode.OK


def test_slow_ratio_threshold() -> None:
    assert judge(run(10300, 10)).state is RunState.OK  # 0.805
    assert judge(run(10200, 10)).state is RunState.SLOW  # 0.797
    assert judge(run(10300, 10), slow_ratio=0.9).state is RunState.SLOW


def test_degrading_run_is_caught_within_a_window() -> None:
    """12.8K for a long time, then the compile cache is lost: the recent window decides, not history."""
    points = run(12800, 200)
    points += [MetricPoint(step=200 + i, tok_s=4300.0, time=NOW) for i in range(1, 12)]
    assert judge(points).state is RunState.SLOW


def test_no_baseline() -> None:
    v = judge(run(4600, 10), baseline=None)
    assert v.state is RunState.NO_BASELINE and v.ratio is None
    assert "4.6K tok/s" in v.reason and "no baseline" in v.reason


def test_warmup_without_points() -> None:
    v = judge([], last_step_time=NOW - 30)
    assert v.state is RunState.WARMUP and "no metric line yet" in v.reason


def test_stalled_when_the_log_stops() -> None:
    points = run(12800, 10)
    assert judge(points, last_step_time=NOW - 599).state is RunState.OK
    v = judge(points, last_step_time=NOW - 600)
    assert v.state is RunState.STALLED and v.idle_s == 600
    assert v.reason == "no log output for 10.0m since step 10"
    assert v.exit_code is ExitCode.STALLED
    # without last_step_time the newest point's time counts
    assert judge(points, last_step_time=None, now=NOW + 601).state is RunState.STALLED
    # a compile that hangs before the first metric line stalls too
    assert judge([], last_step_time=NOW - 700).state is RunState.STALLED
    assert judge(points, last_step_time=NOW - 60, stall_after_s=30).state is RunState.STALLED


def test_crashed() -> None:
    v = judge(run(12800, 10), crash="fx-tracing")
    assert v.state is RunState.CRASHED and v.crash == "fx-tracing"
    assert v.reason == "crashed (fx-tracing) at step 10"
    assert v.exit_code is ExitCode.RUN_FAILED
    v = judge(run(12800, 10), exit_status=139, crash="segfault", last_step_time=NOW - 10_000)
    assert v.state is RunState.CRASHED and v.reason == "crashed (segfault), exit 139 at step 10"
    assert judge([], exit_status=1).state is RunState.CRASHED


def test_finished() -> None:
    v = judge(run(12800, 10), exit_status=0, last_step_time=NOW - 10_000)
    assert v.state is RunState.FINISHED and v.exit_code is ExitCode.OK
    assert v.reason == "finished at step 10; 12.8K tok/s is 1.00x the baseline 12.8K (fresh5)"
    slow = judge(run(4600, 10), exit_status=0)
    assert slow.state is RunState.FINISHED and slow.ratio == pytest.approx(0.359, abs=1e-3)


def test_severity_order() -> None:
    assert sorted(RunState, reverse=True) == [
        RunState.CRASHED, RunState.UNREACHABLE, RunState.STALLED, RunState.SLOW, RunState.NO_BASELINE,
        RunState.WARMUP, RunState.OK, RunState.FINISHED,
    ]
    verdicts = [judge(run(12800, 10)), judge(run(4600, 10)), judge(run(12800, 10), last_step_time=0.0),
                judge(run(12800, 2))]
    w = worst(verdicts)
    assert w is not None and w.state is RunState.STALLED
    # RUN_FAILED (20) < SLOW (21) numerically, yet a crash outranks a slow run
    assert exit_code_for([judge(run(4600, 10)), judge([], crash="nccl")]) is ExitCode.RUN_FAILED
    assert exit_code_for([judge(run(4600, 10)), judge(run(12800, 10))]) is ExitCode.SLOW
    assert exit_code_for([judge(run(12800, 2)), judge(run(4600, 10), baseline=None)]) is ExitCode.OK
    assert exit_code_for([]) is ExitCode.OK and worst([]) is None
    # a host that did not answer (exit 5) outranks what is known to be slow or stalled, never a known crash
    silent = replace(judge(run(12800, 10)), state=RunState.UNREACHABLE)
    assert silent.exit_code is ExitCode.CONNECTION and silent.state.label == "unreachable"
    assert exit_code_for([judge(run(4600, 10)), silent]) is ExitCode.CONNECTION
    assert exit_code_for([silent, judge([], crash="nccl")]) is ExitCode.RUN_FAILED


@pytest.mark.parametrize(
    "kw",
    [{"baseline": 0.0}, {"baseline": float("nan")}, {"baseline": -5.0}, {"slow_ratio": 0.0}, {"slow_ratio": 1.5},
     {"stall_after_s": 0}, {"min_steady_points": 0}, {"warmup_fraction": 1.0}, {"warmup_steps": -1}],
)
def test_bad_settings_are_input_errors(kw: dict[str, Any]) -> None:
    with pytest.raises(InputError):
        judge(run(12800, 10), **kw)


def test_sparkline() -> None:
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert sparkline([5.0, 5.0, 5.0]) == "▄▄▄"
    assert sparkline([1.0, None, 2.0]) == "▁ █"
    assert sparkline(list(range(100)), width=20) == sparkline(list(range(80, 100)))
    assert len(sparkline(list(range(100)))) == 20
    assert sparkline([]) == "" and sparkline([1.0], width=0) == ""
