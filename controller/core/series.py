"""Run names of a series (`fresh1`, `fresh2`, ...): the next one after every name already taken, whether the
registry knows it or only a log in a container shows it. Pure: the caller gathers the names."""

from __future__ import annotations

import posixpath
import re

from controller.errors import InputError
from controller.inventory import RunsSpec
from controller.names import check_name


def numbers(series: str, names: list[str]) -> list[int]:
    """The numbers of those names that are the series' (`fresh12` -> 12); other names are ignored. A container's
    log names are untrusted: a number whose successor would not be a valid run name (`fresh` and 66 digits) is
    ignored too, so no log can block automatic naming."""
    pat = re.compile(rf"{re.escape(series)}(\d{{1,18}})")
    out = []
    for name in names:
        m = pat.fullmatch(name)
        if m is not None and _valid_name(f"{series}{int(m[1]) + 1}"):
            out.append(int(m[1]))
    return out


def _valid_name(name: str) -> bool:
    try:
        check_name(name)
    except InputError:
        return False
    return True


def log_glob(runs: RunsSpec) -> str:
    """The glob that finds the series' logs in a container."""
    return runs.log.replace("{run}", runs.series + "*")


def name_after(runs: RunsSpec, known: list[str], series_logs: list[str]) -> str:
    """The next of the series after every name in `known` (the registry's runs of the containers concerned) AND
    every log file name in `series_logs` (what log_glob found in them)."""
    log_prefix, log_suffix = posixpath.basename(runs.log).split("{run}", 1)
    from_logs = [n[len(log_prefix):len(n) - len(log_suffix) if log_suffix else None]
                 for n in series_logs if n.startswith(log_prefix) and n.endswith(log_suffix)]
    nums = numbers(runs.series, known + from_logs)
    return f"{runs.series}{max(nums, default=0) + 1}"
