"""`ctl store status|prune` on the `local` target: the newest store_keep versions per destination, the version
each last deploy replaced, every version a recorded run used and anything recent are kept; nothing is deleted
without `prune`, and `--dry-run` deletes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from controller.commands.store import RECENT_S, plan
from controller.registry import Registry
from tests.helpers import sha_bytes

REPO = Path(__file__).resolve().parent.parent


def test_plan_keeps_newest_rollback_runs_and_recent() -> None:
    now = 1e9
    old = {"bytes": 1, "mode": "0644", "mtime": now - 2 * RECENT_S}
    deploys = [{"time": i, "files": [{"dest": "/a", "sha256": f"v{i}", "previous": f"v{i - 1}" if i else None}]}
               for i in range(8)]
    objects = {f"v{i}": dict(old) for i in range(8)} | {"orphan": dict(old), "fresh": dict(old, mtime=now)}
    keep, delete = plan({"now": now, "objects": objects, "deploys": deploys,
                         "temps": {".x.tmp1": dict(old), ".y.tmp2": dict(old, mtime=now)}}, 3, {"v1"})
    assert keep == {"v7": "newest", "v6": "newest", "v5": "newest", "v1": "run", "fresh": "recent"}
    assert delete == ["orphan", "v0", "v2", "v3", "v4", ".x.tmp1"]
    keep1, _ = plan({"now": now, "objects": objects, "deploys": deploys}, 1, set())
    assert keep1["v7"] == "newest" and keep1["v6"] == "rollback"  # `ctl deploy --rollback` keeps working


def ctl(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CTL_STATE_DIR=str(tmp / "state"), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "controller", "-i", str(tmp / "inventory.yaml"), *args],
                          capture_output=True, text=True, env=env, cwd=tmp, timeout=120)


def test_status_and_prune_on_the_local_target(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({
        "containers": {"loc": {"transport": "local", "root": str(root), "store_keep": 2}},
        "payload": [{"src": "a.txt", "dest": "/root/a.txt"}]}))
    versions = []
    for i in range(5):
        body = f"version {i}\n".encode()
        versions.append(sha_bytes(body))
        (tmp_path / "a.txt").write_bytes(body)
        r = ctl(tmp_path, "deploy", "--allow-dirty")
        assert r.returncode == 0, r.stdout + r.stderr
    objects = root / "var/lib/ctl/objects"
    assert sorted(p.name for p in objects.iterdir()) == sorted(versions)
    past = time.time() - 2 * RECENT_S
    for p in objects.iterdir():
        os.utime(p, (past, past))
    reg = Registry(tmp_path / "state" / "registry.sqlite3")
    reg.claim_run("fresh1", "loc", files={"/root/a.txt": versions[0]})
    reg.close()

    st = json.loads(ctl(tmp_path, "--json", "store", "status").stdout)[0]
    assert st["objects"] == 5 and st["dests"] == [{"dest": "/root/a.txt", "versions": 5, "bytes": 50}]
    dry = ctl(tmp_path, "store", "prune", "--dry-run")
    assert dry.returncode == 0 and "would delete 2 of 5 objects" in dry.stdout, dry.stdout + dry.stderr
    assert len(list(objects.iterdir())) == 5
    done = json.loads(ctl(tmp_path, "--json", "store", "prune").stdout)[0]
    assert sorted(done["deleted"]) == sorted([versions[1], versions[2]])
    assert sorted(p.name for p in objects.iterdir()) == sorted([versions[0], versions[3], versions[4]])
    r = ctl(tmp_path, "deploy", "--rollback")  # what the last deploy replaced is still there
    assert r.returncode == 0 and (root / "root/a.txt").read_bytes() == b"version 3\n", r.stdout + r.stderr
