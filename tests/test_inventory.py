"""Inventory validation: every error path ends in one line naming file, line and key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from controller.errors import ExitCode, InputError, InventoryError
from controller.inventory import load
from tests.conftest import inventory_error as error_of
from tests.conftest import write_inventory as write

GOOD = """\
hosts:
  kpro6:
    address: 192.0.2.10
    port: 22
containers:
  ct200:
    host: kpro6
    vmid: 200
    gpus: {target: [0, 1], drafter: [2]}
  ct201:
    host: kpro6
    vmid: 201
groups:
  train: [ct200, ct201]
payload:
  - {src: a.py, dest: /root/a.py}
"""


def test_good_inventory_loads(tmp_path: Path) -> None:
    inv = load(write(tmp_path, GOOD))
    ct = inv.container("ct200")
    assert ct.spec.vmid == 200 and ct.host_name == "kpro6" and ct.host is not None
    assert ct.spec.gpus.all == [0, 1, 2]
    assert [c.name for c in inv.select(["train"])] == ["ct200", "ct201"]
    assert [c.name for c in inv.select(["ct201", "train"])] == ["ct201", "ct200"]
    assert inv.model.payload[0].mode is None  # no mode: deployed with its source's own permission bits


def test_the_same_file_and_text_are_built_once_an_edit_is_read(tmp_path: Path) -> None:
    """A command loads its inventory twice (its early session start, then the command): the second load reads the
    file again but gets the Inventory built from that text; an edit in between is read and checked."""
    path = write(tmp_path, GOOD)
    first = load(path)
    assert load(path) is first
    path.write_text(GOOD.replace("vmid: 201", "vmid: 202"))
    edited = load(path)
    assert edited is not first and edited.container("ct201").spec.vmid == 202
    path.write_text(GOOD.replace("vmid: 201", "vmid: 200"))  # a duplicate: refused on every load, as before
    with pytest.raises(InventoryError):
        load(path)
    with pytest.raises(InventoryError):
        load(path)


def test_missing_key(tmp_path: Path) -> None:
    text = GOOD.replace("    address: 192.0.2.10\n", "")
    assert error_of(tmp_path, text) == "INV:2: hosts.kpro6.address: required key is missing"


def test_wrong_type(tmp_path: Path) -> None:
    text = GOOD.replace("vmid: 200", "vmid: two-hundred")
    assert error_of(tmp_path, text) == "INV:8: containers.ct200.vmid: must be an integer, not 'two-hundred'"


def test_unknown_host_reference(tmp_path: Path) -> None:
    text = GOOD.replace("    host: kpro6\n    vmid: 201", "    host: kpro7\n    vmid: 201")
    assert error_of(tmp_path, text) == "INV:11: containers.ct201.host: unknown host 'kpro7' (hosts: kpro6)"


def test_duplicate_vmid_on_a_host(tmp_path: Path) -> None:
    text = GOOD.replace("vmid: 201", "vmid: 200")
    assert error_of(tmp_path, text) == (
        "INV:12: containers.ct201.vmid: vmid 200 on host 'kpro6' is already used by 'ct200'")


def test_yaml_syntax_error(tmp_path: Path) -> None:
    text = GOOD.replace("    vmid: 201", "    vmid: [201")
    msg = error_of(tmp_path, text)
    assert msg.startswith("INV:13: YAML syntax error:")


def test_unknown_key(tmp_path: Path) -> None:
    text = GOOD.replace("    port: 22", "    port: 22\n    prot: 23")
    assert error_of(tmp_path, text) == "INV:5: hosts.kpro6.prot: unknown key"


def test_an_error_in_a_mapping_merged_from_an_anchor_names_its_own_line(tmp_path: Path) -> None:
    text = GOOD.replace("  ct200:\n    host: kpro6\n", "  ct200: &base\n    host: kpro6\n").replace(
        "  ct201:\n    host: kpro6\n    vmid: 201\n", "  ct201:\n    <<: *base\n    vmid: 99\n")
    assert error_of(tmp_path, text) == "INV:12: containers.ct201.vmid: must be >= 100, not 99"


@pytest.mark.parametrize(("change", "expected"), [
    (("    vmid: 201\n", "    vmid: 201\n    nccl: {ib_disable: maybe}\n"),
     "INV:13: containers.ct201.nccl.ib_disable: must be true or false, not 'maybe'"),
    (("    vmid: 201\n", "    vmid: 201\n    gpus_seen: [0, x]\n"),
     "INV:13: containers.ct201.gpus_seen[1]: must be an integer, not 'x'"),
    (("    port: 22\n", "    port: 22\n    api: {url: 'https://h:8006', node: n, token_id: 'a@pve!t', timeout: 30s}\n"),
     "INV:5: hosts.kpro6.api.timeout: must be a number, not '30s'"),
    (("    port: 22\n", "    port: 22\n    connect_timeout: " + "9" * 400 + "\n"),
     "INV:5: hosts.kpro6.connect_timeout: must be a finite number, not a 400-digit integer"),
])
def test_a_wrong_value_inside_an_optional_section_is_named_by_its_own_key(
        tmp_path: Path, change: tuple[str, str], expected: str) -> None:
    text = GOOD.replace(*change)
    assert text != GOOD
    assert error_of(tmp_path, text) == expected


def test_vmid_range(tmp_path: Path) -> None:
    text = GOOD.replace("vmid: 201", "vmid: 42")
    assert error_of(tmp_path, text) == "INV:12: containers.ct201.vmid: must be >= 100, not 42"


def test_pct_needs_host_and_vmid(tmp_path: Path) -> None:
    text = GOOD.replace("    host: kpro6\n    vmid: 201\n", "    transport: pct\n")
    assert error_of(tmp_path, text) == "INV:10: containers.ct201: transport 'pct' needs 'host' and 'vmid'"


def test_payload_dest_with_dotdot(tmp_path: Path) -> None:
    text = GOOD.replace("dest: /root/a.py", "dest: /root/../etc/passwd")
    assert error_of(tmp_path, text) == "INV:16: payload[0].dest: dest '/root/../etc/passwd' must not contain '..'"


def test_payload_needs_one_source(tmp_path: Path) -> None:
    text = GOOD.replace("{src: a.py, dest: /root/a.py}", "{dest: /root/a.py}")
    assert error_of(tmp_path, text) == "INV:16: payload[0]: give exactly one of 'src' or 'template'"


def test_bad_mode(tmp_path: Path) -> None:
    text = GOOD.replace("dest: /root/a.py}", "dest: /root/a.py, mode: '0999'}")
    assert error_of(tmp_path, text) == "INV:16: payload[0].mode: '0999' is not an octal mode such as '0644'"


def test_group_with_unknown_member(tmp_path: Path) -> None:
    text = GOOD.replace("train: [ct200, ct201]", "train: [ct200, ct999]")
    assert error_of(tmp_path, text) == "INV:14: groups.train[1]: unknown container 'ct999' in group"


def test_runs_log_needs_run_placeholder(tmp_path: Path) -> None:
    text = GOOD + 'runs: {series: fresh, log: "/workspace/train.log"}\n'
    assert error_of(tmp_path, text) == (
        "INV:17: runs.log: must contain {run} so that every run gets its own path")


def test_bad_container_name(tmp_path: Path) -> None:
    text = GOOD.replace("  ct201:", "  'ct 201;x':")
    assert "containers.ct 201;x: invalid container name" in error_of(tmp_path, text)


def test_not_a_mapping(tmp_path: Path) -> None:
    assert error_of(tmp_path, "- a\n- b\n") == "INV:1: expected a mapping with 'hosts' and 'containers'"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as e:
        load(tmp_path / "nope.yaml")
    assert "inventory file not found" in str(e.value)


def test_unknown_container_is_input_error(tmp_path: Path) -> None:
    inv = load(write(tmp_path, GOOD))
    with pytest.raises(InputError, match=r"unknown container 'ct999' in .* \(known: ct200, ct201\)"):
        inv.container("ct999")


def test_cli_prints_one_line_and_exit_code(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("vmid: 201", "vmid: 200"))
    r = subprocess.run([sys.executable, "-m", "controller", "-i", str(p), "inventory"],
                       capture_output=True, text=True)
    assert r.returncode == ExitCode.INVENTORY
    assert r.stderr.strip().splitlines() == [
        f"ctl: error: {p}:12: containers.ct201.vmid: vmid 200 on host 'kpro6' is already used by 'ct200'"]


def test_cli_inventory_json(tmp_path: Path) -> None:
    import json

    p = write(tmp_path, GOOD)
    r = subprocess.run([sys.executable, "-m", "controller", "-i", str(p), "--json", "inventory"],
                       capture_output=True, text=True, check=True)
    doc = json.loads(r.stdout)
    assert doc["containers"]["ct200"]["vmid"] == 200
    assert doc["hosts"]["kpro6"]["address"] == "192.0.2.10"


def test_shipped_inventory_is_valid() -> None:
    inv = load(Path(__file__).parent.parent / "inventory.yaml")
    assert {"ct200", "local"} <= set(inv.model.containers)


def test_host_persist_is_whole_seconds_at_least_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from controller import settings
    from controller.transport.pool import Pool

    monkeypatch.delenv(settings.PERSIST, raising=False)
    monkeypatch.setenv(settings.CONFIG, str(tmp_path / "no-config.yaml"))
    inv = load(write(tmp_path, GOOD))
    assert inv.model.hosts["kpro6"].persist is None  # unset: the default applies
    assert Pool(inv).persist("kpro6") == settings.DEFAULT_PERSIST == 60  # sessions are on by default
    for text, want in (("persist: 0", 0), ("persist: 90", 90)):
        inv = load(write(tmp_path, GOOD.replace("    port: 22\n", f"    port: 22\n    {text}\n")))
        assert inv.model.hosts["kpro6"].persist == want and Pool(inv).persist("kpro6") == want
    monkeypatch.setenv(settings.PERSIST, "0")
    assert Pool(inv).persist("kpro6") == 0  # CTL_PERSIST wins over the host's key
    msg = error_of(tmp_path, GOOD.replace("    port: 22\n", "    port: 22\n    persist: -5\n"))
    assert msg.startswith("INV:5: hosts.kpro6.persist:"), msg
    assert ">= 0" in msg or "greater than or equal to 0" in msg, msg


def test_host_keepalive_and_deadlines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults < the host's keepalive/connect_timeout/timeout keys < CTL_* variables; bad values named."""
    from controller import settings
    from controller.transport.pool import Pool

    for var in (settings.KEEPALIVE_INTERVAL, settings.KEEPALIVE_COUNT, settings.CONNECT_TIMEOUT, settings.TIMEOUT):
        monkeypatch.delenv(var, raising=False)
    inv = load(write(tmp_path, GOOD))
    host = inv.model.hosts["kpro6"]
    assert (host.keepalive.interval, host.keepalive.count, host.connect_timeout, host.timeout) == (15, 3, 10, 60)
    with Pool(inv) as pool:
        ep = pool.host("kpro6")
        assert (ep.keepalive_interval, ep.keepalive_count, ep.connect_timeout, ep.request_timeout) == (15, 3, 10, 60)
    keys = "    port: 22\n    keepalive: {interval: 2, count: 4}\n    connect_timeout: 3\n    timeout: 0\n"
    inv = load(write(tmp_path, GOOD.replace("    port: 22\n", keys)))
    with Pool(inv) as pool:
        ep = pool.host("kpro6")
        assert (ep.keepalive_interval, ep.keepalive_count, ep.connect_timeout) == (2, 4, 3)
        assert ep.request_timeout is None  # timeout: 0 is no deadline
    monkeypatch.setenv(settings.KEEPALIVE_INTERVAL, "0")
    monkeypatch.setenv(settings.TIMEOUT, "7.5")
    with Pool(inv) as pool:
        ep = pool.host("kpro6")
        assert (ep.keepalive_interval, ep.keepalive_count, ep.request_timeout) == (0, 4, 7.5)  # the variables win
    for var, bad in ((settings.TIMEOUT, "soon"), (settings.KEEPALIVE_COUNT, "0"), (settings.CONNECT_TIMEOUT, "0")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(InputError, match=var):
            Pool(inv)
        monkeypatch.delenv(var)
    msg = error_of(tmp_path, GOOD.replace("    port: 22\n", "    port: 22\n    keepalive: {count: 0}\n"))
    assert msg.startswith("INV:5: hosts.kpro6.keepalive.count:"), msg
    msg = error_of(tmp_path, GOOD.replace("    port: 22\n", "    port: 22\n    keepalive: {intervl: 5}\n"))
    assert "hosts.kpro6.keepalive.intervl: unknown key" in msg, msg


def _load_in_a_new_process(path: Path, state: Path) -> dict[str, object]:
    """Load the inventory in a fresh interpreter: what it found, and whether PyYAML was imported for it."""
    code = ("import json, sys\nfrom controller.inventory import load\n"
            "from controller.errors import CtlError\n"
            "try:\n    inv = load(sys.argv[1]); got = sorted(inv.model.containers)\n"
            "except CtlError as e:\n    got = str(e)\n"
            "print(json.dumps({'got': got, 'yaml': 'yaml' in sys.modules}))\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                       env={"CTL_STATE_DIR": str(state), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path.cwd())})
    import json

    doc: dict[str, object] = json.loads(r.stdout)
    return doc


def test_an_unchanged_inventory_is_parsed_once_and_its_errors_keep_their_lines(tmp_path: Path) -> None:
    """The parse (data and the line of every key) is kept in the state directory under the hash of the text: the
    next command neither imports PyYAML nor parses, and says the same thing, line included."""
    state = tmp_path / "state"
    p = write(tmp_path, GOOD)
    assert _load_in_a_new_process(p, state) == {"got": ["ct200", "ct201"], "yaml": True}
    assert _load_in_a_new_process(p, state) == {"got": ["ct200", "ct201"], "yaml": False}
    bad = GOOD.replace("vmid: 201", "vmid: 42")
    write(tmp_path, bad)
    first = _load_in_a_new_process(p, state)
    assert first["yaml"] is True and ":12: containers.ct201.vmid: must be >= 100" in str(first["got"]), first
    assert _load_in_a_new_process(p, state) == {**first, "yaml": False}
    entries = list((state / "inventory").iterdir())
    assert len(entries) == 2 and all(e.stat().st_mode & 0o777 == 0o600 for e in entries)
    assert (state / "inventory").stat().st_mode & 0o777 == 0o700
    for e in entries:  # an entry cut short or altered is not used: parsed again (and kept again)
        e.write_bytes(e.read_bytes()[:-3])
    assert _load_in_a_new_process(p, state) == {**first, "yaml": True}
    assert _load_in_a_new_process(p, state) == {**first, "yaml": False}


def test_a_document_marshal_cannot_hold_is_parsed_every_time(tmp_path: Path) -> None:
    state = tmp_path / "state"
    p = write(tmp_path, GOOD + "vars:\n  since: 2026-12-02 10:00:00\n")  # a YAML timestamp: a datetime
    for _ in range(2):
        assert _load_in_a_new_process(p, state) == {"got": ["ct200", "ct201"], "yaml": True}
    assert not list((state / "inventory").glob("[0-9a-f]*"))
