"""What ctl's agent does for runs across several containers, on this machine: `ctl stop` also ends what the
training started in sessions of its own (as torchrun does with its workers), and a checkpoint travels from one
node to another as packdir's lines into unpackdir, which checks it against its manifest before it is renamed
into place and never replaces a directory."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from controller import farside

agent_mod = farside.load("agent")

REPO = Path(__file__).resolve().parents[1]

START = """\
#!/usr/bin/env bash
# a trainer that leaves a worker in a session of its own, as torchrun does
setsid sleep 600 &
echo "worker $!"
exec sleep 600
"""


@pytest.mark.skipif(shutil.which("tmux") is None or shutil.which("setsid") is None, reason="needs tmux, setsid")
def test_stop_ends_what_the_training_started_in_its_own_session(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "start.j2").write_text(START)
    doc = {"containers": {"loc": {"transport": "local", "root": str(root)}},
           "payload": [{"template": "start.j2", "dest": "/root/start_training.sh", "mode": "0755"}],
           "runs": {"series": "r", "session": "sw", "log": "/workspace/train_{run}.log",
                    "dir": "/workspace/runs/{run}"}}
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "tmux").mkdir()
    env = dict(os.environ, CTL_STATE_DIR=str(tmp_path / "state"), TMUX_TMPDIR=str(tmp_path / "tmux"),
               PYTHONPATH=str(REPO))

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "controller", "-i", str(tmp_path / "inventory.yaml"), *args],
                              capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)

    worker = None
    try:
        assert ctl("deploy", "--allow-dirty").returncode == 0
        r = ctl("launch", "loc", "--run", "sw1")
        assert r.returncode == 0, r.stderr
        log = root / "workspace" / "train_sw1.log"
        deadline = time.monotonic() + 20
        while "worker" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = int(log.read_text().split()[1])
        assert os.getsid(worker) == worker  # its own session: a signal to the training's group misses it
        r = ctl("--json", "stop", "sw1", "--grace", "2")
        assert r.returncode == 0, r.stderr
        assert "stopped by ctl stop" in json.loads(r.stdout)["note"] and "swept 1 straggler(s)" in r.stdout
        assert not agent_mod._pid_alive(worker)  # gone (or a zombie its new parent has not reaped yet)
        worker = None
    finally:
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True)
        if worker is not None:
            os.kill(worker, 9)


def make_checkpoint(d: Path, step: int) -> None:
    d.mkdir(parents=True)
    body = json.dumps({"step": step}).encode()
    (d / "state.json").write_bytes(body)
    (d / "sub").mkdir()
    (d / "sub" / "w.bin").write_bytes(os.urandom(200_000))  # several base64 lines
    files = {n: {"sha256": hashlib.sha256((d / n).read_bytes()).hexdigest()} for n in ("state.json", "sub/w.bin")}
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": files}))


def pack(src: Path, capsys: pytest.CaptureFixture[str]) -> tuple[bytes, dict[str, object]]:
    """packdir's stdout as ctl reads it: a header line, base64 lines, and its answer (main prints it last)."""
    buf = io.BytesIO()

    class Out:
        buffer = buf

    real = agent_mod.sys.stdout
    agent_mod.sys.stdout = Out()  # type: ignore[assignment]
    try:
        answer = agent_mod.packdir({"dir": str(src)})
    finally:
        agent_mod.sys.stdout = real
    lines = buf.getvalue().splitlines()
    assert json.loads(lines[0]) == {"ok": True, "files": 3}
    assert all(len(line) <= 65536 for line in lines[1:])
    return b"".join(base64.b64decode(line) for line in lines[1:]), answer


def test_a_checkpoint_travels_verified_and_never_replaces_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    src = tmp_path / "a" / "checkpoints" / "step_6"
    make_checkpoint(src, 6)
    tar, answer = pack(src, capsys)
    assert answer["ok"] is True and answer["bytes"] == len(tar)
    dest = tmp_path / "b" / "checkpoints" / "step_6"
    got = agent_mod.unpackdir({"dir": str(dest)}, io.BytesIO(tar))
    assert got == {"ok": True, "dir": str(dest)}
    for name in ("state.json", "manifest.json", "sub/w.bin"):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
    assert agent_mod._ckpt_problem(str(dest)) is None
    again = agent_mod.unpackdir({"dir": str(dest)}, io.BytesIO(tar))
    assert again["ok"] is False and again["code"] == "clobber"

    (src / "sub" / "w.bin").write_bytes(b"changed after its manifest was written")
    bad, _answer = pack(src, capsys)
    other = tmp_path / "c" / "step_6"
    refused = agent_mod.unpackdir({"dir": str(other)}, io.BytesIO(bad))
    assert refused["ok"] is False and refused["code"] == "verify" and "does not match its sha256" in refused["error"]
    assert not other.exists() and os.listdir(other.parent) == []  # nothing half-copied is left


def test_ckptscan_below_a_step_answers_the_newest_complete_one_under_it(tmp_path: Path) -> None:
    """A job relaunch whose newest step one node cannot hold asks for the newest complete step under it; the
    same question about one step (below step + 1) answers that step when it is complete there."""
    base = tmp_path / "runs" / "r1" / "checkpoints"
    for step in (8, 16, 24):
        make_checkpoint(base / f"step_{step}", step)
    (base / "step_16" / "manifest.json").unlink()  # half-written: never an answer
    dirs = [{"run": "r1", "dir": str(base)}]
    assert agent_mod.ckptscan({"dirs": dirs})["found"]["step"] == 24
    assert agent_mod.ckptscan({"dirs": dirs, "below": 24})["found"]["step"] == 8  # 16 is not complete
    assert agent_mod.ckptscan({"dirs": dirs, "below": 25})["found"]["step"] == 24
    assert agent_mod.ckptscan({"dirs": dirs, "below": 8})["found"] is None
