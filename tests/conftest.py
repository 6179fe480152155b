"""Shared fixtures and helpers. `pvehost`: the local Proxmox test host (tests/pvehost), once per session;
`ctl_wheel`: the wheel of this checkout, built once per session; `make_venv`: a bare venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pvehost import DEFAULT_NODES, PveHost, down, find_free_port, missing_prerequisites, owner_alive

REPO = Path(__file__).resolve().parents[1]


def make_venv(path: Path) -> Path:
    """A venv without pip (fast); install into it with `python -m pip --python VENV/bin/python install ...`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path


def checkout_files(repo: Path = REPO) -> list[str]:
    """The working tree as git sees it: tracked files plus untracked ones .gitignore does not exclude."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return sorted({f for f in out.decode().split("\0") if f and (repo / f).is_file()})


@pytest.fixture(scope="session")
def ctl_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout's working tree (edits included), as `pip wheel` builds it for an operator.

    Built from a copy of the files git knows (checkout_files), never in the checkout: setuptools writes build/
    and ctl.egg-info/ beside pyproject.toml and packs whatever build/lib holds, so a build/ left from an older
    layout would put stale modules into the wheel (and a clean wheel would hide a missing one).
    """
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                        "-w", str(base / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout}\n{r.stderr}"
    (wheel,) = (base / "dist").glob("ctl-*.whl")
    return wheel


def _reap_stale_hosts() -> None:
    """Remove test hosts left by sessions that died without teardown (their owner pid is gone)."""
    for base in Path(tempfile.gettempdir()).glob("ctl-pvehost-*"):
        if (base / "state.json").exists() and not owner_alive(base):
            down(base)


@pytest.fixture(scope="session")
def pvehost() -> Iterator[PveHost]:
    """Two simulated Proxmox hosts over real sshd, real LXC containers, pct and nvidia-smi stand-ins.

    Skips (with the reason) when this machine cannot run it: not root, or lxc/sshd/tmux missing.
    CTL_PVEHOST_DIR and CTL_PVEHOST_PORT pin the base directory and port; by default each session gets
    its own directory and the first free port from 2222, so concurrent sessions do not collide.
    """
    why = missing_prerequisites()
    if why:
        pytest.skip(f"local Proxmox test host unavailable: {why}")
    _reap_stale_hosts()
    base = os.environ.get("CTL_PVEHOST_DIR") or tempfile.mkdtemp(prefix="ctl-pvehost-")
    addresses = [n.address for n in DEFAULT_NODES] + ["127.0.0.4"]
    port = int(os.environ.get("CTL_PVEHOST_PORT") or find_free_port(addresses))
    host = PveHost(base=Path(base), port=port).up(owner_pid=os.getpid())
    try:
        yield host
    finally:
        host.down()
