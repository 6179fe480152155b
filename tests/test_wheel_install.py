"""ctl as an operator installs it: the wheel of this checkout in a fresh venv, run from another directory.

Nothing here may lean on the checkout: the venv lives in tmp_path (no editable install, no PYTHONPATH), the
inventory and the payload are copied into a project directory of their own, and the commands run there. The
scripts ctl sends over an exec (agent, host relay, env probe) must come from the installed package; a path
computed from the checkout's layout (the env probe used to be found by parents[N] arithmetic) fails here.
Only the training itself uses this test's python (it has torch; the fresh venv never gets torch).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from controller.farside import PROGRAMS
from tests.conftest import REPO, make_venv

pytestmark = pytest.mark.slow  # ~1.5 min: wheel build, dependency install, a 20-step CPU run


@pytest.fixture(scope="module")
def installed_ctl(ctl_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the checkout with the wheel installed (non-editable); its `ctl` console script.

    Dependencies come from the package index pip is configured with; the venv has no pip of its own (this
    test's pip installs into it with --python), which saves ensurepip's time.
    """
    venv = make_venv(tmp_path_factory.mktemp("venv") / "ctl")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                        "--no-compile", "--disable-pip-version-check", str(ctl_wheel)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"installing {ctl_wheel.name} failed:\n{r.stdout}\n{r.stderr}"
    return venv / "bin" / "ctl"


def test_wheel_holds_the_remote_scripts_and_nothing_of_the_checkout(ctl_wheel: Path) -> None:
    names = set(zipfile.ZipFile(ctl_wheel).namelist())
    for program in PROGRAMS.values():  # the far side's parts, joined when they ship
        for part in program:
            assert f"controller/farside/{part}" in names
    for page in ("index.html", "dashboard.js", "dashboard.css"):  # ctl dashboard's page, read from the package
        assert f"controller/web/static/{page}" in names
    # remote_payload/ and templates/ are the user's payload, named by their inventory; tests/ is ours. ctl needs none.
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"controller", "ctl-0.1.0.dist-info"}, tops
    assert "ctl = controller.launch.main:main" in zipfile.ZipFile(ctl_wheel).read(
        "ctl-0.1.0.dist-info/entry_points.txt").decode()


def project_dir(path: Path) -> Path:
    """inventory.yaml's `local` container and payload in a directory of their own: a short run, this python."""
    inv = yaml.safe_load((REPO / "inventory.yaml").read_text())
    local = inv["containers"]["local"]
    local["vars"]["python"] = sys.executable  # start_training.sh's python: needs torch, which the ctl venv lacks
    local["vars"]["train_args"].update({"steps": 20, "log-every": 5, "pretrain-target": 0, "eval-every": 0})
    doc = {"containers": {"local": local}, "payload": inv["payload"], "runs": inv["runs"]}
    path.mkdir()
    (path / "inventory.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    for entry in inv["payload"]:
        src = entry.get("src") or entry["template"]
        (path / src).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / src, path / src)
    return path


def test_installed_ctl_deploys_runs_and_probes_from_another_directory(installed_ctl: Path, tmp_path: Path) -> None:
    proj = project_dir(tmp_path / "project")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CTL_INVENTORY", "CTL_PERSIST", "VIRTUAL_ENV", "PYTHONHOME")}
    env["CTL_STATE_DIR"] = str(tmp_path / "state")

    def ctl(*args: str, timeout: float = 120) -> str:
        r = subprocess.run([str(installed_ctl), *args], cwd=proj, env=env, capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, f"ctl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r.stdout + r.stderr

    venv_python = installed_ctl.parent / "python"
    where = subprocess.run([str(venv_python), "-c", "import controller; print(controller.__file__)"],
                           cwd=proj, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(installed_ctl.parent.parent), f"controller imported from {where}"

    out = ctl("deploy", "local", "--allow-dirty")
    n = len(yaml.safe_load((REPO / "inventory.yaml").read_text())["payload"])
    assert f"deployed {n} of {n} files, verified" in out, out
    out = ctl("launch", "local", "--follow", timeout=600)
    assert "done steps=20" in out, out
    assert "run fresh1: finished, exit status 0" in out, out
    out = ctl("env", "probe", "local")
    assert re.search(r"^python\s+3\.\d+\.\d+", out, re.M), out
