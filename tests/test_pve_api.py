"""controller.transport.pveapi against the test host's real HTTPS API (tests/pvehost/api.py) through proxmoxer, and the
pct fallback's parser against the same containers: token, 401 delay, TLS trust, unreachable, task failures."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from controller.commands.snapshot import parse_listsnapshot
from controller.errors import ApiError, ConnectionFailed, InputError
from controller.inventory import ApiSpec
from controller.schema import build
from controller.transport.pveapi import PveApi, PveFailure, snapshots_from_api
from tests.pvehost import PveHost, find_free_port
from tests.pvehost.api import make_certs

pytestmark = pytest.mark.pvehost


@pytest.fixture
def spec(pvehost: PveHost) -> ApiSpec:
    return build(ApiSpec, pvehost.api_spec("pve1", secret_env="CTL_TEST_PVE_TOKEN", timeout=10))


@pytest.fixture
def env(pvehost: PveHost) -> dict[str, str]:
    return {"CTL_TEST_PVE_TOKEN": pvehost.api_token[1]}


@pytest.fixture
def fast_401(pvehost: PveHost) -> Iterator[float]:
    pvehost.set_api_auth_delay(0.5)
    yield 0.5
    pvehost.set_api_auth_delay(None)


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_token_ok(spec: ApiSpec, env: dict[str, str]) -> None:
    api = PveApi(spec, environ=env)
    assert api.version()["release"]
    assert api.status(200) == "running"
    assert isinstance(api.list_snapshots(200), list)
    assert env["CTL_TEST_PVE_TOKEN"] not in repr(api)


def test_bad_token_is_one_line_after_the_401_delay(spec: ApiSpec, fast_401: float, pvehost: PveHost) -> None:
    api = PveApi(spec, environ={"CTL_TEST_PVE_TOKEN": "not-the-secret"})
    since = pvehost.api_log_end()
    with pytest.raises(ConnectionFailed) as ei:
        api.status(200)
    # one request, refused, and no retry of it (each would wait out the 401 delay again)
    assert pvehost.api_requests(since) == ["GET /api2/json/nodes/pve1/lxc/200/status/current 401"]
    assert one_line(ei.value) == (f"PVE API at {pvehost.api_url} refused the token root@pam!ctl (401): "
                                  "check CTL_TEST_PVE_TOKEN")
    assert "not-the-secret" not in str(ei.value)


def test_missing_secret_variable_names_it(spec: ApiSpec) -> None:
    with pytest.raises(InputError) as ei:
        PveApi(spec, environ={})
    assert "CTL_TEST_PVE_TOKEN is not set" in one_line(ei.value)


def test_untrusted_certificate_is_one_line(spec: ApiSpec, env: dict[str, str], tmp_path: Path,
                                           pvehost: PveHost) -> None:
    make_certs(tmp_path / "other")  # a CA that did not sign the server's certificate
    other = tmp_path / "other" / "ca.pem"
    api = PveApi(replace(spec, ca_file=str(other)), environ=env)
    with pytest.raises(ConnectionFailed) as ei:
        api.status(200)
    text = one_line(ei.value)
    assert text.startswith(f"TLS certificate of {pvehost.api_url} is not trusted by {other} ("), text


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_verify_false_warns_every_time(spec: ApiSpec, env: dict[str, str]) -> None:
    said: list[str] = []
    for _ in range(2):
        api = PveApi(replace(spec, verify=False, ca_file=None), environ=env, warn=said.append)
        assert api.status(200) == "running"
    assert len(said) == 2 and "NOT verified" in said[0]


def test_missing_ca_file_refused_before_any_request(spec: ApiSpec, env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(InputError) as ei:
        PveApi(replace(spec, ca_file=str(tmp_path / "nope.pem")), environ=env)
    assert "does not exist" in one_line(ei.value)


def test_unreachable_port_is_one_line(spec: ApiSpec, env: dict[str, str]) -> None:
    port = find_free_port(["127.0.0.2"], start=18006)
    url = f"https://127.0.0.2:{port}"
    api = PveApi(replace(spec, url=url), environ=env)
    t0 = time.monotonic()
    with pytest.raises(ConnectionFailed) as ei:
        api.list_snapshots(200)
    assert one_line(ei.value) == f"cannot reach {url}: connection refused"
    assert time.monotonic() - t0 < 5


def test_task_failing_inside_while_the_post_succeeded(spec: ApiSpec, env: dict[str, str]) -> None:
    api = PveApi(spec, environ=env)
    name = "t" + uuid.uuid4().hex[:8]
    first = api.snapshot(201, name, "first")
    assert first.exitstatus == "OK" and first.upid and first.upid.startswith("UPID:pve1:")
    assert ":vzsnapshot:201:root@pam!ctl:" in first.upid
    try:
        with pytest.raises(ApiError) as ei:
            api.snapshot(201, name)
        assert isinstance(ei.value, PveFailure)
        assert ei.value.upid and ei.value.upid != first.upid  # the POST answered a UPID; the task failed later
        assert ei.value.detail == f"snapshot name '{name}' already used"
        assert one_line(ei.value).endswith(f"task failed: snapshot name '{name}' already used")
        with pytest.raises(PveFailure) as missing:
            api.rollback(201, "nosuchsnap")
        assert missing.value.detail == "snapshot 'nosuchsnap' does not exist"
    finally:
        api.delete_snapshot(201, name)
    assert name not in [s.name for s in api.list_snapshots(201)]


def test_http_shapes(pvehost: PveHost, env: dict[str, str]) -> None:
    """Envelope, 400 with errors, 500 reason = first line, 501 for unknown paths."""
    s = requests.Session()
    s.verify = str(pvehost.api_ca)
    s.trust_env = False  # REQUESTS_CA_BUNDLE would override Session.verify (proxmoxer passes verify per request)
    s.headers["Authorization"] = f"PVEAPIToken=root@pam!ctl={env['CTL_TEST_PVE_TOKEN']}"
    base = f"{pvehost.api_url}/api2/json"
    r = s.get(f"{base}/nodes/pve2/lxc", timeout=10)
    assert r.status_code == 200 and [c["vmid"] for c in r.json()["data"]] == [300, 301]
    r = s.post(f"{base}/nodes/pve1/lxc/200/snapshot", data={"snapname": "bad.name"}, timeout=10)
    assert r.status_code == 400 and r.reason == "Parameter verification failed."
    assert "snapname" in r.json()["errors"]
    r = s.post(f"{base}/nodes/pve1/lxc/200/snapshot", data={}, timeout=10)
    assert r.status_code == 400 and r.json()["errors"] == {"snapname": "property is missing and it is not optional"}
    r = s.get(f"{base}/nodes/pve1/lxc/300/status/current", timeout=10)
    assert r.status_code == 500 and r.reason == "Configuration file 'nodes/pve1/lxc/300.conf' does not exist"
    r = s.get(f"{base}/nodes/pve1/nothing", timeout=10)
    assert r.status_code == 501


def test_api_and_pct_see_the_same_snapshots(pvehost: PveHost, spec: ApiSpec, env: dict[str, str]) -> None:
    api = PveApi(spec, environ=env)
    a, b = "p" + uuid.uuid4().hex[:6], "q" + uuid.uuid4().hex[:6]
    api.snapshot(201, a, "one line")
    api.snapshot(201, b)
    try:
        via_api = api.list_snapshots(201)
        out = pvehost.ssh("pve1", "pct", "listsnapshot", "201")
        assert out.returncode == 0, out.stderr
        via_pct = parse_listsnapshot(out.stdout.decode())
        assert [(s.name, s.parent, s.description, s.current) for s in via_pct] == \
               [(s.name, s.parent, s.description, s.current) for s in via_api]
        mine = {s.name: s for s in via_api}
        assert mine[b].parent == a and mine[b].current and not mine[a].current
    finally:
        api.delete_snapshot(201, b)
        api.delete_snapshot(201, a)


def test_snapshots_from_api_marks_current() -> None:
    items = [{"name": "b", "snaptime": 2, "parent": "a", "description": "x\n"},
             {"name": "a", "snaptime": 1, "description": ""},
             {"name": "current", "parent": "b", "description": "You are here!", "running": 1}]
    snaps = snapshots_from_api(items)
    assert [(s.name, s.current, s.description) for s in snaps] == [("a", False, ""), ("b", True, "x")]
