"""`ctl supervise` on the local target with real tmux, the real agent and the fake payload: verdict changes
become events, a killed trainer is relaunched from its last complete checkpoint, a stopped one is not, a
supervisor killed mid-restart never relaunches one failure twice, one lease per state directory, and the
sinks (a signed webhook checked by a real HTTP receiver, a command) get each event once."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from controller.errors import ExitCode
from tests.conftest import LocalEnv, faulthandler_env, interrupt
from tests.helpers import sha_bytes, wait_for

pytestmark = pytest.mark.skipif(subprocess.run(["which", "tmux"], capture_output=True).returncode != 0,
                                reason="tmux is not installed")

START = """\
#!/usr/bin/env bash
set -euo pipefail
echo "resume=${CTL_RESUME_FROM:-none} parent=${CTL_PARENT_RUN:-none}"
exec python3 {{ root }}{{ payload["emit_metrics.py"] }} --no-preamble $(cat {{ root }}/root/args/$CTL_RUN)
"""
LONG = "--tok-s 12800 --steps 100000 --interval 0.05 --jitter 0"


@pytest.fixture
def sup(env: LocalEnv) -> LocalEnv:
    (env.dir / "start_training.sh.j2").write_text(START)
    env.ok("deploy", "--allow-dirty")
    for run in ("fresh1", "fresh2", "fresh3", "fresh4"):
        (env.root / "root" / "args").mkdir(parents=True, exist_ok=True)
        (env.root / "root" / "args" / run).write_text(LONG)
    return env


def supervise(env: LocalEnv, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    interval = [] if "--interval" in args else ["--interval", "1s"]  # a lease lasts 3 intervals (>= 10 s)
    cmd = [sys.executable, "-m", "controller", "-i", str(env.inventory), "supervise", "--once", *interval, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=env.dir,
                          env={**env.env, "CTL_NOTIFY_RETRIES": "0.1", **(extra_env or {})})


def events(env: LocalEnv, run: str | None = None) -> list[dict[str, Any]]:
    return json.loads(env.ok("--json", "events", *([run] if run else [])))


def checkpoint(env: LocalEnv, run: str, step: int, *, complete: bool = True, bad_hash: bool = False) -> Path:
    d = env.root / "workspace" / "runs" / run / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "drafter.pt").write_bytes(f"weights {step}".encode())
    sha = sha_bytes(f"weights {step}".encode())
    if complete:
        (d / "manifest.json").write_text(json.dumps({"step": step, "files": {
            "drafter.pt": {"sha256": "0" * 64 if bad_hash else sha}}}))
    return d


def kill_trainer(env: LocalEnv, run: str) -> None:
    pid = int((env.root / "workspace" / f"train_stdout_{run}.log.pid").read_text())
    os.killpg(pid, signal.SIGKILL)


def test_a_killed_run_is_relaunched_from_its_last_complete_checkpoint(sup: LocalEnv) -> None:
    sup.ok("launch", "loc", "--run", "fresh1")
    first = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert first.returncode == 0, first.stdout + first.stderr
    checkpoint(sup, "fresh1", 5)
    checkpoint(sup, "fresh1", 9, complete=False)  # written when the run died: no manifest, skipped
    checkpoint(sup, "fresh1", 7, bad_hash=True)  # a file that does not match the manifest: skipped
    kill_trainer(sup, "fresh1")
    wait_for("the exit status", lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), 30)
    crashed = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    first_sight = events(sup, "fresh1")[0]["to"]  # what the first poll saw: the change is from that
    assert f" loc/fresh1: {first_sight.upper()} -> CRASHED: " in crashed.stdout, crashed.stdout
    assert "-> relaunch as the next run of the series in 1s, from its last complete checkpoint" in crashed.stdout
    evs = events(sup, "fresh1")
    verdict = [e for e in evs if e["kind"] == "verdict" and e["to"] == "crashed"]
    assert len(verdict) == 1
    ev = verdict[0]
    assert ev["exit_status"] == 137 and ev["log"].endswith("train_stdout_fresh1.log")
    assert ev["look"] == "ctl tail loc/fresh1" and ev["action"].startswith("relaunch as the next run")
    assert any("step=" in line for line in ev["last_lines"])  # what the run printed last
    time.sleep(1.2)  # the backoff
    relaunched = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert "relaunched as fresh2, resuming from step 5" in relaunched.stdout, relaunched.stdout + relaunched.stderr
    shown = json.loads(sup.ok("--json", "show", "fresh2"))
    assert shown["resumed_step"] == 5 and shown["resumed_from"].endswith("fresh1/checkpoints/step_5")
    assert shown["parent_id"] == json.loads(sup.ok("--json", "show", "fresh1"))["id"]
    log2 = sup.root / "workspace" / "train_stdout_fresh2.log"
    wait_for("fresh2's first line", lambda: log2.exists() and "resume=" in log2.read_text(), 30)
    assert f"resume={sup.root}/workspace/runs/fresh1/checkpoints/step_5 parent=fresh1" in log2.read_text()
    # Polling again changes nothing: one relaunch per failure.
    supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh2", "fresh1"]
    # `ctl stop` is the operator's word: STOPPED, never restarted.
    sup.ok("stop", "fresh2", "--grace", "2")
    stopped = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
    assert "-> STOPPED" in stopped.stdout, stopped.stdout
    # A relaunch would come on a poll after the backoff (1 s, 2 s for fresh2's lineage): poll on past it.
    past = time.monotonic() + 2.5
    while True:
        again = supervise(sup, "--restart", "on-failure:2", "--backoff", "1s")
        assert again.returncode == 0 and "relaunched" not in again.stdout, again.stdout + again.stderr
        assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh2", "fresh1"]
        if time.monotonic() > past:
            break
    assert [e["kind"] for e in events(sup, "fresh2")].count("restart") == 0
    tree = sup.ok("runs", "--tree")
    assert "fresh1 (failed 137) -> fresh2 (stopped" in tree and "from step 5" in tree


def test_opstop_stop_asked_before_its_signal_wins_the_race_with_a_poll(sup: LocalEnv) -> None:
    """The soak's opstop race: `ctl stop`'s SIGINT ends the training and a poll sees the exit before the stop has
    recorded STOPPED (here the stop dies right after its signal, the widest form of that window). The stop was
    asked in the registry before the signal, so the poll calls it stopped and nothing is ever relaunched."""
    sup.ok("launch", "loc", "--run", "fresh1")
    args = ("--restart", "on-failure:2", "--backoff", "0.1s")
    assert supervise(sup, *args).returncode == 0
    cmd = [sys.executable, "-m", "controller", "-i", str(sup.inventory), "stop", "fresh1", "--grace", "5"]
    died = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=sup.dir,
                          env={**sup.env, "CTL_TEST_DIE_AT": "stop_signalled"})
    assert died.returncode == 137, died.stdout + died.stderr
    assert (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists()  # the signal ended the training
    shown = json.loads(sup.ok("--json", "show", "fresh1"))
    assert shown["state"] == "running" and shown["stop_asked"] is not None, shown  # STOPPED never recorded
    seen = supervise(sup, *args)
    assert seen.returncode == 0 and "-> STOPPED" in seen.stdout and "relaunch" not in seen.stdout, seen.stdout
    assert restart_rows(sup) == []  # not even planned: no relaunch can come on a later poll
    assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh1"]
    assert not [e for e in events(sup, "fresh1") if e["kind"] in ("restart", "refused")]


@pytest.mark.parametrize("step", ["planned", "launching", "launched"])
def test_a_supervisor_killed_mid_restart_relaunches_exactly_once(sup: LocalEnv, step: str) -> None:
    sup.ok("launch", "loc", "--run", "fresh1")
    supervise(sup, "--restart", "on-failure", "--backoff", "1s")
    kill_trainer(sup, "fresh1")
    wait_for("the exit status", lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), 30)
    die = {"CTL_TEST_DIE_AT": step}
    first = supervise(sup, "--restart", "on-failure", "--backoff", "0.1s", extra_env=die)
    if step != "planned":  # the restart itself happens on the poll after the backoff
        time.sleep(0.2)
        first = supervise(sup, "--restart", "on-failure", "--backoff", "0.1s", extra_env=die)
    assert first.returncode == 137, first.stdout + first.stderr
    # The lease of the killed supervisor blocks a new one until it expires: a standby takes over, and its first
    # poll finishes the restart the killed one was in (planned: launches; launching: launches under the name it
    # chose; launched: adopts the run that started).
    took = supervise(sup, "--restart", "on-failure", "--backoff", "0.1s", "--interval", "1s", "--standby")
    assert took.returncode == 0, took.stdout + took.stderr
    assert "loc/fresh1: relaunched as fresh2, from scratch: no complete checkpoint found" in took.stdout, took.stdout
    again = supervise(sup, "--restart", "on-failure", "--backoff", "0.1s", "--interval", "1s", "--standby")
    assert again.returncode == 0 and "relaunched" not in again.stdout, again.stdout + again.stderr
    names = [r["name"] for r in json.loads(sup.ok("--json", "runs"))]
    assert names == ["fresh2", "fresh1"], names
    # a real run behind the name: running, and training into its log
    wait_for("fresh2 running", lambda: json.loads(sup.ok("--json", "show", "fresh2"))["state"] == "running", 30)
    log2 = sup.root / "workspace" / "train_stdout_fresh2.log"
    wait_for("fresh2's log", lambda: log2.exists() and "step=" in log2.read_text(), 30)
    assert "resume=none parent=fresh1" in log2.read_text()
    restarts = [e for e in events(sup, "fresh1") if e["kind"] == "restart"]
    assert len(restarts) == 1
    sup.ctl("stop", "fresh2", "--grace", "1")


def test_restarts_end_with_gave_up(sup: LocalEnv) -> None:
    sup.ok("launch", "loc", "--run", "fresh1")
    supervise(sup, "--restart", "on-failure:1", "--backoff", "0.1s")
    for run in ("fresh1", "fresh2"):
        kill_trainer(sup, run)
        wait_for("exit", lambda r=run: (sup.root / "workspace" / f"train_stdout_{r}.log.exit").exists(), 30)  # type: ignore[misc]
        supervise(sup, "--restart", "on-failure:1", "--backoff", "0.1s")
        time.sleep(0.2)
        supervise(sup, "--restart", "on-failure:1", "--backoff", "0.1s")
    kinds = [e["kind"] for e in events(sup)]
    assert kinds.count("restart") == 1 and "gave_up" in kinds
    assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh2", "fresh1"]


def poll_until(env: LocalEnv, args: tuple[str, ...], text: str, timeout: float = 120) -> str:
    """The output of the first `supervise --once` poll that says `text` (polls until one does)."""
    def said() -> str:
        out = supervise(env, *args).stdout
        return out if text in out else ""
    return wait_for(f"a poll saying {text!r}", said, timeout)


def restart_rows(env: LocalEnv) -> list[dict[str, Any]]:
    """The registry's restarts table (the supervisor's plans), oldest first."""
    db = sqlite3.connect(env.dir / "state" / "registry.sqlite3")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM restarts ORDER BY time")]
    finally:
        db.close()


def test_the_backoff_doubles_with_each_restart_of_a_lineage(sup: LocalEnv) -> None:
    args = ("--restart", "on-failure:3", "--backoff", "1s")
    sup.ok("launch", "loc", "--run", "fresh1")
    supervise(sup, *args)
    for n, (run, wait) in enumerate((("fresh1", 1), ("fresh2", 2))):
        kill_trainer(sup, run)
        wait_for("the exit status", lambda r=run: (sup.root / "workspace" / f"train_stdout_{r}.log.exit").exists(),  # type: ignore[misc]
                 30)
        crashed = supervise(sup, *args)
        assert f"-> relaunch as the next run of the series in {wait}s" in crashed.stdout, crashed.stdout
        plan = restart_rows(sup)[n]
        # the plan's earliest relaunch is the backoff after it was made: base, then twice the base
        assert wait - 0.5 < json.loads(plan["doc"])["not_before"] - plan["time"] <= wait, plan
        nxt = f"fresh{n + 2}"
        poll_until(sup, args, f"relaunched as {nxt}")
        pid_file = sup.root / "workspace" / f"train_stdout_{nxt}.log.pid"
        wait_for(f"{nxt}'s pid file", pid_file.exists, 30)
    assert [r["state"] for r in restart_rows(sup)] == ["done", "done"]
    sup.ctl("stop", "fresh3", "--grace", "1")


def test_a_stalled_run_is_stopped_then_relaunched(sup: LocalEnv) -> None:
    (sup.root / "root" / "args" / "fresh1").write_text(f"{LONG} --stall-after 5")
    sup.ok("launch", "loc", "--run", "fresh1")
    args = ("--restart", "on-failure:1", "--backoff", "1s", "--stall-after", "2s")
    log1 = sup.root / "workspace" / "train_stdout_fresh1.log"
    wait_for("fresh1's 5 steps", lambda: log1.exists() and "step=5 " in log1.read_text(), 30)
    pgid = int((sup.root / "workspace" / "train_stdout_fresh1.log.pid").read_text())
    stalled = poll_until(sup, args, "STALLED: ")  # first sight or a change: "loc/fresh1: [OK -> ]STALLED: ..."
    assert "-> relaunch as the next run of the series in 1s" in stalled, stalled
    os.killpg(pgid, 0)  # the stalled trainer is still alive: nothing is stopped before the backoff
    relaunched = poll_until(sup, args, "relaunched as fresh2")
    assert "loc/fresh1: relaunched as fresh2, from scratch: no complete checkpoint found" in relaunched, relaunched
    # the stalled run was stopped first (it held the GPUs): its process group is gone, its record says so
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert json.loads(sup.ok("--json", "show", "fresh1"))["state"] == "stopped"
    wait_for("fresh2 running", lambda: json.loads(sup.ok("--json", "show", "fresh2"))["state"] == "running", 30)
    log2 = sup.root / "workspace" / "train_stdout_fresh2.log"
    wait_for("fresh2's log", lambda: log2.exists() and "step=" in log2.read_text(), 30)
    assert log2.read_text().startswith("resume=none parent=fresh1\n")
    sup.ctl("stop", "fresh2", "--grace", "1")


def test_always_relaunches_a_finished_run_up_to_its_limit(sup: LocalEnv) -> None:
    for run in ("fresh1", "fresh2"):
        (sup.root / "root" / "args" / run).write_text("--tok-s 12800 --steps 4 --interval 0.05")
    args = ("--restart", "always:1", "--backoff", "0.1s")
    sup.ok("launch", "loc", "--run", "fresh1")
    wait_for("fresh1's end", lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), 30)
    poll_until(sup, args, "relaunched as fresh2")
    (finished,) = [e for e in events(sup, "fresh1") if e["kind"] == "verdict" and e["to"] == "finished"]
    assert finished["action"].startswith("relaunch as the next run of the series in 0s"), finished
    wait_for("fresh2's end", lambda: (sup.root / "workspace" / "train_stdout_fresh2.log.exit").exists(), 30)
    last = supervise(sup, *args)
    assert "loc/fresh2: GAVE_UP after 1 restart(s) of this lineage" in last.stdout, last.stdout
    supervise(sup, *args)
    assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh2", "fresh1"]
    assert [e["kind"] for e in events(sup)].count("restart") == 1


def test_a_drifted_payload_is_refused_on_relaunch(sup: LocalEnv) -> None:
    args = ("--restart", "on-failure:2", "--backoff", "0.1s")
    sup.ok("launch", "loc", "--run", "fresh1")
    supervise(sup, *args)
    deployed = sup.root / "root" / "emit_metrics.py"
    deployed.write_text(deployed.read_text() + "# edited in the container\n")
    kill_trainer(sup, "fresh1")
    wait_for("the exit status", lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), 30)
    poll_until(sup, args, "loc/fresh1: not relaunched: refused")
    refused = [e for e in events(sup, "fresh1") if e["kind"] == "refused"]
    assert len(refused) == 1, refused
    assert refused[0]["summary"].startswith("loc/fresh1: not relaunched: refused: loc: deployed files differ from "
                                            "the pinned payload: /root/emit_metrics.py differs ("), refused
    supervise(sup, *args)  # refused stays refused: no second attempt
    assert [r["name"] for r in json.loads(sup.ok("--json", "runs"))] == ["fresh1"]
    assert [(r["state"], r["new_run_id"]) for r in restart_rows(sup)] == [("refused", None)]


def test_one_supervisor_per_state_directory(sup: LocalEnv) -> None:
    cmd = [sys.executable, "-m", "controller", "-i", str(sup.inventory), "supervise", "--interval", "1s"]
    holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=sup.dir,
                              env=faulthandler_env(sup.env))
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().startswith("supervising loc")
        second = supervise(sup)
        assert second.returncode == ExitCode.BUSY
        assert "another supervisor holds" in second.stderr and "--standby" in second.stderr
    finally:
        out, _err = interrupt(holder, 30)
    assert holder.returncode == 0 and "runs keep training" in out


def test_reglock_past_sqlites_wait_skips_a_poll_instead_of_ending_the_supervisor(sup: LocalEnv) -> None:
    """The soak's overlapping reglocks held the registry past SQLite's wait and the supervisor died with a
    traceback. Now the poll is skipped, said on stderr, and the next one goes on once the writer lets go (the
    wait is cut to 0.5 s here: CTL_REGISTRY_WAIT_S)."""
    cmd = [sys.executable, "-m", "controller", "-i", str(sup.inventory), "supervise", "--interval", "1s"]
    errors = sup.dir / "supervise.err"
    with errors.open("w") as err:
        holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=sup.dir,
                                  env=faulthandler_env({**sup.env, "CTL_REGISTRY_WAIT_S": "0.5"}))
    registry = sup.dir / "state" / "registry.sqlite3"
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().startswith("supervising loc")
        writer = sqlite3.connect(registry, isolation_level=None)
        writer.execute("BEGIN EXCLUSIVE")  # another writer, holding it
        try:
            wait_for("a skipped poll", lambda: "ctl: poll skipped: " in errors.read_text(), timeout=30)
        finally:
            writer.execute("ROLLBACK")
            writer.close()
            released = time.time()
        assert holder.poll() is None, errors.read_text()  # still supervising
        assert "held by another writer past SQLite's wait" in errors.read_text()

        def renewed() -> bool:
            db = sqlite3.connect(registry)
            try:
                row = db.execute("SELECT expires FROM leases WHERE name='supervise'").fetchone()
            finally:
                db.close()
            return row is not None and row[0] - 10 > released  # a poll after the writer let go (lease 10 s)

        wait_for("a poll after the writer let go", renewed, timeout=30)
    finally:
        out, _err = interrupt(holder, 30)
    assert holder.returncode == 0 and "runs keep training" in out


class _Receiver(http.server.BaseHTTPRequestHandler):
    """Records each request as it arrives, then answers 204, or first waits for `release` (a hanging sink)."""

    got: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    release: ClassVar[threading.Event | None] = None

    def do_POST(self) -> None:
        n = int(self.headers["Content-Length"])
        data = self.rfile.read(n)
        type(self).got.append((dict(self.headers), data))
        if self.release is not None:
            self.release.wait(30)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _serve(release: threading.Event | None) -> tuple[http.server.ThreadingHTTPServer, type[_Receiver]]:
    handler = type("R", (_Receiver,), {"got": [], "release": release})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, handler


def test_webhooks_are_signed_and_a_hanging_sink_delays_no_other() -> None:
    from controller.commands.notify import Deliverer
    from controller.core.supervision import Sink, verify

    release = threading.Event()
    good, good_h = _serve(None)
    slow, slow_h = _serve(release)
    failures: list[str] = []
    d = Deliverer([Sink.parse(f"http://127.0.0.1:{slow.server_port}/hook", allow_http_loopback=True),
                   Sink.parse(f"http://127.0.0.1:{good.server_port}/hook", allow_http_loopback=True)], b"s3cret",
                  lambda s, doc, err: failures.append(err), retries=())
    try:
        before = int(time.time())
        d.send({"run": "loc/fresh1", "summary": "one"})
        d.send({"run": "loc/fresh1", "summary": "two"})
        wait_for("both events at the good sink, one at the hanging one",
                 lambda: len(good_h.got) == 2 and slow_h.got, 20)
        # the hanging sink holds the first event unanswered: its second waits behind it, the good sink's did not
        assert [json.loads(data)["summary"] for _h, data in slow_h.got] == ["one"]
        for headers, data in good_h.got:
            # the documented format, recomputed here: sha256=HMAC-SHA256(secret, "<timestamp>.<body>")
            ts = headers["X-Ctl-Timestamp"]
            assert ts.isdigit() and before <= int(ts) <= time.time() + 1, ts
            mac = hmac.new(b"s3cret", ts.encode() + b"." + data, hashlib.sha256).hexdigest()
            assert headers["X-Ctl-Signature"] == f"sha256={mac}", headers
            assert verify(b"s3cret", headers["X-Ctl-Timestamp"], data, headers["X-Ctl-Signature"])
            assert not verify(b"other", headers["X-Ctl-Timestamp"], data, headers["X-Ctl-Signature"])
        assert [json.loads(data)["summary"] for _h, data in good_h.got] == ["one", "two"]
        release.set()  # the sink answers again: its queued event follows, nothing was dropped
        wait_for("the hanging sink's second event", lambda: len(slow_h.got) == 2, 20)
        assert [json.loads(data)["summary"] for _h, data in slow_h.got] == ["one", "two"] and failures == []
    finally:
        release.set()
        d.close(wait_s=0)
        good.shutdown()
        slow.shutdown()


def test_a_slack_sink_gets_the_text_message_of_each_transition_once(sup: LocalEnv) -> None:
    srv, got = _serve(None)
    try:
        (sup.root / "root" / "args" / "fresh1").write_text("--tok-s 12800 --steps 6 --interval 0.05")
        sup.ok("launch", "loc", "--run", "fresh1")
        sink = ("--notify", f"slack:http://127.0.0.1:{srv.server_port}/services/T0/B0", "--allow-http-loopback")
        supervise(sup, *sink)  # first sight of a healthy run: recorded, nobody woken
        wait_for("the run's end", lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), 30)
        supervise(sup, *sink)  # -> FINISHED: one message
        supervise(sup, *sink)  # nothing changed: nothing sent
        assert len(got.got) == 1, got.got  # a supervisor exits after its sinks' deliveries (release())
        headers, data = got.got[0]
        assert headers["Content-Type"] == "application/json" and "X-Ctl-Signature" not in headers
        doc = json.loads(data)
        assert list(doc) == ["text"]
        lines = doc["text"].split("\n")
        finished = next(e for e in events(sup, "fresh1") if e["to"] == "finished")
        assert lines[:4] == [f"*{finished['summary']}*", "action: none",
                             "log: `/workspace/train_stdout_fresh1.log` on loc (local)", "look: `ctl tail loc/fresh1`"]
        # "loc/fresh1: OK -> FINISHED: ..." or, where the run ended before the first poll, "loc/fresh1: FINISHED: ..."
        summary = finished["summary"]
        assert re.fullmatch(r"loc/fresh1: ([A-Z-]+ -> )?FINISHED: finished at step 6; .*", summary), summary
        # the run's last lines in a code block, its last step among them
        assert lines[4] == "```" and lines[-1] == "```" and any("step=6 " in x for x in lines[5:-1]), lines
    finally:
        srv.shutdown()


def test_a_command_sink_gets_each_transition_once_and_failures_become_events(sup: LocalEnv) -> None:
    out = sup.dir / "notified.jsonl"
    prog = sup.dir / "notify.sh"
    prog.write_text(f"#!/bin/sh\ncat >> {out}\necho >> {out}\n")
    prog.chmod(0o755)
    failing = sup.dir / "fail.sh"
    failing.write_text("#!/bin/sh\necho 'pager down' >&2\nexit 3\n")
    failing.chmod(0o755)
    (sup.root / "root" / "args" / "fresh1").write_text("--tok-s 12800 --steps 8 --interval 0.2")
    sup.ok("launch", "loc", "--run", "fresh1")
    sinks = ["--notify", f"cmd:{prog}", "--notify", f"cmd:{failing}"]
    supervise(sup, *sinks)  # first sight of a healthy run: recorded, nobody woken
    wait_for("the run's end", lambda: (sup.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), 30)
    supervise(sup, *sinks)  # -> FINISHED: one notification
    supervise(sup, *sinks)  # nothing changed: nothing sent
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    assert [(e["run"], e["to"]) for e in lines] == [("loc/fresh1", "finished")]
    failed = [e for e in events(sup) if e["kind"] == "notify_failed"]
    assert failed and "pager down" in failed[0]["summary"]


def test_the_systemd_unit_runs_this_inventory(sup: LocalEnv) -> None:
    unit = sup.ok("supervise", "--unit", "--restart", "on-failure:3")
    assert "[Service]" in unit and f"-i {sup.inventory}" in unit and "supervise --restart on-failure:3" in unit
    assert "--unit" not in unit.split("ExecStart=")[1].splitlines()[0]


def test_supkill_during_reglock_a_failure_is_taken_by_one_supervisor(tmp_path: Path) -> None:
    """The soak's double relaunch: a supervisor whose poll stalled on a locked registry past its lease and the
    standby that took over both found the same planned restart; only one may move it to `launching`."""
    from controller.registry import Registry

    reg = Registry(tmp_path / "registry.sqlite3")
    other = Registry(tmp_path / "registry.sqlite3")  # the second supervisor's own connection
    try:
        run = reg.claim_run("r1", "loc")
        assert reg.plan_restart(run.id, {"verdict": "crashed", "not_before": 0}) is not None
        assert [reg.take_restart(run.id), other.take_restart(run.id)] == [True, False]
        assert reg.restart(run.id)["state"] == "launching"
    finally:
        reg.close()
        other.close()
