"""The spare session process (controller/transport/mux/spare.py): started from the verb alone, it forks each
session process with exactly what a started one gets (its spec, the spawn lock it keeps until it listens, its
log as stderr, the pipe of its ready line as stdout, a session of its own); it goes when the command closes its
end or after SPARE_WAIT; a spare that cannot take a spec leaves the command to start the session itself.

Real processes, real fds and flock; the session itself (daemon.serve) is replaced by a small function that
reports what it was given, since what it does is tested against the local Proxmox host (tests/integration)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from controller.launch import early
from controller.launch.compspec import SPEC
from controller.transport.mux import spare
from tests.conftest import REPO

# A spare whose sessions report what they were given, then wait for a line on their stdin-less world: they
# sleep until the file named in the spec appears, so the test can look at them while they hold the lock.
_HARNESS = """
import fcntl, json, os, sys, time
from controller.transport.mux import spare
spare.SPARE_WAIT = float(sys.argv[1])

def serve_session(spec):
    fd = spec["lock_fd"]
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already: the same open file
    mask = os.umask(0)
    os.umask(mask)
    fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
    print(json.dumps({"ready": True, "spec": spec, "pid": os.getpid(), "sid": os.getsid(0), "umask": mask,
                      "fds": fds, "cwd": os.getcwd(),
                      "stdin": os.readlink("/proc/self/fd/0"), "stderr": os.readlink("/proc/self/fd/2"),
                      "state": os.environ.get("CTL_STATE_DIR")}), flush=True)
    sys.stderr.write("session log line\\n")
    sys.stderr.flush()
    deadline = time.monotonic() + 30
    while not os.path.exists(spec["go"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return 0

sys.exit(spare.serve(serve_session, -1))
"""


def _harness(wait: float = 30.0) -> spare.Spare:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-c", _HARNESS, str(wait)], stdin=theirs, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    theirs.close()
    return spare.Spare(proc.pid, ours)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.02)
    return False


def _locked(path: Path) -> bool:
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_a_session_forked_by_the_spare_gets_what_a_started_one_gets(tmp_path: Path) -> None:
    sp = _harness()
    lockf = tmp_path / "k.spawn"
    log = tmp_path / "k.log"
    go = tmp_path / "go"
    lock = open(lockf, "a+")  # noqa: SIM115 - the command's spawn lock, held as MuxRelay holds it
    fcntl.flock(lock, fcntl.LOCK_EX)
    logf = open(log, "ab")  # noqa: SIM115
    r, w = os.pipe()
    try:
        pid = sp.hand({"name": "h1", "go": str(go), "state": str(tmp_path / "state")}, lock.fileno(),
                      logf.fileno(), w, wait=30)
    finally:
        os.close(w)
        logf.close()
    assert isinstance(pid, int) and pid != sp.pid
    with os.fdopen(r, "rb") as out:
        doc = json.loads(out.readline())
        lock.close()  # the command lets go of its copy, as _spawn_once does once the session listens
        assert _locked(lockf)  # the session's copy still holds it: no second session starts beside it
        assert doc["pid"] == pid and doc["sid"] == pid  # a session of its own: a Ctrl-C at the terminal is not its
        assert doc["spec"]["name"] == "h1" and doc["spec"]["lock_fd"] > 2
        assert doc["stdin"] == "/dev/null" and doc["stderr"] == str(log)
        assert doc["state"] == str(tmp_path / "state")
        assert doc["umask"] == 0o077 and doc["cwd"] == "/"
        assert set(doc["fds"]) - {0, 1, 2, doc["spec"]["lock_fd"]} <= {max(doc["fds"])}  # + listdir's own
        go.touch()
        assert out.read() == b""  # its stdout ends with it
    assert _gone(pid)
    assert not _locked(lockf)  # and the lock with it
    assert log.read_text() == "session log line\n"
    sp.release()
    assert _gone(sp.pid)


def test_one_spare_forks_a_session_per_host(tmp_path: Path) -> None:
    sp = _harness()
    pids, outs = [], []
    for name in ("h1", "h2"):
        lock = open(tmp_path / f"{name}.spawn", "a+")  # noqa: SIM115
        r, w = os.pipe()
        pids.append(sp.hand({"name": name, "go": str(tmp_path / "go")}, lock.fileno(), sys.stderr.fileno(), w, 30))
        os.close(w)
        lock.close()
        outs.append(os.fdopen(r, "rb"))
    docs = [json.loads(o.readline()) for o in outs]
    assert [d["spec"]["name"] for d in docs] == ["h1", "h2"]
    assert len({*pids, sp.pid}) == 3 and all(d["sid"] == d["pid"] for d in docs)
    (tmp_path / "go").touch()
    for o in outs:
        o.read()
        o.close()
    sp.release()


def test_the_spare_goes_when_the_command_closes_its_end_or_sends_nothing() -> None:
    sp = _harness()
    assert sp.sock is not None
    sp.sock.close()  # the command exited without needing a session
    sp.sock = None
    assert _gone(sp.pid)
    waited = _harness(wait=0.5)
    assert _gone(waited.pid, timeout=20)  # nothing came in SPARE_WAIT


def test_a_spare_that_cannot_take_the_spec_leaves_the_start_to_the_command(tmp_path: Path) -> None:
    sp = _harness()
    os.kill(sp.pid, signal.SIGKILL)
    assert _gone(sp.pid)
    lock = open(tmp_path / "k.spawn", "a+")  # noqa: SIM115
    r, w = os.pipe()
    assert sp.hand({"name": "h1", "go": str(tmp_path / "go")}, lock.fileno(), sys.stderr.fileno(), w, 5) is None
    os.close(w)
    os.close(r)
    lock.close()
    assert sp.sock is None  # given up: the command's next start goes straight to its own Popen


def _fds(pid: int) -> set[int]:
    return {int(f) for f in os.listdir(f"/proc/{pid}/fd")}


def test_the_spare_starts_only_where_no_session_or_spare_of_the_user_is_up(request: pytest.FixtureRequest,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="ctl-t", dir="/tmp"))  # short: XDG_RUNTIME_DIR is used under 60 bytes
    request.addfinalizer(lambda: shutil.rmtree(runtime, ignore_errors=True))
    env = {"XDG_RUNTIME_DIR": str(runtime), "PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}
    monkeypatch.setattr(spare, "_spare", None)
    (runtime / "ctl").mkdir(mode=0o700)
    (runtime / "ctl" / "0123.sock").touch()
    assert not spare.start(env)  # a session is up: the command will most likely find its host's
    (runtime / "ctl" / "0123.sock").unlink()
    leak_r, leak_w = os.pipe()
    os.set_inheritable(leak_w, True)  # a descriptor the command got without close-on-exec
    monkeypatch.chdir(runtime)
    (runtime / "controller").mkdir()  # a package of the same name where ctl was started: never imported
    (runtime / "controller" / "__init__.py").write_text("raise SystemExit('imported from the current directory')")
    try:
        assert spare.start(env)
    finally:
        os.close(leak_w)
    started = spare.take()
    assert started is not None
    try:
        assert not spare.start(env)  # one per command
        monkeypatch.setattr(spare, "_spare", None)
        assert not spare.start(env)  # and one per user: another command's start finds the lock held
        monkeypatch.setattr(spare, "_spare", started)
        deadline = time.monotonic() + 20  # posix_spawn may return before the exec shows in /proc
        while (cmdline := Path(f"/proc/{started.pid}/cmdline").read_bytes().split(b"\0"))[-4:-2] != [
                b"controller.transport.mux.daemon", b"--spare"] or _fds(started.pid) != {0, 1, 2, 3}:
            assert time.monotonic() < deadline, (cmdline, _fds(started.pid))
            time.sleep(0.02)
        assert b"-P" in cmdline and cmdline[-2] == b"3"  # the lock at fd 3; the leaked pipe closed
        assert os.readlink(f"/proc/{started.pid}/cwd") == "/"
        assert os.read(leak_r, 1) == b""  # nobody holds its write end any more
        seen = dict(kv.split("=", 1) for kv in Path(f"/proc/{started.pid}/environ").read_text().split("\0") if kv)
        assert set(seen) <= spare.SESSION_ENV  # only what a session process gets
    finally:
        spare.release()
        os.close(leak_r)
    assert _gone(started.pid) and spare.take() is None
    monkeypatch.setattr(spare, "_spare", None)
    assert spare.start(env)  # the lock went with it
    spare.release()


@pytest.mark.parametrize(("line", "starts"), [
    ("ping", True), ("deploy ct200", True), ("-i inv.yaml status", True),
    ("ping --help", False), ("--help", False), ("runs --version", False), ("show r1", False),
    ("config show", False), ("mux status", False), ("", False),
])
def test_which_lines_start_a_spare(line: str, starts: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    begun: list[object] = []
    monkeypatch.setattr(spare, "start", lambda environ: begun.append(environ) or True)
    monkeypatch.delenv("CTL_PERSIST", raising=False)
    assert early.spare(line.split()) is starts
    monkeypatch.setenv("CTL_PERSIST", "0")
    assert early.spare(line.split()) is False
    assert len(begun) == int(starts)


def test_spare_verbs_are_the_verbs_whose_lines_may_begin_sessions() -> None:
    """SPARE_VERBS, read off the command tree as early.containers reads a line."""
    found: set[str] = set()

    def walk(node: dict[str, object], path: list[str]) -> None:
        subs = node.get("commands")
        if isinstance(subs, dict) and subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
            return
        command = " ".join(path)
        kinds = [k for k, _ in node.get("args", [])]  # type: ignore[attr-defined]
        if any(k in early.NAME_KINDS or (k == "runs" and command in early.RUN_REACHES) for k in kinds) or (
                command in (*early.ALL_WHEN_NONE, *early.ONLY_WHEN_NONE, *early.LIVE_WHEN_NONE)):
            found.add(path[0])

    walk(SPEC, [])
    assert found == early.SPARE_VERBS


def test_the_names_read_before_settings_is_imported_are_settings_own() -> None:
    from controller import settings

    assert early.PERSIST_VAR == settings.PERSIST and spare.STATE_VAR == settings.STATE_DIR
