"""Full checkpoints: atomic directories with a manifest written last, found from a run directory, verified
before use, and every RNG state restored."""

from __future__ import annotations

import json
import random

import pytest
import torch

from remote_payload import dflash_ckpt as ck


class Tiny(torch.nn.Linear):
    def __init__(self):
        super().__init__(3, 3)
        self.c = type("C", (), {"to_dict": lambda self: {"width": 3}})()


def save(root, step, model=None):
    model = model or Tiny()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return ck.save_full(root, step, model, opt, scheduler={"total_steps": 9}, data={"next_global_batch": step},
                        args={"steps": 9}, provenance={"target": "tiny"})


def test_save_writes_a_verified_directory_and_an_index(tmp_path):
    path = save(tmp_path, 4)
    assert sorted(p.name for p in path.iterdir()) == ["drafter.pt", "manifest.json", "train_state.pt"]
    assert not list(tmp_path.glob(".step_*"))  # the temporary directory was renamed, not left behind
    manifest = ck.verify(path)
    assert manifest["step"] == 4 and manifest["provenance"] == {"target": "tiny"}
    index = json.loads((tmp_path / "manifest.json").read_text())
    assert index["checkpoints"] == [{"step": 4, "dir": "step_4", "files": manifest["files"]}]
    weights, state = ck.load_full(path)
    assert weights["config"] == {"width": 3} and state["data"] == {"next_global_batch": 4}
    assert state["optimizer"]["state"]  # AdamW moments travel


def test_resolve_finds_the_newest_step_from_a_run_directory(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 2)
    save(root, 10)
    assert ck.resolve(str(tmp_path)) == root / "step_10"
    assert ck.resolve(str(root)) == root / "step_10"
    assert ck.resolve(str(root / "step_2")) == root / "step_2"
    with pytest.raises(ck.CheckpointError, match="no such file"):
        ck.resolve(str(tmp_path / "nope"))


def test_missing_manifest_or_wrong_hash_is_refused(tmp_path):
    path = save(tmp_path, 3)
    (path / "drafter.pt").write_bytes((path / "drafter.pt").read_bytes() + b"!")
    with pytest.raises(ck.CheckpointError, match=r"drafter.pt sha256 \w{12} does not match the manifest's \w{12}"):
        ck.verify(path)
    (path / "manifest.json").unlink()
    with pytest.raises(ck.CheckpointError, match=r"no manifest\.json"):
        ck.verify(path)
    with pytest.raises(ck.CheckpointError, match=r"no manifest\.json"):
        ck.read_manifest_step(ck.resolve(str(path)))


def test_rng_states_round_trip():
    import numpy as np

    state = ck.rng_state()
    expect = (random.random(), np.random.rand(), torch.rand(2))
    random.random(), np.random.rand(), torch.rand(5)  # move on
    ck.set_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])


def test_resuming_from_the_last_step_is_a_finished_run(tmp_path, monkeypatch):
    """A relaunch after a crash at the very end must finish (exit 0), not fail and be relaunched again."""
    from remote_payload import train_dflash_pipeline as tp

    step = tmp_path / "checkpoints" / "step_20"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": ck.FORMAT, "step": 20, "files": {}}))
    monkeypatch.setenv("CTL_RESUME_FROM", str(tmp_path))
    args = tp.build_parser().parse_args(["--steps", "20"])
    with pytest.raises(tp.AlreadyDone, match="at step 20, --steps is 20: nothing left to train"):
        tp.check_args(args)
    args = tp.build_parser().parse_args(["--steps", "30"])
    tp.check_args(args)
    assert args.start_step == 20 and args.resume_path == str(step)

