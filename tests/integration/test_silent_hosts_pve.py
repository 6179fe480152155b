"""Silent hosts against the local Proxmox host: a stopped `pct`, a stopped host relay, a stopped session process
and dropped traffic end in UNREACHABLE / a clear error (exit 5) within the deadline, never a hang, and the next
command (or a follow) carries on once the host answers again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.errors import ExitCode
from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost

GENEROUS = 45  # seconds: "returned instead of hanging"; the deadlines below are 3 s


def deployed(env: PveEnv, **vars_: object) -> None:
    env.write(vars={**env.base_extra["vars"], **vars_})
    env.ctl("deploy", "ct200", "--allow-dirty", check=True)


def limits(env: PveEnv, **host: object) -> None:
    """Small deadlines on pve1 (and the fixture's payload, runs, vars)."""
    doc = dict(env.base_extra)
    doc["vars"] = {**doc["vars"], "steps": 100000, "interval": 0.2}
    env.host.write_inventory(env.inventory, **doc, hosts={"pve1": {"timeout": 3, "connect_timeout": 3, **host}})


def status(env: PveEnv, *args: str) -> tuple[int, list[dict[str, object]], str, float]:
    t0 = time.monotonic()
    r = env.ctl("--json", "status", *args, timeout=GENEROUS)
    return r.returncode, json.loads(r.stdout or "[]"), r.stderr, time.monotonic() - t0


def runs_json(env: PveEnv, *args: str) -> tuple[int, dict[str, dict[str, object]]]:
    r = env.ctl("--json", "runs", *args, timeout=GENEROUS)
    return r.returncode, {str(x["name"]): x for x in json.loads(r.stdout)}


def descendants(root: int) -> list[int]:
    """PIDs below root (a node's sshd listener): this test host's processes, not another session's."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((d / "stat").read_text().rsplit(") ", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def relay_pids(env: PveEnv, node: str = "pve1") -> list[int]:
    listener = int((env.host.base / node / "sshd.pid").read_text().strip())
    return [p for p in descendants(listener) if "ctl-relay" in cmdline(p) and "python" in cmdline(p)]


def stop_run(env: PveEnv, run: str) -> None:
    env.ctl("stop", run, "--grace", "2", timeout=GENEROUS)


# --------------------------------------------------------------------------------------------
# (a) a stopped `pct` (one exec per container) and a stopped host relay (persistent session)


def test_stopped_pct_is_unreachable_within_the_deadline_and_the_next_status_sees_the_run(
        pve_env: PveEnv, tmp_path: Path) -> None:
    env = pve_env
    gate, pids = tmp_path / "gate", tmp_path / "stopped.pids"
    wrapper = tmp_path / "pct-gate"  # the host's `pct`: stops itself (SIGSTOP) while the gate file exists
    wrapper.write_text(f'#!/bin/sh\nif [ -e {gate} ]; then echo $$ >> {pids}; kill -STOP $$; fi\nexec pct "$@"\n')
    wrapper.chmod(0o755)
    limits(env, pct=str(wrapper))
    env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    env.ctl("launch", "ct200", "--run", "quiet1", check=True)
    rc, before, _, _ = status(env, "ct200")
    assert rc == 0 and before[0]["verdict"] != "unreachable", before
    env.ctl("mux", "stop", check=True)  # the session's staying agent needs no pct: the next one must start one
    gate.touch()
    try:
        rc, sts, err, took = status(env, "ct200")
        assert rc == ExitCode.CONNECTION, (rc, sts, err)
        assert took < GENEROUS
        (st,) = sts
        assert st["verdict"] == "unreachable" and st["state"] == "running" and st["exit_code"] == 5, st
        assert "no answer" in str(st["error"]) and "3s" in str(st["error"]), st
        assert "ct200: state not refreshed" in err and "pve1" in err
        rc, runs = runs_json(env, "ct200")
        assert rc == ExitCode.CONNECTION
        assert runs["quiet1"]["state"] == "running" and "no answer" in str(runs["quiet1"]["unreachable"])
        rc, recorded = runs_json(env, "ct200", "--no-refresh")  # the registry was not touched
        assert rc == 0 and recorded["quiet1"]["state"] == "running" and recorded["quiet1"]["exit_status"] is None
        assert pids.read_text().split()  # the pct of those commands really was stopped
    finally:
        gate.unlink(missing_ok=True)
        for pid in pids.read_text().split() if pids.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGCONT)
    rc, sts, err, _ = status(env, "ct200")
    assert rc == 0, (sts, err)
    assert sts[0]["run"] == "quiet1" and sts[0]["state"] == "running" and sts[0]["verdict"] != "unreachable"
    stop_run(env, "quiet1")


@pytest.fixture
def persist(pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[PveEnv]:
    """CTL_PERSIST=60 for ctl runs; every session started is ended afterwards (continued first if stopped)."""
    from controller.transport import mux as mux_mod

    pve_env.env["CTL_PERSIST"] = "60"
    monkeypatch.setenv("CTL_STATE_DIR", str(pve_env.state))
    yield pve_env
    d = pve_env.state / "mux"
    for info in d.glob("*.json") if d.is_dir() else []:  # a session a test stopped (SIGSTOP) answers again
        with contextlib.suppress(OSError, ValueError, ProcessLookupError):
            os.kill(json.loads(info.read_text())["pid"], signal.SIGCONT)
    mux_mod.stop(timeout=5)  # pve_env's teardown kills any that did not go


def test_stopped_host_relay_is_unreachable_and_the_session_answers_again_after_sigcont(persist: PveEnv) -> None:
    env = persist
    limits(env)
    others = set(relay_pids(env))  # relays of earlier tests' sessions, idling out on the same host
    env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    env.ctl("launch", "ct200", "--run", "quiet2", check=True)
    relays = [p for p in relay_pids(env) if p not in others]
    assert len(relays) == 1, relays  # this test's session: one relay on pve1
    os.kill(relays[0], signal.SIGSTOP)
    try:
        rc, sts, err, took = status(env, "ct200")
        assert rc == ExitCode.CONNECTION and took < GENEROUS, (sts, err)
        assert sts[0]["verdict"] == "unreachable" and sts[0]["state"] == "running", sts
        assert "ctl's session process for pve1" in str(sts[0]["error"]), sts
        rc, runs = runs_json(env, "ct200")
        assert rc == ExitCode.CONNECTION and runs["quiet2"]["state"] == "running" and runs["quiet2"]["unreachable"]
    finally:
        os.kill(relays[0], signal.SIGCONT)
    rc, sts, err, _ = status(env, "ct200")
    assert rc == 0 and sts[0]["state"] == "running" and sts[0]["verdict"] != "unreachable", (sts, err)
    stop_run(env, "quiet2")


# --------------------------------------------------------------------------------------------
# (c) a persistent session process that stopped answering


def test_stopped_session_process_is_a_clear_error_within_the_deadline(persist: PveEnv) -> None:
    env = persist
    limits(env)
    first = env.ctl("--debug", "ping", "ct200", check=True)
    assert "persistent session (pid" in first.stderr
    info = next((env.state / "mux").glob("*.json"))
    pid = json.loads(info.read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = env.ctl("ping", "ct200", timeout=GENEROUS)
        assert time.monotonic() - t0 < GENEROUS
        assert r.returncode == ExitCode.CONNECTION, r.stdout + r.stderr
        said = r.stdout + r.stderr  # ping's result line per container
        assert f"ctl's session process for pve1 (pid {pid};" in said and "did not answer in 3s" in said, said
    finally:
        os.kill(pid, signal.SIGCONT)
    again = env.ctl("ping", "ct200", timeout=GENEROUS)
    assert again.returncode == 0, again.stderr


# --------------------------------------------------------------------------------------------
# (b) the host's traffic dropped (nftables or iptables on loopback) under `ctl tail -f`


class Firewall:
    """Drops what pve1's sshd sends (source 127.0.0.2, source port its port), on loopback; undone by clear()."""

    def __init__(self, port: int, tag: str) -> None:
        self.port, self.table = port, f"ctl_{tag}"
        self.tool = "nft" if shutil.which("nft") else "iptables" if shutil.which("iptables") else None
        self.rule = ["INPUT", "-s", "127.0.0.2", "-p", "tcp", "--sport", str(port), "-j", "DROP"]

    def usable(self) -> str | None:
        """Why rules cannot be set here (None: they can): no tool, no permission, no kernel support."""
        if self.tool is None:
            return "neither nft nor iptables is installed (scripts/setup.sh installs nftables as root)"
        try:
            self.drop()
        except subprocess.CalledProcessError as e:
            return f"{self.tool} cannot add a rule here: {(e.stderr or '').strip()[:200]}"
        finally:
            self.clear()
        return None

    def drop(self) -> None:
        if self.tool == "nft":
            for cmd in (f"add table inet {self.table}",
                        f"add chain inet {self.table} input {{ type filter hook input priority -10 ; }}",
                        f"add rule inet {self.table} input ip saddr 127.0.0.2 tcp sport {self.port} drop"):
                subprocess.run(["nft", *cmd.split()], check=True, capture_output=True, text=True)
        else:
            subprocess.run(["iptables", "-I", *self.rule], check=True, capture_output=True, text=True)

    def clear(self) -> None:
        if self.tool == "nft":
            subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        elif self.tool == "iptables":
            while subprocess.run(["iptables", "-D", *self.rule], capture_output=True).returncode == 0:
                pass


def test_tail_follow_notices_dropped_traffic_by_keepalive_and_reconnects_without_losing_lines(
        pve_env: PveEnv) -> None:
    env = pve_env
    fw = Firewall(env.host.port, env.tag)
    why = fw.usable()
    if why:
        pytest.skip(f"cannot drop the test host's traffic: {why}")
    interval, count = 1, 2
    doc = dict(env.base_extra)
    doc["vars"] = {**doc["vars"], "steps": 250, "interval": 0.1}
    env.host.write_inventory(env.inventory, **doc, hosts={"pve1": {
        "keepalive": {"interval": interval, "count": count}, "connect_timeout": 2, "timeout": 5}})
    env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    env.ctl("launch", "ct200", "--run", "cut1", check=True)
    proc = subprocess.Popen([sys.executable, "-m", "controller", "-i", str(env.inventory), "tail", "ct200",
                             "--run", "cut1", "-f", "-n", "-1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env.env)
    out: list[str] = []
    err: list[tuple[float, str]] = []
    readers = [threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True),  # type: ignore[union-attr]
               threading.Thread(target=lambda: err.extend((time.monotonic(), x) for x in
                                                          iter(proc.stderr.readline, "")), daemon=True)]  # type: ignore[union-attr]
    for th in readers:
        th.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum("step=" in x for x in out) < 10:
            time.sleep(0.05)
        assert sum("step=" in x for x in out) >= 10, (out, err)
        fw.drop()
        cut = time.monotonic()
        try:
            deadline = cut + GENEROUS
            while time.monotonic() < deadline and not any("reconnecting" in x for _, x in err):
                time.sleep(0.1)
            noticed = [t for t, x in err if "reconnecting" in x]
            assert noticed, (err, out[-3:])
            # within the keepalive window (interval * (count + 1) = 3 s) plus a margin for a loaded machine
            assert noticed[0] - cut < interval * (count + 1) + 10, noticed[0] - cut
            assert any("no answer to keepalives" in x for _, x in err), err
            time.sleep(2)  # a reconnect attempt or two runs into the dropped traffic (connect timeout)
        finally:
            fw.clear()
        rc = proc.wait(timeout=120)
    finally:
        fw.clear()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for th in readers:
        th.join(timeout=10)
    assert rc == 0, (rc, err)
    assert any("reconnected after" in x for _, x in err), err
    log = (env.host.rootfs(200) / "workspace" / env.tag / "train_stdout_cut1.log").read_text().splitlines()
    body = [x.rstrip("\n") for x in out][:len(log)]
    assert body == log  # every line once, in order: nothing lost, nothing repeated
    assert "finished, exit status 0" in "".join(out[len(log):])


@pytest.mark.parametrize("persist", ["0", None], ids=["own-connection", "session"])
def test_an_ssh_agent_that_never_answers_ends_the_connect_at_its_deadline(pve_env: PveEnv, tmp_path: Path,
                                                                        persist: str | None) -> None:
    """pve1 refuses the identity file, so paramiko asks the ssh agent for keys; this agent (a forwarded one whose
    connection died) accepts and never answers. The connect ends at 3 x connect_timeout + 5 s with one line,
    and a session that met it lets the next command try again (no spawn lock left behind)."""
    key = tmp_path / "not_authorized"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    agent = tmp_path / "agent.sock"
    listener = __import__("socket").socket(__import__("socket").AF_UNIX)
    listener.bind(str(agent))
    listener.listen(8)
    held: list[object] = []

    def accept_all() -> None:  # and hold every connection unanswered, until the test closes the listener
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept())

    threading.Thread(target=accept_all, daemon=True).start()
    doc = dict(pve_env.base_extra)
    pve_env.host.write_inventory(pve_env.inventory, **doc, hosts={"pve1": {"identity_file": str(key),
                                                                           "connect_timeout": 1}})
    pve_env.env["SSH_AUTH_SOCK"] = str(agent)
    if persist is not None:
        pve_env.env["CTL_PERSIST"] = persist
    try:
        for _ in range(2):  # the second: nothing left holding on from the first
            t0 = time.monotonic()
            r = pve_env.ctl("ping", "ct200", timeout=GENEROUS)
            took = time.monotonic() - t0
            assert r.returncode == ExitCode.CONNECTION, r.stdout + r.stderr
            assert "pve1: connecting to 127.0.0.2" in r.stdout and "did not finish in 8s" in r.stdout, r.stdout
            assert "Traceback" not in r.stderr, r.stderr
            assert took < GENEROUS
    finally:
        listener.close()
    assert len(held) >= 2  # the agent was asked each time: the wait was its
