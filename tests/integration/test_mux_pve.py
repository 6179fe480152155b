"""Persistent host sessions (on by default; CTL_PERSIST) against the local Proxmox host: reuse, drops, idle exit,
permissions. How they hold under failures: test_mux_failures_pve.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.errors import ConnectionFailed, ExitCode
from controller.inventory import load
from controller.transport import mux as mux_mod
from controller.transport.pct import PctContainer
from controller.transport.pool import Pool
from tests.helpers import sha_file
from tests.integration.conftest import REPO, PveEnv, children, sshd_sessions

pytestmark = pytest.mark.pvehost

_PID = re.compile(r"(started|reused) ctl's persistent session \(pid (\d+)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of this test process counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def persist(pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[PveEnv]:
    """The default (sessions on, 60 s) for ctl runs and Pools made here, whatever the caller's environment
    says; pve_env stops the sessions afterwards, and every session process seen here is gone too."""
    pve_env.env.pop("CTL_PERSIST", None)
    monkeypatch.delenv("CTL_PERSIST", raising=False)
    yield pve_env
    mux_mod.stop(timeout=10)
    for pid in _pids_seen:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)
    _pids_seen.clear()


def sockets(env: PveEnv) -> list[Path]:
    """The sockets of the live sessions of the test's state directory (their paths are in the info files)."""
    d = env.state / "mux"
    return [Path(json.loads(i.read_text())["socket"]) for i in d.glob("*.json")] if d.is_dir() else []


_pids_seen: list[int] = []


def _environ(pid: int | bytes) -> dict[str, str]:
    """The environment process `pid` started with (or one as /proc/PID/environ holds it)."""
    raw = pid if isinstance(pid, bytes) else Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="surrogateescape").split("\0") if "=" in kv)


def _session_pid(stderr: str) -> int:
    m = _PID.search(stderr)
    assert m, stderr
    _pids_seen.append(int(m.group(2)))
    return int(m.group(2))


def test_persistence_is_on_by_default_for_60s_and_ctl_persist_0_turns_it_off(pve_env: PveEnv) -> None:
    env = dict(pve_env.env)
    env.pop("CTL_PERSIST", None)
    argv = [sys.executable, "-m", "controller", "-i", str(pve_env.inventory), "--debug", "deploy", "ct200",
            "--allow-dirty"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    pid = _session_pid(r.stderr)
    assert "started ctl's persistent session" in r.stderr and "60s idle timeout" in r.stderr
    (info,) = (pve_env.state / "mux").glob("*.json")
    assert json.loads(info.read_text())["idle"] == 60
    off = subprocess.run(argv, capture_output=True, text=True, env={**env, "CTL_PERSIST": "0"}, timeout=120)
    assert off.returncode == 0 and "up to date" in off.stdout, off.stdout + off.stderr
    assert "persistent session" not in off.stderr
    again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert f"reused ctl's persistent session (pid {pid}," in again.stderr
    env["CTL_PERSIST"] = "soon"
    bad = subprocess.run([sys.executable, "-m", "controller", "-i", str(pve_env.inventory), "deploy", "ct200",
                          "--allow-dirty"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == ExitCode.INPUT
    assert "CTL_PERSIST: expected whole seconds >= 0" in bad.stderr and "'soon'" in bad.stderr


def test_second_deploy_reuses_the_session_without_a_new_connection(persist: PveEnv) -> None:
    env = persist
    before = sshd_sessions(env, "pve1")
    first = env.ctl("--debug", "deploy", "ct200", "--allow-dirty", check=True)
    assert "deployed 2 of 2 files" in first.stdout
    pid = _session_pid(first.stderr)
    assert "started ctl's persistent session" in first.stderr
    # begun while ctl loaded (launch/early.py), and still the one session and connection
    assert "starting ctl's persistent session for pve1 while ctl loads" in first.stderr
    sessions = sshd_sessions(env, "pve1")
    mine = sessions - before
    assert len(mine) == 1  # the session's own SSH connection, kept after ctl exited
    second = env.ctl("--debug", "deploy", "ct200", "--allow-dirty", check=True)
    assert "up to date (2 files verified" in second.stdout
    assert f"reused ctl's persistent session (pid {pid}," in second.stderr
    assert not sshd_sessions(env, "pve1") - sessions and mine <= sshd_sessions(env, "pve1")  # no new one
    for name in ("emit_metrics.py", "start_training.sh"):
        assert (env.host.rootfs(200) / "root" / env.tag / name).exists()
    landed = env.host.rootfs(200) / "root" / env.tag / "emit_metrics.py"
    assert sha_file(landed) == sha_file(env.dir / "emit_metrics.py")
    # A client that finds the session imports no paramiko and opens no SSH connection of its own.
    probe = (
        "import sys, json\n"
        "from controller.inventory import load\nfrom controller.transport.pool import Pool\n"
        "from controller.commands import deploy\n"
        f"inv = load({str(env.inventory)!r}); ct = inv.container('ct200')\n"
        "with Pool(inv) as pool:\n"
        "    r = deploy.deploy(inv, ct, pool.container(ct), None, allow_dirty=True)\n"
        "    h = pool.host('pve1')\n"
        "    print(json.dumps([r.changed, len(r.plan), 'paramiko' in sys.modules, h.connects, h.round_trips,\n"
        "                      pool._relays['pve1'].hello['pid']]))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env.env, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [0, 2, False, 0, 0, pid]
    # Changed content through the same session lands whole and verified.
    (env.dir / "emit_metrics.py").write_bytes((env.dir / "emit_metrics.py").read_bytes() + b"\n# v2\n")
    third = env.ctl("deploy", "ct200", "ct201", "--allow-dirty", check=True)
    assert "ct200        deployed 1 of 2 files" in third.stdout, third.stdout
    assert "ct201        deployed 2 of 2 files" in third.stdout, third.stdout  # first deploy there
    for vmid in (200, 201):
        deployed = env.host.rootfs(vmid) / "root" / env.tag / "emit_metrics.py"
        assert sha_file(deployed) == sha_file(env.dir / "emit_metrics.py")
    assert not sshd_sessions(env, "pve1") - sessions and mine <= sshd_sessions(env, "pve1")
    st = env.ctl("mux", "status", "--json", check=True)
    assert [(d["host"], d["pid"], d["live"]) for d in json.loads(st.stdout)["sessions"]] == [("pve1", pid, True)]
    stop = env.ctl("mux", "stop", check=True)
    assert f"pve1: stopped session (pid {pid})" in stop.stdout
    assert _wait_gone(pid)
    assert not sockets(env)


def test_a_cold_command_starts_each_hosts_session_while_it_loads_and_uses_it(persist: PveEnv) -> None:
    env = persist
    before = {n: sshd_sessions(env, n) for n in ("pve1", "pve2")}
    r = env.ctl("--debug", "ping", "ct200", "ct201", "ct300", check=True)
    assert "starting ctl's persistent session for pve1, pve2 while ctl loads" in r.stderr, r.stderr
    for n in ("pve1", "pve2"):
        assert re.search(rf"{n}: started ctl's persistent session \(pid (\d+)", r.stderr), r.stderr
        assert len(sshd_sessions(env, n) - before[n]) == 1, n  # one connection each, the session's
    for m in re.finditer(r"started ctl's persistent session \(pid (\d+)", r.stderr):
        _pids_seen.append(int(m.group(1)))
    assert [ln.split()[:2] for ln in r.stdout.splitlines()] == [["ct200", "ok"], ["ct201", "ok"], ["ct300", "ok"]]
    assert sorted(d["host"] for d in json.loads(env.ctl("mux", "status", "--json", check=True).stdout)["sessions"]) == [
        "pve1", "pve2"]
    again = env.ctl("--debug", "ping", "ct200", check=True)
    assert "while ctl loads" not in again.stderr  # a session runs: nothing begun early, it is reused
    assert "pve1: reused ctl's persistent session" in again.stderr


def _spares_of(runtime: Path, sessions: list[int]) -> list[int]:
    """The processes started as a spare with this runtime directory, other than the sessions forked from one."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or int(d.name) in sessions or b"--spare" not in (d / "cmdline").read_bytes():
                continue
            if _environ(int(d.name)).get("XDG_RUNTIME_DIR") == str(runtime):
                found.append(int(d.name))
        except (OSError, ValueError):
            continue
    return found


def test_a_cold_commands_sessions_are_forks_of_its_spare(persist: PveEnv) -> None:
    """No session of the user up: the command's spare (transport/mux/spare.py), started from its verb alone,
    forks the session process of each host it reaches, each in a session of its own, and goes with the
    command; the sessions serve the next command as any other."""
    env = persist
    runtime = Path(tempfile.mkdtemp(prefix="ctl-t", dir="/tmp"))  # this test's sockets only: nothing else is up
    env.env["XDG_RUNTIME_DIR"] = str(runtime)
    try:
        r = env.ctl("--debug", "ping", "ct200", "ct300", check=True)
        pids = [int(m.group(1)) for m in re.finditer(r"started ctl's persistent session \(pid (\d+)", r.stderr)]
        _pids_seen.extend(pids)
        assert len(pids) == 2, r.stderr
        for pid in pids:
            assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-4:-2] == [
                b"controller.transport.mux.daemon", b"--spare"]
            assert os.getsid(pid) == pid
            assert _environ(pid).get("CTL_STATE_DIR") == str(env.state)
        deadline = time.monotonic() + 15
        while _spares_of(runtime, pids):  # it goes when the command's end of its socketpair closes
            assert time.monotonic() < deadline, _spares_of(runtime, pids)
            time.sleep(0.05)
        again = env.ctl("--debug", "ping", "ct200", "ct300", check=True)
        assert "pve1: reused ctl's persistent session" in again.stderr and "while ctl loads" not in again.stderr
        assert not _spares_of(runtime, pids)  # a warm command starts none
        env.env["CTL_PERSIST"] = "0"
        env.ctl("mux", "stop", check=True)
        env.ctl("ping", "ct200", check=True)
        assert not _spares_of(runtime, pids)  # nor one with sessions off
    finally:
        env.env.pop("CTL_PERSIST", None)
        env.ctl("mux", "stop")
        shutil.rmtree(runtime, ignore_errors=True)


def test_socket_directory_and_socket_are_private(persist: PveEnv) -> None:
    env = persist
    r = env.ctl("--debug", "deploy", "ct200", "--allow-dirty", check=True)
    pid = _session_pid(r.stderr)
    d = env.state / "mux"
    (sock,) = sockets(env)
    for private in (d, sock.parent):
        st = private.stat()
        assert (st.st_mode & 0o777, st.st_uid) == (0o700, os.getuid()), private
    assert (sock.stat().st_mode & 0o777, sock.stat().st_uid) == (0o600, os.getuid())
    assert sock.parent == mux_mod.socket_dir(create=False)
    assert not any(str(env.dir) in line or "BEGIN" in line for line in (d / sock.with_suffix(".log").name)
                   .read_text().splitlines())
    # Someone else's socket under our name is refused, never used.
    os.chown(sock, 65534, 65534, follow_symlinks=False)
    try:
        bad = env.ctl("deploy", "ct200", "--allow-dirty")
        assert bad.returncode == ExitCode.CONNECTION, bad.stdout + bad.stderr
        assert "not a socket owned by uid 0" in bad.stdout + bad.stderr
    finally:
        os.chown(sock, os.getuid(), os.getgid(), follow_symlinks=False)
    # A directory others may enter is refused too.
    d.chmod(0o755)
    try:
        bad = env.ctl("deploy", "ct200", "--allow-dirty")
        assert bad.returncode == ExitCode.CONNECTION
        assert "must be a directory owned by uid 0 with mode 0700" in bad.stdout + bad.stderr
    finally:
        d.chmod(0o700)
    assert _alive(pid)


def test_killed_session_fails_open_streams_clearly_and_the_next_command_starts_a_new_one(persist: PveEnv) -> None:
    env = persist
    inv = load(env.inventory)
    ct = inv.container("ct200")
    with Pool(inv) as pool:
        t = pool.container(ct)
        assert isinstance(t, PctContainer) and t.relay is not None
        d = t.open(["sleep", "8"])
        pid = t.relay.hello["pid"]  # type: ignore[attr-defined]
        _pids_seen.append(pid)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ConnectionFailed, match=r"connection dropped.*ctl's session process.*ended; the next "
                                                   r"ctl command starts a new one"):
            d.finish(timeout=30)
        # The next exec of the same command connects to a new session, as SSH reconnects after a drop.
        again = t.run(["echo", "hi"])
        assert again.out == "hi\n"
        new = t.relay.hello["pid"]  # type: ignore[attr-defined]
        _pids_seen.append(new)
        assert new != pid and t.relay.started_session  # type: ignore[attr-defined]
    assert _wait_gone(pid)
    r = env.ctl("--debug", "deploy", "ct200", "--allow-dirty", check=True)
    assert f"reused ctl's persistent session (pid {new}," in r.stderr
    # The SSH connection under a live session drops: the session ends, its socket goes, the next one is fresh.
    (sock,) = sockets(env)
    for p in sshd_sessions(env, "pve1"):
        os.kill(p, signal.SIGKILL)
    assert _wait_gone(new)
    assert not sock.exists()
    again = env.ctl("--debug", "deploy", "ct200", "--allow-dirty", check=True)
    assert "up to date" in again.stdout
    assert _session_pid(again.stderr) not in (pid, new)


def test_idle_session_exits_and_removes_its_socket(persist: PveEnv) -> None:
    env = persist
    env.env["CTL_PERSIST"] = "1"
    r = env.ctl("--debug", "deploy", "ct200", "--allow-dirty", check=True)
    pid = _session_pid(r.stderr)
    socks = sockets(env)
    assert _wait_gone(pid, timeout=10)
    assert socks and not any(s.exists() for s in socks) and not sockets(env)
    assert "ending: idle for 1s" in next((env.state / "mux").glob("*.log")).read_text()


def test_inventory_persist_key_sets_the_idle_time_or_turns_sessions_off_and_ctl_persist_wins(persist: PveEnv) -> None:
    """`persist: SECONDS` on a host sets its sessions' idle time, `persist: 0` turns them off for that host only;
    CTL_PERSIST (and the config file's `persist`) win over it."""
    import yaml

    env = persist
    doc = yaml.safe_load(env.inventory.read_text())
    doc["hosts"]["pve1"]["persist"] = 0
    doc["hosts"]["pve2"]["persist"] = 45
    env.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = env.ctl("--debug", "ping", "ct200", "ct300", check=True)
    assert "pve1: started ctl's persistent session" not in r.stderr
    assert "pve2: started ctl's persistent session" in r.stderr and "45s idle timeout" in r.stderr, r.stderr
    _session_pid(r.stderr)
    assert [d["host"] for d in mux_mod.sessions()] == ["pve2"]
    env.env["CTL_PERSIST"] = "30"
    on = env.ctl("--debug", "ping", "ct200", check=True)
    assert "pve1: started ctl's persistent session" in on.stderr and "30s idle timeout" in on.stderr
    _session_pid(on.stderr)
    env.env["CTL_PERSIST"] = "0"
    off = env.ctl("--debug", "ping", "ct200", "ct300", check=True)
    assert "persistent session" not in off.stderr


def test_session_process_gets_only_the_environment_it_needs(persist: PveEnv) -> None:
    """The session outlives the command that started it: that command's secrets never reach it."""
    env = persist
    env.env["PVE_TOKEN"] = "xyz"
    env.env["AWS_SECRET_ACCESS_KEY"] = "abc"
    r = env.ctl("--debug", "deploy", "ct200", "--allow-dirty", check=True)
    pid = _session_pid(r.stderr)
    assert "started ctl's persistent session" in r.stderr
    seen = _environ(pid)
    assert "PVE_TOKEN" not in seen and "AWS_SECRET_ACCESS_KEY" not in seen
    assert "xyz" not in seen.values() and "abc" not in seen.values()
    assert seen["CTL_STATE_DIR"] == str(env.state)
    assert "PATH" in seen
    assert set(seen) <= {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "SSH_AUTH_SOCK", "PYTHONPATH",
                         "PYTHONHOME", "XDG_RUNTIME_DIR", "CTL_STATE_DIR"} | {k for k in seen if k.startswith("LC_")}


# Runs `ctl ARGS` and writes the modules it imported to OUT when it exits (tests/test_cli_startup.py's hook).
_HOOK = ("import atexit, json, runpy, sys\n"
         "out = sys.argv.pop(1)\n"
         "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(sys.modules))))\n"
         "sys.argv[0] = 'ctl'\n"
         "runpy.run_module('controller', run_name='__main__')\n")


def test_commands_through_a_session_never_import_paramiko(persist: PveEnv) -> None:
    """The client side of a command that has a session (warm, or one it starts: the session process connects)
    imports no paramiko; with sessions off it does (the check can fail)."""
    env = persist
    out = env.dir / "modules.json"

    def imported(*args: str, extra: dict[str, str] | None = None) -> set[str]:
        r = subprocess.run([sys.executable, "-c", _HOOK, str(out), "-i", str(env.inventory), *args],
                           capture_output=True, text=True, env={**env.env, **(extra or {})}, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return set(json.loads(out.read_text()))

    cold = imported("--debug", "ping", "ct200")
    assert "paramiko" not in cold
    env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    for args in (("ping", "ct200", "ct201"), ("deploy", "ct200", "--check"), ("runs",)):
        mods = imported(*args)
        assert not {"paramiko", "proxmoxer", "cryptography", "nacl"} & mods, (args, {"paramiko"} & mods)
    assert "paramiko" in imported("ping", "ct200", extra={"CTL_PERSIST": "0"})


def test_every_operation_of_every_command_goes_through_the_one_session(persist: PveEnv, tmp_path: Path) -> None:
    """Deploy, exec, follows (launch -f, tail -f), status, metrics, the environment probe, a download (cache save
    --local), pct on the host (snapshots) and several containers at once: one SSH login on the host, the session's.
    A container with its own sshd gets one session of its own."""
    from tests.conftest import fill_cache
    from tests.integration.conftest import container_venv

    env = persist
    inside, _venv = container_venv(env)
    cache, store = f"/workspace/{env.tag}/inductor", f"/workspace/{env.tag}/caches"
    env.write(containers={"ct200": {"vars": {"venv": inside, "compile_cache_dir": cache, "cache_store": store}}})
    fill_cache(env.host.rootfs(200) / cache.lstrip("/"))
    logs = {"pve1": env.host.base / "pve1" / "sshd.log", "ct301": env.host.rootfs(301) / "var" / "log" / "sshd.log"}

    def logins() -> dict[str, int]:
        return {k: p.read_text(errors="replace").count("Accepted publickey") if p.exists() else 0
                for k, p in logs.items()}

    before = logins()
    steps: list[tuple[tuple[str, ...], tuple[int, ...]]] = [
        (("deploy", "ct200", "ct201", "ct301", "--allow-dirty"), (0,)),
        (("ping", "ct200", "ct201", "ct301"), (0,)),
        (("launch", "ct200", "--run", "one", "-f"), (0,)),
        (("tail", "ct200", "--run", "one"), (0,)),
        (("tail", "ct200", "--run", "one", "-f"), (0,)),
        (("status", "ct200"), (0, 20, 21, 22)),
        (("metrics", "pull", "one"), (0,)),
        (("env", "probe", "ct200"), (0,)),
        (("cache", "save", "ct200", "c1", "--local", str(tmp_path / "pulled")), (0,)),
        (("snapshot", "list", "ct200"), (0,)),
        (("deploy", "ct200", "ct301", "--check"), (0,)),
    ]
    for args, ok in steps:
        r = env.ctl(*args)
        assert r.returncode in ok, (args, r.stdout, r.stderr)
    assert (tmp_path / "pulled" / "c1.tar.gz").stat().st_size > 0
    time.sleep(0.5)  # sshd writes its log line as a login completes
    after = logins()
    assert {k: after[k] - before[k] for k in logs} == {"pve1": 1, "ct301": 1}, (before, after)
    assert sorted(d["host"] for d in mux_mod.sessions()) == ["ct301", "pve1"]


def test_agent_requests_leave_out_the_source_a_session_already_keeps(persist: PveEnv) -> None:
    """The agent's 77 KB travel once per session, not with every request: a command that finds a session sends
    its agent requests without the source; a session that never got it answers U, and the request goes again
    with it (nothing runs twice); a session this command starts gets the source with the first request."""
    from controller.remote.client import Agent, agent_sha

    inv = load(persist.inventory)
    ct = inv.container("ct200")
    with Pool(inv) as pool:  # starts the session with a `pct status` only: its relay has no agent source yet
        t = pool.container(ct)
        assert isinstance(t, PctContainer) and t.status() == "running"
        assert t.relay is not None and t.relay.started_session
    with Pool(inv) as pool:  # finds it: tries without the source, is told U, sends it
        t = pool.container(ct)
        assert Agent(t).call("hello", {})["staying"] is True
        assert t.relay is not None and not t.relay.started_session
        assert t.relay.sources_missing == {agent_sha()} and t.relay.sources_sent == {agent_sha()}
    with Pool(inv) as pool:  # finds it, now with the source: none travels, none is missing
        t = pool.container(ct)
        agent = Agent(t)
        assert agent.call("hello", {})["staying"] is True and agent.call("hashes", ["/"])["ok"]
        assert t.relay is not None and t.relay.sources_missing == set() and t.relay.sources_sent == set()
    persist.ctl("mux", "stop", check=True)
    with Pool(inv) as pool:  # a session this command starts: the first request carries the source
        t = pool.container(ct)
        assert Agent(t).call("hello", {})["staying"] is True
        assert t.relay is not None and t.relay.started_session
        assert t.relay.sources_missing == set() and t.relay.sources_sent == {agent_sha()}


def test_a_closed_pool_leaves_no_connection_to_the_session(persist: PveEnv) -> None:
    """A process that goes on after its Pool closed (the dashboard, supervise's loop) is no longer a client of
    the session: the relay's reader thread ends. Closing the socket under that thread's blocked recv() left the
    socket open (no FIN): the session counted the process as a client, never went idle, and `ctl mux stop`
    waited out its 30 s grace for it."""
    inv = load(persist.inventory)
    with Pool(inv) as pool:
        t = pool.container(inv.container("ct200"))
        assert isinstance(t, PctContainer) and t.status() == "running"
        readers = [th for th in threading.enumerate() if th.name == "mux-pve1"]
    assert len(readers) == 1
    readers[0].join(10)
    assert not readers[0].is_alive()
    stopped = persist.ctl("mux", "stop", check=True)  # the default grace: nothing of ours left for it to wait for
    assert "pve1: stopped session" in stopped.stdout


def test_a_session_relay_the_command_closes_leaves_its_host_connection_open(persist: PveEnv) -> None:
    """A relay the command itself closes (an early start it did not use, a Pool's end) is no dropped connection:
    its reader, woken by the shutdown, must not close the host endpoint the command may still be using."""
    inv = load(persist.inventory)
    with Pool(inv) as pool:
        t = pool.container(inv.container("ct200"))
        assert isinstance(t, PctContainer) and t.status() == "running"
        relay = t.relay
        assert relay is not None and relay.staying is not None
        own = pool.host("pve1").connection()  # the endpoint's own SSH connection, opened by the command
        reader = relay._reader
        relay.close()
        assert reader is not None
        reader.join(10)
        assert not reader.is_alive()
        transport = own.get_transport()
        assert transport is not None and transport.is_active()
        assert pool.host("pve1").run(["true"], timeout=30).returncode == 0


def test_a_request_past_its_deadline_ends_its_staying_agent_at_once(persist: PveEnv) -> None:
    """ctl gives up on an agent request at its deadline and tells the relay (K): the staying agent stuck in it
    is ended while the command goes on (not only when it exits), and the stream's id is freed by the relay's X."""
    from controller.errors import DeadlineExceeded
    from controller.remote.client import BOOT
    from controller.transport.base import AgentStart
    from tests.relay_fakes import FAKE, FAKE_AT

    inv = load(persist.inventory)
    argv = ["sh", "-c", 'exec "$0" "$@" hang', "python3", "-I", "-S", "-c", BOOT, str(len(FAKE)), "verb"]
    start = AgentStart(FAKE_AT, len(FAKE), False, hashlib.sha256(FAKE).hexdigest())

    def busy() -> list[dict[str, object]]:
        (doc,) = [d for d in mux_mod.sessions() if d["host"] == "pve1"]
        return [a for a in doc["agents"] or [] if a["busy"]]

    with Pool(inv) as pool:
        t = pool.container(inv.container("ct200"))
        assert isinstance(t, PctContainer) and t.keeps_agents()
        with pytest.raises(DeadlineExceeded, match="no answer in 2s"):
            t.run_agent(argv, start, stdin=FAKE, timeout=2)
        deadline = time.monotonic() + 10
        while busy() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert busy() == []
        assert t.relay is not None and t.relay._streams == {}  # the relay's X came: the id is free again


def test_ping_counts_the_first_answer_of_an_agent_that_was_up_as_a_round_trip(persist: PveEnv) -> None:
    """Best of three round trips to the staying agent: a first ping starts it (its first answer has the start in
    it: three more requests); a second finds it up (its first answer is one of the three: two more)."""

    def requests() -> list[int]:
        docs = json.loads(persist.ctl("--json", "mux", "status", check=True).stdout)["sessions"]
        return [a["requests"] for d in docs if d["host"] == "pve1" for a in d["agents"] or []]

    rows = json.loads(persist.ctl("--json", "ping", "ct200", check=True).stdout)
    assert rows[0]["staying"] is True and rows[0]["rtt_ms"] <= rows[0]["first_ms"]
    assert requests() == [4]
    rows = json.loads(persist.ctl("--json", "ping", "ct200", check=True).stdout)
    assert rows[0]["staying"] is True and rows[0]["rtt_ms"] <= rows[0]["first_ms"]
    assert requests() == [7]


def test_a_fan_out_of_agent_requests_runs_in_the_sessions_readers_and_keeps_each_failure_its_own(
        persist: PveEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """flows(): through a session's staying agents, every container's requests are in flight together and each
    answer moves its container on in the session's reader thread, not in a thread per container. A stopped
    container fails alone with pct's refusal; one whose agent stops answering fails alone at its deadline."""
    from controller.commands.fanout import Flow, flows
    from controller.errors import DeadlineExceeded
    from controller.inventory import Container
    from controller.remote.client import Agent

    names = ["ct200", "ct201", "ct300", "ct301"]
    persist.ctl("ping", *names, check=True)  # the sessions and their agents are up
    seen: list[str] = []

    def flow(ct: Container, agent: Agent) -> Flow[list[int]]:
        pids = []
        for _ in range(3):
            doc = yield "hello", {}
            seen.append(threading.current_thread().name)
            pids.append(doc["pid"])
        return pids

    inv = load(persist.inventory)
    cts = [inv.container(n) for n in names]
    persist.host.stop(201)
    try:
        with Pool(inv) as pool:
            out = {o.ct: o for o in flows(pool, cts, flow)}
    finally:
        persist.host.start(201)
    assert "CT 201 on pve1 is stopped" in str(out["ct201"].error), out["ct201"]
    for n in ("ct200", "ct300", "ct301"):
        assert out[n].ok and len(set(out[n].value or [])) == 1, out[n]  # one staying agent answered all three
    # the sessions of pve1, pve2 and ct301 (a container with its own sshd): their readers, no fan-out thread
    assert set(seen) <= {"mux-pve1", "mux-pve2", "mux-ct301", "MainThread"} and len(seen) == 9, seen

    # ct300's agent stops answering (SIGSTOP): its request fails at the deadline, the others are answered.
    docs = json.loads(persist.ctl("--json", "mux", "status", check=True).stdout)["sessions"]
    (attach,) = [a["pid"] for d in docs for a in d["agents"] or [] if a["argv"][:3] == ["pct", "exec", "300"]]
    (agent_pid,) = children(attach)
    monkeypatch.setenv("CTL_TIMEOUT", "2")
    inv = load(persist.inventory)
    os.kill(agent_pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with Pool(inv) as pool:
            out = {o.ct: o for o in flows(pool, [inv.container(n) for n in ("ct200", "ct300", "ct301")], flow)}
        took = time.monotonic() - t0
    finally:
        os.kill(agent_pid, signal.SIGKILL)
    assert out["ct200"].ok and out["ct301"].ok, out
    assert not out["ct300"].ok and "no answer in 2s" in str(out["ct300"].error), out["ct300"]
    assert out["ct300"].exit_code == int(DeadlineExceeded.exit_code)
    assert took < 15, took


def test_staying_agents_start_by_lxc_attach_with_the_environment_pct_gives(persist: PveEnv) -> None:
    """pct exec is `lxc-attach -n VMID --keep-env -- ...` once pct (a Perl program, several hundred ms a start on
    a real host) has found the container running. The relay starts a staying agent that way itself: the node's
    journal shows an attach and no pct; while that agent lives, the relay's other execs in the container attach
    too. The agent's environment, which a launch passes on to the training, is the one `pct exec` gives. A stopped
    container still gets pct's own refusal."""
    host = persist.host
    before = len(host.pct_calls("pve1"))
    persist.ctl("ping", "ct200", check=True)
    calls = host.pct_calls("pve1")[before:]
    assert [(c["cmd"], c["args"][0], c["argv"][6]) for c in calls] == [("attach", "200", "serve")], calls
    docs = json.loads(persist.ctl("--json", "mux", "status", check=True).stdout)["sessions"]
    agents = [a for d in docs if d["host"] == "pve1" for a in d["agents"]]
    assert [(a["via"], a["argv"][:4]) for a in agents] == [("lxc-attach", ["pct", "exec", "200", "--"])], agents
    (agent,) = children(agents[0]["pid"])  # lxc-attach's child: the agent, in the container
    staying = _environ(agent)
    relay = int(Path(f"/proc/{agents[0]['pid']}/stat").read_text().rsplit(") ", 1)[1].split()[1])
    session = _environ(relay)  # what the relay started with: the session's

    inv = load(persist.inventory)
    with Pool(inv) as pool:  # the same session, so the same relay: its exec attaches as the agent did
        t = pool.container(inv.container("ct200"))
        res = t.run(["cat", "/proc/self/environ"])
    assert res.returncode == 0, res.err
    through_relay = _environ(res.out.encode(errors="surrogateescape"))
    assert staying["PATH"] == "/sbin:/bin:/usr/sbin:/usr/bin" and staying.get("container") == "lxc", staying
    assert session["SSL_CERT_FILE"] and "SSL_CERT_FILE" not in staying, staying  # pct.pm's clean_environment
    assert staying.get("LC_CTYPE") == session.get("LC_CTYPE"), (staying, session)  # not the relay's coercion
    assert staying == through_relay
    assert [c["cmd"] for c in host.pct_calls("pve1")[before + 1:]] == ["attach"]  # the cat
    # pct itself, in a login of its own, gives the same environment (but for that login's own address and port,
    # and `_`, which its shell sets to the command it ran)
    r = subprocess.run([*host.ssh_argv("pve1"), "--", "pct exec 200 -- cat /proc/self/environ"],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [c["cmd"] for c in host.pct_calls("pve1")[before + 2:]] == ["exec"]

    def mine(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in ("SSH_CLIENT", "SSH_CONNECTION", "_")}

    assert mine(staying) == mine(_environ(r.stdout))

    host.stop(201)
    try:
        mark = len(host.pct_calls("pve1"))
        r = persist.ctl("ping", "ct201")
        assert r.returncode == ExitCode.NOT_RUNNING and "CT 201 on pve1 is stopped" in r.stdout + r.stderr, r
        tried = [(c["cmd"], c["args"][0]) for c in host.pct_calls("pve1")[mark:]]
        assert tried[0] == ("attach", "201") and ("exec", "201") in tried[1:], tried
    finally:
        host.start(201)
