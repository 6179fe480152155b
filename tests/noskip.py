"""CTL_NO_SKIP=1 (set by .ci/run): every skip is a failure, its reason kept. CI's machine is set up to run every
test (scripts/setup.sh installs what the skips name), so a skip there means a test that proved nothing while the
run went green. Without the variable (a developer's run, without root say) skips stay skips and say why.

Loaded by tests/conftest.py (its hooks are imported there); a pytest of its own loads it with `-p tests.noskip`."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

VAR = "CTL_NO_SKIP"


def no_skip() -> bool:
    return os.environ.get(VAR, "") not in ("", "0")


def _reason(longrepr: Any) -> str:
    # a skip's longrepr is (path, line, "Skipped: reason")
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail(report: pytest.TestReport | pytest.CollectReport) -> None:
    report.longrepr = f"{VAR}=1 (CI runs every test) turns this skip into a failure: {_reason(report.longrepr)}"
    report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    # an xfail is reported as skipped too (with wasxfail): it says what it expects, it is not a skip
    if report.skipped and no_skip() and not hasattr(report, "wasxfail"):
        _fail(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and no_skip():  # a module-level pytest.skip or importorskip
        _fail(report)
