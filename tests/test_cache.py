"""`ctl cache ...` and `ctl env ...` end to end through the CLI against the local transport (a directory
standing for the container's /), with real venvs, real tarballs and the real agent; nothing is mocked."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from controller.errors import ExitCode
from tests.conftest import WARMUP, add_dist, fill_cache, good_venv, install_torch, tree_hashes

REPO = Path(__file__).resolve().parents[1]
CACHE = "workspace/.cache/torchinductor"
STORE = "workspace/.ctl-caches"


class Ctl:
    def __init__(self, tmp: Path, **container: object) -> None:
        self.tmp = tmp
        self.root = tmp / "ct"
        self.root.mkdir()
        self.inventory = tmp / "inventory.yaml"
        self.env = dict(os.environ, CTL_STATE_DIR=str(tmp / "state"), PYTHONPATH=str(REPO))
        self.write(**container)

    def write(self, payload: list[dict[str, str]] | None = None, **container: object) -> None:
        spec = {"transport": "local", "root": "ct", "vars": {"venv": "/root/venv"}, **container}
        self.inventory.write_text(yaml.safe_dump({"containers": {"box": spec}, "payload": payload or []}))

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "controller", "-i", str(self.inventory), *args],
                              capture_output=True, text=True, env=self.env, timeout=120, cwd=self.tmp)

    def json(self, *args: str) -> dict[str, object]:
        r = self("--json", *args)
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert isinstance(doc, dict)
        return doc


@pytest.fixture
def box(tmp_path: Path) -> Ctl:
    c = Ctl(tmp_path)
    good_venv(c.root / "root" / "venv")
    return c


def test_status_save_delete_restore_is_byte_identical(box: Ctl) -> None:
    cache = box.root / CACHE
    st = box.json("cache", "status", "box")
    assert st["exists"] is False
    fill_cache(cache)
    st = box.json("cache", "status", "box")
    assert st["entries"] == {"fxgraph": 3, "aotautograd": 2, "triton": 4} and st["files"] == 10
    assert st["marker"] is None

    saved = box.json("cache", "save", "box", "good1")
    assert saved["torch_build"] == "2.11.0+cu130"
    tgz = box.root / STORE / "good1.tar.gz"
    assert hashlib.sha256(tgz.read_bytes()).hexdigest() == saved["sha256"]
    side = json.loads((box.root / STORE / "good1.json").read_text())
    assert side["sha256"] == saved["sha256"] and side["torch_build"] == "2.11.0+cu130"
    marker = json.loads((cache / "ctl-cache.json").read_text())
    assert marker["torch_build"] == "2.11.0+cu130" and marker["by"] == "save"
    before = tree_hashes(cache)

    shutil.rmtree(cache)  # what a cleaned /tmp did to the seeds
    r = box("cache", "restore", "box", "good1")
    assert r.returncode == 0, r.stderr
    assert tree_hashes(cache) == before
    st = box.json("cache", "status", "box")
    assert st["marker"]["torch_build"] == "2.11.0+cu130"  # type: ignore[index]
    assert [s["name"] for s in st["saved"]] == ["good1"]  # type: ignore[union-attr]


def test_save_never_overwrites_a_name(box: Ctl) -> None:
    fill_cache(box.root / CACHE)
    box.json("cache", "save", "box", "keep")
    tgz = box.root / STORE / "keep.tar.gz"
    first = tgz.read_bytes()
    fill_cache(box.root / CACHE, "b")
    r = box("cache", "save", "box", "keep")
    assert r.returncode == ExitCode.CLOBBER
    assert "already exists" in r.stderr and "never overwritten" in r.stderr
    assert tgz.read_bytes() == first
    r = box("cache", "save", "box", "../evil")
    assert r.returncode == ExitCode.INPUT and "invalid cache name" in r.stderr


def test_restore_keeps_the_current_cache_aside(box: Ctl) -> None:
    cache = box.root / CACHE
    fill_cache(cache)
    box.json("cache", "save", "box", "one")
    one = tree_hashes(cache)
    shutil.rmtree(cache)
    fill_cache(cache, "other")
    other = tree_hashes(cache)
    res = box.json("cache", "restore", "box", "one")
    assert tree_hashes(cache) == one
    aside = box.root / str(res["aside"]).lstrip("/")
    assert aside.name.startswith("torchinductor.ctl-aside-")
    assert tree_hashes(aside) == other  # nothing deleted


def test_restore_refuses_another_torch_build_unless_forced(box: Ctl) -> None:
    cache = box.root / CACHE
    fill_cache(cache)
    box.json("cache", "save", "box", "cu130")
    install_torch(box.root / "root" / "venv", "2.11.0+cu128", "12.8")  # the seeds' swap
    before = tree_hashes(cache)
    r = box("cache", "restore", "box", "cu130")
    assert r.returncode == ExitCode.ENV_MISMATCH
    assert "made by torch 2.11.0+cu130" in r.stderr and "2.11.0+cu128" in r.stderr and "--force" in r.stderr
    assert tree_hashes(cache) == before
    res = box.json("cache", "restore", "box", "cu130", "--force")
    assert res["forced"] is True and res["live_torch_build"] == "2.11.0+cu128"


def test_damaged_tarball_is_refused_and_nothing_moves(box: Ctl) -> None:
    cache = box.root / CACHE
    fill_cache(cache)
    box.json("cache", "save", "box", "x")
    tgz = box.root / STORE / "x.tar.gz"
    data = bytearray(tgz.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tgz.write_bytes(bytes(data))
    before = tree_hashes(cache)
    r = box("cache", "restore", "box", "x")
    assert r.returncode == ExitCode.VERIFY and "does not match its sidecar" in r.stderr
    assert tree_hashes(cache) == before
    assert not list(cache.parent.glob("*.ctl-aside-*"))
    r = box("cache", "restore", "box", "nosuch")
    assert r.returncode == ExitCode.INPUT and "no saved cache 'nosuch'" in r.stderr


def test_unsafe_archive_members_are_refused(box: Ctl) -> None:
    store = box.root / STORE
    store.mkdir(parents=True)
    evil = store / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("fxgraph/link")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    sha = hashlib.sha256(evil.read_bytes()).hexdigest()
    (store / "evil.json").write_text(json.dumps({"sha256": sha, "torch_build": "2.11.0+cu130"}))
    r = box("cache", "restore", "box", "evil")
    assert r.returncode == ExitCode.VERIFY and "link leaving the cache" in r.stderr
    assert not (box.root / CACHE).exists()


def test_save_local_copy(box: Ctl, tmp_path: Path) -> None:
    fill_cache(box.root / CACHE)
    res = box.json("cache", "save", "box", "pulled", "--local", str(tmp_path / "here"))
    local = tmp_path / "here" / "pulled.tar.gz"
    assert res["local_path"] == str(local)
    assert local.read_bytes() == (box.root / STORE / "pulled.tar.gz").read_bytes()
    assert json.loads((tmp_path / "here" / "pulled.json").read_text())["sha256"] == res["sha256"]


def test_warm_runs_one_gpu_at_a_time_and_marks_the_cache(tmp_path: Path) -> None:
    box = Ctl(tmp_path, gpus={"target": [0, 1], "drafter": [5, 6, 7]},
              vars={"venv": "/root/venv", "train_args": {"model": "tiny", "seq-len": 128, "steps": 9}})
    good_venv(box.root / "root" / "venv")
    r = box("cache", "warm", "box")
    assert r.returncode == ExitCode.INPUT and "warmup_compile.py" in r.stderr
    box.write(gpus={"target": [0, 1], "drafter": [5, 6, 7]},
              vars={"venv": "/root/venv", "train_args": {"model": "tiny", "seq-len": 128, "steps": 9}},
              payload=[{"src": "warmup_compile.py", "dest": "/root/warmup_compile.py"}])
    r = box("cache", "warm", "box")
    assert r.returncode == ExitCode.INPUT and "ctl deploy box" in r.stderr
    (box.root / "root" / "warmup_compile.py").write_text(WARMUP)
    r = box("cache", "warm", "box")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[1/3 GPU 5] compiling block 0 on 5" in r.stdout and "[3/3 GPU 7] compiling block 2 on 7" in r.stdout
    events = [json.loads(line) for line in (box.root / CACHE).parent.joinpath("warm.log").read_text().splitlines()]
    assert [e["gpu"] for e in events] == ["5", "5", "6", "6", "7", "7"]
    for a, b in zip(events[1::2], events[2::2], strict=False):
        assert a["end"] <= b["start"]  # never concurrently
    assert events[0]["argv"] == ["--targets", "1", "--drafters", "1", "--device", "cuda", "--model", "tiny",
                                 "--seq-len", "128", "--steps", "9", "--compile-cache",
                                 str(box.root / CACHE / "artifacts.bin")]
    marker = json.loads((box.root / CACHE / "ctl-cache.json").read_text())
    assert marker["by"] == "warm" and marker["torch_build"] == "2.11.0+cu130"


# --- env (local transport) -----------------------------------------------------------------------


def test_env_check_lock_and_sync_without_uv(box: Ctl) -> None:
    r = box("env", "check", "box")
    assert r.returncode == ExitCode.INPUT and "no lock configured" in r.stderr and "ctl env lock box" in r.stderr
    assert box("env", "lock", "box", "-o", "env/box.lock").returncode == 0
    r = box("env", "lock", "box", "-o", "env/box.lock")
    assert r.returncode == ExitCode.CLOBBER and "--force" in r.stderr
    box.write(lock="env/box.lock")
    r = box("env", "check", "box")
    assert r.returncode == 0 and "matches" in r.stdout
    venv = box.root / "root" / "venv"
    add_dist(venv, "sglang", "0.5.5")
    install_torch(venv, "2.11.0+cu128", "12.8")
    r = box("env", "check", "box")
    assert r.returncode == ExitCode.ENV_MISMATCH
    assert "sglang: 0.5.5 installed, not in the lock" in r.stdout
    assert "build tag cu130 -> cu128" in r.stdout
    probe = box("env", "probe", "box")
    assert "2.11.0+cu128 (CUDA tag cu128" in probe.stdout and "fingerprint" in probe.stdout

    dry = box("env", "sync", "box", "--dry-run", "--uv", "/opt/uv/bin/uv")  # not found, whatever this machine has
    assert dry.returncode == 0, dry.stderr
    assert "take a snapshot first: ctl snapshot box pre-sync-" in dry.stdout
    assert "uv venv --python" in dry.stdout and "mv -T" in dry.stdout and "uv is not installed" in dry.stdout
    r = box("env", "sync", "box", "--yes", "--uv", "/opt/uv/bin/uv")
    assert r.returncode == ExitCode.FAILURE
    assert "uv is not installed in the container (looked for /opt/uv/bin/uv)" in r.stderr
    assert venv.is_dir() and not venv.is_symlink()
