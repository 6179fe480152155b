"""`ctl cache ...` on the local Proxmox host through pct: save, lose, restore byte for byte; torch build
refusal; a copy pulled to the operator's machine; warm-up one GPU at a time with a stand-in warmup script."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from controller.errors import ExitCode
from tests.conftest import WARMUP, fill_cache, install_torch, tree_hashes
from tests.integration.conftest import PveEnv, container_venv

pytestmark = pytest.mark.pvehost


def setup(env: PveEnv, **extra: object) -> tuple[Path, Path, Path]:
    inside, venv = container_venv(env)
    cache, store = f"/workspace/{env.tag}/inductor", f"/workspace/{env.tag}/caches"
    env.write(containers={"ct200": {"vars": {"venv": inside, "compile_cache_dir": cache, "cache_store": store}}},
              **extra)
    root = env.host.rootfs(200)
    return venv, root / cache.lstrip("/"), root / store.lstrip("/")


def test_save_delete_restore_is_byte_identical_and_keeps_what_was_there(pve_env: PveEnv, tmp_path: Path) -> None:
    venv, cache, store = setup(pve_env)
    assert json.loads(pve_env.ctl("cache", "status", "ct200", "--json", check=True).stdout)["exists"] is False
    fill_cache(cache)
    pve_env.host.own_as_ct_root(200, cache.parent, tree=True)  # what a run in the container wrote
    st = pve_env.ctl("cache", "status", "ct200", check=True).stdout
    assert "fxgraph=3 aotautograd=2 triton=4" in st and "no ctl-cache.json marker" in st
    saved = json.loads(pve_env.ctl("cache", "save", "ct200", "good", "--local", str(tmp_path / "pulled"),
                                   "--json", check=True).stdout)
    assert saved["torch_build"] == "2.11.0+cu130"
    tgz = store / "good.tar.gz"
    assert hashlib.sha256(tgz.read_bytes()).hexdigest() == saved["sha256"]
    assert (tmp_path / "pulled" / "good.tar.gz").read_bytes() == tgz.read_bytes()
    before = tree_hashes(cache)
    r = pve_env.ctl("cache", "save", "ct200", "good")
    assert r.returncode == ExitCode.CLOBBER

    shutil.rmtree(cache)  # a cleaned /tmp, a new container
    r = pve_env.ctl("cache", "restore", "ct200", "good")
    assert r.returncode == 0, r.stderr
    assert tree_hashes(cache) == before

    fill_cache(cache, "later")
    pve_env.host.own_as_ct_root(200, cache, tree=True)
    later = tree_hashes(cache)
    r = pve_env.ctl("cache", "restore", "ct200", "good")
    assert r.returncode == 0 and "the previous cache is kept at" in r.stdout
    assert tree_hashes(cache) == before
    (aside,) = cache.parent.glob("inductor.ctl-aside-*")
    assert tree_hashes(aside) == later

    install_torch(venv, "2.11.0+cu128", "12.8")  # the seeds' swap: the saved kernels no longer apply
    r = pve_env.ctl("cache", "restore", "ct200", "good")
    assert r.returncode == ExitCode.ENV_MISMATCH
    assert "made by torch 2.11.0+cu130, the container runs torch 2.11.0+cu128" in r.stderr
    assert tree_hashes(cache) == before
    r = pve_env.ctl("cache", "restore", "ct200", "good", "--force")
    assert r.returncode == 0 and "forced" in r.stdout


def test_warm_one_gpu_at_a_time(pve_env: PveEnv) -> None:
    (pve_env.dir / "warmup_compile.py").write_text(WARMUP)
    warmup = {"src": "warmup_compile.py", "dest": f"/root/{pve_env.tag}/warmup_compile.py"}
    payload = [*pve_env.base_extra["payload"], warmup]
    _, cache, _ = setup(pve_env, payload=payload)
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    r = pve_env.ctl("cache", "warm", "ct200")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[1/3 GPU 5] compiling block 0 on 5" in r.stdout and "on 3 GPU(s) one at a time" in r.stdout
    events = [json.loads(line) for line in (cache.parent / "warm.log").read_text().splitlines()]
    assert [e["gpu"] for e in events] == ["5", "5", "6", "6", "7", "7"]
    assert all(a["end"] <= b["start"] for a, b in zip(events[1::2], events[2::2], strict=False))
    marker = json.loads((cache / "ctl-cache.json").read_text())
    assert marker["by"] == "warm" and marker["torch_build"] == "2.11.0+cu130" and len(marker["gpus"]) == 8
    st = pve_env.ctl("cache", "status", "ct200", check=True).stdout
    assert "built by torch 2.11.0+cu130 (warm" in st
