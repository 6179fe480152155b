"""Sessions started while ctl loads (controller/launch/early.py): which command lines begin them, and that a command
meets the outcome of the start begun for it (a host that never answers is waited for once, not twice)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from controller.launch.early import containers
from tests.conftest import REPO

INVENTORY = """\
hosts:
  pve1: {address: 127.0.0.2, known_hosts: kh}
  pve2: {address: 127.0.0.3, known_hosts: kh}
containers:
  ct200: {host: pve1, vmid: 200}
  ct201: {host: pve1, vmid: 201}
  ct300: {host: pve2, vmid: 300}
groups:
  pair: [ct201, ct300]
"""


@pytest.fixture
def inv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CTL_STATE_DIR", str(tmp_path / "state"))  # a registry of this test's own
    p = tmp_path / "inventory.yaml"
    p.write_text(INVENTORY)
    (tmp_path / "kh").write_text("")
    return str(p)


def names(argv: list[str]) -> list[str] | None:
    found = containers(argv)
    return None if found is None else [ct.name for ct in found[1]]


@pytest.mark.parametrize(("line", "want"), [
    ("deploy ct200 --allow-dirty", ["ct200"]),
    ("deploy --dry-run ct200", ["ct200"]),  # deploy's plan reads the containers' files
    ("--json deploy pair", ["ct201", "ct300"]),
    ("deploy --all", ["ct200", "ct201", "ct300"]),
    ("ping", ["ct200", "ct201", "ct300"]),  # no names: every container
    ("ping ct300", ["ct300"]),
    ("launch ct200 --run r1 -f", ["ct200"]),  # --run's value is not a name
    ("tail ct300/r7 -n 5", ["ct300"]),
    ("env probe ct201", ["ct201"]),
    ("snapshot create ct200 before-upgrade", ["ct200"]),
])
def test_lines_that_name_containers(inv: str, line: str, want: list[str]) -> None:
    assert names(["-i", inv, *line.split()]) == want


@pytest.mark.parametrize("line", [
    "deploy",  # several containers and no --all: the command refuses
    "status",  # live runs: where they are is the registry's to say
    "status ct201 ct300 --stall-after 30",  # no runs recorded there (no registry): nothing to reach
    "show r1", "stop r1",  # runs, not containers
    "tail r7",  # a run name, not a container
    "deploy ct999",  # not in the inventory: the command says so
    "deploy ct200 --help",
    "snapshot create ct200 snap1 --dry-run",  # a dry run that does not connect
    "mux stop pve1",  # never start a session to stop it
    "config show", "mux status", "nosuch ct200",
    "deploy -- ct200",
    "--version ping ct200",  # prints the version and exits: no connection
    "ping ct200 --show-completion",
])
def test_lines_that_begin_nothing(inv: str, line: str) -> None:
    assert names(["-i", inv, *line.split()]) is None


def test_runs_named_or_live_are_found_where_they_ran(inv: str, tmp_path: Path) -> None:
    """Run references (NAME, CT/NAME, #ID) and bare `status`/`supervise`/`runs` reach the containers the registry
    says (read-only); a name it does not resolve to one run begins nothing."""
    from controller.lifecycle import Lifecycle
    from controller.registry import Registry

    line = ["-i", inv]
    assert names([*line, "status"]) is None  # no registry yet
    reg = Registry()
    live = reg.claim_run("r1", "ct300")  # starting: live
    done = reg.claim_run("old", "ct201")
    reg.update_run(done.id, state=Lifecycle.FINISHED)
    # `status CT...` reaches the containers that have runs, finished ones too (their logs are pulled)
    assert names([*line, "status", "ct200", "ct300", "--stall-after", "30"]) == ["ct300"]
    assert names([*line, "status", "ct201", "ct300"]) == ["ct201", "ct300"]
    assert names([*line, "status", "ct200"]) is None
    assert names([*line, "status", "pair"]) == ["ct201", "ct300"]  # a group: its containers that have runs
    for ct in ("ct200", "ct300"):
        reg.update_run(reg.claim_run("twice", ct).id, state=Lifecycle.STOPPED)
    reg.claim_run("gone", "ct999")  # live, on a container no longer in the inventory
    assert names([*line, "status"]) == ["ct300"]  # the live runs only
    assert names([*line, "supervise", "--once"]) == ["ct300"]
    assert names([*line, "runs"]) == ["ct300"]
    assert names([*line, "runs", "--no-refresh"]) is None
    assert names([*line, "tail", "old", "-n", "5"]) == ["ct201"]
    assert names([*line, "stop", "r1"]) == ["ct300"]
    assert names([*line, "watch", f"#{live.id}", "--for", "1m"]) == ["ct300"]
    assert names([*line, "tail", "ct200/twice"]) == ["ct200"]
    assert names([*line, "tail", "twice"]) is None  # ambiguous: the command asks for CT/NAME
    assert names([*line, "stop", "nosuch"]) is None
    assert names([*line, "show", "r1"]) is None  # shows the record: no connection


def test_an_inventory_that_does_not_load_begins_nothing(tmp_path: Path) -> None:
    p = tmp_path / "inventory.yaml"
    p.write_text("hosts: [unclosed\n")
    assert names(["-i", str(p), "deploy", "ct200"]) is None
    assert names(["-i", str(tmp_path / "missing.yaml"), "ping"]) is None


def test_a_host_that_never_answers_is_waited_for_once(tmp_path: Path) -> None:
    """The early start meets the silent host first; the command must report that outcome, not try again (which
    would double every wait on a dead host)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)  # held open, never a banner

    threading.Thread(target=serve, daemon=True).start()
    (tmp_path / "kh").write_text("")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"hosts:\n  mute: {{address: 127.0.0.1, port: {port}, known_hosts: kh}}\n"
                   "containers:\n  ct1: {host: mute, vmid: 101}\n")
    env = {k: v for k, v in os.environ.items() if k != "CTL_PERSIST"}
    env.update(CTL_STATE_DIR=str(tmp_path / "state"), CTL_CONNECT_TIMEOUT="1", PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "controller", "-i", str(inv), "ping", "ct1"]
    try:
        r = subprocess.run([*argv, "--debug"], capture_output=True, text=True, env=env, timeout=60)
        once = len(accepted)
        direct = subprocess.run(argv, capture_output=True, text=True, env=dict(env, CTL_PERSIST="0"), timeout=60)
    finally:
        listener.close()
        for c in accepted:
            c.close()
    assert r.returncode != 0, r.stdout
    assert "starting ctl's persistent session for mute while ctl loads" in r.stderr, r.stderr
    assert once == 1, (once, r.stdout, r.stderr)
    # what the user reads, with or without a session: the one line that says what happened, no traceback
    # (paramiko's transport thread logs one; its "No existing session" said nothing of the silence)
    for res in (r, direct):
        assert (f"ct1          FAIL  mute: 127.0.0.1:{port} accepted the connection but no SSH server answered "
                "in 1s (no SSH banner)") in res.stdout, (res.stdout, res.stderr)
        assert "Traceback" not in res.stderr and "Exception" not in res.stderr, res.stderr


def test_an_error_of_any_kind_in_the_early_start_is_the_commands_own(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What the early start meets, whatever its type (here: out of file descriptors as the session process is
    started), is what the command's own start raises, as if it had started the session itself; never a traceback
    from the background thread and a silent fall back to one exec per container."""
    from controller.transport.mux import client
    from controller.transport.ssh import SshEndpoint

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("CTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))

    def spawn_once(*_: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(client.MuxRelay, "_spawn_once", spawn_once)
    hooked: list[object] = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    ep = SshEndpoint("h1", "127.0.0.1", port=9, known_hosts=str(tmp_path / "kh"))
    assert client.start_early(ep, 60)
    relay = client.MuxRelay(ep, 60)
    with pytest.raises(OSError, match="Too many open files"):
        relay.available()
    assert hooked == []
