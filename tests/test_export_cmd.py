"""`ctl export`'s decisions without a container: which node's checkpoint it takes (the newest complete one, or
step N) from each node's checkpoint scan, and the one line it gives when there is none; the registry's exports
table, added to an older registry file in place."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from controller.commands.export import Found, pick, summary_of
from controller.errors import CtlError, InputError
from controller.lifecycle import Lifecycle
from controller.registry import SCHEMA, Registry, RunRecord

CK = "/workspace/runs/fresh1/checkpoints"


def rec(ct: str = "ct200", name: str = "fresh1") -> RunRecord:
    return RunRecord(id=1, name=name, ct=ct, host=None, created=0.0, started=None, ended=None,
                     state=Lifecycle.FINISHED, exit_status=0, session=None, log_path=None,
                     run_dir="/workspace/runs/fresh1", command=None, commit_sha=None, dirty=False)


def scan(step: int | None, *skipped: tuple[int, str]) -> dict[str, Any]:
    return {"ok": True, "found": None if step is None else {"run": "fresh1", "dir": f"{CK}/step_{step}", "step": step},
            "skipped": [{"dir": f"{CK}/step_{s}", "why": why} for s, why in skipped]}


def test_the_newest_complete_checkpoint_of_all_nodes_is_taken() -> None:
    assert pick(rec(), CK, [("ct200", scan(80))], None) == Found("ct200", f"{CK}/step_80", 80)
    # A job: rank 0's node holds the newest; another node has an older copy (a restart spread it there).
    got = pick(rec("pair"), CK, [("ct300", scan(40)), ("ct200", scan(120, (160, "no manifest.json")))], None)
    assert got == Found("ct200", f"{CK}/step_120", 120)
    assert pick(rec(), CK, [("ct200", scan(120))], 40) == Found("ct200", f"{CK}/step_40", 40)


@pytest.mark.parametrize(("scans", "step", "says"), [
    ([("ct200", scan(None))], None, f"run ct200/fresh1 has no checkpoint in {CK} (the payload writes one"),
    ([("ct200", scan(None, (80, "no manifest.json (written last: the checkpoint is incomplete)")))], None,
     f"run ct200/fresh1 has no complete checkpoint in {CK}: ct200:{CK}/step_80: no manifest.json (written last"),
    ([("ct200", scan(80))], 120, "run ct200/fresh1: no checkpoint step 120 (the newest complete one is step 80)"),
    ([("ct200", scan(40, (80, "drafter.pt does not match its sha256 in the manifest")))], 80,
     f"run ct200/fresh1: checkpoint step 80 is not complete (ct200:{CK}/step_80: drafter.pt does not match"),
    ([("ct200", scan(None))], 80, f"run ct200/fresh1 has no complete checkpoint in {CK}, so no step 80"),
])
def test_no_usable_checkpoint_is_one_line(scans: list[tuple[str, dict[str, Any]]], step: int | None,
                                          says: str) -> None:
    with pytest.raises(InputError) as e:
        pick(rec(), CK, scans, step)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_the_exporters_summary_is_checked_before_anything_is_copied() -> None:
    good = ('{"ok": true, "step": 80, "files": {"config.json": {"sha256": "' + "a" * 64 + '", "bytes": 10}, '
            '"model.safetensors": {"sha256": "' + "b" * 64 + '", "bytes": 20}}}')
    assert summary_of("ct200", "exported ...\n" + good + "\n")["step"] == 80
    for bad in ("", "not json", good.replace('"a', '"../a'), good.replace("config.json", "../../etc/passwd"),
                good.replace('"step": 80', '"step": "80"')):
        with pytest.raises(CtlError, match="answered no summary ctl can check"):
            summary_of("ct200", bad)


def test_an_older_registry_gets_the_exports_table_and_keeps_its_runs(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite3"
    db = sqlite3.connect(path)
    for i, script in enumerate(SCHEMA[:7], start=1):  # as ctl wrote it before `ctl export`
        db.executescript(script)
        db.execute(f"PRAGMA user_version={i}")
    db.execute("INSERT INTO runs (name, ct, created, state, good) VALUES ('fresh1', 'local', 1.0, 'finished', 0)")
    db.commit()
    db.close()
    reg = Registry(path)
    run = reg.find_run("fresh1")
    assert reg.exports(run.id) == []
    files = {"config.json": {"sha256": "a" * 64, "bytes": 10}}
    reg.add_export(run.id, step=80, dtype="bfloat16", node="local", checkpoint="/w/step_80", path="/x/fresh1-step80",
                   files=files, provenance={"metrics": {"loss": 0.5}}, when=5.0)
    (e,) = reg.exports(run.id)
    assert (e["step"], e["dtype"], e["path"], e["files"], e["provenance"]["metrics"], e["time"]) == (
        80, "bfloat16", "/x/fresh1-step80", files, {"loss": 0.5}, 5.0)
    reg.close()
    assert [x["step"] for x in Registry(path).exports(run.id)] == [80]  # opened again: migrated once
