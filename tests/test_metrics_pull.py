"""`ctl metrics pull`, `status`, `watch`, `mark-good`, `plot`, `metrics export` against real components: the
`local` transport, a real tmux server (its own TMUX_TMPDIR), the real agent, a real SQLite registry and the
fake payload printing the seeds' log format at a chosen speed."""

from __future__ import annotations

import csv
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.commands import monitor
from controller.core.metrics import parse_line
from controller.errors import BusyError, ExitCode, InputError
from controller.inventory import load
from controller.registry import Registry, RunRecord
from controller.remote.client import agent_source
from controller.settings import checkpoint_glob
from controller.transport.base import Result
from controller.transport.counting import Counting
from controller.transport.local import LocalContainer
from tests.conftest import LocalEnv  # the `env` fixture (local inventory, tmux, state dir) is in conftest
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


# --- verdicts end to end -------------------------------------------------------------------------


def test_slow_run_is_reported_against_the_marked_good_baseline_within_the_first_window(env: LocalEnv) -> None:
    env.launch("fresh1", "--tok-s 12800 --steps 12 --interval 0.02 --jitter 0", follow=True)
    assert "marked good" in env.ok("mark-good", "fresh1")
    env.launch("fresh2", "--tok-s 4600 --steps 600 --interval 0.2 --jitter 0")
    try:
        seen: list[dict[str, Any]] = []

        def judged() -> tuple[int, dict[str, Any]] | None:
            rc, rows = env.status("loc")
            assert [r["run"] for r in rows] == ["fresh2"]
            seen.append(rows[0])
            return (rc, rows[0]) if rows[0]["verdict"] != "warmup" else None

        rc, row = wait_for("a judged status", judged, 20)
        # The first judgement after the warm-up already says SLOW, with the ratio to the baseline.
        assert row["verdict"] == "slow" and rc == ExitCode.SLOW
        assert row["baseline"] == "loc/fresh1" and row["ratio"] == pytest.approx(4.6 / 12.8, abs=0.02)
        assert row["step"] <= 3 + 20, "judged after the first steady window"
        assert "0.36x the baseline 12.8K (loc/fresh1)" in row["reason"]
        text = env.ctl("status")
        assert text.returncode == ExitCode.SLOW and "SLOW" in text.stdout and "4.6K" in text.stdout
    finally:
        env.ctl("stop", "fresh2", "--grace", "2")
    rc, rows = env.status()
    assert rc == 0 and rows[0]["verdict"] == "finished" and "stopped by ctl stop" in rows[0]["reason"]


def test_a_log_that_stops_growing_is_stalled(env: LocalEnv) -> None:
    env.launch("quiet", "--tok-s 12800 --steps 100 --interval 0.02 --stall-after 5")
    try:
        wait_for("step 5 in ctl status", lambda: env.status("--stall-after", "1h")[1][0]["step"] == 5, 20)
        time.sleep(2.2)
        rc, rows = env.status("--stall-after", "2s")
        assert rc == ExitCode.STALLED and rows[0]["verdict"] == "stalled"
        assert rows[0]["idle_s"] >= 2 and "no log output for" in rows[0]["reason"]
        assert env.status("--stall-after", "1h")[0] == 0  # warming up: nothing to compare with yet
    finally:
        env.ctl("stop", "quiet", "--grace", "1")


def test_watch_ends_when_the_run_crashes_or_reaches_the_step(env: LocalEnv) -> None:
    env.launch("boom", "--tok-s 12800 --steps 8 --interval 0.05 --crash cuda-oom")
    r = env.ctl("watch", "boom", "--until-step", "100000", "--every", "0.3s")
    assert r.returncode == ExitCode.RUN_FAILED, r.stdout + r.stderr
    assert "CRASHED" in r.stdout and "cuda-oom" in r.stdout
    env.launch("long", "--tok-s 12800 --steps 600 --interval 0.05")
    try:
        r = env.ctl("--json", "watch", "long", "--until-step", "10", "--every", "0.3s")
        doc = json.loads(r.stdout)
        assert doc["step"] >= 10 and doc["ended_because"].startswith("reached step")
        assert r.returncode == 0  # no baseline: nothing to call slow
        t0 = time.monotonic()
        r = env.ctl("watch", "long", "--for", "1s", "--every", "0.3s")
        assert r.returncode == 0 and "watched for 1s" in r.stdout and time.monotonic() - t0 < 10
    finally:
        env.ctl("stop", "long", "--grace", "1")
    assert env.ctl("watch", "long").returncode == ExitCode.INPUT  # neither --until-step nor --for


def test_export_plot_and_pull_through_the_cli(env: LocalEnv) -> None:
    env.launch("fresh1", "--tok-s 21500 --steps 15 --interval 0.01", follow=True)
    ckpt = env.root / "workspace" / "runs" / "fresh1" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "step_15.pt").write_bytes(b"weights")
    doc = json.loads(env.ok("--json", "metrics", "pull", "fresh1"))
    assert doc["new_points"] == 15 and doc["fetched"] == doc["size"] and doc["files_changed"] == []
    assert list(doc["checkpoints"]) == ["checkpoints/step_15.pt"]
    again = json.loads(env.ok("--json", "metrics", "pull", "fresh1"))
    assert again["fetched"] == 0 and again["new_points"] == 0 and again["wire_out"] < 2048

    out = env.dir / "m.csv"
    assert "15 point(s)" in env.ok("metrics", "export", "fresh1", "--format", "csv", "-o", str(out))
    rows = list(csv.DictReader(out.open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 16)) and float(rows[-1]["tok_s"]) > 20000
    assert env.ctl("metrics", "export", "fresh1", "-o", str(out)).returncode == ExitCode.CLOBBER
    jl = env.ok("metrics", "export", "fresh1", "--format", "jsonl").splitlines()
    points = [parse_line(line) for line in jl]
    assert [p.step for p in points] == list(range(1, 16))  # type: ignore[union-attr]
    bad = env.ctl("metrics", "export", "fresh1", "--format", "xml")
    assert bad.returncode == ExitCode.INPUT and "csv or jsonl" in bad.stderr

    env.launch("fresh2", "--tok-s 4600 --steps 15 --interval 0.01", follow=True)
    env.ok("mark-good", "fresh1")
    png = env.dir / "p.png"
    assert "baseline loc/fresh1" in env.ok("plot", "fresh1", "fresh2", "-o", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert env.ctl("plot", "fresh2", "-o", str(png)).returncode == ExitCode.CLOBBER
    assert env.ctl("metrics", "pull", "nosuch").returncode == ExitCode.INPUT


def test_export_several_runs_to_tensorboard_and_files(env: LocalEnv) -> None:
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    env.launch("tb1", "--tok-s 12800 --steps 6 --interval 0.01 --json", follow=True)  # JSON lines carry `time`
    env.launch("tb2", "--tok-s 4600 --steps 4 --interval 0.01", follow=True)  # text lines: time of receipt
    tb = env.dir / "tb"
    doc = json.loads(env.ok("--json", "metrics", "export", "tb1", "tb2", "--format", "tensorboard", "-o", str(tb)))
    assert [(r["run"], r["points"]) for r in doc["runs"]] == [("loc/tb1", 6), ("loc/tb2", 4)]
    assert sorted(p.name for p in tb.iterdir()) == ["loc_tb1", "loc_tb2"]
    for run, n in (("tb1", 6), ("tb2", 4)):
        want = [parse_line(line) for line in env.ok("metrics", "export", run, "--no-pull", "--format",
                                                    "jsonl").splitlines()]
        acc = event_accumulator.EventAccumulator(str(tb / f"loc_{run}"))
        acc.Reload()
        assert {"loss", "tok_s", "lr", "tgt_bps", "dft_bps"} <= set(acc.Tags()["scalars"])
        tok = acc.Scalars("tok_s")
        assert [e.step for e in tok] == list(range(1, n + 1)) == [p.step for p in want]  # type: ignore[union-attr]
        assert [e.value for e in tok] == pytest.approx([p.tok_s for p in want])  # type: ignore[union-attr]
        assert [e.value for e in acc.Scalars("loss")] == pytest.approx([p.loss for p in want])  # type: ignore
        assert [e.wall_time for e in tok] == pytest.approx([p.time for p in want])  # type: ignore[union-attr]
        assert all(abs(e.wall_time - time.time()) < 600 for e in tok)
    r = env.ctl("metrics", "export", "tb1", "tb2", "--format", "tensorboard", "-o", str(tb))
    assert r.returncode == ExitCode.CLOBBER and "loc_tb1 exists" in r.stderr
    assert "view: tensorboard --logdir" in env.ok("metrics", "export", "tb1", "tb2", "--format", "tensorboard",
                                                  "-o", str(tb), "--force", "--no-pull")

    out = env.dir / "csv"
    text = env.ok("metrics", "export", "tb1", "tb2", "-o", str(out), "--no-pull")
    assert "loc/tb2: 4 point(s) written to" in text
    assert [int(r["step"]) for r in csv.DictReader((out / "loc_tb1.csv").open())] == list(range(1, 7))
    assert env.ctl("metrics", "export", "tb1", "tb2", "-o", str(out)).returncode == ExitCode.CLOBBER
    r = env.ctl("metrics", "export", "tb1", "tb2", "--no-pull")
    assert r.returncode == ExitCode.INPUT and "-o DIR" in r.stderr

    # Without the library: one line that says how to install it, exit 4, before contacting anything.
    shadow = env.dir / "shadow"
    shadow.mkdir()
    (shadow / "tensorboardX.py").write_text("raise ImportError('not installed')\n")
    env.env["PYTHONPATH"] = f"{shadow}:{env.env['PYTHONPATH']}"
    r = env.ctl("metrics", "export", "tb1", "--format", "tensorboard", "-o", str(env.dir / "tb3"))
    assert r.returncode == ExitCode.INPUT and r.stderr.count("\n") == 1
    assert "pip install 'ctl[tensorboard]'" in r.stderr and not (env.dir / "tb3").exists()


# --- the pull itself: bytes on the wire, cursor, truncation, rotation, hashes -----------------------




def lines(first: int, n: int, tok: str = "12.8K") -> bytes:
    return b"".join(f"[5m] step={s} loss=9.1 lr=3.0e-04 ({tok}tok/s) | ETA=1.0d\n".encode()
                    for s in range(first, first + n))


@pytest.fixture
def fake_run(tmp_path: Path) -> tuple[Counting, Registry, RunRecord, Path]:
    root = tmp_path / "root"
    (root / "workspace").mkdir(parents=True)
    reg = Registry(tmp_path / "reg.sqlite3")
    rec = reg.claim_run("r1", "loc", log_path="/workspace/r1.log", run_dir="/workspace/runs/r1")
    rec = reg.update_run(rec.id, state="running", files={"/root/a.py": "0" * 64})
    return Counting(LocalContainer("loc", root)), reg, rec, root / "workspace" / "r1.log"


def steps_of(reg: Registry, rec: RunRecord) -> list[int]:
    return [p["step"] for p in reg.points(rec.id)]


def test_incremental_pull_moves_only_new_bytes(fake_run: tuple[Counting, Registry, RunRecord, Path]) -> None:
    t, reg, rec, log = fake_run
    log.write_bytes(lines(1, 40000))  # ~2.4 MB
    size = log.stat().st_size
    first = monitor.pull(t, reg, rec, chunk=1 << 20)
    assert first.fetched == size and first.calls == 3 and first.new_points == 40000 and first.reset is None
    assert t.received - size < 4096, "raw bytes after a small header, no base64"
    assert steps_of(reg, rec) == list(range(1, 40001))

    t.sent = t.received = 0
    second = monitor.pull(t, reg, rec)
    assert second.fetched == 0 and second.calls == 1 and second.new_points == 0
    # a header back; out, the agent's source and a few hundred bytes of arguments
    assert t.received < 1024 and t.sent < len(agent_source()) + 1024

    # A half-written line waits in the cursor until its newline arrives; nothing is parsed twice.
    with log.open("ab") as f:
        f.write(lines(40001, 2) + b"[5m] step=40003 loss=9.")
    t.received = 0
    third = monitor.pull(t, reg, rec)
    assert third.fetched == t.received - (t.received - third.fetched) and third.new_points == 2
    assert reg.cursor(rec.id)[2] == b"[5m] step=40003 loss=9."
    with log.open("ab") as f:
        f.write(b"1 lr=3.0e-04 (12.8Ktok/s) | ETA=1.0d\n")
    fourth = monitor.pull(t, reg, rec)
    assert fourth.fetched == len(b"1 lr=3.0e-04 (12.8Ktok/s) | ETA=1.0d\n") and fourth.new_points == 1
    assert steps_of(reg, rec)[-4:] == [40000, 40001, 40002, 40003]
    assert reg.points(rec.id)[-1]["loss"] == pytest.approx(9.1)
    assert reg.cursor(rec.id)[0] == log.stat().st_size


def test_truncation_and_rotation_start_again_from_byte_zero(
        fake_run: tuple[Counting, Registry, RunRecord, Path]) -> None:
    t, reg, rec, log = fake_run
    log.write_bytes(lines(1, 100))
    monitor.pull(t, reg, rec)
    # Truncated in place (`: > log`), then a little new output.
    with log.open("r+b") as f:
        f.truncate(0)
        f.write(lines(500, 3))
    res = monitor.pull(t, reg, rec)
    assert res.reset is not None and res.reset.startswith("truncated") and res.new_points == 3
    assert res.start == 0 and steps_of(reg, rec)[-3:] == [500, 501, 502]
    # Rotated: renamed away and a new, longer file in its place (size > offset: only the inode tells).
    log.rename(log.with_suffix(".1"))
    log.write_bytes(lines(900, 200))
    res = monitor.pull(t, reg, rec)
    assert res.reset == "replaced (new inode)" and res.new_points == 200
    # Rewritten in place, same inode, longer than before (copytruncate + fast writer): the head changed.
    with log.open("r+b") as f:
        f.write(lines(2000, 300))
    res = monitor.pull(t, reg, rec)
    assert res.reset is not None and res.reset.startswith("rewritten") and res.new_points == 300
    assert monitor.pull(t, reg, rec).reset is None  # and then steady again
    # A missing log is one clear error.
    log.unlink()
    with pytest.raises(InputError, match="does not exist"):
        monitor.pull(t, reg, rec)


def test_hashes_of_deployed_files_and_checkpoints(fake_run: tuple[Counting, Registry, RunRecord, Path]) -> None:
    t, reg, rec, log = fake_run
    root = Path(t.path("/"))
    log.write_bytes(lines(1, 5))
    (root / "root").mkdir()
    (root / "root" / "a.py").write_text("print('changed after launch')\n")
    ck = root / "workspace" / "runs" / "r1" / "checkpoints"
    ck.mkdir(parents=True)
    (ck / "s1.pt").write_bytes(b"one")
    (ck / "notes.txt").write_text("not a checkpoint")
    res = monitor.pull(t, reg, rec)
    assert res.files_changed == ("/root/a.py",)  # the run recorded sha 000..., the file differs
    assert set(res.checkpoints) == {"checkpoints/s1.pt"}
    stored = reg.run_files(rec.id, "checkpoint")
    assert stored["checkpoints/s1.pt"] is not None and stored["checkpoints/s1.pt"]["size"] == 3
    (ck / "s1.pt").write_bytes(b"two!")
    (ck / "s2.pt").write_bytes(b"three")
    res2 = monitor.pull(t, reg, rec, checkpoints="checkpoints/*.pt")
    assert set(res2.checkpoints) == {"checkpoints/s1.pt", "checkpoints/s2.pt"}
    assert res2.checkpoints["checkpoints/s1.pt"] != res.checkpoints["checkpoints/s1.pt"]
    assert reg.run_files(rec.id, "deployed")["/root/a.py"] is not None
    with pytest.raises(InputError, match="relative pattern"):
        checkpoint_glob("../../etc/*")


def test_a_pull_that_lost_a_race_stores_nothing(fake_run: tuple[Counting, Registry, RunRecord, Path]) -> None:
    t, reg, rec, log = fake_run
    log.write_bytes(lines(1, 10))

    class Racing(Counting):
        def run(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
                max_output: int | None = None) -> Result:
            reg.set_cursor(rec.id, 7, "x", b"")  # another ctl moved the cursor meanwhile
            return super().run(argv, stdin=stdin, timeout=timeout, max_output=max_output)

    with pytest.raises(BusyError, match="pulling"):
        monitor.pull(Racing(t.inner), reg, rec)
    assert reg.points(rec.id) == []


# --- baselines -----------------------------------------------------------------------------------


def test_baseline_precedence_inventory_then_latest_marked_good(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.sqlite3")
    a = reg.claim_run("fresh5", "loc")
    b = reg.claim_run("fresh6", "loc")
    other = reg.claim_run("fresh7", "elsewhere")
    me = reg.claim_run("fresh8", "loc")
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(yaml.safe_dump({"containers": {"loc": {"transport": "local", "root": str(tmp_path)}}}))
    inv = load(str(inv_path))
    assert monitor.resolve_baseline(inv, reg, me) is None
    reg.mark_good(other.id)
    got = monitor.resolve_baseline(inv, reg, me)
    assert got is not None and got.run.id == other.id  # anywhere, when none on this container
    reg.mark_good(a.id)
    reg.mark_good(b.id)
    got = monitor.resolve_baseline(inv, reg, me)
    assert got is not None and got.run.id == b.id and got.source == "marked good"  # newest on this CT
    got = monitor.resolve_baseline(inv, reg, b)
    assert got is not None and got.run.id == a.id  # never the run itself
    reg.mark_good(b.id, False)
    got = monitor.resolve_baseline(inv, reg, me)
    assert got is not None and got.run.id == a.id
    # The inventory's `baseline:` wins over every mark.
    inv_path.write_text(yaml.safe_dump({"containers": {"loc": {"transport": "local", "root": str(tmp_path),
                                                               "baseline": "fresh6"}}}))
    got = monitor.resolve_baseline(load(str(inv_path)), reg, me)
    assert got is not None and got.run.id == b.id and got.source == "inventory"
    inv_path.write_text(yaml.safe_dump({"containers": {"loc": {"transport": "local", "root": str(tmp_path),
                                                               "baseline": "fresh99"}}}))
    with pytest.raises(InputError, match=r"containers\.loc\.baseline: no run 'fresh99'"):
        monitor.resolve_baseline(load(str(inv_path)), reg, me)


def test_mark_good_cli_and_unset(env: LocalEnv) -> None:
    env.launch("fresh1", "--tok-s 12800 --steps 3 --interval 0", follow=True)
    assert json.loads(env.ok("--json", "mark-good", "fresh1")) == {"run": "loc/fresh1", "good": True, "forced": False,
                                                                   "why": "finished with exit 0"}
    assert "fresh1 *" in env.ok("runs", "--no-refresh")
    assert "no longer" in env.ok("mark-good", "fresh1", "--unset")
    assert "*" not in env.ok("runs", "--no-refresh")
    assert env.ctl("mark-good", "nosuch").returncode == ExitCode.INPUT


def test_bad_options_are_one_clear_line(env: LocalEnv) -> None:
    for args, words in ((["status", "--slow-ratio", "1.5"], "--slow-ratio"),
                        (["status", "--stall-after", "soon"], "--stall-after: 'soon' is not a duration"),
                        (["status", "--checkpoints", "../x/*.pt"], "relative pattern"),
                        (["watch", "fresh1", "--for", "0s"], "--for")):
        r = env.ctl(*args)
        assert r.returncode == ExitCode.INPUT, (args, r.stderr)
        assert r.stderr.startswith("ctl: error: ") and words in r.stderr and len(r.stderr.splitlines()) == 1
