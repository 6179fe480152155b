"""Inventory text that the rendered start_training.sh would execute is refused at load (file:line), and what
the template takes from the inventory is quoted: a run directory with a space works."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from controller.errors import InventoryError
from controller.inventory import load

REPO = Path(__file__).resolve().parent.parent

BASE = {
    "containers": {"loc": {"transport": "local", "root": "root"}},
    "payload": [{"src": "train_dflash_pipeline.py", "dest": "/root/train_dflash_pipeline.py"},
                {"template": "start_training.sh.j2", "dest": "/root/start_training.sh", "mode": "0755"}],
}


def write(tmp_path: Path, doc: dict) -> Path:
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


@pytest.mark.parametrize("where", ["global", "container"])
@pytest.mark.parametrize("var,value,key,why", [
    ("env", {"A;touch /tmp/pwn": 1}, "env.A;touch /tmp/pwn", "is not an environment variable name"),
    ("env", {"1A": 1}, "env.1A", "is not an environment variable name"),
    ("train_args", {"x $(id)": 1}, "train_args.x $(id)", "is not an option name"),
    ("train_args", {"-x": 1}, "train_args.-x", "is not an option name"),
    ("python", "python3; id", "python", "is not an interpreter name or path"),
    ("python", "python3 -X dev", "python", "is not an interpreter name or path"),
])
def test_shell_text_in_vars_is_refused_with_file_and_line(tmp_path: Path, where: str, var: str, value: object,
                                                          key: str, why: str) -> None:
    doc = dict(BASE, containers={"loc": dict(BASE["containers"]["loc"])})
    if where == "global":
        doc["vars"] = {"steps": 1, var: value}
        prefix = "vars"
    else:
        doc["containers"]["loc"]["vars"] = {"steps": 1, var: value}
        prefix = "containers.loc.vars"
    p = write(tmp_path, doc)
    with pytest.raises(InventoryError) as e:
        load(p)
    msg = str(e.value)
    lines = p.read_text().splitlines()
    line = int(msg.split(":")[1])
    assert msg.startswith(f"{p}:{line}: {prefix}.{key}: ") and why in msg
    # The line named is the offending key's (or the python value's) line.
    assert (key.split(".")[-1] in lines[line - 1]) or (var in lines[line - 1])


def test_good_names_load(tmp_path: Path) -> None:
    doc = dict(BASE, vars={"env": {"HF_HOME": "/x", "_A1": "y"}, "train_args": {"steps": 3, "log-every": 1,
                                                                                  "no_compile": True},
                           "python": "/root/venv/bin/python3.11"})
    from controller.commands.deploy import pin

    (tmp_path / "train_dflash_pipeline.py").write_text("")
    (tmp_path / "start_training.sh.j2").write_text((REPO / "templates" / "start_training.sh.j2").read_text())
    inv = load(write(tmp_path, doc))
    assert inv.model.vars == doc["vars"]
    # ...and they reach the start script as written: exported, as the interpreter, as arguments
    (tmp_path / "root").mkdir()
    script = next(f for f in pin(inv, inv.container("loc")).files if f.dest.endswith("start_training.sh"))
    lines = script.content.decode().splitlines()
    assert "export HF_HOME=/x" in lines and "export _A1=y" in lines
    assert any(x.startswith("exec /root/venv/bin/python3.11 -m torch.distributed.run ") for x in lines), lines
    assert any(' --steps 3 --log-every 1 --no-compile ' in x for x in lines), lines


def test_run_dir_with_control_character_is_refused(tmp_path: Path) -> None:
    p = write(tmp_path, dict(BASE, runs={"dir": "/workspace/a\nb/{run}"}))
    with pytest.raises(InventoryError, match=r"runs\.dir: must not contain control characters"):
        load(p)


def test_run_dir_with_a_space_and_shell_characters_works(tmp_path: Path) -> None:
    """The shipped template, rendered and run by bash: RUN_DIR is the literal directory (a space, `$(...)`
    and quotes in it stay text), the interpreter is quoted, train_args arrive as arguments."""
    from controller.commands.pins import pin

    (tmp_path / "train_dflash_pipeline.py").write_text("")
    (tmp_path / "start_training.sh.j2").write_text((REPO / "templates" / "start_training.sh.j2").read_text())
    fake = tmp_path / "fake python"
    fake.mkdir()
    py = fake / "python3"
    py.write_text('#!/bin/sh\necho "cwd=$(pwd)"\nfor a in "$@"; do echo "arg=$a"; done\n')
    py.chmod(0o755)
    weird = "/workspace/my runs/$(touch pwned)'\"/{run}"
    doc = dict(BASE, runs={"dir": weird},
               vars={"python": "python3", "train_args": {"steps": "3 $(id)"}, "env": {"X_Y": "a b"}})
    p = write(tmp_path, doc)
    inv = load(p)
    (tmp_path / "root").mkdir()
    manifest = pin(inv, inv.container("loc"))
    script = next(f for f in manifest.files if f.dest.endswith("start_training.sh")).content.decode()
    env = dict(os.environ, CTL_RUN="r1", PATH=f"{fake}:{os.environ['PATH']}")
    env.pop("CTL_RUN_DIR", None)
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run_dir = str(tmp_path / "root") + weird.replace("{run}", "r1")
    assert f"cwd={run_dir}" in r.stdout.splitlines()
    assert "arg=--steps" in r.stdout and "arg=3 $(id)" in r.stdout
    assert not (tmp_path / "pwned").exists() and not list(tmp_path.rglob("pwned"))
