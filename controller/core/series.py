"""Run names of a series (`fresh1`, `fresh2`, ...): the next one after every name already taken, whether the
registry knows it or only a log in a container shows it. Pure: the caller gathers the names."""

from __future__ import annotations

import posixpath
import re

from controller.inventory import RunsSpec


def numbers(series: str, names: list[str]) -> list[int]:
    """The numbers of those names that are the series' (`fresh12` -> 12); other names are ignored."""
    pat = re.compile(rf"{re.escape(series)}(\d+)")
    return [int(m.group(1)) for n in names if (m := pat.fullmatch(n))]


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
