"""A `starting` run (its launch got no answer) reconciled from what its container shows (reconcile._reconcile)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from controller.commands import reconcile
from controller.lifecycle import Lifecycle
from controller.registry import Registry, RunRecord


def _claim(tmp_path: Path, age: float = 0.0) -> tuple[Registry, RunRecord]:
    reg = Registry(tmp_path / "r.sqlite3")
    rec = reg.claim_run("cut1", "ct200", log_path="/w/train_cut1.log", session="s-cut1")
    rec = reg.update_run(rec.id, created=rec.created - age, note=f"{reconcile.UNKNOWN_OUTCOME}: SSH connection dropped")
    return reg, rec


def _st(**kw: Any) -> dict[str, Any]:
    return {"name": "cut1", "exit": None, "pid": None, "alive": False, "session": False, "log_size": None, **kw}


def test_running_in_the_container_becomes_running_with_the_launch_record(tmp_path: Path) -> None:
    reg, rec = _claim(tmp_path)
    record = {"run": "cut1", "created": rec.created, "command": "tmux new-session ...", "commit": "abc",
              "dirty": False, "files": {"/root/start_training.sh": "00"}, "vars": {"steps": 6}}
    new = reconcile._reconcile(reg, rec, _st(pid=42, alive=True, session=True, log_size=10, record=record))
    assert new is not None and new.state == Lifecycle.RUNNING
    assert (new.command, new.commit_sha, new.files) == ("tmux new-session ...", "abc", record["files"])
    assert new.note is not None and "reconciled from the container" in new.note and "SSH connection" in new.note


def test_an_exit_status_beside_the_log_finishes_it(tmp_path: Path) -> None:
    reg, rec = _claim(tmp_path)
    new = reconcile._reconcile(reg, rec, _st(pid=42, exit=3, log_size=10, log_mtime=time.time()))
    assert new is not None and (new.state, new.exit_status) == (Lifecycle.FAILED, 3)


def test_nothing_in_the_container_waits_for_a_launch_in_progress_then_is_lost(tmp_path: Path) -> None:
    reg, rec = _claim(tmp_path)
    assert reconcile._reconcile(reg, rec, _st()) is None  # a launch may still be in its preflight
    assert reconcile._reconcile(reg, rec, _st(session=True)) is None
    reg, rec = _claim(tmp_path / "old", age=reconcile.LAUNCH_GRACE_S + 1)
    new = reconcile._reconcile(reg, rec, _st())
    assert new is not None and new.state == Lifecycle.LOST and "never started" in str(new.note)
    assert reg.names("ct200") == ["cut1"]  # the name stays claimed


def test_a_record_of_another_launch_means_this_one_started_nothing(tmp_path: Path) -> None:
    reg, rec = _claim(tmp_path)
    new = reconcile._reconcile(reg, rec, _st(log_size=5, record={"run": "cut1", "created": 1.0}))
    assert new is not None and new.state == Lifecycle.LOST and "belongs to another launch" in str(new.note)


def test_a_pid_file_naming_another_process_leaves_it_starting(tmp_path: Path) -> None:
    reg, rec = _claim(tmp_path)
    assert reconcile._reconcile(reg, rec, _st(pid=7, log_size=5, impostor="pid 7 (sleep 300): its CTL_RUN is unset")) \
        is None
