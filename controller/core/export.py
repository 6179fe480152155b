"""Exports of several runs' metric points: one CSV / JSON-lines file per run, or TensorBoard event files
(one run per subdirectory, so TensorBoard shows the runs side by side).

tensorboardX is an optional extra (`ctl[tensorboard]`), imported inside `write_tensorboard` only; `ctl --help`
never pays for it. Every file or run directory is written under a temporary name and renamed into place:
never half an export, and nothing existing is replaced unless `overwrite`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.core.metrics import MetricPoint
from controller.core.plot import export_points
from controller.errors import ClobberError, InputError
from controller.files import replace_dir

FORMATS = ("tensorboard", "csv", "jsonl")
# Scalars written to TensorBoard, by tag; a point without the field writes nothing for it.
TB_SCALARS = ("loss", "tok_s", "lr", "accept_len", "tgt_bps", "dft_bps")
TB_HINT = "pip install 'ctl[tensorboard]'"


@dataclass(frozen=True)
class RunPoints:
    """One run to export: `label` is CT/NAME, `started` its start (epoch seconds) when known."""

    ct: str
    name: str
    points: Sequence[MetricPoint]
    started: float | None = None

    @property
    def label(self) -> str:
        return f"{self.ct}/{self.name}"

    @property
    def stem(self) -> str:
        """The file or directory name of the run in an export directory: CT_NAME, safe as a path component."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"{self.ct}_{self.name}")


@dataclass(frozen=True)
class Written:
    run: str
    points: int
    output: Path


def wall_time(p: MetricPoint, started: float | None) -> float | None:
    """When the point was logged: its own `time`, else the run's start plus its `elapsed_s`, else None."""
    if p.time is not None:
        return p.time
    if started is not None and p.elapsed_s is not None:
        return started + p.elapsed_s
    return None


def scalars(points: Sequence[MetricPoint], started: float | None) -> list[tuple[str, int, float, float | None]]:
    """(tag, step, value, wall time) of every scalar TensorBoard gets, in step order."""
    out = []
    for p in sorted(points, key=lambda q: q.step):
        wt = wall_time(p, started)
        for tag in TB_SCALARS:
            value = getattr(p, tag)
            if value is not None:
                out.append((tag, p.step, float(value), wt))
    return out


def targets(runs: Sequence[RunPoints], out_dir: Path, suffix: str = "") -> dict[str, Path]:
    """Where each run goes under `out_dir`; two runs that would share a name are refused."""
    seen: dict[Path, str] = {}
    for r in runs:
        path = out_dir / f"{r.stem}{suffix}"
        if path in seen and seen[path] != r.label:
            raise InputError(f"runs {seen[path]} and {r.label} would both be written to {path}")
        seen[path] = r.label
    return {label: path for path, label in seen.items()}


def _check_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} is a file: give a directory for an export of several runs")
    if not out_dir.parent.is_dir():
        raise InputError(f"directory {str(out_dir.parent)!r} for the export does not exist")


def _check_clobber(paths: Sequence[Path], overwrite: bool) -> None:
    taken = [p for p in paths if p.exists() or p.is_symlink()]
    if taken and not overwrite:
        more = f" (and {len(taken) - 1} more)" if len(taken) > 1 else ""
        raise ClobberError(f"{taken[0]} exists{more}; refusing to overwrite it", hint="choose another -o or --force")


def write_file(points: Sequence[MetricPoint], fmt: str, out: Path, *, overwrite: bool = False) -> int:
    """One run as CSV or JSON lines into `out`, via a temporary file renamed into place."""
    _check_clobber([out], overwrite)
    if out.is_dir():
        raise InputError(f"{out} is a directory")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".ctl-tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            n = export_points(points, fmt, f)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


def write_files(runs: Sequence[RunPoints], fmt: str, out_dir: Path, *, overwrite: bool = False) -> list[Written]:
    """One file per run, `out_dir/CT_NAME.csv` (or `.jsonl`); every name is checked before anything is written."""
    if fmt not in ("csv", "jsonl"):
        raise InputError(f"unknown export format {fmt!r}: use tensorboard, csv or jsonl")
    _check_dir(out_dir)
    where = targets(runs, out_dir, f".{fmt}")
    _check_clobber(list(where.values()), overwrite)
    out_dir.mkdir(exist_ok=True)
    return [Written(r.label, write_file(r.points, fmt, where[r.label], overwrite=overwrite), where[r.label])
            for r in runs]


def require_tensorboard() -> Any:
    """tensorboardX's SummaryWriter, or one line saying how to install it (exit 4)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as exc:
        raise InputError("TensorBoard export needs tensorboardX", hint=TB_HINT) from exc
    return SummaryWriter


def write_tensorboard(runs: Sequence[RunPoints], out_dir: Path, *, overwrite: bool = False) -> list[Written]:
    """TensorBoard event files, one run per subdirectory `out_dir/CT_NAME`: the scalars of TB_SCALARS at each
    point's step, with the point's wall time (`wall_time`; the run's start, else now, when it has none).
    Each run directory is written beside its place and renamed into it; with `overwrite` an existing one is
    replaced whole, so no stale event file of an earlier export stays mixed in."""
    SummaryWriter = require_tensorboard()
    _check_dir(out_dir)
    where = targets(runs, out_dir)
    _check_clobber(list(where.values()), overwrite)
    out_dir.mkdir(exist_ok=True)
    done = []
    for r in runs:
        dest = where[r.label]
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".ctl-tmp", dir=out_dir))
        try:
            writer = SummaryWriter(logdir=str(tmp), flush_secs=3600)
            try:
                for tag, step, value, wt in scalars(r.points, r.started):
                    writer.add_scalar(tag, value, global_step=step, walltime=wt if wt is not None else r.started)
            finally:
                writer.close()
            replace_dir(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        done.append(Written(r.label, len(r.points), dest))
    return done


