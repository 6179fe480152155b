"""tests/noskip.py: under CTL_NO_SKIP=1 (CI) every kind of skip fails with its reason; without it skips stay skips.
A pytest of its own runs a small file that skips in each way the suite does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SKIPS = '''\
import pytest

@pytest.fixture
def host():
    pytest.skip("no host here")

@pytest.mark.skipif(True, reason="marked away")
def test_marked():
    pass

def test_in_body():
    pytest.skip("skipped in the body")

def test_in_fixture(host):
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

def test_passes():
    pass
'''

MODULE = '''\
import pytest
pytest.importorskip("no_such_module_anywhere")

def test_never_collected():
    pass
'''


def pytest_run(tmp_path: Path, no_skip: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_skips.py").write_text(SKIPS)
    (tmp_path / "test_module_skip.py").write_text(MODULE)
    env = {k: v for k, v in os.environ.items() if k != "CTL_NO_SKIP"}
    if no_skip is not None:
        env["CTL_NO_SKIP"] = no_skip
    env["PYTHONPATH"] = str(REPO)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # none of the venv's plugins: a faster start
    # --continue-on-collection-errors: the module that fails to collect does not hide the other file's outcomes
    # (without it, as in CI, pytest stops after collecting and exits 2: a failed run all the same)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.noskip", "-p", "no:cacheprovider", "-rA",
                           "--continue-on-collection-errors", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def summary(r: subprocess.CompletedProcess[str]) -> str:
    return r.stdout.strip().splitlines()[-1]


def test_under_ctl_no_skip_every_skip_fails_naming_its_reason(tmp_path: Path) -> None:
    r = pytest_run(tmp_path, "1")
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    # a skip in the body fails the test, one at setup (a mark, a fixture) errors it, as does the module's at
    # collection; the xfail and the plain test keep their outcome
    assert "1 failed, 1 passed, 1 xfailed, 3 errors" in summary(r), out
    said = "CTL_NO_SKIP=1 (CI runs every test) turns this skip into a failure: Skipped: "
    for reason in ("marked away", "skipped in the body", "no host here",
                   "could not import 'no_such_module_anywhere': No module named 'no_such_module_anywhere'"):
        assert said + reason in out, out
    assert "FAILED test_skips.py::test_in_body" in out, out
    for name in ("test_marked", "test_in_fixture"):
        assert f"ERROR test_skips.py::{name}" in out, out
    assert "ERROR test_module_skip.py" in out, out
    assert "SKIPPED" not in out, out


def test_without_it_skips_stay_skips_and_say_why(tmp_path: Path) -> None:
    for value in (None, "0"):
        r = pytest_run(tmp_path, value)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "1 passed, 4 skipped, 1 xfailed" in summary(r), r.stdout
        for reason in ("marked away", "skipped in the body", "no host here", "no_such_module_anywhere"):
            assert reason in r.stdout, r.stdout
