"""Names and small things of the second hardening pass (issue 40): every validator matches whole (no trailing
newline), an inventory `user:` cannot be an ssh option and ssh gets `-l USER -- HOST`, a container's log name
cannot block automatic naming, the agent's stop account and file hashes are checked, the rendezvous warning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controller.errors import InputError
from tests.conftest import inventory_error


@pytest.mark.parametrize("bad", ["fresh7\n", "ct200\n", "a\n"])
def test_names_with_a_trailing_newline_are_refused(bad: str) -> None:
    from controller.names import check_name, check_snapshot_name

    with pytest.raises(InputError):
        check_name(bad)
    with pytest.raises(InputError):
        check_snapshot_name("snap" + bad)


def test_inventory_validators_match_whole_values(tmp_path: Path) -> None:
    import yaml

    doc = {"hosts": {"pve1": {"address": "127.0.0.2"}},
           "containers": {"ct200": {"host": "pve1", "vmid": 200, "address": "127.0.0.2\n"},
                          "ct201": {"host": "pve1", "vmid": 201, "address": "127.0.0.3"}},
           "jobs": {"pair": {"nodes": ["ct200", "ct201"]}}}
    assert "is not a host name or an IP address" in inventory_error(tmp_path, yaml.safe_dump(doc))
    doc = {"containers": {"loc": {"transport": "local", "root": "/x", "vars": {"env": {"A\n": 1}}}}}
    inventory_error(tmp_path, yaml.safe_dump(doc))  # refused, in one line
    doc = {"containers": {"loc": {"transport": "local", "root": "/x", "vars": {"train_args": {"steps\n": 1}}}}}
    inventory_error(tmp_path, yaml.safe_dump(doc))


@pytest.mark.parametrize("user", ["-oProxyCommand=touch /tmp/x", "root\n", "a b", ""])
def test_an_inventory_user_cannot_be_an_ssh_option(tmp_path: Path, user: str) -> None:
    import yaml

    for doc in ({"hosts": {"pve1": {"address": "127.0.0.2", "user": user}}, "containers": {}},
                {"containers": {"c": {"transport": "ssh", "address": "127.0.0.2", "user": user}}}):
        assert "is not a user name" in inventory_error(tmp_path, yaml.safe_dump(doc))


def test_ssh_command_lines_end_options_before_the_host() -> None:
    from controller.transport.ssh import SshEndpoint

    ep = SshEndpoint("pve1", "127.0.0.2", port=2222, user="ops", known_hosts="/k")
    argv = ep.interactive_argv(["tmux", "attach-session", "-t", "=s"])
    i = argv.index("--")
    assert argv[i - 2:i + 2] == ["-l", "ops", "--", "127.0.0.2"] and argv.count("--") == 1
    assert not any("@" in a for a in argv[:i])
    assert ep.script(["true"]).split(" -- ")[1].startswith("127.0.0.2 ")


def test_a_log_name_of_66_digits_does_not_block_naming() -> None:
    from controller.core.series import numbers as _series_numbers

    huge = "fresh" + "9" * 66
    assert _series_numbers("fresh", ["fresh3", huge, "fresh12\n", "fresh" + "1" * 19]) == [3]
    assert _series_numbers("fresh", ["fresh" + "9" * 18]) == [10 ** 18 - 1]  # its successor is still a name


def test_the_stop_account_of_the_agent_is_words_only() -> None:
    from controller.commands.reconcile import signal_steps

    assert signal_steps(["SIGINT", "SIGTERM", "kill-session", "swept 2 straggler(s)"]) == [
        "SIGINT", "SIGTERM", "kill-session", "swept 2 straggler(s)"]
    assert signal_steps(["[link=https://evil]SIGINT", "[/x]", "SIG\x1b]0;t\x07", 3]) == ["?", "?", "?", "?"]
    assert signal_steps("SIGINT") == []


def test_a_malformed_hash_from_a_container_is_refused() -> None:
    from controller.commands.deploy import checked_hashes
    from controller.remote.client import AgentReplyError

    good = {"/root/a": {"sha256": "ab" * 32, "mode": 420}, "/root/b": None, "/root/c": {"error": "a directory"}}
    assert checked_hashes(good, "ct200") == good
    for bad in ("[link=https://evil]x[/link]", "AB" * 32, "ab" * 31, 7):
        with pytest.raises(AgentReplyError, match="malformed sha256"):
            checked_hashes({"/root/a": {"sha256": bad}}, "ct200")


def test_nodes_outside_private_ranges_are_named(tmp_path: Path) -> None:
    from controller.commands.launcher import exposed_nodes
    from controller.inventory import load

    p = tmp_path / "inventory.yaml"
    p.write_text("hosts:\n  pve1: {address: 127.0.0.2}\ncontainers:\n"
                 "  a: {host: pve1, vmid: 200, address: 10.1.2.3}\n"
                 "  b: {host: pve1, vmid: 201, address: 100.64.7.8}\n"
                 "  c: {host: pve1, vmid: 202, address: 8.8.4.4}\n"
                 "  d: {host: pve1, vmid: 203, address: node-d.lan}\n"
                 "  e: {host: pve1, vmid: 204, address: 'fe80::1'}\n"
                 "jobs:\n  j: {nodes: [a, b, c, d, e]}\n")
    inv = load(p)
    assert exposed_nodes(inv.job("j")) == ["b (100.64.7.8)", "c (8.8.4.4)"]


def test_launch_of_an_exposed_job_warns_once(tmp_path: Path) -> None:
    """The warning comes from the inventory alone, before any connection: here the host does not even answer
    (a closed loopback port), and the public address is never contacted."""
    import os
    import socket
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    p = tmp_path / "inventory.yaml"
    p.write_text(f"hosts:\n  pve1: {{address: 127.0.0.1, port: {port}, connect_timeout: 2}}\ncontainers:\n"
                 "  a: {host: pve1, vmid: 200, address: 192.168.7.1}\n"
                 "  b: {host: pve1, vmid: 201, address: 8.8.4.4}\n"
                 "jobs:\n  j: {nodes: [a, b]}\n")
    r = subprocess.run([sys.executable, "-m", "controller", "-i", str(p), "launch", "j"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "CTL_STATE_DIR": str(tmp_path / "state"),
                                                   "CTL_PERSIST": "0"})
    warned = [x for x in r.stderr.splitlines() if "not on a private network" in x]
    assert len(warned) == 1 and "b (8.8.4.4)" in warned[0] and "29400" in warned[0], r.stderr
    assert re.match(r"ctl: warning: j: ", warned[0])
