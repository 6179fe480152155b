"""`ctl snapshot` / `ctl rollback` end to end on the local Proxmox host: through the HTTPS API and through the
pct fallback (same messages and exit codes), refusal while a run is live, names refused before anything is sent.

Every test leaves its container running and deletes the snapshots it took (other tests share the CTs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.errors import ExitCode
from tests.integration.conftest import PveEnv
from tests.pvehost import PveHost

pytestmark = pytest.mark.pvehost


def use_api(env: PveEnv, **api: object) -> PveEnv:
    """Give both hosts an `api:` section (the secret travels in PVE_TOKEN, never in the inventory)."""
    h = env.host
    env.write(hosts={n: {"api": h.api_spec(n, **api)} for n in ("pve1", "pve2")})
    env.env["PVE_TOKEN"] = h.api_token[1]
    return env


@pytest.fixture(params=["api", "pct"])
def via_env(request: pytest.FixtureRequest, pve_env: PveEnv) -> PveEnv:
    if request.param == "api":
        use_api(pve_env)
        assert pve_env.host.api_token[1] not in pve_env.inventory.read_text()
    return pve_env


@pytest.fixture
def cleanup(pvehost: PveHost) -> Iterator[list[tuple[int, str]]]:
    """Snapshots to delete afterwards (vmid, name); their containers are started again if stopped."""
    taken: list[tuple[int, str]] = []
    yield taken
    for vmid, name in taken:
        node = pvehost.node_of(vmid).name
        pvehost.ssh(node, "pct", "delsnapshot", str(vmid), name)
        if not pvehost.running(vmid):
            pvehost.start(vmid)


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ctl: error: "), stderr
    return lines[0]


def test_rollback_restores_a_file_changed_after_the_snapshot(via_env: PveEnv, cleanup: list[tuple[int, str]]) -> None:
    env, host = via_env, via_env.host
    via = "api" if "PVE_TOKEN" in env.env else "pct"
    d = host.rootfs(200) / "root" / env.tag
    d.mkdir(parents=True, exist_ok=True)
    (d / "state.txt").write_text("before\n")
    name = f"s{env.tag}"
    cleanup.append((200, name))
    r = env.ctl("snapshot", "create", "ct200", name, "-d", "before the change", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["via"] == via and res["exitstatus"] == "OK" and res["action"] == "snapshot"
    assert (res["upid"] or "").startswith("UPID:pve1:") if via == "api" else res["upid"] is None

    (d / "state.txt").write_text("after\n")
    (d / "new.txt").write_text("created after the snapshot\n")
    listed = json.loads(env.ctl("snapshot", "list", "ct200", "--json", check=True).stdout)
    mine = [s for s in listed["snapshots"] if s["name"] == name]
    assert mine and mine[0]["description"] == "before the change" and mine[0]["current"]

    r = env.ctl("rollback", "ct200", name, "--yes")
    assert r.returncode == 0, r.stderr
    assert f"rolled back to '{name}' via {via}" in r.stdout and "container stopped" in r.stdout
    assert not host.running(200)  # PVE leaves a rolled-back CT stopped unless asked
    assert (d / "state.txt").read_text() == "before\n"
    assert not (d / "new.txt").exists()

    (d / "state.txt").write_text("changed again\n")
    r = env.ctl("snapshot", "rollback", "ct200", name, "--yes", "--start", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "running"
    assert host.running(200)
    assert (d / "state.txt").read_text() == "before\n"

    r = env.ctl("snapshot", "delete", "ct200", name, "--yes")
    assert r.returncode == 0, r.stderr
    assert name not in env.ctl("snapshot", "list", "ct200", check=True).stdout


def test_failures_read_the_same_through_api_and_pct(pve_env: PveEnv, cleanup: list[tuple[int, str]]) -> None:
    name = f"d{pve_env.tag}"
    cleanup.append((201, name))
    errors = {}
    for via in ("pct", "api"):
        if via == "api":
            use_api(pve_env)
        if via == "pct":
            pve_env.ctl("snapshot", "create", "ct201", name, check=True)
        r = pve_env.ctl("snapshot", "create", "ct201", name)  # the API's POST succeeds; its task fails
        assert r.returncode == ExitCode.API, r.stderr
        missing = pve_env.ctl("rollback", "ct201", "nosuchsnap", "--yes")
        assert missing.returncode == ExitCode.INPUT, missing.stderr
        errors[via] = (one_error_line(r.stderr), one_error_line(missing.stderr))
    assert errors["api"] == errors["pct"]
    assert errors["api"][0] == (f"ctl: error: ct201 (pve1/201): snapshot '{name}' failed: "
                                f"snapshot name '{name}' already used")
    assert "snapshot 'nosuchsnap' does not exist" in errors["api"][1]


def test_rollback_refused_while_a_run_is_live(pve_env: PveEnv, cleanup: list[tuple[int, str]]) -> None:
    env = use_api(pve_env)
    name = f"r{env.tag}"
    cleanup.append((200, name))
    env.write(hosts={n: {"api": env.host.api_spec(n)} for n in ("pve1", "pve2")},
              vars={**env.base_extra["vars"], "steps": 100000, "interval": 0.2})
    env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    env.ctl("snapshot", "create", "ct200", name, check=True)
    env.ctl("launch", "ct200", "--run", "live1", check=True)

    r = env.ctl("rollback", "ct200", name, "--yes")
    assert r.returncode == ExitCode.BUSY, r.stdout + r.stderr
    line = one_error_line(r.stderr)
    assert "run live1 is live" in line and "--force" in line and "ctl stop ct200/live1" in line
    assert env.host.running(200)  # nothing happened
    runs = json.loads(env.ctl("runs", "--json", check=True).stdout)
    assert [(x["name"], x["state"]) for x in runs] == [("live1", "running")]

    r = env.ctl("rollback", "ct200", name, "--yes", "--force", "--start")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run live1 was live and is recorded as stopped" in r.stdout
    assert env.host.running(200)
    runs = json.loads(env.ctl("runs", "--json", check=True).stdout)
    assert runs[0]["state"] == "stopped" and "rolled back" in runs[0]["note"]
    # The container really restarted: no tmux server survived the rollback.
    ls = env.host.ssh("pve1", "pct", "exec", "200", "--", "tmux", "ls")
    assert f"{env.tag}-live1" not in ls.stdout.decode()


def test_a_run_that_ended_does_not_block(pve_env: PveEnv, cleanup: list[tuple[int, str]]) -> None:
    env = pve_env
    name = f"e{env.tag}"
    cleanup.append((201, name))
    env.ctl("deploy", "ct201", "--allow-dirty", check=True)
    env.ctl("snapshot", "create", "ct201", name, check=True)
    env.ctl("launch", "ct201", "--run", "short1", "-f", check=True)
    r = env.ctl("rollback", "ct201", name, "--yes", "--start")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("bad", ["1abc", "a", "current", "vzdump", "bad.name", "x" * 41, "a b", "-rf", "$(id)"])
def test_invalid_snapshot_names_refused_before_anything_is_sent(pve_env: PveEnv, bad: str) -> None:
    # An API that cannot be reached: a name error (exit 4), not a connection error (5), proves nothing was sent.
    use_api(pve_env, url="https://127.0.0.2:1")
    for args in (["snapshot", "create", "ct200"], ["rollback", "--yes", "ct200"],
                 ["snapshot", "delete", "--yes", "ct200"]):
        r = pve_env.ctl(*args, "--", bad)
        assert r.returncode == ExitCode.INPUT, r.stderr
        assert "invalid snapshot name" in one_error_line(r.stderr)


def test_rollback_without_a_terminal_needs_yes(pve_env: PveEnv, cleanup: list[tuple[int, str]]) -> None:
    name = f"y{pve_env.tag}"
    cleanup.append((201, name))
    pve_env.ctl("snapshot", "create", "ct201", name, check=True)
    r = pve_env.ctl("rollback", "ct201", name)
    assert r.returncode == ExitCode.INPUT
    assert "confirm with --yes (no terminal to ask on)" in one_error_line(r.stderr)
    assert pve_env.host.running(201)
    dry = pve_env.ctl("rollback", "ct201", name, "--dry-run", "--yes")
    assert dry.returncode == 0 and f"pct rollback 201 {name}" in dry.stdout
    assert pve_env.host.running(201)


def test_bad_token_and_unreachable_api_are_one_line(pve_env: PveEnv, pvehost: PveHost) -> None:
    use_api(pve_env)
    pve_env.env["PVE_TOKEN"] = "wrong"
    pvehost.set_api_auth_delay(0.3)
    try:
        since = pvehost.api_log_end()
        r = pve_env.ctl("snapshot", "list", "ct200")
        # one request, refused; no retry
        assert pvehost.api_requests(since) == ["GET /api2/json/nodes/pve1/lxc/200/snapshot 401"]
    finally:
        pvehost.set_api_auth_delay(None)
    assert r.returncode == ExitCode.CONNECTION
    assert one_error_line(r.stderr) == (f"ctl: error: PVE API at {pvehost.api_url} refused the token "
                                        "root@pam!ctl (401): check PVE_TOKEN")
    del pve_env.env["PVE_TOKEN"]
    r = pve_env.ctl("snapshot", "list", "ct200")
    assert r.returncode == ExitCode.INPUT and "PVE_TOKEN is not set" in one_error_line(r.stderr)
    use_api(pve_env, url="https://127.0.0.2:1")
    r = pve_env.ctl("snapshot", "list", "ct200")
    assert r.returncode == ExitCode.CONNECTION
    assert one_error_line(r.stderr) == "ctl: error: cannot reach https://127.0.0.2:1: connection refused"


def test_verify_false_warns(pve_env: PveEnv, tmp_path: Path) -> None:
    use_api(pve_env, verify=False, ca_file=None)
    r = pve_env.ctl("snapshot", "list", "ct300")
    assert r.returncode == 0, r.stderr
    assert "NOT verified" in r.stderr
