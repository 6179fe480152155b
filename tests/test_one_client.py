"""One client of ctl's agent per container for a whole command (remote/client.py `Agent.of`, on the transport the
Pool hands out for that container every time), and the agent's directory copy between containers
(`Agent.copy_dir`, what a job's relaunch uses to give every node the checkpoint it resumes from)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.errors import CtlError
from controller.inventory import Inventory, load
from controller.remote.client import Agent
from controller.transport.local import LocalContainer
from controller.transport.pool import Pool
from tests.conftest import LocalEnv
from tests.helpers import COUNTED


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_a_launch_speaks_to_its_container_through_one_agent_client(env: LocalEnv) -> None:
    """`ctl launch` checks, probes, claims, starts and looks at the run: every step through one client."""
    (env.root / "root" / "args").mkdir(parents=True, exist_ok=True)
    (env.root / "root" / "args" / "one1").write_text("--steps 2")
    counts = env.dir / "agents.json"
    r = subprocess.run([sys.executable, "-c", COUNTED, str(counts), "-i", str(env.inventory), "launch", "loc",
                        "--run", "one1"], capture_output=True, text=True, timeout=120, env=env.env, cwd=env.dir)
    assert r.returncode == 0, r.stderr
    assert "launched one1 on loc" in r.stdout
    assert json.loads(counts.read_text()) == {"loc": 1}


def _inventory(tmp_path: Path, names: tuple[str, ...]) -> Inventory:
    doc = {"containers": {n: {"transport": "local", "root": str(tmp_path / n)} for n in names}}
    for n in names:
        (tmp_path / n).mkdir()
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load(path)


def test_the_pool_gives_a_container_one_transport_and_so_one_client(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, ("a", "b"))
    with Pool(inv) as pool:
        a = pool.container(inv.container("a"))
        assert pool.container(inv.container("a")) is a
        assert Agent.of(a) is Agent.of(pool.container(inv.container("a")))
        assert Agent.of(pool.container(inv.container("b"))) is not Agent.of(a)
    with Pool(inv) as other:  # another command: its own connections, its own clients
        assert Agent.of(other.container(inv.container("a"))) is not Agent.of(a)


def _checkpoint(d: Path, step: int) -> dict[str, str]:
    """A complete checkpoint as the payload writes one: its files, then manifest.json with their sha256s."""
    (d / "sub").mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"step": step}))
    (d / "sub" / "w.bin").write_bytes(os.urandom(300_000))  # several of packdir's base64 lines
    files = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in ("state.json", "sub/w.bin")}
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": {n: {"sha256": h} for n, h in files.items()}}))
    return files


def test_copy_dir_gives_each_container_its_own_verified_copy_and_replaces_none(tmp_path: Path) -> None:
    a, b, c = (LocalContainer(n, tmp_path / n) for n in ("a", "b", "c"))
    files = _checkpoint(tmp_path / "a" / "ckpt" / "step_6", 6)
    answers = Agent.of(a).copy_dir("/ckpt/step_6", [(Agent.of(b), ()), (Agent.of(c), ())])
    assert [d["ok"] for d in answers] == [True, True]
    for n in ("b", "c"):
        got = tmp_path / n / "ckpt" / "step_6"
        assert {f: hashlib.sha256((got / f).read_bytes()).hexdigest() for f in files} == files
        assert (got / "manifest.json").read_bytes() == (tmp_path / "a" / "ckpt" / "step_6" / "manifest.json"
                                                        ).read_bytes()

    again = Agent.of(a).copy_dir("/ckpt/step_6", [(Agent.of(b), ())])
    assert again[0]["ok"] is False and again[0]["code"] == "clobber"  # a directory there is never replaced

    (tmp_path / "a" / "ckpt" / "step_6" / "sub" / "w.bin").write_bytes(b"changed after its manifest")
    d = LocalContainer("d", tmp_path / "d")
    bad = Agent.of(a).copy_dir("/ckpt/step_6", [(Agent.of(d), ())])
    assert bad[0]["ok"] is False and bad[0]["code"] == "verify"
    assert not (tmp_path / "d" / "ckpt" / "step_6").exists()  # nothing half-copied is left in its place


def test_copy_dir_of_no_checkpoint_is_one_line_naming_the_container(tmp_path: Path) -> None:
    a, b = (LocalContainer(n, tmp_path / n) for n in ("a", "b"))
    (tmp_path / "a" / "ckpt" / "empty").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    with pytest.raises(CtlError) as got:
        Agent.of(a).copy_dir("/ckpt/empty", [(Agent.of(b), ())])
    assert str(got.value).startswith("a: ") and "not a checkpoint directory" in str(got.value)
    ckpt = tmp_path / "b" / "ckpt"
    assert not ckpt.exists() or os.listdir(ckpt) == []  # the receiving side ended and left nothing behind

