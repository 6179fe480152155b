"""Judging a run from a few indexed reads of its stored points (monitor.point_window) gives exactly what judging all
of them does (core.metrics.verdict over monitor.stored_points), for runs of any length and any oddity: warm-up,
points without a rate, zero, negative, infinite and NaN rates, repeated and out-of-order steps (a log read again),
points without a time. A real SQLite registry."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from controller.commands import monitor
from controller.core.metrics import RunState, parse_line, steady_state, verdict, verdict_of_window
from controller.registry import Registry


def _records(rng: random.Random, n: int) -> list[dict[str, object]]:
    out = []
    step = 0
    for i in range(n):
        step = step + 1 if rng.random() > 0.05 else max(1, step - rng.randint(0, 30))  # repeats: a log read again
        rate: object = rng.choice([12800.0 * rng.uniform(0.5, 1.1)] * 12 + [None, 0, -5.0, math.inf, math.nan])
        doc = {"step": step, "loss": 9.0 - i * 1e-4, "time": None if rng.random() < 0.1 else 1000.0 + i}
        if rate is not None:
            doc["tok_s"] = rate
        p = parse_line(json.dumps(doc))
        assert p is not None
        out.append(p.record())
    if n > 3:  # the highest step twice, told apart by their loss: the first logged is the run's latest point
        top = max(int(r["step"]) for r in out) + 1  # type: ignore[call-overload]
        out += [{**out[-1], "step": top, "loss": 1.5}, {**out[-1], "step": top, "loss": 2.5}]
    return out


class _Decodes:
    """Counts the points monitor decodes (its point_of) while in use."""

    def __init__(self) -> None:
        self.count = 0
        self.real = monitor.point_of

    def __enter__(self) -> _Decodes:
        def counting(rec: dict[str, object]):  # type: ignore[no-untyped-def]
            self.count += 1
            return self.real(rec)

        monitor.point_of = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        monitor.point_of = self.real  # type: ignore[assignment]


@pytest.mark.parametrize("n", [0, 1, 3, 5, 25, 60, 400, 5000])
def test_the_window_judges_as_all_points_do(tmp_path: Path, n: int) -> None:
    rng = random.Random(n)
    reg = Registry(tmp_path / "r.sqlite3")
    run = reg.claim_run("r1", "ct", log_path="/l")
    recs = _records(rng, n)
    for i in range(0, n, 997):  # several pulls, as a long run's are
        assert reg.advance_cursor(run.id, reg.cursor(run.id)[:2], i + 1, "1:1:x", b"", recs[i:i + 997])
    run = reg.run_by_id(run.id)
    points = monitor.stored_points(reg, run)
    assert len(points) == len(recs)
    window = monitor.point_window(reg, run)
    history = tuple(None if p.tok_s is not None and math.isnan(p.tok_s) else p.tok_s for p in points[-20:])
    assert window.history == history  # (a NaN rate is a gap in the trend: SQLite keeps it as NULL)
    assert window.top == (max(points, key=lambda p: p.step) if points else None)
    now = 1000.0 + n
    for baseline in (None, 11000.0):
        for last_step_time in (None, now - 5, now - 60):
            name = "ct/b" if baseline else None
            want = verdict(points, baseline_tok_s=baseline, now=now, last_step_time=last_step_time, exit_status=None,
                           crash=None, stall_after_s=30.0, baseline_name=name)
            got = verdict_of_window(window.steady_rates, step=window.top.step if window.top else None,
                                    baseline_tok_s=baseline, now=now, exit_status=None, crash=None,
                                    last_step_time=window.last_time if last_step_time is None else last_step_time,
                                    stall_after_s=30.0, baseline_name=name)
            assert got == want
            if last_step_time is not None:  # the same through monitor.judge, the container's clock from a pull
                pull = monitor.PullResult("ct/r1", 0, 0, 0, 0, 0, 0, 1, 0, None, None, None, last_step_time, now)
                assert monitor.judge(run, window, (name, baseline) if name and baseline else None, pull=pull,
                                     stall_after_s=30.0) == want
    base = reg.claim_run("b1", "ct")
    assert reg.advance_cursor(base.id, (0, None), 1, "1:1:x", b"", recs)
    rate = steady_state(points)
    assert monitor.baseline_rate(reg, monitor.Baseline(reg.run_by_id(base.id), "marked good")) == (
        ("ct/b1", rate) if rate else None)


def test_a_long_run_is_judged_without_decoding_its_history(tmp_path: Path) -> None:
    """30,000 points (a 36-day run logging every ~100 s): the status reads a window of them, not all."""
    reg = Registry(tmp_path / "r.sqlite3")
    run = reg.claim_run("r1", "ct", log_path="/l")
    line = "[23m] step=%d loss=10.6894 lr=3.0e-04 tgt=0.11b/s dft=0.11b/s (4.6Ktok/s) q_hs=[0] | ETA=36.9d"
    recs = [p.record() for p in (parse_line(line % i) for i in range(1, 30_001)) if p is not None]
    assert reg.advance_cursor(run.id, (0, None), 1, "1:1:x", b"", recs)
    run = reg.run_by_id(run.id)
    with _Decodes() as decoded:
        st = monitor.status_of(run, reg, ("ct/b", 12800.0), pull=None, slow_ratio=0.8, stall_after_s=1e9)
    assert st.verdict.state == RunState.SLOW and st.verdict.step == 30_000 and st.last is not None
    assert decoded.count <= 41  # the steady window (20), the top point, the trend (20)


@pytest.mark.parametrize("n", [300, 3000])
def test_a_long_run_across_nodes_is_judged_from_its_newest_points_as_from_all(
        tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run across two containers: node 0 logs rates, node 1 logs its own (some odd) and stops logging halfway,
    as a DFlash node other than 0 does. Past JOB_WHOLE_MAX points per node, job_status reads the newest steps of
    each node (and indexed aggregates) instead of decoding everything, and says exactly what decoding all says."""
    reg = Registry(tmp_path / "r.sqlite3")
    run, members = reg.claim_job_run("j1", "pair", [("ct200", "pve1"), ("ct300", "pve2")], session="s",
                                     log_path="/l", run_dir="/d")
    first = _records(random.Random(n), n)
    first += [{**r, "time": float(r["time"]) + 500} for r in first[-10:] if r.get("time")]  # type: ignore[arg-type]
    # (node 0 restarted and logged its last steps again, later: a step's first line is the one that counts)
    for m, recs in zip(members, (first, _records(random.Random(n + 1), n // 2)), strict=True):
        assert reg.advance_cursor(m.id, (0, None), 1, "1:1:x", b"", recs)
    run = reg.run_by_id(run.id)
    now = 1000.0 + n
    pulled: dict[int, monitor.PullResult | str] = {
        m.id: monitor.PullResult(f"{m.ct}/j1", 0, 0, 0, 0, 0, 0, 1, 0, None, None, None, now - 7 * (i + 1), now)
        for i, m in enumerate(members)}

    def status(whole_max: int, pulls: dict[int, monitor.PullResult | str] = pulled) -> monitor.RunStatus:
        monkeypatch.setattr(monitor, "JOB_WHOLE_MAX", whole_max)
        return monitor.job_status(run, reg, ("ct/b", 11000.0), pulls, slow_ratio=0.8, stall_after_s=1e9)

    want = status(10 * n)
    with _Decodes() as decoded:
        got = status(n // 2 - 1 if n > 1000 else 10 * n)
    assert got.verdict == want.verdict and got.last == want.last and got.nodes == want.nodes
    assert len(got.tok_s_history) == len(want.tok_s_history) and all(
        a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))
        for a, b in zip(got.tok_s_history, want.tok_s_history, strict=True))
    # Without pulls (`ctl status --no-pull`) idleness comes from the points' own times: the same newest time.
    monkeypatch.setattr(monitor.time, "time", lambda: now + 100.0)
    assert status(10 * n, {}).verdict == status(n // 2 - 1 if n > 1000 else 10 * n, {}).verdict
    if n > 1000:
        assert decoded.count < 400, decoded.count  # the newest steps of each node, not their 4,500 points
    else:
        assert decoded.count >= n  # a short run: every point, its warm-up judged exactly
