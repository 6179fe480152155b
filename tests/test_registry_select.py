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


def test_a_later_ctls_registry_stays_readable_by_this_one(tmp_path: Path) -> None:
    """A registry a newer ctl migrated (a schema version past this one's, a column this one does not know) read
    after a downgrade: the runs come back as they were, the unknown column left out, not a TypeError."""
    import sqlite3

    from controller.registry import SCHEMA

    path = tmp_path / "registry.sqlite3"
    reg = Registry(path)
    run = reg.claim_run("fresh1", "ct200", created=1000.0)
    reg.update_run(run.id, state=Lifecycle.FINISHED)
    reg.close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE runs ADD COLUMN a_later_ctls_column TEXT")
        db.execute("UPDATE runs SET a_later_ctls_column='x'")
        db.execute(f"PRAGMA user_version={len(SCHEMA) + 1}")
    again = Registry(path)
    try:
        (got,) = again.runs("ct200")
        assert (got.id, got.name, got.ct, got.state) == (run.id, "fresh1", "ct200", Lifecycle.FINISHED)
        assert again.run_by_id(run.id).name == "fresh1"
    finally:
        again.close()
