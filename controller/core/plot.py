"""Pictures and exports of run metrics: tok/s and loss by step for several runs, CSV / JSON lines.

matplotlib is an optional extra (`ctl[plot]`) and slow to import, so it is imported inside
`plot_runs` only; `ctl --help` never pays for it. The object API with an Agg canvas is used instead
of pyplot, so no global backend or figure state is touched.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TextIO

from controller.core.metrics import MetricPoint, format_rate
from controller.errors import ClobberError, InputError

_FORMATS = {".png", ".svg", ".pdf"}
CSV_COLUMNS = ("step", "elapsed_s", "time", "loss", "lr", "tgt_bps", "dft_bps", "tok_s", "eta_s", "accept_len", "q_hs",
               "extra")


def plot_runs(
    series: Mapping[str, Sequence[MetricPoint]],
    out: Path,
    baseline: tuple[str, float] | None = None,
    *,
    title: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Draw tok/s (top) and loss (bottom) against step for each run, with the baseline as a dashed
    line, into `out` (.png, .svg or .pdf). Written to a temporary file and renamed: never half a file,
    and an existing file is kept unless `overwrite`."""
    if not series:
        raise InputError("nothing to plot: no runs given")
    empty = [name for name, points in series.items() if not points]
    if empty:
        raise InputError(f"run {empty[0]!r} has no metric points to plot")
    if out.suffix.lower() not in _FORMATS:
        raise InputError(f"plot file {str(out)!r} must end in .png, .svg or .pdf")
    if not out.parent.is_dir():
        raise InputError(f"directory {str(out.parent)!r} for the plot does not exist")
    if out.exists() and not overwrite:
        raise ClobberError(f"{out} exists; refusing to overwrite it", hint="choose another name or --force")
    if baseline is not None and not (math.isfinite(baseline[1]) and baseline[1] > 0):
        raise InputError(f"baseline throughput must be positive, got {baseline[1]!r}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise InputError("plotting needs matplotlib", hint="pip install 'ctl[plot]'") from exc

    fig = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_tok, ax_loss = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for name, points in series.items():
        ordered = sorted(points, key=lambda p: p.step)
        marker = "o" if len(ordered) <= 60 else None
        tok = [(p.step, p.tok_s) for p in ordered if p.tok_s is not None and math.isfinite(p.tok_s)]
        steady = _last_steady_label(tok)
        (line,) = ax_tok.plot(
            [s for s, _ in tok], [v for _, v in tok], marker=marker, markersize=3, linewidth=1.6,
            label=f"{name}{steady}",
        )
        loss = [(p.step, p.loss) for p in ordered if p.loss is not None and math.isfinite(p.loss)]
        ax_loss.plot(
            [s for s, _ in loss], [v for _, v in loss], marker=marker, markersize=3, linewidth=1.4,
            color=line.get_color(), label=name,
        )
    if baseline is not None:
        label, tok_s = baseline
        ax_tok.axhline(tok_s, color="0.25", linestyle="--", linewidth=1.4,
                       label=f"baseline {label} ({format_rate(tok_s)} tok/s)")
    ax_tok.set_ylim(bottom=0)
    ax_tok.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_rate(v)))
    ax_tok.set_ylabel("throughput (tok/s)")
    ax_tok.set_title(title or "Throughput by step" + (f" vs baseline {baseline[0]}" if baseline else ""),
                     fontsize=13)
    ax_tok.legend(loc="best", fontsize=9, framealpha=0.9)
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("Loss by step", fontsize=11)
    ax_loss.legend(loc="best", fontsize=9, framealpha=0.9)
    for ax in (ax_tok, ax_loss):
        ax.grid(True, alpha=0.3)

    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=out.suffix, dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format=out.suffix.lower().lstrip("."))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _last_steady_label(tok: list[tuple[int, float]]) -> str:
    """Legend suffix with the run's median of its last half: readable without squinting at the axis."""
    if not tok:
        return ""
    tail = sorted(v for _, v in tok[len(tok) // 2 :])
    return f" ({format_rate(tail[len(tail) // 2])} tok/s)"


def export_points(points: Sequence[MetricPoint], fmt: Literal["csv", "jsonl"] | str, out: TextIO) -> int:
    """Write points as CSV (one column per field; q_hs and extra as JSON) or JSON lines (the form
    `metrics.parse_line` reads back). Returns the number of points written."""
    if fmt == "jsonl":
        for p in points:
            out.write(json.dumps(p.record()) + "\n")
    elif fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for p in points:
            writer.writerow([_cell(p, name) for name in CSV_COLUMNS])
    else:
        raise InputError(f"unknown export format {fmt!r}: use csv or jsonl")
    return len(points)


def _cell(p: MetricPoint, name: str) -> Any:
    value = getattr(p, name)
    if value is None:
        return ""
    if name == "q_hs":
        return json.dumps(list(value))
    if name == "extra":
        return json.dumps(value, sort_keys=True) if value else ""
    return repr(value) if isinstance(value, float) else value
