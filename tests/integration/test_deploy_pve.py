"""`ctl deploy` against the local Proxmox host: real sshd, real pct, real LXC containers."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from controller.commands import deploy as deploy_mod
from controller.errors import ConnectionDropped, DiskError, DriftError, ExitCode, VerifyError
from controller.inventory import load
from controller.registry import Registry
from controller.remote.client import Agent
from controller.transport.local import LocalContainer
from controller.transport.pool import Pool
from tests.helpers import sha_file, wait_for
from tests.integration.conftest import PveEnv, sshd_sessions

pytestmark = pytest.mark.pvehost


def test_deploy_three_containers_then_nothing_travels(pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    r = pve_env.ctl("deploy", "ct200", "ct201", "ct300", "--allow-dirty", "--json", check=True)
    results = json.loads(r.stdout)
    assert [x["ct"] for x in results] == ["ct200", "ct201", "ct300"]
    assert all(x["ok"] and x["bytes_sent"] > 0 for x in results)
    for vmid in (200, 201, 300):
        root = pve_env.host.rootfs(vmid) / "root" / pve_env.tag
        assert sha_file(root / "emit_metrics.py") == sha_file(pve_env.dir / "emit_metrics.py")
        script = root / "start_training.sh"
        assert oct(script.stat().st_mode & 0o777) == "0o755"
        assert "--tok-s 12800" in script.read_text()
    # Unchanged: one round trip per container, nothing sent; through the host's persistent session (the
    # default), that is a request to the agent the session kept in the container (after a `hello` sent while
    # pinning): no exec of the command's own, and no `pct exec` on the host either.
    inv = load(pve_env.inventory)
    before = len(pve_env.host.pct_calls("pve1"))
    with Pool(inv) as pool:
        ct = inv.container("ct200")
        res = deploy_mod.deploy(inv, ct, pool.container(ct), None, allow_dirty=True)
        assert res.changed == 0 and res.bytes_sent == 0
        assert pool.round_trips() == 0 and pool._relays["pve1"].streams_opened == 2
    assert pve_env.host.pct_calls("pve1")[before:] == []
    monkeypatch.setenv("CTL_PERSIST", "0")
    with Pool(inv) as pool:  # persistence off: the command's own exec
        res = deploy_mod.deploy(inv, ct, pool.container(ct), None, allow_dirty=True)
        assert res.changed == 0 and pool.round_trips() == 1


def test_dry_run_changes_nothing_and_prints_commands(pve_env: PveEnv) -> None:
    r = pve_env.ctl("deploy", "ct201", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "would change 2 of 2 files" in r.stdout
    assert "pct exec 201 -- python3 -I -S -c" in r.stdout and "< " in r.stdout and ".stdin" in r.stdout
    assert not (pve_env.host.rootfs(201) / "root" / pve_env.tag).exists()


def test_dirty_sources_need_allow_dirty(pve_env: PveEnv) -> None:
    r = pve_env.ctl("deploy", "ct200")
    assert r.returncode == ExitCode.DRIFT
    assert "differ from git HEAD" in r.stdout and "--allow-dirty" in r.stdout


def test_unknown_container(pve_env: PveEnv) -> None:
    r = pve_env.ctl("deploy", "ct999")
    assert r.returncode == ExitCode.INPUT
    assert "unknown container 'ct999'" in r.stdout + r.stderr


def test_stopped_container(pve_env: PveEnv) -> None:
    pve_env.host.stop(201)
    try:
        r = pve_env.ctl("deploy", "ct201", "--allow-dirty")
        assert r.returncode == ExitCode.NOT_RUNNING
        assert "CT 201 on pve1 is stopped" in r.stdout + r.stderr
        p = pve_env.ctl("ping", "ct201", "ct200")
        assert p.returncode == ExitCode.NOT_RUNNING
        assert "stopped" in p.stdout and "ct200        ok" in p.stdout
    finally:
        pve_env.host.start(201)


def test_missing_source_file(pve_env: PveEnv) -> None:
    pve_env.write(payload=[{"src": "nope.py", "dest": "/root/nope.py"}])
    r = pve_env.ctl("deploy", "ct200", "--allow-dirty")
    assert r.returncode == ExitCode.INPUT
    assert "payload[0]: source file nope.py not found" in r.stdout + r.stderr


def test_missing_template_variable_names_template_line_and_variable(pve_env: PveEnv) -> None:
    (pve_env.dir / "templates" / "bad.sh.j2").write_text("#!/bin/sh\necho ok\necho {{ not_defined }}\n")
    pve_env.write(payload=[{"template": "templates/bad.sh.j2", "dest": "/root/bad.sh"}])
    r = pve_env.ctl("deploy", "ct200", "--allow-dirty")
    assert r.returncode == ExitCode.INPUT
    assert "templates/bad.sh.j2:3: 'not_defined' is undefined" in r.stdout + r.stderr


@pytest.mark.parametrize("dest,why", [("/etc/passwd", "outside the allowed paths"), ("/root/../etc/x", "'..'")])
def test_destination_outside_allowed_paths(pve_env: PveEnv, dest: str, why: str) -> None:
    pve_env.write(payload=[{"src": "emit_metrics.py", "dest": dest}])
    r = pve_env.ctl("deploy", "ct200", "--allow-dirty")
    assert r.returncode in (ExitCode.INPUT, ExitCode.INVENTORY)
    assert why in r.stdout + r.stderr


def test_drift_check_and_rollback(pve_env: PveEnv) -> None:
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    target = pve_env.host.rootfs(200) / "root" / pve_env.tag / "emit_metrics.py"
    v1 = target.read_bytes()
    # A hand edit in the container is drift.
    target.write_bytes(v1 + b"# hand edit\n")
    r = pve_env.ctl("deploy", "ct200", "--check")
    assert r.returncode == ExitCode.DRIFT and "changed" in r.stdout
    target.write_bytes(v1)
    # New version, then roll back to v1 from the container's store.
    (pve_env.dir / "emit_metrics.py").write_bytes(v1 + b"# v2\n")
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    assert target.read_bytes().endswith(b"# v2\n")
    r = pve_env.ctl("deploy", "ct200", "--rollback")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rolled back 1 file" in r.stdout
    assert target.read_bytes() == v1
    assert pve_env.ctl("deploy", "ct200", "--check").returncode == 0


def test_disk_full_keeps_old_file(pve_env: PveEnv) -> None:
    """CT 300's /workspace/small is a 4 MiB tmpfs: a 6 MiB file cannot land; the old one stays whole."""
    small = pve_env.dir / "blob.bin"
    small.write_bytes(b"old" * 1000)
    pve_env.write(payload=[{"src": "blob.bin", "dest": "/workspace/small/blob.bin"}])
    pve_env.ctl("deploy", "ct300", "--allow-dirty", check=True)
    landed = pve_env.host.rootfs(300) / "workspace" / "small" / "blob.bin"
    inside = ["cat", "/workspace/small/blob.bin"]
    old = small.read_bytes()
    small.write_bytes(os.urandom(6 << 20))
    r = pve_env.ctl("deploy", "ct300", "--allow-dirty")
    assert r.returncode == ExitCode.DISK, r.stdout + r.stderr
    assert "No space left on device" in r.stdout and "nothing was replaced" in r.stdout
    got = pve_env.host.ssh("pve2", "pct", "exec", "300", "--", *inside)
    assert got.stdout == old
    listing = pve_env.host.ssh("pve2", "pct", "exec", "300", "--", "ls", "-a", "/workspace/small")
    assert b".ctl-" not in listing.stdout  # no temporary file left behind
    assert landed.name == "blob.bin"


def test_pct_push_trap_is_caught_by_verify(pve_env: PveEnv, tmp_path: Path) -> None:
    """pct push exits 0 when the copy fails (disk full): the transport's put verifies and says so."""
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(6 << 20))
    inv = load(pve_env.inventory)
    with Pool(inv) as pool:
        t = pool.container(inv.container("ct300"))
        with pytest.raises(VerifyError, match="did not land intact"):
            t.put(str(big), "/workspace/small/pushed.bin")


def test_host_key_changed_or_unknown_is_refused(pve_env: PveEnv, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(bogus)], check=True)
    addr, port, _node = pve_env.host.hosts["pve1"]
    kh = tmp_path / "known_hosts_changed"
    kh.write_text(f"[{addr}]:{port} {Path(str(bogus) + '.pub').read_text().split(' ', 2)[0]} "
                  f"{Path(str(bogus) + '.pub').read_text().split(' ', 2)[1]}\n")
    pve_env.write(hosts={"pve1": {"known_hosts": str(kh)}})
    r = pve_env.ctl("ping", "ct200")
    assert r.returncode == ExitCode.HOST_KEY
    assert "CHANGED" in r.stdout and "refusing to connect" in r.stdout
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    pve_env.write(hosts={"pve1": {"known_hosts": str(empty)}})
    r = pve_env.ctl("ping", "ct200")
    assert r.returncode == ExitCode.HOST_KEY
    assert "is unknown" in r.stdout and "ssh-keyscan" in r.stdout


def test_connection_dropped_mid_deploy_leaves_whole_files_and_rerun_finishes(pve_env: PveEnv) -> None:
    blob = pve_env.dir / "blob.bin"
    blob.write_bytes(b"v1" * 1000)
    dest = f"/root/{pve_env.tag}/blob.bin"
    pve_env.write(payload=[{"src": "blob.bin", "dest": dest}])
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    v1 = blob.read_bytes()
    v2 = os.urandom(96 << 20)
    blob.write_bytes(v2)
    landed = pve_env.host.rootfs(200) / dest.lstrip("/")

    def cut_when_receiving() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(landed.parent.glob(".blob.bin.ctl-*")):
                for pid in sshd_sessions(pve_env, "pve1"):
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    cutter = threading.Thread(target=cut_when_receiving)
    cutter.start()
    inv = load(pve_env.inventory)
    reg = Registry(pve_env.state / "reg.sqlite3")
    with Pool(inv) as pool, pytest.raises(ConnectionDropped) as e:
        ct = inv.container("ct200")
        deploy_mod.deploy(inv, ct, pool.container(ct), reg, allow_dirty=True)
    cutter.join()
    # through the host's session: the session says how it lost the connection, or that it ended with it
    assert str(e.value).startswith("pve1: SSH connection dropped"), e.value
    assert landed.read_bytes() in (v1, v2)  # whole old or whole new, never a mix
    # the agent, its connection gone, removes its temporary file as it ends
    wait_for("the temporary file removed", lambda: not list(landed.parent.glob(".blob.bin.ctl-*")), 30)
    r = pve_env.ctl("deploy", "ct200", "--allow-dirty")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sha_file(landed) == hashlib.sha256(v2).hexdigest()


def test_agent_refusal_codes_name_the_exit_code() -> None:
    """deploy maps the agent's refusal code, not its text, to an exit code (controller/remote/client.py)."""
    agent = Agent(LocalContainer("ct300", Path("/")))
    err = agent.error({"ok": False, "code": "disk", "error": "/w/.x.ctl-1: No space left on device"},
                      suffix="; nothing was replaced")
    assert isinstance(err, DiskError) and err.exit_code == ExitCode.DISK
    assert str(err) == "ct300: container disk full: /w/.x.ctl-1: No space left on device; nothing was replaced"
    assert agent.error({"ok": False, "code": "verify", "error": "x"}).exit_code == ExitCode.VERIFY
    assert agent.error({"ok": False, "error": "odd"}).exit_code == ExitCode.FAILURE


def test_container_over_its_own_sshd(pve_env: PveEnv) -> None:
    """ct301 runs its own sshd (transport: ssh): same deploy, same verification, no pct in between."""
    r = pve_env.ctl("deploy", "ct301", "--allow-dirty", "--json", check=True)
    (res,) = json.loads(r.stdout)
    assert res["ok"] and {f["action"] for f in res["files"]} == {"create"}
    landed = pve_env.host.rootfs(301) / "root" / pve_env.tag / "emit_metrics.py"
    assert sha_file(landed) == sha_file(pve_env.dir / "emit_metrics.py")
    p = pve_env.ctl("ping", "ct301", "--json", check=True)
    assert json.loads(p.stdout)[0]["ok"]
    again = json.loads(pve_env.ctl("deploy", "ct301", "--allow-dirty", "--json", check=True).stdout)[0]
    assert again["bytes_sent"] == 0


def test_a_warm_session_applies_small_changes_by_request_and_large_ones_over_their_own_exec(pve_env: PveEnv) -> None:
    """With the session's staying agent, a small change is two requests to it (plan, apply) and no `pct exec`; a
    change over 1 MiB travels over a `sync` exec of its own, with progress, as without a session. That exec
    attaches as the staying agent did (the container is running: no pct start)."""
    blob = pve_env.dir / "blob.bin"
    blob.write_bytes(b"v1" * 1000)
    dest = f"/root/{pve_env.tag}/blob.bin"
    pve_env.write(payload=[{"src": "blob.bin", "dest": dest}])
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)  # the session and its agent in CT 200 are up
    landed = pve_env.host.rootfs(200) / dest.lstrip("/")
    inv = load(pve_env.inventory)
    ct = inv.container("ct200")
    for body, execs in ((b"v2" * 1000, []), (os.urandom(3 << 20), [("attach", "sync")])):
        blob.write_bytes(body)
        seen: list[tuple[int, int]] = []

        def sent(_ct: str, n: int, total: int, seen: list[tuple[int, int]] = seen) -> None:
            seen.append((n, total))

        before = len(pve_env.host.pct_calls("pve1"))
        with Pool(inv) as pool:
            res = deploy_mod.deploy(inv, ct, pool.container(ct), None, allow_dirty=True, progress=sent)
        assert res.changed == 1 and sha_file(landed) == hashlib.sha256(body).hexdigest()
        calls = pve_env.host.pct_calls("pve1")[before:]
        assert [(c["cmd"], c["argv"][6]) for c in calls] == execs, calls
        assert seen and seen[-1][0] == seen[-1][1] and [n for n, _ in seen] == sorted(n for n, _ in seen)
        assert len(seen) == (1 if not execs else -(-seen[-1][1] // (1 << 20)))  # a step per MiB sent


def test_a_container_file_changed_between_plan_and_apply_is_drift_and_nothing_is_replaced(
        pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan and apply are two requests to a staying agent: a file changed in the container in between is needed
    too, and its body is not in the tar. The deploy says so (exit 8, the file named), and replaces nothing."""
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)  # the session and its agent in CT 200 are up
    inv = load(pve_env.inventory)
    ct = inv.container("ct200")
    root = pve_env.host.rootfs(200) / "root" / pve_env.tag
    (pve_env.dir / "emit_metrics.py").write_text((pve_env.dir / "emit_metrics.py").read_text() + "\n# v2\n")
    before = (root / "emit_metrics.py").read_bytes()
    real_sync = Agent.sync

    def meddling(self: Agent, args: Any, header: bytes, tar: bytes | None = None, **kw: Any) -> Any:
        if tar is not None:  # between the plan and the apply, someone edits the start script by hand
            (root / "start_training.sh").write_text("#!/bin/sh\necho edited by hand\n")
        return real_sync(self, args, header, tar, **kw)

    monkeypatch.setattr(Agent, "sync", meddling)
    with Pool(inv) as pool, pytest.raises(DriftError) as e:
        deploy_mod.deploy(inv, ct, pool.container(ct), None, allow_dirty=True)
    assert "changed while this deploy ran" in str(e.value) and "start_training.sh" in str(e.value)
    assert "nothing was replaced" in str(e.value) and e.value.exit_code == ExitCode.DRIFT
    assert (root / "emit_metrics.py").read_bytes() == before
    assert (root / "start_training.sh").read_text() == "#!/bin/sh\necho edited by hand\n"
