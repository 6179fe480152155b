"""The registry's selections that read only what they select (live runs, the runs a container's newest rows
belong to, runs a supervisor saw go and has not seen end), each held to the answer of reading every record, over
registries of random history in a real SQLite file."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from controller.commands.runs import whole_runs
from controller.commands.supervise import TERMINAL
from controller.lifecycle import Lifecycle
from controller.registry import Registry

CTS = ["ct200", "ct201", "ct300"]
VERDICTS = ["ok", "slow", "stalled", "finished", "crashed", "stopped", "", None]


def _history(reg: Registry, rng: random.Random, n: int) -> None:
    """n runs, some across two containers, in random states, some with verdict events; created times apart."""
    states = list(Lifecycle)
    for i in range(n):
        created = 1000.0 + i
        if rng.random() < 0.2:
            nodes = rng.sample(CTS, 2)
            run, members = reg.claim_job_run(f"j{i}", "pair", [(c, "pve1") for c in nodes], created=created)
            for m in members:
                reg.update_run(m.id, state=rng.choice(states))
            ids = [run.id]
        else:
            run = reg.claim_run(f"r{i}", rng.choice(CTS), created=created)
            ids = [run.id]
        for rid in ids:
            reg.update_run(rid, state=rng.choice(states))
            for _ in range(rng.randrange(3)):
                v = rng.choice(VERDICTS)
                reg.add_event(rid, "verdict", "v", {}, to_verdict=v)


@pytest.mark.parametrize("seed", range(4))
def test_selections_match_reading_every_record(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    reg = Registry(tmp_path / "r.sqlite3")
    _history(reg, rng, 120)
    assert [r.id for r in reg.live_runs()] == [r.id for r in reg.runs(None, limit=10_000) if r.state.live]
    assert reg.live_ids() == [(r.id, r.ct) for r in reg.live_runs()]
    for ct in CTS:
        everything = reg.runs(ct, limit=10_000)
        assert [r.id for r in reg.live_runs(ct)] == [r.id for r in everything if r.state.live]
        for limit in (1, 7, 50):
            assert reg.latest_whole(ct, limit) == [(w.id, w.state) for w in whole_runs(reg, reg.runs(ct, limit=limit))]
    unsettled = sorted(reg.unsettled_runs(TERMINAL))
    assert unsettled == sorted((r.id, r.ct) for r in reg.runs(None, limit=10_000)
                               if not r.state.live and (reg.last_verdict(r.id) or "") not in TERMINAL | {""})
    assert unsettled  # the random history has some (else this test would check nothing)


def test_live_runs_read_no_record_of_the_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry(tmp_path / "r.sqlite3")
    for i in range(300):
        reg.update_run(reg.claim_run(f"old{i}", "ct200").id, state=Lifecycle.FINISHED)
    live = reg.claim_run("now", "ct200")
    from controller import registry

    decoded: list[int] = []
    real = registry._run
    monkeypatch.setattr(registry, "_run", lambda row: decoded.append(1) or real(row))
    assert [r.id for r in reg.live_runs("ct200")] == [r.id for r in reg.live_runs()] == [live.id]
    assert reg.latest_whole("ct200", 50)[0] == (live.id, Lifecycle.STARTING)
    assert reg.live_ids() == [(live.id, "ct200")]
    assert len(decoded) == 2  # the live run, once for each call of live_runs; none of the 300 finished ones
