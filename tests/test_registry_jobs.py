"""The registry's schema version 5 (runs across several containers): an old (version 4) file is migrated in
place and its runs read as before; a run's name is claimed on every node or on none; a node's row stands for
its whole run wherever a run is looked up."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from controller.errors import BusyError
from controller.lifecycle import Lifecycle
from controller.registry import SCHEMA, Registry


def v4_file(path: Path) -> None:
    """A registry as ctl wrote it before version 5, with one run and one deploy in it."""
    db = sqlite3.connect(path)
    for i, script in enumerate(SCHEMA[:4], start=1):
        db.executescript(script)
        db.execute(f"PRAGMA user_version={i}")
    db.execute("INSERT INTO runs (name, ct, host, created, state, exit_status, log_path, files, good) "
               "VALUES ('fresh6', 'ct200', 'kpro6', 1000.0, 'finished', 0, '/workspace/f6.log', ?, 1)",
               ('{"/root/a": "ab"}',))
    db.execute("INSERT INTO events (run_id, time, kind, summary, doc) VALUES (1, 1001.0, 'verdict', 'ok', '{}')")
    db.commit()
    db.close()


def test_a_version_4_file_is_migrated_and_its_runs_read_as_before(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite3"
    v4_file(path)
    reg = Registry(path)
    assert reg._db.execute("PRAGMA user_version").fetchone()[0] == len(SCHEMA) >= 5
    (old,) = reg.runs(None)
    assert (old.name, old.ct, old.state, old.exit_status, old.good) == ("fresh6", "ct200", Lifecycle.FINISHED, 0, True)
    assert old.files == {"/root/a": "ab"} and old.nodes is None and old.member_of is None and not old.multi
    assert reg.find_run("fresh6").id == old.id and reg.baseline("ct200") is not None
    assert [e["summary"] for e in reg.events(old.id)] == ["ok"]
    reg.close()
    again = Registry(path)  # opening a migrated file again changes nothing
    assert [r.name for r in again.runs(None)] == ["fresh6"]


def test_a_run_across_nodes_is_one_run_with_its_members(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.sqlite3")
    run, members = reg.claim_job_run("fresh7", "pair", [("ct200", "pve1"), ("ct300", "pve2")],
                                     session="s-fresh7", log_path="/w/f7.log", run_dir="/w/runs/fresh7")
    assert run.multi and run.nodes == 2 and run.ct == "pair" and run.state == Lifecycle.STARTING
    assert [(m.ct, m.host, m.node_rank, m.member_of, m.log_path) for m in members] == [
        ("ct200", "pve1", 0, run.id, "/w/f7.log"), ("ct300", "pve2", 1, run.id, "/w/f7.log")]
    assert [r.id for r in reg.runs(None)] == [run.id]  # one row per run
    assert [r.ct for r in reg.runs("ct300")] == ["ct300"]  # what ran in a container: its node's row
    for ref in ("fresh7", "pair/fresh7", "ct300/fresh7", f"#{members[1].id}"):
        assert reg.find_run(ref).id == run.id, ref  # a node stands for its whole run
    assert "fresh7" in reg.names("ct200") and "fresh7" in reg.names("pair")


def test_the_name_is_claimed_on_every_node_or_on_none(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.sqlite3")
    reg.claim_run("fresh8", "ct300")  # a run of its own on one node
    with pytest.raises(BusyError, match=r"'fresh8' is taken on ct300 .*nothing claimed on any node of pair"):
        reg.claim_job_run("fresh8", "pair", [("ct200", "pve1"), ("ct300", "pve2")])
    assert reg.names("ct200") == [] and reg.names("pair") == []
    run, _ = reg.claim_job_run("fresh9", "pair", [("ct200", "pve1"), ("ct300", "pve2")])
    with pytest.raises(BusyError, match="a node of another run"):
        reg.claim_job_run("fresh9", "quad", [("ct201", "pve1"), ("ct200", "pve1")])
    assert reg.names("ct201") == []
    with pytest.raises(BusyError):  # and a run of its own cannot take a node's name either
        reg.claim_run("fresh9", "ct300")
    reg.release_run(run.id)  # refused by a preflight: every row goes
    assert reg.names("ct200") == reg.names("pair") == [] and reg.names("ct300") == ["fresh8"]


def test_release_keeps_a_run_whose_node_started(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.sqlite3")
    run, members = reg.claim_job_run("r1", "pair", [("ct200", "pve1"), ("ct300", "pve2")])
    reg.update_run(members[0].id, state=Lifecycle.RUNNING)
    reg.release_run(run.id)
    assert [m.ct for m in reg.members(run.id)] == ["ct200"] and reg.run_by_id(run.id).multi
    reg.forget_job_claim(run.id)  # only when every node answered that it started nothing
    assert reg.runs(None) == [] and reg.names("ct200") == []
