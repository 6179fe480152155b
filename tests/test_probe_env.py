"""controller/farside/probe_env.py against real venvs (python -m venv --without-pip) with real dist-info.

The helpers that build the venvs live in tests/conftest.py; tests/test_envpin.py and others use them too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    GOOD,
    PROBE,
    add_dist,
    bin_dir,
    good_venv,
    install_torch,
    make_venv,
    probe_env,
    run_probe,
    set_dist_version,
)

NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)


# --------------------------------------------------------------------------------------------
# Tests


TOP_KEYS = {
    "schema",
    "python",
    "venv",
    "torch",
    "nvidia_smi",
    "kernel",
    "compile_cache",
    "disk",
    "hostname",
    "time",
    "fingerprint",
}


def test_good_venv_is_read_from_metadata_without_importing_torch(tmp_path: Path) -> None:
    venv = good_venv(tmp_path / "venv")
    add_dist(venv, "Flash_Attn", "2.8.3", installer="pip")
    doc = run_probe("--venv", venv)
    assert set(doc) == TOP_KEYS
    v = doc["venv"]
    assert "error" not in v
    assert v["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert v["is_venv"] is True
    assert v["packages"] == {**GOOD, "torch": "2.11.0+cu130", "flash-attn": "2.8.3"}  # names normalized
    assert v["provenance"]["torch"] == {"installer": "uv"}
    assert v["provenance"]["flash-attn"] == {"installer": "pip"}
    t = doc["torch"]
    assert (t["version"], t["cuda_tag"], t["cuda"]) == ("2.11.0+cu130", "cu130", "13.0")
    assert t["git_version"].startswith("3d5e5a7c")
    assert "warning" not in t
    assert len(doc["fingerprint"]) == 64


def test_bare_environment_gives_error_sections_not_a_crash(tmp_path: Path) -> None:
    """No venv, no torch, no nvidia-smi, unreadable disk path: every section says why, exit 0, one document."""
    doc = run_probe("--disk", tmp_path / "missing", "--cache-dir", tmp_path / "nocache")
    assert set(doc) == TOP_KEYS
    assert "VIRTUAL_ENV" in doc["venv"]["error"]
    assert "error" in doc["torch"]
    assert doc["nvidia_smi"] == {"error": "nvidia-smi not found on PATH"}
    assert "error" in doc["disk"][str(tmp_path / "missing")]
    assert doc["compile_cache"]["exists"] is False
    assert doc["python"]["version"]
    assert len(doc["fingerprint"]) == 64


def test_venv_that_is_not_a_venv(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    doc = run_probe("--venv", tmp_path / "empty")
    assert "no bin/python" in doc["venv"]["error"]
    doc = run_probe("--venv", tmp_path / "nowhere")
    assert "does not exist" in doc["venv"]["error"]


def test_venv_python_that_crashes_is_an_error_section(tmp_path: Path) -> None:
    venv = tmp_path / "broken"
    (venv / "bin").mkdir(parents=True)
    bad = venv / "bin" / "python"
    bad.write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 1\n")
    bad.chmod(0o755)
    doc = run_probe("--venv", venv)
    assert "exited 1" in doc["venv"]["error"]
    assert "init_fs_encoding" in doc["venv"]["error"]


def test_virtual_env_variable_is_the_default_venv(tmp_path: Path) -> None:
    venv = good_venv(tmp_path / "venv")
    doc = run_probe(env=probe_env(VIRTUAL_ENV=str(venv)))
    assert doc["venv"]["path"] == str(venv)
    assert doc["venv"]["packages"]["torch"] == "2.11.0+cu130"


def test_direct_url_and_editable_are_recorded(tmp_path: Path) -> None:
    venv = make_venv(tmp_path / "venv")
    wheel = {"url": "https://example.invalid/fi.whl", "archive_info": {}}
    add_dist(venv, "flashinfer-python", "0.5.2", direct_url=wheel)
    add_dist(venv, "dflash", "0.1.0", direct_url={"url": "file:///data/dflash", "dir_info": {"editable": True}})
    add_dist(
        venv,
        "sglang",
        "0.5.3",
        direct_url={"url": "https://github.com/sgl-project/sglang", "vcs_info": {"vcs": "git", "commit_id": "abc123"}},
    )
    prov = run_probe("--venv", venv)["venv"]["provenance"]
    assert prov["flashinfer-python"] == {"installer": "uv", "url": "https://example.invalid/fi.whl"}
    assert prov["dflash"] == {"installer": "uv", "url": "file:///data/dflash", "editable": True}
    assert prov["sglang"]["vcs"] == {"vcs": "git", "commit_id": "abc123"}


def test_torch_half_swapped_metadata_and_files_disagree(tmp_path: Path) -> None:
    venv = good_venv(tmp_path / "venv")
    set_dist_version(venv, "torch", "2.11.0+cu128")  # metadata says cu128, files still cu130
    doc = run_probe("--venv", venv)
    assert doc["venv"]["packages"]["torch"] == "2.11.0+cu128"
    assert doc["torch"]["version"] == "2.11.0+cu130"
    assert "cu128" in doc["torch"]["warning"]


def test_torch_build_tag_without_local_version(tmp_path: Path) -> None:
    venv = make_venv(tmp_path / "venv")
    install_torch(venv, "2.11.0", "12.8")  # PyPI wheels carry no +tag; version.py's cuda gives it
    assert run_probe("--venv", venv)["torch"]["cuda_tag"] == "cu128"
    install_torch(venv, "2.11.0+cpu", None)
    assert run_probe("--venv", venv)["torch"]["cuda_tag"] == "cpu"


def test_no_torch_in_venv(tmp_path: Path) -> None:
    venv = make_venv(tmp_path / "venv")
    assert run_probe("--venv", venv)["torch"] == {"error": "torch is not installed in the venv"}
    add_dist(venv, "torch", "2.11.0+cu130")  # metadata without files: a broken uninstall
    assert "torch/version.py is missing" in run_probe("--venv", venv)["torch"]["error"]


def test_shadowed_distribution_is_reported(tmp_path: Path) -> None:
    """Two dist-info of one name (a reinstall that left the old one): import sees one, both are listed."""
    venv = good_venv(tmp_path / "venv")
    add_dist(venv, "Transformers", "4.57.1", dirname="Transformers-4.57.1")
    v = run_probe("--venv", venv)["venv"]
    assert v["packages"]["transformers"] in ("5.17.0", "4.57.1")
    assert len(v["shadowed"]["transformers"]) == 1


def test_nvidia_smi_gpus_and_driver(tmp_path: Path) -> None:
    rows = "\n".join(
        f"{i}, NVIDIA H200, GPU-0000000{i}-aaaa-bbbb-cccc-ddddeeeeffff, 143771, 580.95.05" for i in range(8)
    )
    path = bin_dir(tmp_path, {"nvidia-smi": f"#!/bin/sh\ncat <<'EOF'\n{rows}\nEOF\n"})
    doc = run_probe(env=probe_env(f"{path}:/usr/bin:/bin"))
    smi = doc["nvidia_smi"]
    assert smi["driver_version"] == "580.95.05"
    assert len(smi["gpus"]) == 8
    assert smi["gpus"][3] == {
        "index": 3,
        "name": "NVIDIA H200",
        "uuid": "GPU-00000003-aaaa-bbbb-cccc-ddddeeeeffff",
        "memory_total_mib": 143771,
        "driver_version": "580.95.05",
    }


def test_nvidia_smi_without_driver_is_an_error_section(tmp_path: Path) -> None:
    path = bin_dir(tmp_path, {"nvidia-smi": f'#!/bin/sh\necho "{NO_DRIVER}"\nexit 9\n'})
    smi = run_probe(env=probe_env(f"{path}:/usr/bin:/bin"))["nvidia_smi"]
    assert smi["error"].startswith("nvidia-smi exited 9: NVIDIA-SMI has failed")


def test_compile_cache_counts(tmp_path: Path) -> None:
    cache = tmp_path / "inductor"
    for sub, n in (("fxgraph", 3), ("aotautograd", 2), ("triton", 4)):
        for i in range(n):
            d = cache / sub / f"entry{i}"
            d.mkdir(parents=True)
            (d / "blob").write_bytes(b"x" * 1000)
    doc = run_probe(env=probe_env(TORCHINDUCTOR_CACHE_DIR=str(cache)))
    c = doc["compile_cache"]
    assert (c["path"], c["source"], c["exists"]) == (str(cache), "env", True)
    assert (c["bytes"], c["files"]) == (9000, 9)
    assert c["entries"] == {"fxgraph": 3, "aotautograd": 2, "triton": 4}
    flag = run_probe("--cache-dir", tmp_path / "other", env=probe_env(TORCHINDUCTOR_CACHE_DIR=str(cache)))
    assert flag["compile_cache"] == {"path": str(tmp_path / "other"), "source": "flag", "exists": False}


def test_default_cache_dir_is_torchs(tmp_path: Path) -> None:
    doc = run_probe(env=probe_env(TMPDIR=str(tmp_path), USER="trainer"))
    assert doc["compile_cache"]["path"] == str(tmp_path / "torchinductor_trainer")
    assert doc["compile_cache"]["source"] == "default"


def test_disk_free(tmp_path: Path) -> None:
    d = run_probe("--disk", tmp_path, "--disk", "/")["disk"]
    assert d[str(tmp_path)]["free"] > 0 and d["/"]["total"] >= d["/"]["free"]


def test_fingerprint_stable_and_sensitive(tmp_path: Path) -> None:
    venv = good_venv(tmp_path / "venv")
    cache = tmp_path / "cache"
    first = run_probe("--venv", venv, "--cache-dir", cache, "--disk", tmp_path)
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "x").write_bytes(b"y" * 10)  # cache size and time are not part of it
    second = run_probe("--venv", venv, "--cache-dir", cache, "--disk", tmp_path)
    assert second["compile_cache"]["bytes"] == 10
    assert first["time"] != second["time"] or first["time"]["epoch"] <= second["time"]["epoch"]
    assert first["fingerprint"] == second["fingerprint"]
    set_dist_version(venv, "datasets", "4.4.2")
    assert run_probe("--venv", venv)["fingerprint"] != first["fingerprint"]
    set_dist_version(venv, "datasets", "4.4.1")
    assert run_probe("--venv", venv)["fingerprint"] == first["fingerprint"]
    install_torch(venv, "2.11.0+cu128", "12.8")
    assert run_probe("--venv", venv)["fingerprint"] != first["fingerprint"]


def test_probe_lists_a_hundred_packages(tmp_path: Path) -> None:
    venv = good_venv(tmp_path / "venv")
    for i in range(100):
        add_dist(venv, f"pkg-{i:03d}", f"1.{i}.0", direct_url={"url": f"https://example.invalid/p{i}.whl"})
    doc = run_probe("--venv", venv)
    assert len(doc["venv"]["packages"]) == 107
    assert doc["venv"]["packages"]["pkg-042"] == "1.42.0"


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3")
def test_runs_on_the_system_python(tmp_path: Path) -> None:
    """The container's python3 is the distribution's, not ours: run the probe with it."""
    venv = good_venv(tmp_path / "venv")
    proc = subprocess.run(
        ["/usr/bin/python3", str(PROBE), "--venv", str(venv)], capture_output=True, text=True, env=probe_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["torch"]["cuda_tag"] == "cu130"
