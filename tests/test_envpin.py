"""controller/core/envlock.py on probes of real venvs (tests/conftest.py builds them), and its lock format."""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from controller.core.envlock import (
    Lock,
    Pin,
    Probe,
    check,
    diff_probes,
    fingerprint,
    require_match,
    switch_commands,
    sync_plan,
)
from controller.errors import EnvMismatch, InputError
from tests.conftest import (
    add_dist,
    bin_dir,
    good_venv,
    install_torch,
    probe_env,
    remove_dist,
    run_probe,
    set_dist_version,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "env" / "example.lock"


def probe(venv: Path, *args: str | Path, env: dict[str, str] | None = None) -> Probe:
    return Probe.from_json(json.dumps(run_probe("--venv", venv, *args, env=env)), "test")


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    return good_venv(tmp_path / "venv")


@pytest.fixture
def lock(venv: Path) -> Lock:
    return Lock.from_probe(probe(venv), source="ct200")


# --------------------------------------------------------------------------------------------
# Probe


def test_probe_parses_and_fingerprint_is_recomputed(venv: Path) -> None:
    p = probe(venv)
    assert p.packages["torch"] == "2.11.0+cu130"
    assert (p.torch.version, p.torch.cuda_tag, p.torch.cuda) == ("2.11.0+cu130", "cu130", "13.0")
    assert p.errors["nvidia_smi"] == "nvidia-smi not found on PATH"
    assert "venv" not in p.errors
    assert fingerprint(p) == p.fingerprint  # the controller and the probe agree on what it covers


@pytest.mark.parametrize(
    ("text", "needle"),
    [("not json", "not JSON"), ("[1, 2]", "not a JSON object"), ('{"schema": 1, "venv": {}}', "unexpected shape")],
)
def test_bad_probe_output_is_input_error(text: str, needle: str) -> None:
    with pytest.raises(InputError, match=needle) as info:
        Probe.from_json(text, "ct200")
    assert str(info.value).startswith("ct200: ")


# --------------------------------------------------------------------------------------------
# Check


def test_lock_of_a_venv_matches_it(venv: Path, lock: Lock) -> None:
    assert lock.pin("torch") == Pin("torch", "2.11.0+cu130")
    assert lock.extra_index_urls == ("https://download.pytorch.org/whl/cu130",)
    assert check(lock, probe(venv)) == []
    require_match(lock, probe(venv), "ct200")


def test_hand_installed_package_is_extra(venv: Path, lock: Lock) -> None:
    add_dist(venv, "sglang", "0.5.3", installer="pip")
    (f,) = check(lock, probe(venv))
    assert (f.kind, f.name, f.locked, f.found) == ("extra", "sglang", None, "0.5.3")
    assert f.message == "sglang: 0.5.3 installed, not in the lock"


def test_torch_build_swap_is_build_tag(venv: Path, lock: Lock) -> None:
    install_torch(venv, "2.11.0+cu128", "12.8")
    (f,) = check(lock, probe(venv))
    assert f.kind == "build_tag"
    assert f.message == "torch: locked 2.11.0+cu130, found 2.11.0+cu128 (build tag cu130 -> cu128)"


def test_build_tag_changed_in_metadata_only(venv: Path, lock: Lock) -> None:
    """A swap that rewrote the dist-info but not the files is found twice: metadata and torch/version.py."""
    set_dist_version(venv, "torch", "2.11.0+cu128")
    (f,) = check(lock, probe(venv))
    assert (f.kind, f.found) == ("build_tag", "2.11.0+cu128")
    set_dist_version(venv, "torch", "2.11.0+cu130")
    install_torch(venv, "2.11.0+cu128", "12.8")
    set_dist_version(venv, "torch", "2.11.0+cu130")  # metadata back, files still cu128
    (f,) = check(lock, probe(venv))
    assert f.kind == "build_tag"
    assert "torch/version.py says 2.11.0+cu128" in f.message


def test_version_and_missing_and_python(venv: Path, lock: Lock) -> None:
    set_dist_version(venv, "transformers", "4.57.1")
    remove_dist(venv, "safetensors")
    findings = check(lock, probe(venv))
    assert [(f.kind, f.name) for f in findings] == [("missing", "safetensors"), ("version", "transformers")]
    assert findings[0].message == "safetensors: locked 0.6.2, not installed"
    assert findings[1].message == "transformers: locked 5.17.0, found 4.57.1"
    other = Lock(pins=lock.pins, python="3.9.1")
    (f,) = [f for f in check(other, probe(venv)) if f.kind == "python"]
    assert f.message.startswith("python: locked 3.9.1, found 3.")
    minor = ".".join(lock.python.split(".")[:2]) if lock.python else ""
    assert check(Lock(pins=lock.pins, python=minor), probe(venv)) == findings  # 3.12 accepts 3.12.x


def test_require_match_raises_env_mismatch(venv: Path, lock: Lock) -> None:
    add_dist(venv, "flashinfer-python", "0.5.2")
    with pytest.raises(EnvMismatch, match=r"ct200: .*flashinfer-python: 0.5.2 installed, not in the lock"):
        require_match(lock, probe(venv), "ct200")


def test_check_without_venv_is_env_mismatch(tmp_path: Path, lock: Lock) -> None:
    bare = Probe.from_json(json.dumps(run_probe()), "bare")
    with pytest.raises(EnvMismatch, match="venv"):
        check(lock, bare)
    with pytest.raises(EnvMismatch):
        Lock.from_probe(bare)


# --------------------------------------------------------------------------------------------
# Lock format


def test_render_parse_round_trip(lock: Lock) -> None:
    text = lock.render()
    assert text.startswith("# format: ctl-lock 1\n")
    assert "--extra-index-url https://download.pytorch.org/whl/cu130\n" in text
    assert "torch==2.11.0+cu130\n" in text
    again = Lock.parse(text, "ct200.lock")
    assert again == lock
    assert again.path == "ct200.lock"
    torch = again.pin("torch")
    assert torch is not None and torch.line == text.splitlines().index("torch==2.11.0+cu130") + 1


def test_example_lock_parses() -> None:
    lock = Lock.parse(EXAMPLE.read_text(), str(EXAMPLE))
    assert lock.pin("torch") == Pin("torch", "2.11.0+cu130")
    assert lock.python == "3.12.3"
    assert lock.extra_index_urls == ("https://download.pytorch.org/whl/cu130",)
    assert {"transformers", "datasets", "safetensors"} <= {p.name for p in lock.pins}


def test_direct_urls_survive_and_editables_do_not(tmp_path: Path) -> None:
    venv = good_venv(tmp_path / "venv")
    add_dist(venv, "fi", "0.5.2", direct_url={"url": "https://example.invalid/fi-0.5.2.whl", "archive_info": {}})
    add_dist(venv, "dflash", "0.1.0", direct_url={"url": "file:///data/dflash", "dir_info": {"editable": True}})
    lock = Lock.from_probe(probe(venv))
    assert lock.pin("fi") == Pin("fi", "0.5.2", "https://example.invalid/fi-0.5.2.whl")
    assert lock.pin("dflash") == Pin("dflash", "0.1.0")
    text = lock.render()
    assert "fi @ https://example.invalid/fi-0.5.2.whl  # version: 0.5.2\n" in text
    assert Lock.parse(text, "x.lock") == lock


@pytest.mark.parametrize(
    ("body", "line", "needle"),
    [
        ("torch==2.11.0+cu130\ntransformers>=5\n", 4, "pins exact versions"),
        ("torch==2.11.0+cu130\n-e /src/dflash\n", 4, "unsupported option '-e'"),
        ("torch==2.11.0+cu130\n\nTorch==2.11.0+cu128\n", 5, "pinned twice (first on line 3)"),
        ("--index-url ftp://mirror/simple\n", 3, "http(s) URL"),
        ("--index-url https://a/simple\n--index-url https://b/simple\n", 4, "--index-url given twice"),
        ("fi @ https://example.invalid/fi.whl\n", 3, "# version: 1.2.3"),
        ("torch == \n", 3, "write name==version"),
        ("rm -rf /\n", 3, "cannot read"),
    ],
)
def test_parse_errors_name_file_and_line(body: str, line: int, needle: str) -> None:
    text = "# format: ctl-lock 1\n# python: 3.12.3\n" + body
    with pytest.raises(InputError) as info:
        Lock.parse(text, "env/ct200.lock")
    assert str(info.value).startswith(f"env/ct200.lock:{line}: ")
    assert needle in str(info.value)


def test_parse_header_errors() -> None:
    with pytest.raises(InputError, match=r"^a.lock:2: python version 'three'"):
        Lock.parse("# format: ctl-lock 1\n# python: three\n", "a.lock")
    with pytest.raises(InputError, match=r"^a.lock:2: header key 'python' given twice"):
        Lock.parse("# python: 3.12\n# python: 3.11\n", "a.lock")
    with pytest.raises(InputError, match=r"^a.lock: unsupported lock format 'ctl-lock 9'"):
        Lock.parse("# format: ctl-lock 9\n", "a.lock")
    free = Lock.parse("# note: a comment with a colon\nsix==1.17.0  # why pinned\n", "a.lock")
    assert free.pins == (Pin("six", "1.17.0"),) and free.python is None


# --------------------------------------------------------------------------------------------
# Diff


def test_diff_probes_lists_exactly_the_changes(tmp_path: Path) -> None:
    venv = good_venv(tmp_path / "venv")
    cache = tmp_path / "inductor"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "g1").write_bytes(b"x" * 353_000)
    rows = "".join(f"{i}, NVIDIA H200, GPU-{i}, 143771, 580.95.05\\n" for i in range(8))
    path = bin_dir(tmp_path, {"nvidia-smi": f"#!/bin/sh\nprintf '{rows}'\n"})
    env = probe_env(f"{path}:/usr/bin:/bin", TORCHINDUCTOR_CACHE_DIR=str(cache))
    before = probe(venv, env=env)
    assert diff_probes(before, probe(venv, env=env)) == []

    # what the seeds did: SGLang in, torch swapped to cu128, /tmp cleaned, a driver update
    add_dist(venv, "sglang", "0.5.3")
    remove_dist(venv, "safetensors")
    set_dist_version(venv, "transformers", "4.57.1")
    install_torch(venv, "2.11.0+cu128", "12.8")
    (cache / "fxgraph" / "g1").unlink()
    (cache / "fxgraph").rmdir()
    cache.rmdir()
    rows = "".join(f"{i}, NVIDIA H200, GPU-{i}, 143771, 580.105.08\\n" for i in range(7))
    bin_dir(tmp_path, {"nvidia-smi": f"#!/bin/sh\nprintf '{rows}'\n"})
    after = probe(venv, env=env)
    assert [c.message for c in diff_probes(before, after)] == [
        "- safetensors 0.6.2",
        "+ sglang 0.5.3",
        "~ torch 2.11.0+cu130 -> 2.11.0+cu128 (build tag cu130 -> cu128)",
        "~ transformers 5.17.0 -> 4.57.1",
        "torch build (torch/version.py): 2.11.0+cu130 (cu130) -> 2.11.0+cu128 (cu128)",
        "NVIDIA driver: 580.95.05 -> 580.105.08",
        "GPUs: 8x NVIDIA H200 [GPU-0,GPU-1,GPU-2,GPU-3,GPU-4,GPU-5,GPU-6,GPU-7] -> "
        "7x NVIDIA H200 [GPU-0,GPU-1,GPU-2,GPU-3,GPU-4,GPU-5,GPU-6]",
        f"compile cache {cache}: 0.4 MB in 1 files -> missing",
    ]
    kinds = [c.kind for c in diff_probes(before, after)]
    assert kinds == ["removed", "added", "changed", "changed", "torch", "driver", "gpus", "cache"]
    other = probe(venv, "--cache-dir", str(tmp_path / "elsewhere"), env=env)
    assert [c.kind for c in diff_probes(after, other)] == ["cache"]  # dir changed; both missing


# --------------------------------------------------------------------------------------------
# Sync


def test_sync_plan_builds_beside_and_switches(lock: Lock) -> None:
    new = "/root/venvs/train-20260520"
    plan = sync_plan(lock, "/root/venv", new, "3.11")
    cmds = [list(c) for c in (*plan.guard, *plan.build, *plan.switch)]
    assert cmds[0] == ["test", "!", "-e", new]  # never build over something
    assert cmds[1] == ["test", "-f", f"{new}.lock"]
    assert cmds[2] == ["uv", "venv", "--python", "3.11", new]
    assert cmds[3] == [
        "uv", "pip", "install", "--python", f"{new}/bin/python", "--no-deps",
        "--extra-index-url", "https://download.pytorch.org/whl/cu130",
        "--index-strategy", "unsafe-best-match", "-r", f"{new}.lock",
    ]  # fmt: skip
    assert cmds[4] == ["ln", "-sfn", new, "/root/.venv.ctl-switch"]
    assert cmds[5] == ["mv", "-T", "/root/.venv.ctl-switch", "/root/venv"]
    assert len(cmds) == 6
    for argv in cmds:
        assert argv[0] not in {"rm", "rmdir", "sh", "bash"}
        assert "--clear" not in argv and not any("rm " in a for a in argv)
    plan = sync_plan(lock, "/root/venv", new, lock_path="/root/ctl/ct200.lock")
    assert plan.build[0][3] == lock.python  # the lock's python by default
    assert plan.build[1][-1] == "/root/ctl/ct200.lock"


@pytest.mark.parametrize(
    ("venv_dir", "new_dir", "python", "needle"),
    [
        ("venv", "/root/v2", None, "absolute"),
        ("/root/venv", "/root/venv", None, "beside"),
        ("/root/venv", "/root/venv/v2", None, "beside"),
        ("/root/venvs/a", "/root/venvs", None, "beside"),
        ("/root/venv", "/root/../etc/v2", None, "'..'"),
        ("/root/venv", "/root/v2\n", None, "control character"),
        ("/root/venv", "/root/v2", "python3; rm -rf /", "version like 3.12"),
        ("/root/venv", "/root/v2", "3.9", "does not match"),
        ("/", "/root/v2", None, "cannot be /"),
    ],
)
def test_sync_validates_what_the_user_names(lock: Lock, venv_dir: str, new_dir: str, python: str, needle: str) -> None:
    with pytest.raises(InputError) as info:
        sync_plan(lock, venv_dir, new_dir, python)
    assert needle in str(info.value)


def test_sync_refuses_empty_lock_and_bad_tools(lock: Lock) -> None:
    with pytest.raises(InputError, match="pins nothing"):
        sync_plan(Lock(pins=(), python="3.12"), "/root/venv", "/root/v2")
    with pytest.raises(InputError, match="uv"):
        sync_plan(lock, "/root/venv", "/root/v2", uv="uv; true")
    with pytest.raises(InputError, match="inside the new venv"):
        sync_plan(lock, "/root/venv", "/root/v2", lock_path="/root/v2/ctl.lock")


def _run_all(cmds: list[list[str]]) -> list[int]:
    return [subprocess.run(c, capture_output=True).returncode for c in cmds]


def test_switch_is_atomic_and_keeps_the_old_venv(tmp_path: Path) -> None:
    """Run the real ln/mv: the link moves, both venvs stay; a real directory at the link path is refused."""
    old, new, link = tmp_path / "venv-old", tmp_path / "venv-new", tmp_path / "venv"
    for d in (old, new):
        (d / "bin").mkdir(parents=True)
        (d / "bin" / "marker").write_text(d.name)
    os.symlink(old, link)
    assert _run_all(switch_commands(str(link), str(new))) == [0, 0]
    assert os.readlink(link) == str(new)
    assert (link / "bin" / "marker").read_text() == "venv-new"
    assert (old / "bin" / "marker").read_text() == "venv-old"  # the old venv is still there
    assert not (tmp_path / ".venv.ctl-switch").exists()
    assert _run_all(switch_commands(str(link), str(old))) == [0, 0]  # rollback is the same switch
    assert os.readlink(link) == str(old)

    real = tmp_path / "realvenv"
    (real / "bin").mkdir(parents=True)
    (real / "bin" / "marker").write_text("real")
    codes = _run_all(switch_commands(str(real), str(new)))
    assert codes[0] == 0 and codes[1] != 0  # mv -T refuses to replace a directory with a link
    assert (real / "bin" / "marker").read_text() == "real"
    assert not real.is_symlink()


def _wheel(folder: Path, name: str, version: str) -> None:
    """A real (pure-python) wheel, written by hand: enough for uv to install."""
    import base64
    import hashlib
    import zipfile

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{k},{digest(v)},{len(v)}\n" for k, v in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{info}/RECORD", record)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not installed")
def test_sync_plan_runs_for_real_with_uv(tmp_path: Path, venv: Path) -> None:
    """The whole plan with real uv against a package index on loopback: build, verify, switch."""
    index = tmp_path / "simple"
    (index / "tinypkg").mkdir(parents=True)
    _wheel(index / "tinypkg", "tinypkg", "1.0.0+cu130")
    (index / "tinypkg" / "index.html").write_text('<a href="tinypkg-1.0.0+cu130-py3-none-any.whl">w</a>')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        link = tmp_path / "venv-link"
        os.symlink(venv, link)
        lock = Lock(
            pins=(Pin("tinypkg", "1.0.0+cu130"),),
            python=Probe.from_json(json.dumps(run_probe("--venv", venv))).python_version,
            index_url=f"http://127.0.0.1:{server.server_address[1]}/simple",
        )
        plan = sync_plan(lock, str(link), str(tmp_path / "venv-new"))
        Path(plan.lock_path).write_text(lock.render())
        env = dict(os.environ, UV_CACHE_DIR=str(tmp_path / "uvcache"), UV_NO_CONFIG="1", UV_PYTHON_DOWNLOADS="never")
        env.pop("VIRTUAL_ENV", None)
        for argv in (*plan.guard, *plan.build):
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path)
            assert proc.returncode == 0, (argv, proc.stderr)
        new_probe = Probe.from_json(json.dumps(run_probe("--venv", plan.new_venv_dir)), "new venv")
        assert check(lock, new_probe) == []  # what ctl checks before it switches
        for argv in plan.switch:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path)
            assert proc.returncode == 0, (argv, proc.stderr)
    finally:
        server.shutdown()
    assert os.readlink(link) == str(tmp_path / "venv-new")
    assert (venv / "bin" / "python").exists()  # the old venv is untouched
