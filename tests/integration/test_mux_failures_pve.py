"""How persistent host sessions (on by default) hold under failures, against the local Proxmox host: the idle
timeout or a stop arriving while commands use the session, 64 commands at once, a state directory too long for
a socket path, a session of another ctl build, a host key known_hosts stopped trusting, a session killed -9,
and two users on one machine."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.errors import ExitCode
from controller.inventory import load
from controller.transport import mux
from controller.transport.mux.sock import session_key, socket_dir
from controller.transport.pool import Pool
from tests.helpers import wait_for
from tests.integration.conftest import REPO, PveEnv, children, sshd_sessions

pytestmark = pytest.mark.pvehost

_STARTED = re.compile(r"pve1: (started|reused) ctl's persistent session \(pid (\d+)")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


def _wait(cond: object, timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or cond}")


def _session(r: subprocess.CompletedProcess[str]) -> tuple[str, int]:
    m = _STARTED.search(r.stderr)
    assert m, r.stdout + r.stderr
    return m.group(1), int(m.group(2))


def _infos(env: PveEnv) -> list[dict[str, object]]:
    d = env.state / "mux"
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


def _queued(sock: Path) -> int:
    """Connections waiting in the session socket's accept queue (the kernel's Recv-Q of a listening socket)."""
    out = subprocess.run(["ss", "-xlH", "src", str(sock)], capture_output=True, text=True).stdout.split()
    return int(out[2]) if len(out) > 2 else 0


def _session_child(pid: int) -> list[int]:
    """[pid] of the session process that the process `pid` started, once it has (waited for): its child, or a
    fork of its spare (transport/mux/spare.py)."""
    daemon: list[int] = []

    def spawned() -> bool:
        daemon[:] = []
        for c in children(pid):
            try:
                cmdline = Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            if b"controller.transport.mux.daemon" in cmdline:
                daemon.extend(children(c) if b"--spare" in cmdline else [c])
        return bool(daemon)

    _wait(spawned, 60, "the session process")
    return daemon


def _stopped_before_listening(env: PveEnv, start: Callable[[], subprocess.Popen[Any]],
                              listens: Callable[[], bool]) -> tuple[subprocess.Popen[Any], list[int]]:
    """A command start()ed, and the session process it started stopped (SIGSTOP) before it listens: (the command,
    [the session's pid]). pve1's sshd is paused meanwhile: the session waits for its SSH banner until it is
    caught, so it cannot listen first however fast the machine is."""
    sshd = int((env.host.node_dir("pve1") / "sshd.pid").read_text())
    os.kill(sshd, signal.SIGSTOP)  # new connections wait in its backlog; the running sessions' own sshd go on
    try:
        proc = start()
        daemon = _session_child(proc.pid)
        os.kill(daemon[0], signal.SIGSTOP)
    finally:
        os.kill(sshd, signal.SIGCONT)
    assert not listens(), "the session listened before it was stopped"
    return proc, daemon


def _ctl(env: PveEnv, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "controller", "-i", str(env.inventory), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env.env)


@pytest.fixture
def env(pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[PveEnv]:
    """The default settings (sessions on) whatever the caller's environment says; pve_env ends the sessions."""
    pve_env.env.pop("CTL_PERSIST", None)
    monkeypatch.delenv("CTL_PERSIST", raising=False)
    yield pve_env


# --------------------------------------------------------------------------------------------
# The session ends while commands use it


def test_idle_timeout_reached_as_commands_connect_never_cuts_them(env: PveEnv) -> None:
    """Commands queued on the session's socket when its idle timeout passes are served, not dropped: the session
    stops listening first, then serves what was queued, then ends."""
    env.env["CTL_PERSIST"] = "2"
    _, pid = _session(env.ctl("--debug", "ping", "ct200", check=True))
    (info,) = _infos(env)
    sock = Path(str(info["socket"]))
    os.kill(pid, signal.SIGSTOP)  # frozen: the kernel still queues connections, nobody accepts them
    try:
        procs = [_ctl(env, "--debug", "ping", "ct200") for _ in range(6)]
        _wait(lambda: _queued(sock) == len(procs), 120, "6 commands queued on the session's socket")
        time.sleep(2.5)  # past the idle timeout, counted from the last command
    finally:
        os.kill(pid, signal.SIGCONT)
    outs = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert all(rc == 0 for rc, _, _ in outs), outs
    assert all("ct200        ok" in out for _, out, _ in outs), outs
    assert all(f"reused ctl's persistent session (pid {pid}," in err for _, _, err in outs), outs
    _wait(lambda: not _alive(pid), 20, "the idle session to end once its queued commands were done")
    assert not sock.exists()
    log = next((env.state / "mux").glob("*.log")).read_text()
    assert "ending: idle for 2s" in log


def test_stop_and_sigterm_let_a_request_in_flight_finish_and_new_commands_get_a_new_session(env: PveEnv) -> None:
    """`ctl mux stop` (and SIGTERM, at logout) end the session once the commands using it are done: one in
    flight finishes; a command started meanwhile gets a session of its own."""
    _, pid = _session(env.ctl("--debug", "ping", "ct200", check=True))
    long_request = textwrap.dedent(f"""
        import sys, time
        from controller.inventory import load
        from controller.transport.pool import Pool
        inv = load({str(env.inventory)!r}); ct = inv.container("ct200")
        with Pool(inv) as pool:
            t = pool.container(ct)
            t.run(["true"])
            print("connected", flush=True)
            res = t.run(["sh", "-c", "sleep 3; echo done"])
            print(res.returncode, res.out.strip(), flush=True)
        """)
    def sleeping_3() -> bool:
        """The request's `sleep 3` is running (containers share this machine's kernel: its /proc shows it)."""
        for d in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if d.name.isdigit() and (d / "cmdline").read_bytes() == b"sleep\x003\x00":
                    return True
        return False

    for how in ("mux stop", "SIGTERM"):
        proc = subprocess.Popen([sys.executable, "-c", long_request], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env.env, cwd=REPO)
        assert proc.stdout is not None and proc.stdout.readline() == "connected\n"
        wait_for("the request running in the container", sleeping_3, 30)
        if how == "mux stop":
            stopper = _ctl(env, "mux", "stop")
        else:
            os.kill(pid, signal.SIGTERM)
        # Stopping: no new command reaches it; the next one starts a session of its own at once.
        _wait(lambda p=pid: not any(i.get("pid") == p and Path(str(i["socket"])).exists()  # type: ignore[misc]
                                    for i in _infos(env)), 10, "the stopping session to leave its socket")
        how_new, new = _session(env.ctl("--debug", "ping", "ct200", check=True))
        assert how_new == "started" and new != pid
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out == "0 done\n", (how, out, err)
        if how == "mux stop":
            assert stopper.wait(timeout=60) == 0
            assert f"pve1: stopped session (pid {pid})" in stopper.communicate()[0]
        _wait(lambda p=pid: not _alive(p), 20, f"the session stopped by {how} to end")  # type: ignore[misc]
        pid = new


def test_a_request_after_the_session_ended_under_the_command_goes_to_a_new_session(env: PveEnv) -> None:
    """A command connected to a session that ends before its next request (stopped, idle elsewhere, killed):
    that request is sent to a new session, never a broken pipe."""
    inv = load(env.inventory)
    ct = inv.container("ct200")
    with Pool(inv) as pool:
        t = pool.container(ct)
        assert t.run(["true"]).returncode == 0
        pid = t.relay.hello["pid"]  # type: ignore[union-attr]
        mux.stop(grace=0)  # another user of the session stops it now
        _wait(lambda: not _alive(pid), 20, "the session to end")
        res = t.run(["echo", "again"])
        assert (res.returncode, res.out) == (0, "again\n")
        assert t.relay.hello["pid"] != pid and t.relay.started_session  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------
# Many commands, long paths, stale sessions


def test_64_concurrent_commands_from_cold_start_one_session_and_all_succeed(env: PveEnv) -> None:
    before = sshd_sessions(env, "pve1")
    procs = [_ctl(env, "--debug", "ping", "ct200") for _ in range(64)]
    outs = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    failed = [(rc, out, err) for rc, out, err in outs if rc != 0]
    assert not failed, failed[:3]
    seen = [_session(subprocess.CompletedProcess([], rc, out, err)) for rc, out, err in outs]
    assert sorted(how for how, _ in seen).count("started") == 1, seen
    assert len({pid for _, pid in seen}) == 1  # one session process served all 64
    assert len(sshd_sessions(env, "pve1") - before) == 1  # over one SSH connection
    assert [i["host"] for i in _infos(env)] == ["pve1"]


def test_a_command_gone_while_its_session_starts_leaves_one_session_that_the_next_command_uses(env: PveEnv) -> None:
    """`ctl env check ct200` names a container, so its session begins to start while ctl loads (launch/early.py); the
    command then refuses at once (no lock configured) and exits before the session listens. That session must
    neither die on the closed pipe of its starter nor let a second one start beside it: the next command uses it."""
    before = sshd_sessions(env, "pve1")
    for _ in range(3):
        gone = env.ctl("--debug", "env", "check", "ct200")
        assert gone.returncode == ExitCode.INPUT and "no lock configured" in gone.stderr, gone.stderr
        assert "starting ctl's persistent session for pve1 while ctl loads" in gone.stderr
        nxt = env.ctl("--debug", "ping", "ct200")
        assert nxt.returncode == 0, nxt.stdout + nxt.stderr
        how, pid = _session(nxt)
        assert how == "reused", nxt.stderr  # the session the refused command began
        infos = _infos(env)
        assert [(i["host"], i["pid"]) for i in infos] == [("pve1", pid)]
        assert len(sshd_sessions(env, "pve1") - before) == 1
        log = next((env.state / "mux").glob("*.log")).read_text()
        assert "Traceback" not in log, log
        env.ctl("mux", "stop", check=True)
        _wait(lambda pid=pid: not _alive(pid), what="the session to end")
        before = sshd_sessions(env, "pve1")


@pytest.mark.parametrize("closed", [None, 0, 1, 2])
def test_a_command_with_a_standard_stream_closed_hands_its_spawn_lock_to_the_session(env: PveEnv,
                                                                                    closed: int | None) -> None:
    """A command started with stdin, stdout or stderr closed (`<&-`, a supervisor) opens its spawn lock on that
    low fd. The session it starts must still inherit the lock (held until it listens, even with the command
    killed), and must neither close its own stdout before its "ready" line nor its log (stderr)."""
    code = textwrap.dedent(f"""
        import os
        from controller.inventory import load
        from controller.transport.pool import Pool
        inv = load({str(env.inventory)!r})
        if {closed!r} is not None:
            os.close({closed!r})  # the lowest free fd: the spawn lock gets it
        with Pool(inv) as pool:
            pool.container(inv.container("ct200")).run(["true"])
        """)

    def socket() -> Path:
        (info,) = (env.state / "mux").glob("*.spawn")
        return socket_dir(create=False) / f"{info.stem}.sock"

    proc, daemon = _stopped_before_listening(env, lambda: subprocess.Popen(
        [sys.executable, "-c", code], env=env.env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL), lambda: socket().exists())  # stopped, it cannot listen (nor let the lock go)
    (info,) = (env.state / "mux").glob("*.spawn")
    sock = socket()
    try:
        proc.kill()
        proc.wait(timeout=30)
        with open(info) as lock, pytest.raises(BlockingIOError):  # the session process holds it
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.kill(daemon[0], signal.SIGCONT)
    _wait(lambda: sock.exists(), 60, "the session to listen")
    nxt = env.ctl("--debug", "ping", "ct200")
    assert nxt.returncode == 0, nxt.stdout + nxt.stderr
    assert _session(nxt) == ("reused", daemon[0]), nxt.stderr
    log = next((env.state / "mux").glob("*.log")).read_text()
    assert "Traceback" not in log, log
    env.ctl("mux", "stop", check=True)
    _wait(lambda: not _alive(daemon[0]), what="the session to end")
    assert "ending: " in (env.state / "mux" / f"{info.stem}.log").read_text()  # its log still written


def test_a_session_process_that_never_listens_is_ended_by_the_command_that_gave_up_on_it(env: PveEnv) -> None:
    """The session process holds the spawn lock until it listens. One that hangs before (here: stopped) is given
    up on by its command at that command's deadline, and must not keep the lock from there on: the next command
    starts a session of its own instead of waiting for the lock and failing with "another ctl command has been
    starting the session"."""
    env.env.update(CTL_CONNECT_TIMEOUT="2", CTL_TIMEOUT="2")  # the starter waits (3 x 2 + 5) + 2 + 10 s
    first, daemon = _stopped_before_listening(env, lambda: _ctl(env, "ping", "ct200"),
                                              lambda: any((env.state / "mux").glob("*.json")))
    try:
        out, err = first.communicate(timeout=60)
        assert first.returncode != 0 and "did not say it listens in 23s" in out + err, out + err
        nxt = env.ctl("--debug", "ping", "ct200", timeout=60)
        assert nxt.returncode == 0, nxt.stdout + nxt.stderr
        assert _session(nxt)[0] == "started"
        assert not _alive(daemon[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon[0], signal.SIGKILL)


def test_state_directory_too_long_for_a_socket_path_puts_the_socket_under_a_short_one(
        env: PveEnv, tmp_path: Path) -> None:
    state = tmp_path / ("s" * 100) / ("t" * 100)
    env.env["CTL_STATE_DIR"] = str(state)
    assert len(str(state / "mux" / "0123456789abcdef0123.sock")) > 108  # too long for any sockaddr_un
    how, pid = _session(env.ctl("--debug", "ping", "ct200", check=True))
    assert how == "started"
    again = env.ctl("--debug", "ping", "ct200", check=True)
    assert _session(again) == ("reused", pid)
    (info,) = [json.loads(p.read_text()) for p in (state / "mux").glob("*.json")]
    sock = Path(str(info["socket"]))
    assert sock.parent == socket_dir(create=False) and len(os.fsencode(str(sock))) < 104
    st = sock.parent.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (os.getuid(), 0o700)
    mux.stop(state=state)
    assert not _alive(pid)


_OLDER_SESSION = """
import json, sys
from controller.transport.mux import daemon
daemon.build = lambda: "2-0ld0ld0ld0ld0ld0"  # what an older ctl's session says in its hello
sys.exit(daemon.serve(json.loads(sys.argv[1])))
"""


def test_session_of_an_older_ctl_is_replaced_and_the_user_told_in_one_line(env: PveEnv) -> None:
    inv = load(env.inventory)
    with Pool(inv) as pool:
        ep = pool.host("pve1")
    meta = env.state / "mux"
    meta.mkdir(mode=0o700, parents=True)
    key = session_key(ep, env.state)
    path = socket_dir(create=True) / f"{key}.sock"
    spec = {"name": ep.name, "address": ep.address, "port": ep.port, "user": ep.user,
            "identity_file": ep.identity_file, "known_hosts": ep.known_hosts, "connect_timeout": ep.connect_timeout,
            "idle": 60, "socket": str(path), "info": str(meta / f"{key}.json")}
    old = subprocess.Popen([sys.executable, "-c", _OLDER_SESSION, json.dumps(spec)], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=REPO,
                           env={**env.env, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        assert old.stdout is not None and json.loads(old.stdout.readline()) == {"ready": True}
        r = env.ctl("--debug", "ping", "ct200", check=True)
        warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("ctl: warning:")]
        assert len(warnings) == 1, r.stderr
        assert warnings[0].startswith(f"ctl: warning: pve1: replaced ctl's session process (pid {old.pid}): it runs "
                                      "another ctl (session protocol 3, build 2-0ld0ld0ld0ld0ld0; this ctl: 3-")
        assert old.wait(timeout=30) == 0  # it ended (its commands had a grace period; it had none)
        how, pid = _session(r)
        assert how == "started" and pid != old.pid
        assert _session(env.ctl("--debug", "ping", "ct200", check=True)) == ("reused", pid)  # and told once
    finally:
        if old.poll() is None:
            os.killpg(old.pid, signal.SIGKILL)
            old.wait()


def test_session_holding_a_host_key_known_hosts_no_longer_trusts_is_replaced_and_the_host_refused(
        env: PveEnv, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    shutil.copy(env.host.base / "keys" / "known_hosts", known)
    doc = yaml.safe_load(env.inventory.read_text())
    for h in doc["hosts"].values():
        h["known_hosts"] = str(known)
    env.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    _, pid = _session(env.ctl("--debug", "ping", "ct200", check=True))
    original = known.read_text()
    label = f"[127.0.0.2]:{env.host.port}"
    line = next(ln for ln in original.splitlines() if ln.startswith(label + " "))
    _, ktype, key = line.split()[:3]
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = (tmp_path / "other.pub").read_text().split()[1]
    for changed, refusal in ((original.replace(key, other), "CHANGED"),
                             (original + f"@revoked * {ktype} {key}\n", "REVOKED")):
        known.write_text(changed)
        r = env.ctl("ping", "ct200")
        assert r.returncode == ExitCode.HOST_KEY, r.stdout + r.stderr  # the new session is refused the host
        said = r.stdout + r.stderr
        assert f"host key for {label}" in said and refusal in said, said
        warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("ctl: warning:")]
        assert warnings == [f"ctl: warning: pve1: replaced ctl's session process (pid {pid}): the host key it holds "
                            f"({ktype} for {label}) is no longer trusted: {known} "
                            + ("no longer lists it for " + label if refusal == "CHANGED" else "revokes it")], r.stderr
        _wait(lambda p=pid: not _alive(p), 20, "the untrusted session to end")  # type: ignore[misc]
        known.write_text(original)
        _, pid = _session(env.ctl("--debug", "ping", "ct200", check=True))


def test_session_killed_9_leaves_a_stale_socket_that_the_next_command_replaces(env: PveEnv) -> None:
    _, pid = _session(env.ctl("--debug", "ping", "ct200", check=True))
    (info,) = _infos(env)
    sock = Path(str(info["socket"]))
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: not _alive(pid), 20, "the killed session to be gone")
    assert sock.exists()  # nobody removed it: stale
    how, new = _session(env.ctl("--debug", "ping", "ct200", check=True))
    assert how == "started" and new != pid  # (not the socket's inode: a filesystem may give the new one the same)
    st = env.ctl("mux", "status", "--json", check=True)
    assert [(d["pid"], d["live"]) for d in json.loads(st.stdout)["sessions"]] == [(new, True)]


# --------------------------------------------------------------------------------------------
# Two users on one machine

_AS_NOBODY = """
import json, os, socket, sys
from controller.transport.mux.sock import socket_dir
d = socket_dir(create=True)
st = os.lstat(d)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    reached = "connected"
except OSError as e:
    reached = type(e).__name__
print(json.dumps({"dir": str(d), "uid": st.st_uid, "mode": st.st_mode & 0o777, "root_socket": reached}))
"""


def test_two_users_never_share_a_socket(env: PveEnv, tmp_path: Path) -> None:
    _, pid = _session(env.ctl("--debug", "ping", "ct200", check=True))
    (info,) = _infos(env)
    root_sock = str(info["socket"])
    nobody = 65534
    theirs = Path(f"/tmp/ctl-{nobody}")
    made = not theirs.exists()
    python = "/usr/bin/python3"  # the venv's interpreter may live under root's 0700 home
    try:
        r = subprocess.run(["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups",
                            python, "-c", _AS_NOBODY, root_sock], capture_output=True, text=True, cwd="/",
                           env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "HOME": "/nonexistent"},
                           timeout=60)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got == {"dir": str(theirs), "uid": nobody, "mode": 0o700, "root_socket": "PermissionError"}
        assert Path(root_sock).parent != theirs
    finally:
        if made:
            shutil.rmtree(theirs, ignore_errors=True)
    mux.stop(state=env.state, grace=0)
    _wait(lambda: not _alive(pid), 20, "the session to end")
    # A socket directory that another user made (before us, or in our runtime dir) is refused, never used: the
    # command connects directly instead, and says so in one line.
    run = Path(tempfile.mkdtemp(prefix="ctl-run-"))  # short: a runtime dir as systemd makes it, 0700
    try:
        (run / "ctl").mkdir(mode=0o700)
        os.chown(run / "ctl", nobody, nobody)
        env.env["XDG_RUNTIME_DIR"] = str(run)
        r = env.ctl("ping", "ct200")
        assert r.returncode == 0, r.stdout + r.stderr
        said = r.stdout + r.stderr
        assert f"refusing ctl's socket directory {run / 'ctl'}: it must be a directory owned by uid {os.getuid()} " \
               f"with mode 0700 (found a directory, owner {nobody}, mode 0700)" in said, said
        assert not list((run / "ctl").iterdir())
        (run / "ctl").rmdir()
        r = env.ctl("--debug", "ping", "ct200", check=True)  # the runtime dir, ours: used
        (info,) = _infos(env)
        assert Path(str(info["socket"])).parent == run / "ctl" and (run / "ctl").stat().st_uid == os.getuid()
    finally:
        env.env.pop("XDG_RUNTIME_DIR")
        mux.stop(state=env.state, grace=0)
        shutil.rmtree(run, ignore_errors=True)
