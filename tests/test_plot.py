"""Plots of several runs against a baseline, and CSV / JSON-lines export."""

from __future__ import annotations

import builtins
import csv
import io
import json
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.core.metrics import MetricPoint, parse_line, parse_lines, points_of
from controller.core.plot import export_points, plot_runs
from controller.errors import ClobberError, InputError

pytest.importorskip("matplotlib")


def fake_run(tok_s: float, steps: int, seed: int) -> list[MetricPoint]:
    rng = random.Random(seed)
    out = []
    loss = 11.5
    for i in range(steps):
        loss = loss * (0.985 + 0.004 * seed) - 0.005 + rng.uniform(-0.03, 0.03)
        rate = (600.0 if i < 3 else tok_s) * (1 + rng.uniform(-0.03, 0.03))
        out.append(MetricPoint(step=i + 1, tok_s=rate, loss=loss, q_hs=(0,), elapsed_s=60.0 * i))
    return out


def three_runs() -> dict[str, list[MetricPoint]]:
    return {"fresh4": fake_run(21500, 60, 1), "fresh5": fake_run(12800, 50, 2), "fresh6": fake_run(4600, 30, 3)}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def test_three_runs_to_png(tmp_path: Path) -> None:
    out = plot_runs(three_runs(), tmp_path / "runs.png", ("fresh5", 12800.0))
    assert out == tmp_path / "runs.png"
    width, height = png_size(out)
    assert 800 <= width <= 2000 and 600 <= height <= 1500
    assert 20_000 < out.stat().st_size < 2_000_000
    assert [p.name for p in tmp_path.iterdir()] == ["runs.png"]  # no temporary file left behind


def test_svg_and_no_baseline(tmp_path: Path) -> None:
    out = plot_runs({"only": fake_run(12800, 10, 4)}, tmp_path / "one.svg", None)
    assert out.read_text().lstrip().startswith("<?xml")


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "runs.png"
    target.write_bytes(b"keep me")
    with pytest.raises(ClobberError):
        plot_runs(three_runs(), target, None)
    assert target.read_bytes() == b"keep me"
    plot_runs(three_runs(), target, None, overwrite=True)
    png_size(target)


@pytest.mark.parametrize(
    ("series", "name", "match"),
    [({}, "x.png", "no runs"), ({"fresh7": []}, "x.png", "'fresh7' has no metric points"),
     ({"a": [MetricPoint(step=1)]}, "x.gif", r"\.png"), ({"a": [MetricPoint(step=1)]}, "no/such/x.png", "does not")],
)
def test_bad_input(tmp_path: Path, series: dict[str, list[MetricPoint]], name: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        plot_runs(series, tmp_path / name, None)


def test_missing_matplotlib_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(InputError) as info:
        plot_runs(three_runs(), tmp_path / "x.png", None)
    assert "pip install 'ctl[plot]'" in str(info.value)


def test_importing_the_modules_does_not_load_matplotlib_or_torch() -> None:
    code = ("import sys, controller.core.plot, controller.core.metrics; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_export_jsonl_round_trips() -> None:
    points = points_of(parse_lines(
        "[23m] step=14 loss=10.6894 lr=3.0e-04 tgt=0.11b/s dft=0.11b/s (4.6Ktok/s) q_hs=[0] foo=bar | ETA=36.9d\n"
        "[24m] step=15 loss=10.6 (4.7Ktok/s) q_hs=[3, 1, 0]\n"
    ))
    buf = io.StringIO()
    assert export_points(points, "jsonl", buf) == 2
    again = [parse_line(line) for line in buf.getvalue().splitlines()]
    assert again == points


def test_export_csv() -> None:
    points = [MetricPoint(step=1, tok_s=4600.0, loss=10.5, q_hs=(3, 1), extra={"foo": "bar"}), MetricPoint(step=2)]
    buf = io.StringIO()
    export_points(points, "csv", buf)
    rows = list(csv.DictReader(io.StringIO(buf.getvalue())))
    assert rows[0]["step"] == "1" and float(rows[0]["tok_s"]) == 4600.0 and rows[0]["loss"] == "10.5"
    assert json.loads(rows[0]["q_hs"]) == [3, 1] and json.loads(rows[0]["extra"]) == {"foo": "bar"}
    assert rows[1]["tok_s"] == "" and rows[1]["q_hs"] == ""


def test_export_unknown_format() -> None:
    with pytest.raises(InputError, match="csv or jsonl"):
        export_points([], "xml", io.StringIO())
