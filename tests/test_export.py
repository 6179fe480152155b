"""Exports of several runs: one CSV / JSON-lines file per run, TensorBoard event files one run per directory,
read back with TensorBoard's own reader."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from controller.core.export import RunPoints, scalars, wall_time, write_files, write_tensorboard
from controller.core.metrics import MetricPoint
from controller.errors import ClobberError, ExitCode, InputError


def read_tb(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """(step, value, wall time) of every scalar tag in a run directory, as TensorBoard reads them."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def pts(n: int, t0: float | None, tok: float, *, accept: bool = False) -> list[MetricPoint]:
    return [MetricPoint(step=i, loss=10.0 - i / 4, lr=3e-4, elapsed_s=60.0 * i, tgt_bps=1.5 * i, dft_bps=2.0 * i,
                        tok_s=tok + i, time=None if t0 is None else t0 + 10.0 * i,
                        accept_len=(1.0 + i / 10) if accept else None) for i in range(1, n + 1)]


def test_wall_time_is_the_points_time_else_the_runs_start_plus_elapsed() -> None:
    p = MetricPoint(step=3, elapsed_s=120.0, time=1_700_000_500.0)
    assert wall_time(p, 1_700_000_000.0) == 1_700_000_500.0
    assert wall_time(MetricPoint(step=3, elapsed_s=120.0), 1_700_000_000.0) == 1_700_000_120.0
    assert wall_time(MetricPoint(step=3, elapsed_s=120.0), None) is None
    assert wall_time(MetricPoint(step=3), 1_700_000_000.0) is None
    got = scalars([MetricPoint(step=2, loss=1.0, tok_s=5.0), MetricPoint(step=1, accept_len=2.5, q_hs=(1,))], 7.0)
    assert got == [("accept_len", 1, 2.5, None), ("loss", 2, 1.0, None), ("tok_s", 2, 5.0, None)]


def test_tensorboard_two_runs_side_by_side(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    a = RunPoints("ct200", "fresh1", pts(5, 1_700_000_000.0, 12800.0, accept=True), started=1_699_999_000.0)
    b = RunPoints("ct201", "fresh2", pts(4, None, 4600.0), started=1_700_100_000.0)  # no time: start + elapsed
    done = write_tensorboard([a, b], tmp_path / "tb")
    assert [(w.run, w.points, w.output.name) for w in done] == [("ct200/fresh1", 5, "ct200_fresh1"),
                                                                ("ct201/fresh2", 4, "ct201_fresh2")]
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["ct200_fresh1", "ct201_fresh2"]  # no temp left
    ra, rb = read_tb(tmp_path / "tb" / "ct200_fresh1"), read_tb(tmp_path / "tb" / "ct201_fresh2")
    assert sorted(ra) == ["accept_len", "dft_bps", "loss", "lr", "tgt_bps", "tok_s"]
    assert sorted(rb) == ["dft_bps", "loss", "lr", "tgt_bps", "tok_s"]  # no accept_len logged: no tag
    assert [(s, v) for s, v, _ in ra["tok_s"]] == [(i, 12800.0 + i) for i in range(1, 6)]
    assert [s for s, _, _ in ra["loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v, _ in ra["loss"]] == pytest.approx([10.0 - i / 4 for i in range(1, 6)])
    assert [v for _, v, _ in ra["accept_len"]] == pytest.approx([1.1, 1.2, 1.3, 1.4, 1.5])
    assert [v for _, v, _ in ra["lr"]] == pytest.approx([3e-4] * 5)
    assert [w for _, _, w in ra["tok_s"]] == pytest.approx([1_700_000_000.0 + 10.0 * i for i in range(1, 6)])
    assert [w for _, _, w in rb["tok_s"]] == pytest.approx([1_700_100_000.0 + 60.0 * i for i in range(1, 5)])
    assert [(s, v) for s, v, _ in rb["tgt_bps"]] == [(i, pytest.approx(1.5 * i)) for i in range(1, 5)]

    with pytest.raises(ClobberError) as err:
        write_tensorboard([b], tmp_path / "tb")
    assert err.value.exit_code == ExitCode.CLOBBER
    stale = tmp_path / "tb" / "ct201_fresh2" / "events.out.tfevents.0.stale"
    stale.write_bytes(b"")
    write_tensorboard([RunPoints("ct201", "fresh2", pts(2, None, 100.0), started=5.0)], tmp_path / "tb",
                      overwrite=True)
    assert not stale.exists(), "--force replaces the run's directory whole"
    assert [s for s, _, _ in read_tb(tmp_path / "tb" / "ct201_fresh2")["tok_s"]] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["ct200_fresh1", "ct201_fresh2"]


def test_one_file_per_run_and_no_overwrite(tmp_path: Path) -> None:
    a = RunPoints("ct200", "fresh1", pts(3, 1.0, 10.0))
    b = RunPoints("ct200", "fresh2", pts(2, 1.0, 20.0))
    out = tmp_path / "csv"
    done = write_files([a, b], "csv", out)
    assert [w.output.name for w in done] == ["ct200_fresh1.csv", "ct200_fresh2.csv"] and [w.points for w in done] \
        == [3, 2]
    assert [int(r["step"]) for r in csv.DictReader((out / "ct200_fresh2.csv").open())] == [1, 2]
    (out / "ct200_fresh2.csv").write_text("mine\n")
    with pytest.raises(ClobberError):
        write_files([a, b], "csv", out)  # checked before anything is written
    assert (out / "ct200_fresh2.csv").read_text() == "mine\n"
    write_files([a, b], "csv", out, overwrite=True)
    assert (out / "ct200_fresh2.csv").read_text().startswith("step,")
    assert sorted(p.name for p in out.iterdir()) == ["ct200_fresh1.csv", "ct200_fresh2.csv"]
    with pytest.raises(InputError, match="both be written"):
        write_files([RunPoints("a_b", "c", []), RunPoints("a", "b_c", [])], "jsonl", tmp_path / "j")
    with pytest.raises(InputError, match="is a file"):
        write_files([a], "csv", out / "ct200_fresh1.csv")


def test_tensorboard_without_the_library_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as when it is not installed
    with pytest.raises(InputError) as err:
        write_tensorboard([RunPoints("ct200", "fresh1", pts(1, 1.0, 1.0))], tmp_path / "tb")
    assert err.value.exit_code == ExitCode.INPUT and "pip install 'ctl[tensorboard]'" in str(err.value)
    assert not (tmp_path / "tb").exists()
