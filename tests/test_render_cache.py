"""A template's rendering is kept in the state directory under the hash of the template, its context and the
renderer: the next deploy or launch with nothing changed reads it instead of importing and running jinja2, and
any change (a variable, the template) renders again."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

INVENTORY = """\
containers:
  loc: {transport: local, root: r, vars: {steps: 10}}
payload:
  - {template: start.j2, dest: /root/start.sh, mode: "0755"}
"""

# Pins the payload of `loc` in a fresh process: the rendered bytes, and whether jinja2 was imported for it.
PIN = ("import json, sys\n"
       "from controller.inventory import load\n"
       "from controller.commands.pins import pin\n"
       "inv = load(sys.argv[1])\n"
       "m = pin(inv, inv.container('loc'))\n"
       "print(json.dumps({'content': m.files[0].content.decode(), 'jinja2': 'jinja2' in sys.modules}))\n")


def pin(tmp_path: Path) -> dict[str, object]:
    env = {**os.environ, "CTL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", PIN, str(tmp_path / "inventory.yaml")], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_second_pin_reads_the_rendering_and_any_change_renders_again(tmp_path: Path) -> None:
    (tmp_path / "inventory.yaml").write_text(INVENTORY)
    (tmp_path / "start.j2").write_text("train --steps {{ steps }} on {{ ct.name }}\n")
    assert pin(tmp_path) == {"content": "train --steps 10 on loc\n", "jinja2": True}
    assert pin(tmp_path) == {"content": "train --steps 10 on loc\n", "jinja2": False}
    cache = tmp_path / "state" / "render"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (entry,) = cache.iterdir()
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600  # a rendering may hold the inventory's variables

    (tmp_path / "inventory.yaml").write_text(INVENTORY.replace("steps: 10", "steps: 11"))
    assert pin(tmp_path) == {"content": "train --steps 11 on loc\n", "jinja2": True}
    (tmp_path / "start.j2").write_text("train --steps {{ steps }}\n")
    assert pin(tmp_path) == {"content": "train --steps 11\n", "jinja2": True}
    assert pin(tmp_path) == {"content": "train --steps 11\n", "jinja2": False}
    assert len(list(cache.iterdir())) == 3


def test_order_types_and_a_damaged_entry_are_never_served_wrong(tmp_path: Path) -> None:
    """The rendering follows the order of a mapping (train_args become flags in that order) and the types of its
    keys; an entry cut short (a crash while it was written) is rendered again, not deployed."""
    inv = INVENTORY.replace("vars: {steps: 10}", "vars: {train_args: {lr: 0.1, steps: 10}, m: {1: a}}")
    (tmp_path / "inventory.yaml").write_text(inv)
    (tmp_path / "start.j2").write_text("train {{ train_args | cli_args }} {{ m }}\n")
    assert pin(tmp_path)["content"] == "train --lr 0.1 --steps 10 {1: 'a'}\n"
    (tmp_path / "inventory.yaml").write_text(inv.replace("{lr: 0.1, steps: 10}", "{steps: 10, lr: 0.1}"))
    assert pin(tmp_path) == {"content": "train --steps 10 --lr 0.1 {1: 'a'}\n", "jinja2": True}
    (tmp_path / "inventory.yaml").write_text(inv.replace("{1: a}", "{'1': a}"))
    assert pin(tmp_path) == {"content": "train --lr 0.1 --steps 10 {'1': 'a'}\n", "jinja2": True}
    for entry in (tmp_path / "state" / "render").iterdir():
        entry.write_bytes(entry.read_bytes()[:-5])  # cut short
    assert pin(tmp_path) == {"content": "train --lr 0.1 --steps 10 {'1': 'a'}\n", "jinja2": True}
    assert pin(tmp_path) == {"content": "train --lr 0.1 --steps 10 {'1': 'a'}\n", "jinja2": False}


def test_a_template_error_is_still_reported_and_nothing_is_kept(tmp_path: Path) -> None:
    (tmp_path / "inventory.yaml").write_text(INVENTORY)
    (tmp_path / "start.j2").write_text("train --steps {{ stepz }}\n")
    env = {**os.environ, "CTL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", PIN, str(tmp_path / "inventory.yaml")], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode != 0 and "'stepz' is undefined" in r.stderr
    assert not (tmp_path / "state" / "render").exists()
