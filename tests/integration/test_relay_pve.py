"""ctl's host relay against the local Proxmox host: several containers of one host, one SSH exec."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from controller.commands import deploy as deploy_mod
from controller.commands.fanout import fanout
from controller.errors import ConnectionFailed, ExitCode, NotRunning
from controller.inventory import load
from controller.transport import relay as relay_mod
from controller.transport.pct import PctContainer
from controller.transport.pool import Pool
from tests.helpers import sha_file
from tests.integration.conftest import PveEnv, sshd_sessions

pytestmark = pytest.mark.pvehost


@pytest.fixture(autouse=True)
def one_command_relay(pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay of one command, persistent sessions off (CTL_PERSIST=0): a session process runs the same relay
    for many commands (test_mux_pve.py)."""
    monkeypatch.setenv("CTL_PERSIST", "0")
    pve_env.env["CTL_PERSIST"] = "0"


def test_two_containers_of_one_host_deploy_through_one_exec(pve_env: PveEnv) -> None:
    inv = load(pve_env.inventory)
    cts = [inv.container("ct200"), inv.container("ct201"), inv.container("ct300")]
    notes: list[str] = []
    before = len(pve_env.host.pct_calls("pve1"))
    with Pool(inv, note=notes.append) as pool:
        assert pool.share_exec(cts) == ["pve1"]  # ct300 is alone on pve2: direct exec
        results = fanout(pool, cts, lambda ct, t: deploy_mod.deploy(inv, ct, t, None, allow_dirty=True))
        assert [r.error for r in results] == [None, None, None]
        pve1, pve2 = pool.host("pve1"), pool.host("pve2")
        assert (pve1.connects, pve1.round_trips) == (1, 1)  # one connection, one exec for ct200 and ct201
        assert (pve2.connects, pve2.round_trips) == (1, 1)
        relay = pool._relays["pve1"]
        assert relay.streams_opened == 6  # per container: hello (while pinning), plan, apply
        # Again, nothing changed: still one exec for the host, and the relay's staying agents answer.
        again = fanout(pool, cts[:2], lambda ct, t: deploy_mod.deploy(inv, ct, t, None, allow_dirty=True))
        assert all(r.ok and r.value is not None and r.value.changed == 0 for r in again)
        assert pve1.round_trips == 1 and relay.streams_opened == 10
    calls = pve_env.host.pct_calls("pve1")[before:]  # one `pct exec` per container: its staying agent
    assert sorted((c["args"][0], c["argv"][6]) for c in calls) == [("200", "serve"), ("201", "serve")], calls
    assert any("pve1: containers share one exec" in n for n in notes)
    for vmid in (200, 201, 300):
        landed = pve_env.host.rootfs(vmid) / "root" / pve_env.tag / "emit_metrics.py"
        assert sha_file(landed) == sha_file(pve_env.dir / "emit_metrics.py")


def test_relay_keeps_streams_exit_codes_and_pct_refusals_apart(pve_env: PveEnv) -> None:
    inv = load(pve_env.inventory)
    cts = [inv.container("ct200"), inv.container("ct201")]
    pve_env.host.stop(201)
    try:
        with Pool(inv) as pool:
            pool.share_exec(cts)
            t200, t201 = pool.container(cts[0]), pool.container(cts[1])
            assert isinstance(t200, PctContainer) and t200.relay is not None
            res = t200.run(["sh", "-c", "cat; echo out-line; echo err-line >&2; exit 3"], stdin=b"in-line\n")
            assert (res.returncode, res.out, res.err) == (3, "in-line\nout-line\n", "err-line\n")
            missing = t200.run(["no-such-program-ctl"])
            assert missing.returncode == 127
            with pytest.raises(NotRunning, match="CT 201 on pve1 is stopped"):
                t201.run(["true"])
            # Two conversations at once over the one exec, answered in the opposite order.
            a = t200.open(["sh", "-c", "read x; echo a:$x"])
            b = t200.open(["sh", "-c", "read x; echo b:$x"])
            b.send(b"2\n")
            assert b.readline(timeout=30) == b"b:2\n"
            a.send(b"1\n")
            assert a.readline(timeout=30) == b"a:1\n"
            assert a.finish(30).returncode == 0 and b.finish(30).returncode == 0
            assert pool.host("pve1").round_trips == 1
    finally:
        pve_env.host.start(201)


def test_one_failed_container_does_not_hide_the_others(pve_env: PveEnv) -> None:
    pve_env.host.stop(201)
    try:
        r = pve_env.ctl("--debug", "deploy", "ct200", "ct201", "ct300", "--allow-dirty")
        assert r.returncode == ExitCode.NOT_RUNNING, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert any(ln.startswith("ct200") and "deployed 2 of 2 files" in ln for ln in lines), r.stdout
        assert any(ln.startswith("ct201") and "FAILED" in ln and "CT 201 on pve1 is stopped" in ln
                   for ln in lines), r.stdout
        assert any(ln.startswith("ct300") and "deployed 2 of 2 files" in ln for ln in lines), r.stdout
        assert "pve1: containers share one exec through ctl's host relay" in r.stderr
        j = pve_env.ctl("deploy", "ct200", "ct201", "--allow-dirty", "--json")
        assert j.returncode == ExitCode.NOT_RUNNING
        doc = json.loads(j.stdout)
        assert [(x["ct"], x["ok"]) for x in doc] == [("ct200", True), ("ct201", False)]
        assert "stopped" in doc[1]["error"]
    finally:
        pve_env.host.start(201)


def test_host_without_python3_falls_back_to_one_exec_per_container(
        pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a host without python3 answers: the shell's "not found" and exit status 127.
    monkeypatch.setattr(relay_mod, "_START", 'echo "sh: 1: python3: not found" >&2; exit 127')
    inv = load(pve_env.inventory)
    cts = [inv.container("ct200"), inv.container("ct201")]
    notes: list[str] = []
    with Pool(inv, note=notes.append) as pool:
        pool.share_exec(cts)
        results = fanout(pool, cts, lambda ct, t: deploy_mod.deploy(inv, ct, t, None, allow_dirty=True))
        assert all(r.ok for r in results), [r.error for r in results]
        assert pool.host("pve1").round_trips == 3  # the relay that did not start, then one exec per container
    assert notes == ["pve1: no python3 on the host; falling back to one exec per container"]


def test_connection_dropped_during_a_relayed_deploy_leaves_whole_files(pve_env: PveEnv) -> None:
    blob = pve_env.dir / "blob.bin"
    blob.write_bytes(b"v1" * 1000)
    dest = f"/root/{pve_env.tag}/blob.bin"
    pve_env.write(payload=[{"src": "blob.bin", "dest": dest}])
    pve_env.ctl("deploy", "ct200", "ct201", "--allow-dirty", check=True)
    v1 = blob.read_bytes()
    v2 = os.urandom(64 << 20)
    blob.write_bytes(v2)
    landed = [pve_env.host.rootfs(v) / dest.lstrip("/") for v in (200, 201)]

    def cut_when_receiving() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(any(p.parent.glob(".blob.bin.ctl-*")) for p in landed):
                for pid in sshd_sessions(pve_env, "pve1"):
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    cutter = threading.Thread(target=cut_when_receiving)
    cutter.start()
    inv = load(pve_env.inventory)
    cts = [inv.container("ct200"), inv.container("ct201")]
    with Pool(inv) as pool:
        pool.share_exec(cts)
        results = fanout(pool, cts, lambda ct, t: deploy_mod.deploy(inv, ct, t, None, allow_dirty=True))
    cutter.join()
    assert not any(r.ok for r in results), "the cut came while both were receiving"
    for r in results:
        assert r.exit_code == ExitCode.CONNECTION, r.error
        assert "connection dropped" in (r.error or "").lower()
    for p in landed:
        assert p.read_bytes() in (v1, v2)  # whole old or whole new, never a mix
    time.sleep(0.5)
    for p in landed:
        assert not list(p.parent.glob(".blob.bin.ctl-*")), "temporary file removed"
    r = pve_env.ctl("deploy", "ct200", "ct201", "--allow-dirty")
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(sha_file(p) == hashlib.sha256(v2).hexdigest() for p in landed)


def test_relay_reports_a_dropped_connection_to_every_open_stream(pve_env: PveEnv) -> None:
    inv = load(pve_env.inventory)
    cts = [inv.container("ct200"), inv.container("ct201")]
    with Pool(inv) as pool:
        pool.share_exec(cts)
        t200, t201 = pool.container(cts[0]), pool.container(cts[1])
        a, b = t200.open(["sleep", "30"]), t201.open(["sleep", "30"])
        for pid in sshd_sessions(pve_env, "pve1"):
            os.kill(pid, signal.SIGKILL)
        for d in (a, b):
            with pytest.raises(ConnectionFailed, match="connection dropped"):
                d.finish(timeout=30)


def test_every_fanout_shares_one_exec_per_host(pve_env: PveEnv) -> None:
    """Not only deploy: any command run on several containers of one host (run-state refresh, metrics pull,
    ping) gets the relay from fanout itself."""
    inv = load(pve_env.inventory)
    cts = [inv.container("ct200"), inv.container("ct201")]
    with Pool(inv) as pool:
        results = fanout(pool, cts, lambda ct, t: t.check(["cat", "/etc/hostname"], what="hostname").stdout)
        assert [r.error for r in results] == [None, None]
        assert results[0].value != results[1].value  # each answer came from its own container
        pve1 = pool.host("pve1")
        assert (pve1.connects, pve1.round_trips) == (1, 1)
        assert pool._relays["pve1"].streams_opened == 2


def test_a_request_past_its_deadline_ends_its_staying_agent_and_the_relay_ends_too(pve_env: PveEnv) -> None:
    """A command's relay: at the deadline ctl tells the relay (K), so the `pct exec` of the staying agent stuck in
    that request is ended, and the relay, at the end of the command, has nothing left to wait for. (The agent
    inside, as after an exec's end, stops at its next write; this one only sleeps and is killed here.)"""
    from controller.errors import DeadlineExceeded
    from controller.remote.client import BOOT
    from controller.transport.base import AgentStart
    from tests.relay_fakes import FAKE, FAKE_AT

    token = f"ctl-late-{os.getpid()}-{time.monotonic_ns()}".encode()  # in the argv of every process of it

    def holding() -> dict[int, bytes]:
        out = {}
        for p in Path("/proc").glob("[0-9]*"):
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if token in cmd:
                out[int(p.name)] = cmd
        return out

    def on_host() -> list[bytes]:  # pct exec and what it runs on the host, not the agent in the container
        return [c for c in holding().values() if not c.startswith(b"python3\0")]

    inv = load(pve_env.inventory)
    argv = ["sh", "-c", f'exec "$0" "$@" hang {token.decode()}', "python3", "-I", "-S", "-c", BOOT, str(len(FAKE)),
            "verb"]
    try:
        with Pool(inv) as pool:
            assert pool.share_exec([inv.container("ct200"), inv.container("ct201")]) == ["pve1"]
            t = pool.container(inv.container("ct200"))
            assert isinstance(t, PctContainer) and t.keeps_agents()
            with pytest.raises(DeadlineExceeded, match="no answer in 2s"):
                t.run_agent(argv, AgentStart(FAKE_AT, len(FAKE), False), stdin=FAKE, timeout=2)
        deadline = time.monotonic() + 10
        while on_host() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert on_host() == []
        assert [c.split(b"\0")[6:8] for c in holding().values()] == [[b"serve", b"hang"]]  # it did start
    finally:
        for pid in holding():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_ping_asks_each_container_once_without_a_staying_agent_and_four_times_with_one(pve_env: PveEnv) -> None:
    """Without a session, a lone container's ping is one agent exec (its first answer is the round trip of a
    request); two containers of one host share the command's relay, which keeps an agent in each: one `pct exec`
    each, and three more requests to it for the round trip."""
    before = {n: len(pve_env.host.pct_calls(n)) for n in ("pve1", "pve2")}
    r = pve_env.ctl("--json", "ping", "ct300", "ct200", "ct201", check=True)
    rows = {row["ct"]: row for row in json.loads(r.stdout)}
    assert rows["ct300"]["staying"] is False and rows["ct300"]["rtt_ms"] == rows["ct300"]["first_ms"]
    assert rows["ct200"]["staying"] is True and rows["ct201"]["staying"] is True
    calls = {n: [(c["args"][0], c["argv"][6]) for c in pve_env.host.pct_calls(n)[before[n]:]] for n in before}
    assert calls["pve2"] == [("300", "hello")], calls
    assert sorted(calls["pve1"]) == [("200", "serve"), ("201", "serve")], calls
