"""Shared by unit and integration tests: the fixtures `pvehost`, `env` and `ctl_wheel` (the wheel of this
checkout, built once per session), and the helpers more than one test module builds its world with. Helpers
only one module uses stay in that module."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.noskip import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (CI: skips fail)
from tests.pvehost import DEFAULT_NODES, DEFAULT_PORT, PveHost, down, find_free_port, missing_prerequisites, owner_alive

REPO = Path(__file__).resolve().parents[1]
# The developer's own ~/.config/ctl/config.yaml must not steer the tests (nor their ctl subprocesses).
os.environ.setdefault("CTL_CONFIG", str(Path(tempfile.gettempdir()) / "ctl-tests-no-config" / "config.yaml"))
# A suite started in the background by a non-interactive shell (`nohup scripts/test.sh &`) inherits SIGINT ignored,
# and so does every ctl it starts (an ignored signal survives exec; Python then installs no KeyboardInterrupt):
# the tests that press Ctrl-C on a ctl saw it run on. ctl itself keeps an inherited SIG_IGN, as the shell meant.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _own_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """ctl's state (caches of renderings and parsed inventories, the registry) of in-process calls goes to a
    directory of the test session, never to the user's own state directory. A test that sets CTL_STATE_DIR wins."""
    if not os.environ.get("CTL_STATE_DIR"):
        monkeypatch.setenv("CTL_STATE_DIR", str(tmp_path_factory.getbasetemp() / "ctl-state"))


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


# --------------------------------------------------------------------------------------------
# Persistent host sessions (on by default): each test's state directory has its own, ended at its teardown


def end_sessions(state: Path) -> None:
    """Stop the persistent sessions of a test's state directory (`ctl mux stop`, no grace), then kill by pid any
    that did not go (one stopped with SIGSTOP by a test, one that no longer answers): none outlives its test."""
    from controller.transport import mux

    with contextlib.suppress(Exception):
        mux.stop(timeout=5, grace=0, state=state)
    d = state / "mux"
    for info in d.glob("*.json") if d.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ProcessLookupError):
            doc = json.loads(info.read_text())
            pid = int(doc["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"controller.transport.mux.daemon" in cmdline:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
                sock = Path(doc["socket"])  # killed: nobody else removes it (the socket dir is shared)
                if sock.is_socket() and sock.stat().st_uid == os.getuid():
                    sock.unlink()


# --------------------------------------------------------------------------------------------
# The local Proxmox test host (tests/pvehost), once per session


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
    # pytest-xdist workers (gw0, gw1, ...) each bring up their own host: each searches its own port range, so two
    # workers starting at once never both find the same port free.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = DEFAULT_PORT + 100 * int(worker) if worker.isdigit() else DEFAULT_PORT
    port = int(os.environ.get("CTL_PVEHOST_PORT") or find_free_port(addresses, start))
    # CTL_PVEHOST_UNPRIVILEGED=200,201: those containers unprivileged, to run whole modules against such ones by hand
    unpriv = tuple(int(v) for v in os.environ.get("CTL_PVEHOST_UNPRIVILEGED", "").replace(",", " ").split())
    host = PveHost(base=Path(base), port=port, unprivileged=unpriv).up(owner_pid=os.getpid())
    try:
        yield host
    finally:
        host.down()


# --------------------------------------------------------------------------------------------
# Fake venvs with real dist-info (python -m venv --without-pip, metadata written as an installer would),
# and controller/farside/probe_env.py run against them


PROBE = REPO / "controller" / "farside" / "probe_env.py"


def site_packages(venv: Path) -> Path:
    (sp,) = venv.glob("lib/python3*/site-packages")
    return sp


def add_dist(
    venv: Path,
    name: str,
    version: str,
    *,
    installer: str | None = "uv",
    direct_url: dict[str, Any] | None = None,
    dirname: str | None = None,
) -> Path:
    """Write NAME-VERSION.dist-info as an installer would (METADATA, INSTALLER, RECORD, direct_url.json)."""
    folder = dirname or f"{name.replace('-', '_')}-{version}"
    info = site_packages(venv) / f"{folder}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n")
    (info / "RECORD").write_text("")
    if installer:
        (info / "INSTALLER").write_text(installer + "\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return info


def remove_dist(venv: Path, name: str) -> None:
    for info in site_packages(venv).glob(f"{name.replace('-', '_')}-*.dist-info"):
        for f in info.iterdir():
            f.unlink()
        info.rmdir()


def set_dist_version(venv: Path, name: str, version: str) -> None:
    """What a reinstall does to the metadata: rewrite the dist-info with the new version."""
    remove_dist(venv, name)
    add_dist(venv, name, version)


def install_torch(venv: Path, version: str = "2.11.0+cu130", cuda: str | None = "13.0") -> None:
    """A fake torch: dist-info plus torch/version.py laid out as the real wheel's (read as text, never imported)."""
    remove_dist(venv, "torch")
    add_dist(venv, "torch", version)
    pkg = site_packages(venv) / "torch"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('the probe must not import torch')\n")
    (pkg / "version.py").write_text(
        "from typing import Optional\n\n"
        "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'xpu']\n"
        f"__version__ = '{version}'\n"
        "debug = False\n"
        f"cuda: Optional[str] = {cuda!r}\n"
        "git_version = '3d5e5a7c0ffee0000000000000000000000000aa'\n"
        "hip: Optional[str] = None\n"
        "xpu: Optional[str] = None\n"
    )


# the seeds' training packages besides torch, at their known-good versions
GOOD = {
    "transformers": "5.17.0",
    "datasets": "4.4.1",
    "safetensors": "0.6.2",
    "tokenizers": "0.22.1",
    "numpy": "2.3.4",
    "triton": "3.7.0",
}


def good_venv(path: Path) -> Path:
    """The seeds' known-good state: torch 2.11.0+cu130 and the training packages."""
    venv = make_venv(path)
    install_torch(venv)
    for name, version in GOOD.items():
        add_dist(venv, name, version)
    return venv


def bin_dir(tmp_path: Path, scripts: dict[str, str]) -> str:
    """A directory of executables to put first on PATH (e.g. an nvidia-smi stand-in)."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        f = d / name
        f.write_text(body)
        f.chmod(f.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(d)


def probe_env(path: str = "/usr/bin:/bin", **extra: str) -> dict[str, str]:
    """A bare environment: no VIRTUAL_ENV, no TORCHINDUCTOR_CACHE_DIR, PATH without nvidia-smi."""
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def run_probe(*args: str | Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        ["python3", str(PROBE), *map(str, args)],
        capture_output=True,
        text=True,
        env=env or probe_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    doc = json.loads(proc.stdout)  # exactly one JSON document
    assert isinstance(doc, dict)
    return doc


# --------------------------------------------------------------------------------------------
# Inductor compile caches on disk, and a stand-in warmup_compile.py that fills one per GPU


def fill_cache(d: Path, tag: str = "a") -> None:
    for sub, n in (("fxgraph", 3), ("aotautograd", 2), ("triton", 4)):
        for i in range(n):
            f = d / sub / f"{tag}{i}" / "entry.bin"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(hashlib.sha256(f"{sub}{tag}{i}".encode()).digest() * (50 + i))
    (d / "artifacts.bin").write_bytes(os.urandom(4096))


def tree_hashes(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


WARMUP = """\
import json, os, sys, time
d = os.environ["TORCHINDUCTOR_CACHE_DIR"]
gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "cpu")
log = os.path.join(d, "..", "warm.log")
os.makedirs(os.path.join(d, "fxgraph"), exist_ok=True)
with open(log, "a") as f:
    f.write(json.dumps({"gpu": gpu, "start": time.time(), "argv": sys.argv[1:]}) + "\\n")
for i in range(3):
    print(f"compiling block {i} on {gpu}", flush=True)
    time.sleep(0.05)
open(os.path.join(d, "fxgraph", "g" + gpu), "w").write("x" * 100)
with open(log, "a") as f:
    f.write(json.dumps({"gpu": gpu, "end": time.time()}) + "\\n")
"""


# --------------------------------------------------------------------------------------------
# A local inventory with tmux (`env`): the `local` transport over a directory standing for the container's /,
# its own tmux server (TMUX_TMPDIR) and state dir, the fake payload deployed. The Proxmox-host counterpart is
# `pve_env` in tests/integration/conftest.py.

FAKE = REPO / "tests" / "fakepayload" / "emit_metrics.py"

# The start script reads the fake payload's arguments from a file named after the run, so one deploy serves
# every run of a test.
START = """\
#!/usr/bin/env bash
set -euo pipefail
exec python3 {{ root }}{{ payload["emit_metrics.py"] }} --no-preamble $(cat {{ root }}/root/args/$CTL_RUN)
"""


def write_inventory(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "inventory.yaml"
    p.write_text(text)
    return p


def inventory_error(tmp_path: Path, text: str) -> str:
    """The one-line InventoryError (exit INVENTORY) that loading `text` raises, its path shown as INV."""
    from controller.errors import ExitCode, InventoryError
    from controller.inventory import load

    p = write_inventory(tmp_path, text)
    with pytest.raises(InventoryError) as e:
        load(p)
    assert e.value.exit_code == ExitCode.INVENTORY
    msg = str(e.value).replace(str(p), "INV")
    assert "\n" not in msg
    return msg


def interrupt(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """Ctrl-C to a ctl started with PYTHONFAULTHANDLER=1 (faulthandler_env), then its output. If it has not ended
    within `timeout`, SIGABRT makes it print every thread's stack, and the failure shows where it hung."""
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"not ended {timeout:g}s after Ctrl-C; its threads then:\n{out or ''}\n{err or ''}"
                             ) from None
    return out or "", err or ""


def faulthandler_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONFAULTHANDLER": "1"}


@dataclass
class LocalEnv:
    dir: Path
    root: Path
    inventory: Path
    env: dict[str, str]

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "controller.launch.main", "-i", str(self.inventory), *args],
                              capture_output=True, text=True, timeout=timeout, env=self.env, cwd=self.dir)

    def ok(self, *args: str) -> str:
        r = self.ctl(*args)
        assert r.returncode == 0, f"ctl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def launch(self, run: str, args: str, *, follow: bool = False) -> None:
        (self.root / "root" / "args").mkdir(parents=True, exist_ok=True)
        (self.root / "root" / "args" / run).write_text(args)
        self.ok("launch", "loc", "--run", run, *(["-f"] if follow else []))

    def status(self, *args: str) -> tuple[int, list[dict[str, Any]]]:
        r = self.ctl("--json", "status", *args)
        assert r.returncode in (0, 20, 21, 22), r.stderr
        return r.returncode, json.loads(r.stdout)

    def write_inventory(self, **extra: Any) -> None:
        doc: dict[str, Any] = {
            "containers": {"loc": {"transport": "local", "root": str(self.root), **extra}},
            "payload": [{"src": "emit_metrics.py", "dest": "/root/emit_metrics.py"},
                        {"template": "start_training.sh.j2", "dest": "/root/start_training.sh", "mode": "0755"}],
            "runs": {"series": "fresh", "session": "mt", "log": "/workspace/train_stdout_{run}.log",
                     "dir": "/workspace/runs/{run}"},
        }
        self.inventory.write_text(yaml.safe_dump(doc))


    def end(self) -> None:
        """Kill its tmux server and what its runs left: a run's training has its own process group, which
        outlives its tmux session."""
        subprocess.run(["tmux", "kill-server"], env=self.env, capture_output=True)
        for pid_file in (self.root / "workspace").glob("*.log.pid"):
            with contextlib.suppress(ValueError, OSError):
                os.killpg(int(pid_file.read_text().strip()), signal.SIGKILL)


def local_env(checkout: Path, state: Path, tmux_dir: Path) -> LocalEnv:
    """A checkout's inventory with its `local` target under checkout/root, deployed, using the registry in
    `state` and the tmux server in `tmux_dir` (two checkouts of one user share both)."""
    shutil.copy(FAKE, checkout / "emit_metrics.py")
    (checkout / "start_training.sh.j2").write_text(START)
    tmux_dir.mkdir(exist_ok=True)
    e = LocalEnv(checkout, checkout / "root", checkout / "inventory.yaml", dict(
        os.environ, CTL_STATE_DIR=str(state), TMUX_TMPDIR=str(tmux_dir), PYTHONPATH=str(REPO)))
    e.root.mkdir()
    e.write_inventory()
    e.ok("deploy", "--allow-dirty")
    return e


@pytest.fixture
def env(tmp_path: Path) -> Iterator[LocalEnv]:
    """Deployed and ready to launch; its tmux server is killed afterwards. Needs tmux: its users skip without."""
    e = local_env(tmp_path, tmp_path / "state", tmp_path / "tmux")
    try:
        yield e
    finally:
        e.end()

