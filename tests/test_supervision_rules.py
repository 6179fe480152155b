"""The supervisor's rules as controller/core/supervision.py states them, without I/O: the restart policy's
parsing and what it relaunches (`wants`), and the backoff doubling per restart of a lineage."""

from __future__ import annotations

import pytest

from controller.core.supervision import Policy, backoff_s
from controller.errors import InputError

VERDICTS = ("ok", "warmup", "no-baseline", "slow", "finished", "crashed", "stalled", "stopped", "unreachable")


@pytest.mark.parametrize("text, mode, max_restarts", [
    ("no", "no", 3),
    ("on-failure", "on-failure", 3),
    ("on-failure:2", "on-failure", 2),
    ("always", "always", 3),
    ("always:1", "always", 1),
    ("  always:9999 ", "always", 9999),
    ("on-failure:0", "on-failure", 0),
])
def test_a_policy_reads_its_mode_and_its_limit(text: str, mode: str, max_restarts: int) -> None:
    assert Policy.parse(text) == Policy(mode, max_restarts)


def test_the_default_limit_is_the_callers() -> None:
    assert Policy.parse("always", default_max=7) == Policy("always", 7)
    assert Policy.parse("always:2", default_max=7) == Policy("always", 2)


@pytest.mark.parametrize("text", ["", "yes", "On-failure", "on-failure:", "on-failure:x", "always:-1",
                                  "always:10000", "no:2:3", "always;reboot", "on_failure"])
def test_anything_else_is_one_line_naming_it(text: str) -> None:
    with pytest.raises(InputError) as e:
        Policy.parse(text)
    assert str(e.value) == f"--restart {text!r}: use no, on-failure[:N] or always[:N] (N: restarts per lineage)"


@pytest.mark.parametrize("mode, relaunched", [
    ("no", set()),
    ("on-failure", {"crashed", "stalled"}),
    ("always", {"crashed", "stalled", "finished"}),
])
def test_wants_relaunches_failures_and_with_always_a_finished_run_never_a_stopped_or_unreachable_one(
        mode: str, relaunched: set[str]) -> None:
    policy = Policy(mode, 3)
    assert {v for v in VERDICTS if policy.wants(v)} == relaunched


def test_the_backoff_doubles_per_restart_and_stops_at_an_hour() -> None:
    assert [backoff_s(1.5, n) for n in range(5)] == [1.5, 3.0, 6.0, 12.0, 24.0]
    assert backoff_s(60, 5) == 1920.0 and backoff_s(60, 6) == 3600.0 and backoff_s(60, 40) == 3600.0
    assert backoff_s(2, -1) == 2.0  # never below the base
    assert Policy("always", 3).describe() == "always, at most 3 per lineage"
    assert Policy("no", 3).describe() == "no restarts"
