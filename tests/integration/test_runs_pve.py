"""Runs end to end on the local Proxmox host: real tmux in real containers, real SQLite registry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller.errors import ExitCode
from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost


def deployed(env: PveEnv, ct: str = "ct200", **vars_: object) -> PveEnv:
    if vars_:
        env.write(vars={**env.base_extra["vars"], **vars_})
    env.ctl("deploy", ct, "--allow-dirty", check=True)
    return env


def log_path(env: PveEnv, vmid: int, run: str) -> str:
    return str(env.host.rootfs(vmid) / "workspace" / env.tag / f"train_stdout_{run}.log")


def wait_state(env: PveEnv, run: str, states: set[str], timeout: float = 30) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        rec = json.loads(env.ctl("runs", "--json", check=True).stdout)
        mine = [r for r in rec if r["name"] == run]
        if mine and mine[0]["state"] in states:
            return mine[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run} never reached {states}: {mine}")
        time.sleep(0.3)


def test_series_names_and_no_relaunch_over_a_log(pve_env: PveEnv) -> None:
    deployed(pve_env)
    r1 = pve_env.ctl("launch", "ct200", "-f")
    assert r1.returncode == 0, r1.stdout + r1.stderr
    assert "launched fresh1" in r1.stdout and "finished, exit status 0" in r1.stdout
    assert "step=6" in r1.stdout
    r2 = pve_env.ctl("launch", "ct200", "-f")
    assert "launched fresh2" in r2.stdout, r2.stdout + r2.stderr
    log2 = log_path(pve_env, 200, "fresh2")
    before = Path(log2).read_bytes()
    again = pve_env.ctl("launch", "ct200", "--run", "fresh2")
    assert again.returncode == ExitCode.BUSY
    assert "already exists" in again.stderr
    assert Path(log2).read_bytes() == before
    # Exit status and the JSON record sit beside the log.
    assert Path(log2 + ".exit").read_text().strip() == "0"
    record = json.loads(Path(log2 + ".ctl.json").read_text())
    assert record["run"] == "fresh2" and record["files"]
    runs = json.loads(pve_env.ctl("runs", "--json", check=True).stdout)
    assert [(r["name"], r["state"], r["exit_status"]) for r in runs] == [("fresh2", "finished", 0),
                                                                          ("fresh1", "finished", 0)]


def test_a_log_started_by_hand_is_never_reused(pve_env: PveEnv) -> None:
    deployed(pve_env, "ct201")
    d = pve_env.host.rootfs(201) / "workspace" / pve_env.tag
    d.mkdir(parents=True, exist_ok=True)
    (d / "train_stdout_fresh6.log").write_text("a run started by hand\n")
    pve_env.host.own_as_ct_root(201, d, d / "train_stdout_fresh6.log")  # a hand in the container made them
    r = pve_env.ctl("launch", "ct201", "--run", "fresh6")
    assert r.returncode == ExitCode.CLOBBER
    assert "never overwritten" in r.stderr
    assert (d / "train_stdout_fresh6.log").read_text() == "a run started by hand\n"
    r = pve_env.ctl("launch", "ct201", "--force", "--run", "fresh6")
    assert r.returncode == ExitCode.CLOBBER  # --force never overrides the clobber check
    r = pve_env.ctl("launch", "ct201")
    assert "launched fresh7" in r.stdout, r.stdout + r.stderr
    pve_env.ctl("tail", "ct201", "-f")


@pytest.mark.parametrize("bad", ["x;reboot", "../a", "$(id)", "a b", "-rf", ""])
def test_bad_run_names_refused_before_any_command(pve_env: PveEnv, bad: str) -> None:
    r = pve_env.ctl("launch", "ct200", "--run", bad)
    assert r.returncode == ExitCode.INPUT
    assert "invalid run name" in r.stderr


def test_preflight_refuses_busy_gpus(pve_env: PveEnv) -> None:
    deployed(pve_env)
    pve_env.host.set_gpus(200, count=8, busy={5: [(4242, 30000, "python")]})
    try:
        r = pve_env.ctl("launch", "ct200", "--run", "busy1")
        assert r.returncode == ExitCode.BUSY
        assert "GPU 5 busy (pids 4242)" in r.stderr
        assert pve_env.ctl("runs", "--json", check=True).stdout.strip() == "[]"  # the claim was released
    finally:
        pve_env.host.set_gpus(200, count=8)


def test_preflight_refuses_drift(pve_env: PveEnv) -> None:
    deployed(pve_env)
    script = pve_env.host.rootfs(200) / "root" / pve_env.tag / "start_training.sh"
    script.write_text(script.read_text() + "# edited by hand\n")
    r = pve_env.ctl("launch", "ct200", "--run", "drift1")
    assert r.returncode == ExitCode.DRIFT
    assert "start_training.sh differs" in r.stderr and "ctl deploy ct200" in r.stderr


def test_preflight_refuses_stopped_container(pve_env: PveEnv) -> None:
    deployed(pve_env, "ct201")
    pve_env.host.stop(201)
    try:
        r = pve_env.ctl("launch", "ct201", "--run", "stopped1")
        assert r.returncode == ExitCode.NOT_RUNNING
        assert "is stopped" in r.stderr
    finally:
        pve_env.host.start(201)


def test_exit_3_is_recorded_as_failed(pve_env: PveEnv) -> None:
    deployed(pve_env, extra="--no-preamble --exit 3")
    r = pve_env.ctl("launch", "ct200", "--run", "three", "-f")
    assert r.returncode == ExitCode.RUN_FAILED
    run = wait_state(pve_env, "three", {"failed"})
    assert run["exit_status"] == 3
    show = pve_env.ctl("show", "three", check=True).stdout
    assert "failed" in show and "exit_status      3" in show


def test_killed_from_outside_is_lost(pve_env: PveEnv) -> None:
    deployed(pve_env, steps=100000, interval=0.2)
    pve_env.ctl("launch", "ct200", "--run", "victim", check=True)
    log = log_path(pve_env, 200, "victim")
    pid = int(Path(log + ".pid").read_text())
    # Kill the launcher's whole tmux session and the training from outside ctl, as an OOM killer or a hand would.
    pve_env.host.ssh("pve1", "pct", "exec", "200", "--", "kill", "-KILL", "--", f"-{pid}")
    pve_env.host.ssh("pve1", "pct", "exec", "200", "--", "tmux", "kill-session", "-t", f"{pve_env.tag}-victim")
    run = wait_state(pve_env, "victim", {"lost", "failed"})
    assert run["state"] == "lost" or run["exit_status"] == 137


def test_tail_f_ends_on_crash_signature(pve_env: PveEnv) -> None:
    deployed(pve_env, extra="--no-preamble --crash cuda-oom")
    r = pve_env.ctl("launch", "ct200", "--run", "oom1", "-f")
    assert r.returncode == ExitCode.RUN_FAILED, r.stdout + r.stderr
    assert "crash signature 'cuda-oom'" in r.stdout
    t = pve_env.ctl("tail", "ct200", "--run", "oom1", "-n", "5")
    assert "out of memory" in t.stdout.lower()


def test_stop_sends_sigint_and_records_stopped(pve_env: PveEnv) -> None:
    deployed(pve_env, steps=100000, interval=0.2)
    pve_env.ctl("launch", "ct200", "--run", "long1", check=True)
    r = pve_env.ctl("stop", "long1", "--grace", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stopped" in r.stdout and "SIGINT" in r.stdout
    run = wait_state(pve_env, "long1", {"stopped"})
    assert run["exit_status"] not in (None, 0)
    sessions = pve_env.host.ssh("pve1", "pct", "exec", "200", "--", "tmux", "ls")
    assert f"{pve_env.tag}-long1" not in sessions.stdout.decode()


def test_concurrent_launches_of_one_name_start_it_once(pve_env: PveEnv) -> None:
    deployed(pve_env, steps=30, interval=0.05)
    cmd = [sys.executable, "-m", "controller", "-i", str(pve_env.inventory), "launch", "ct200", "--run", "twin"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=pve_env.env)
             for _ in range(3)]
    codes = [p.wait(timeout=60) for p in procs]
    assert sorted(codes).count(0) == 1, [p.communicate() for p in procs]
    assert all(c in (0, ExitCode.BUSY, ExitCode.CLOBBER) for c in codes)
    runs = json.loads(pve_env.ctl("runs", "--json", check=True).stdout)
    assert [r["name"] for r in runs] == ["twin"]
    pve_env.ctl("tail", "ct200", "--run", "twin", "-f")


def test_diff_shows_what_changed_between_runs(pve_env: PveEnv) -> None:
    deployed(pve_env)
    pve_env.ctl("launch", "ct200", "--run", "good1", "-f", check=True)
    deployed(pve_env, tok_s=4600)
    pve_env.ctl("launch", "ct200", "--run", "slow1", "-f", check=True)
    r = pve_env.ctl("diff", "good1", "slow1")
    assert r.returncode == 1
    assert "start_training.sh" in r.stdout
    assert "-exec python3" in r.stdout and "--tok-s 12800" in r.stdout and "--tok-s 4600" in r.stdout
    assert "tok_s: 12800 -> 4600" in r.stdout
    same = pve_env.ctl("diff", "slow1", "slow1")
    assert same.returncode == 0 and "no difference" in same.stdout


def test_attach_command_line_goes_through_host_and_pct(pve_env: PveEnv) -> None:
    deployed(pve_env, steps=100000, interval=0.2)
    pve_env.ctl("launch", "ct200", "--run", "att1", check=True)
    try:
        argv = json.loads(pve_env.ctl("attach", "att1", "--json", check=True).stdout)["argv"]
        assert argv[:2] == ["ssh", "-t"] and "StrictHostKeyChecking=yes" in argv
        assert argv[-1].startswith("pct exec 200 -- tmux attach-session -t")
    finally:
        pve_env.ctl("stop", "att1", "--grace", "2")


def test_tail_f_ends_on_a_crash_even_when_the_process_hangs(pve_env: PveEnv) -> None:
    """An NCCL error often leaves the process alive: the follow still ends, shortly after the signature."""
    (pve_env.dir / "templates" / "start_training.sh.j2").write_text(
        "#!/usr/bin/env bash\necho 'Traceback (most recent call last):'\n"
        "echo 'torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error'\n"
        "exec sleep 600\n")
    deployed(pve_env)
    r = pve_env.ctl("launch", "ct200", "--run", "hang1", "-f", timeout=60)  # the training sleeps 600 s
    assert r.returncode == ExitCode.RUN_FAILED, r.stdout + r.stderr
    assert "crash signature 'nccl'" in r.stdout and "(crashed)" in r.stdout
    stop = pve_env.ctl("stop", "hang1", "--grace", "2")
    assert stop.returncode == 0, stop.stdout + stop.stderr


@pytest.mark.parametrize("persist", [None, "0"])  # through the host's session (the default), and without one
def test_follow_survives_a_dropped_connection_without_losing_or_repeating_lines(
        pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch, persist: str | None) -> None:
    import threading

    from controller.commands import runs
    from controller.core import metrics
    from controller.inventory import load
    from controller.registry import Registry
    from controller.transport.pool import Pool

    deployed(pve_env, steps=40, interval=0.1)
    pve_env.ctl("launch", "ct200", "--run", "drop1", check=True)
    inv = load(pve_env.inventory)
    reg = Registry(pve_env.state / "registry.sqlite3")
    rec = reg.find_run("drop1")
    listener = int((pve_env.host.base / "pve1" / "sshd.pid").read_text())
    lines: list[str] = []
    sessions: list[int] = []  # the session process that followed before the cut
    if persist is None:
        monkeypatch.delenv("CTL_PERSIST", raising=False)
    else:
        monkeypatch.setenv("CTL_PERSIST", persist)

    def cut() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len([x for x in lines if "step=" in x]) < 10:
            time.sleep(0.05)
        sessions.extend(json.loads(p.read_text())["pid"] for p in (pve_env.state / "mux").glob("*.json"))
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(listener)], capture_output=True, text=True).stdout
        for pid in out.split():
            os.kill(int(pid), signal.SIGKILL)

    cutter = threading.Thread(target=cut)
    cutter.start()
    with Pool(inv) as pool:
        t = pool.container(inv.container("ct200"))
        end = runs.follow(t, reg, rec, lines=-1, follow=True, emit=lines.append, detect=metrics.detect_crash)
        if persist == "0":
            assert pool.host("pve1").connects >= 2  # the connection was really cut and re-opened
        else:  # the session's connection was cut: the follow went on through a new session
            assert t.relay is not None and len(sessions) == 1, sessions
            assert t.relay.hello["pid"] != sessions[0]  # type: ignore[attr-defined]
            assert pool.host("pve1").connects == 0
    cutter.join()
    steps = [p.step for p in map(metrics.parse_line, lines) if isinstance(p, metrics.MetricPoint)]
    assert steps == list(range(1, 41)), steps
    assert end.state == "finished" and end.exit_status == 0


def test_attach_really_attaches_and_detaches(pve_env: PveEnv, tmp_path: Path) -> None:
    """`ctl attach` on a terminal: ssh -t to the host, pct exec, tmux attach; C-b d detaches, run goes on."""
    deployed(pve_env, steps=100000, interval=0.2)
    pve_env.ctl("launch", "ct200", "--run", "att2", check=True)
    sock = str(tmp_path / "tmux.sock")  # the operator's own terminal: a tmux on this machine
    env = {k: v for k, v in pve_env.env.items() if k != "TMUX"}
    cmd = f"{sys.executable} -m controller -i {pve_env.inventory} attach att2"
    subprocess.run(["tmux", "-S", sock, "new-session", "-d", "-x", "160", "-y", "40", cmd], env=env, check=True)
    try:
        deadline = time.monotonic() + 20
        screen = ""
        while time.monotonic() < deadline and "step=" not in screen:
            time.sleep(0.3)
            screen = subprocess.run(["tmux", "-S", sock, "capture-pane", "-p"], capture_output=True,
                                    text=True).stdout
        assert "step=" in screen, screen  # the run's own pane, seen through ssh + pct exec + tmux attach
        subprocess.run(["tmux", "-S", sock, "send-keys", "C-b", "d"], check=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and subprocess.run(
                ["tmux", "-S", sock, "has-session"], capture_output=True).returncode == 0:
            time.sleep(0.2)
        assert subprocess.run(["tmux", "-S", sock, "has-session"], capture_output=True).returncode != 0
        run = wait_state(pve_env, "att2", {"running"})  # detaching leaves the training alone
        assert run["state"] == "running"
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)
        pve_env.ctl("stop", "att2", "--grace", "2")


def test_a_run_gets_its_own_variables_while_another_holds_the_tmux_server(pve_env: PveEnv) -> None:
    """tmux gives new sessions the running server's environment: the launcher must export CTL_RUN itself."""
    deployed(pve_env, steps=100000, interval=0.2)
    pve_env.ctl("launch", "ct200", "--run", "first1", check=True)  # keeps the container's tmux server up
    try:
        pve_env.ctl("launch", "ct200", "--run", "second1", check=True)
        deadline = time.monotonic() + 10
        log = Path(log_path(pve_env, 200, "second1"))
        while time.monotonic() < deadline and "ctl run:" not in log.read_text():
            time.sleep(0.1)
        assert f"ctl run: second1 in /workspace/{pve_env.tag}/runs/second1" in log.read_text()
    finally:
        pve_env.ctl("stop", "first1", "--grace", "2")
        pve_env.ctl("stop", "second1", "--grace", "2")


def test_env_sync_refuses_while_a_run_is_live(pve_env: PveEnv) -> None:
    deployed(pve_env, steps=100000, interval=0.2)
    pve_env.ctl("launch", "ct200", "--run", "busyenv", check=True)
    try:
        r = pve_env.ctl("env", "sync", "ct200", "--yes")
        assert r.returncode == ExitCode.BUSY, r.stdout + r.stderr
        assert "run busyenv is live" in r.stderr and "ctl stop ct200/busyenv" in r.stderr
    finally:
        pve_env.ctl("stop", "busyenv", "--grace", "2")


def test_status_and_supervise_of_many_runs_cost_one_connection_per_host_and_one_agent_call_per_container(
        pve_env: PveEnv) -> None:
    """`ctl status` (and one `ctl supervise` poll) of five live runs in three containers on two hosts: each host is
    connected to once at most (sshd's own log counts the logins: none with the sessions the launches left, one with
    sessions off) and each container gets exactly one agent exec (the test host's pct journal counts them): the
    states and new log bytes of all of its runs in one `poll`."""
    deployed(pve_env, "ct200", steps=100000, interval=0.2)
    for ct in ("ct201", "ct300"):
        pve_env.ctl("deploy", ct, "--allow-dirty", check=True)
    runs = {"ct200": ["a1", "a2"], "ct201": ["b1"], "ct300": ["c1", "c2"]}
    for ct, names in runs.items():
        for run in names:
            r = pve_env.ctl("launch", ct, "--run", run)
            assert r.returncode == 0, r.stdout + r.stderr
    host = pve_env.host

    def logins() -> dict[str, int]:
        return {n: (host.base / n / "sshd.log").read_text(errors="replace").count("Accepted publickey")
                for n in ("pve1", "pve2")}

    def agent_verbs(since: dict[str, int]) -> dict[str, list[str]]:
        """{vmid: the agent verbs exec'd in it} from the pct journals, past `since` entries of each node."""
        out: dict[str, list[str]] = {}
        for node, skip in since.items():
            for call in host.pct_calls(node)[skip:]:
                # nothing but agent starts (pct exec, or the relay's own lxc-attach): no pct status, push or pull
                assert call["cmd"] in ("exec", "attach"), call
                out.setdefault(call["args"][0], []).append(call["argv"][6])  # python3 -I -S -c BOOT N VERB
        return out

    def served() -> dict[str, int]:
        """{vmid: requests its staying agents answered}, from `ctl mux status` (the sessions' relays)."""
        r = pve_env.ctl("--json", "mux", "status", check=True)
        out: dict[str, int] = {}
        for doc in json.loads(r.stdout)["sessions"]:
            for agent in doc["agents"] or []:
                vmid = agent["argv"][2]  # pct exec VMID -- python3 ...
                out[vmid] = out.get(vmid, 0) + agent["requests"]
        return out

    try:
        # Sessions on (the default): the launches' sessions serve these too, with no new login and no exec at all:
        # their staying agents answer one poll per container. Off: one login per host, and one exec per container.
        for persist, new_logins in ((None, 0), ("0", 1)):
            env = pve_env.env if persist is None else {**pve_env.env, "CTL_PERSIST": persist}
            for cmd in (["--json", "status", "ct200", "ct201", "ct300"],
                        ["supervise", "--once", "ct200", "ct201", "ct300"]):
                before, calls = logins(), {n: len(host.pct_calls(n)) for n in ("pve1", "pve2")}
                answered = served() if persist is None else {}
                r = subprocess.run([sys.executable, "-m", "controller", "-i", str(pve_env.inventory), *cmd],
                                   capture_output=True, text=True, env=env, timeout=120)
                assert r.returncode in (0, 21, 22), r.stdout + r.stderr
                if cmd[0] == "--json":
                    rows = {row["run"]: row for row in json.loads(r.stdout)}
                    assert set(rows) == {"a1", "a2", "b1", "c1", "c2"}
                    assert all(row["state"] == "running" and row["error"] is None for row in rows.values()), rows
                elif persist is None:  # the first poll sees each run (the next one only changes: none here)
                    assert all(f"{ct}/{run}" in r.stdout for ct, names in runs.items() for run in names), r.stdout
                time.sleep(0.5)  # sshd writes its log line as the login completes
                after = logins()
                assert {n: after[n] - before[n] for n in after} == {"pve1": new_logins, "pve2": new_logins}, cmd
                if persist is None:
                    assert agent_verbs(calls) == {}, cmd
                    now = served()
                    assert {v: now[v] - answered.get(v, 0) for v in now} == {"200": 1, "201": 1, "300": 1}, cmd
                else:  # the command's own relay starts one staying agent per container of pve1; ct300 is alone
                    assert agent_verbs(calls) == {"200": ["serve"], "201": ["serve"], "300": ["poll"]}, cmd
    finally:
        for names in runs.values():
            for run in names:
                pve_env.ctl("stop", run, "--grace", "1")


def test_a_launch_is_two_execs_with_the_environment_probe_inside_the_preflight(pve_env: PveEnv) -> None:
    """`ctl launch CT --run NAME`: the preflight, the environment probe and then the start are two agent execs in
    the container (the pct journal counts them), not three: probe_env.py runs inside the agent's `probe`. What it
    found is recorded with the run, as when it ran on its own. (Without a persistent session, so that each agent
    request is an exec the journal shows; with one, a staying agent answers both.)"""
    deployed(pve_env, "ct200", steps=100000, interval=0.2)
    host = pve_env.host
    before = len(host.pct_calls("pve1"))
    pve_env.env["CTL_PERSIST"] = "0"
    r = pve_env.ctl("launch", "ct200", "--run", "env1")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        calls = [c for c in host.pct_calls("pve1")[before:] if c["args"][0] == "200"]
        assert [c["cmd"] for c in calls] == ["exec", "exec"], calls
        assert [c["argv"][6] for c in calls] == ["probe", "launch"], calls  # python3 -I -S -c BOOT N VERB
        shown = json.loads(pve_env.ctl("show", "env1", "--json", check=True).stdout)
        assert shown["env_fingerprint"] and shown["env"]["python"]["version"], shown
    finally:
        pve_env.ctl("stop", "env1", "--grace", "1")


def test_launch_follow_streams_the_log_at_once_from_the_pid_the_launch_answered(pve_env: PveEnv) -> None:
    """`ctl launch CT -f`: the launch's answer names the training's pid and made its log, so the log stream (a
    `tail --pid`) starts right after it; before, a runstate round trip came first. The whole log is shown, and the
    run is recorded finished when the stream ends. (Without a persistent session, so that each agent request is an
    exec the journal shows.)"""
    deployed(pve_env, "ct200", steps=5, interval=0.05)
    host = pve_env.host
    before = len(host.pct_calls("pve1"))
    pve_env.env["CTL_PERSIST"] = "0"
    r = pve_env.ctl("launch", "ct200", "--run", "ff1", "-f")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [c for c in host.pct_calls("pve1")[before:] if c["args"][0] == "200"]
    did = [c["argv"][6] if c["argv"][0] == "python3" else c["argv"][0] for c in calls]
    assert did == ["probe", "launch", "tail", "runstate"], calls
    assert "--pid=" in " ".join(calls[2]["argv"])
    assert r.stdout.count("step=") == 5, r.stdout
    assert wait_state(pve_env, "ff1", {"finished"})["exit_status"] == 0
