"""The second hardening pass (issue 40) against a real container of the local Proxmox host: train_args secrets
kept out of every stored and shown text, a log name that would block automatic naming, and a container whose
python3 answers ctl's agent with rich markup in a stop's account and in a file's sha256."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost

SECRET = "sk-live-8c1f2e7a9b"
HF = "hf_QwErTy123456"
START = """\
#!/usr/bin/env bash
set -euo pipefail
export A=1 HF_TOKEN={{ hf_token | shquote }}
# the training's flags: {{ train_args | cli_args }}
exec python3 {{ payload["emit_metrics.py"] }} --tok-s {{ tok_s }} --steps {{ steps }} --interval {{ interval }} \\
  {{ extra }}
"""


def _in_ct(env: PveEnv, *argv: str) -> bytes:
    return bytes(env.host.ssh("pve1", "pct", "exec", "200", "--", *argv).stdout)


def test_train_args_secrets_are_stored_and_shown_nowhere(pve_env: PveEnv) -> None:
    (pve_env.dir / "templates" / "start_training.sh.j2").write_text(START)
    base = pve_env.base_extra["vars"]
    for run, steps in (("sec1", 3), ("sec2", 4)):
        pve_env.write(vars={**base, "steps": steps, "hf_token": HF,
                            "train_args": {"wandb_api_key": SECRET, "lr": 0.001}})
        pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
        pve_env.ctl("launch", "ct200", "--run", run, "-f", check=True)
    script = pve_env.host.rootfs(200) / "root" / pve_env.tag / "start_training.sh"
    assert f"--wandb-api-key {SECRET}" in script.read_text() and HF in script.read_text()  # the training has it
    diff = pve_env.ctl("--json", "diff", "sec1", "sec2")
    text_diff = pve_env.ctl("diff", "sec1", "sec2")
    assert diff.stdout and text_diff.stdout, diff.stderr + text_diff.stderr
    shown = {"diff": diff.stdout + diff.stderr, "text diff": text_diff.stdout + text_diff.stderr,
             "show": pve_env.ctl("--json", "show", "sec2", check=True).stdout,
             "runs": pve_env.ctl("--json", "runs", check=True).stdout}
    assert json.loads(diff.stdout)["rendered"], diff.stdout  # the scripts differ: their diff is shown
    for what, text in shown.items():
        assert SECRET not in text and HF not in text, (what, text)
    assert "--wandb-api-key <redacted>" in shown["show"] and "HF_TOKEN=<redacted>" in shown["show"]
    # The dashboard's run page: provenance, and the diff against the baseline (sec1, marked good)
    pve_env.ctl("mark-good", "sec1", check=True)
    from controller.commands.dashboard import Board, Settings
    from controller.inventory import load
    from controller.registry import Registry

    reg = Registry(pve_env.state / "registry.sqlite3")
    board = Board(load(pve_env.inventory), reg, [], lambda: None, Settings())  # type: ignore[arg-type, return-value]
    page = json.dumps(board.run_detail(reg.find_run("sec2").id))
    assert '"against": "baseline"' in page and SECRET not in page and HF not in page, page
    for f in pve_env.state.glob("registry.sqlite3*"):
        data = f.read_bytes()
        assert SECRET.encode() not in data and HF.encode() not in data, f
    record = pve_env.host.rootfs(200) / "workspace" / pve_env.tag / "train_stdout_sec2.log.ctl.json"
    assert SECRET not in record.read_text() and HF not in record.read_text()


def test_a_log_named_with_66_digits_does_not_block_naming(pve_env: PveEnv) -> None:
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    logs = pve_env.host.rootfs(200) / "workspace" / pve_env.tag
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"train_stdout_fresh{'9' * 66}.log").write_text("a container wrote this\n")
    (logs / "train_stdout_fresh4.log").write_text("an older run\n")
    pve_env.host.own_as_ct_root(200, logs, tree=True)  # the container wrote them
    r = pve_env.ctl("launch", "ct200", "-f")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "launched fresh5 on ct200" in r.stdout, r.stdout


# A python3 ahead of the real one on pct's PATH (/sbin comes first): ctl's agent runs, and its answers are
# rewritten as a hostile container could.
_WRAP = """#!/bin/bash
set -o pipefail
/usr/bin/python3 "$@" | sed -u -e '{sed}'
"""


@pytest.fixture
def hostile_python(pve_env: PveEnv) -> Iterator[Path]:
    pve_env.env["CTL_PERSIST"] = "0"  # one exec per request: each goes through the wrapper
    wrapper = pve_env.host.rootfs(200) / "sbin" / "python3"
    yield wrapper
    wrapper.unlink(missing_ok=True)


def _hostile(wrapper: Path, sed: str) -> None:
    wrapper.write_text(_WRAP.replace("{sed}", sed))
    wrapper.chmod(0o755)


def test_a_stop_account_with_markup_is_shown_as_text(pve_env: PveEnv, hostile_python: Path) -> None:
    pve_env.write(vars={**pve_env.base_extra["vars"], "steps": 100000, "interval": 0.2})
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    pve_env.ctl("launch", "ct200", "--run", "mark1", check=True)
    _hostile(hostile_python, r's|"signals": \[|"signals": ["[conceal]hidden[/conceal]", "[link=https://evil.example]'
                             r'SIGINT[/link]", "[/x]", |')
    r = pve_env.ctl("stop", "mark1", "--grace", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MarkupError" not in r.stderr and "Traceback" not in r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("ct200/mark1: stopped (stopped by ctl stop (?") and "hidden" not in line, line
    hostile_python.unlink()
    run = next(x for x in json.loads(pve_env.ctl("--json", "runs", check=True).stdout) if x["name"] == "mark1")
    assert run["state"] == "stopped" and "[" not in str(run["note"]), run


def test_a_malformed_sha256_from_the_container_is_refused(pve_env: PveEnv, hostile_python: Path) -> None:
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    _hostile(hostile_python, r's|"sha256": "[0-9a-f]\{64\}"|"sha256": "[link=https://evil.example]ok[/link]"|g')
    r = pve_env.ctl("deploy", "ct200", "--allow-dirty", "--dry-run")
    assert r.returncode != 0, r.stdout + r.stderr
    said = r.stdout + r.stderr
    assert "malformed sha256" in said and "'[link=https://evil.example]ok[/link]'" in said, said  # shown as text
    r = pve_env.ctl("deploy", "ct200", "--check")
    assert r.returncode != 0 and "malformed sha256" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_squatted_socket_directory_falls_back_to_direct_connections(pve_env: PveEnv) -> None:
    nobody = 65534
    run = Path(tempfile.mkdtemp(prefix="ctl-run-"))  # a runtime dir as systemd makes it (0700, ours)
    try:
        (run / "ctl").mkdir(mode=0o700)
        os.chown(run / "ctl", nobody, nobody)  # another user made ctl's socket directory first
        pve_env.env["XDG_RUNTIME_DIR"] = str(run)
        r = pve_env.ctl("ping", "ct200")
        assert r.returncode == 0, r.stdout + r.stderr
        warned = [x for x in r.stderr.splitlines() if "warning" in x]
        assert len(warned) == 1 and f"refusing ctl's socket directory {run / 'ctl'}" in warned[0], r.stderr
        assert "connecting directly" in warned[0]
        assert not list((run / "ctl").iterdir())  # never used
        assert pve_env.ctl("deploy", "ct200", "--allow-dirty").returncode == 0  # every command still works
        (run / "ctl").rmdir()
        r = pve_env.ctl("ping", "ct200", check=True)  # ours again: sessions as before, no warning
        assert "warning" not in r.stderr and list((run / "ctl").glob("*.sock")), r.stderr
    finally:
        pve_env.env.pop("XDG_RUNTIME_DIR")
        pve_env.ctl("mux", "stop", "--grace", "0")
        shutil.rmtree(run, ignore_errors=True)


def test_a_session_serves_no_process_of_another_context(pve_env: PveEnv) -> None:
    """The persistent session reads each client's /proc: a command under NoNewPrivs (a sandbox of the same uid)
    is not lent the session's root login on the host; it connects by itself, and works."""
    first = pve_env.ctl("--debug", "ping", "ct200", check=True)
    assert "ctl's persistent session" in first.stderr, first.stderr
    argv = ["setpriv", "--no-new-privs", sys.executable, "-m", "controller", "-i", str(pve_env.inventory), "--debug",
            "ping", "ct200"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=pve_env.env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ctl's session would not serve this process: the client's NoNewPrivs differ" in r.stderr, r.stderr
    assert "reused ctl's persistent session" not in r.stderr
    again = pve_env.ctl("--debug", "ping", "ct200", check=True)  # the session still serves its own kind
    assert "reused ctl's persistent session" in again.stderr, again.stderr
