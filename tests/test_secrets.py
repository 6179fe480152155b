"""Secrets at rest and in output: run records are 0600 and hold no secret-looking env value, the registry is
private, `ctl show` / `ctl diff` / --json redact, dry-run stdin files are 0600 (on the `local` target)."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

from controller.core.redact import REDACTED, is_secret, redact_text, redact_vars
from tests.conftest import START, LocalEnv

TOKEN = "hf_SeCrEtVaLuE123"


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize("name", ["HF_TOKEN", "wandb_api_key", "DB_PASSWORD", "aws_secret_access_key", "Passwd"])
def test_secret_looking_names(name: str) -> None:
    assert is_secret(name)


def test_redaction_keeps_other_values() -> None:
    doc = {"env": {"HF_TOKEN": TOKEN, "HF_HOME": "/x"}, "steps": 3, "nested": [{"api_key": "k"}]}
    assert redact_vars(doc) == {"env": {"HF_TOKEN": REDACTED, "HF_HOME": "/x"}, "steps": 3,
                                "nested": [{"api_key": REDACTED}]}
    text = f"export HF_TOKEN='{TOKEN}'\nexport HF_HOME=/x\nPASSWORD=p exec x\n"
    assert redact_text(text) == f"export HF_TOKEN={REDACTED}\nexport HF_HOME=/x\nPASSWORD={REDACTED}\n"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_records_and_output_hold_no_secret(env: LocalEnv) -> None:
    (env.dir / "start_training.sh.j2").write_text(
        START.replace("set -euo pipefail\n", "set -euo pipefail\n{% for k, v in env | dictsort %}export {{ k }}="
                      "{{ v | shquote }}\n{% endfor %}"))
    env.write_inventory(vars={"env": {"HF_TOKEN": TOKEN, "HF_HOME": "/tmp/hf"}})
    env.ok("deploy", "--allow-dirty")
    assert TOKEN in (env.root / "root" / "start_training.sh").read_text()  # the training gets it
    env.launch("fresh1", "--tok-s 12800 --steps 2 --interval 0.01 --jitter 0", follow=True)
    env.launch("fresh2", "--tok-s 12800 --steps 2 --interval 0.01 --jitter 0", follow=True)
    record = env.root / "workspace" / "train_stdout_fresh1.log.ctl.json"
    assert mode(record) == 0o600
    assert TOKEN not in record.read_text() and json.loads(record.read_text())["vars"]["env"]["HF_TOKEN"] == REDACTED
    state = Path(env.env["CTL_STATE_DIR"])
    assert mode(state) == 0o700 and mode(state / "registry.sqlite3") == 0o600
    for f in state.glob("registry.sqlite3*"):
        assert TOKEN.encode() not in f.read_bytes(), f
    shown = env.ok("--json", "show", "fresh1")
    assert TOKEN not in shown and json.loads(shown)["vars"]["env"]["HF_HOME"] == "/tmp/hf"
    assert TOKEN not in env.ok("show", "fresh1") and TOKEN not in env.ok("--json", "runs")
    r = env.ctl("--json", "diff", "fresh1", "fresh2")
    assert TOKEN not in r.stdout + r.stderr


def test_dry_run_stdin_file_is_private(env: LocalEnv) -> None:
    (env.dir / "emit_metrics.py").write_text((env.dir / "emit_metrics.py").read_text() + "# v2\n")
    out = env.ok("deploy", "--dry-run")
    (stdin_file,) = (Path(env.env["CTL_STATE_DIR"]) / "dry-run").glob("*.stdin")
    assert str(stdin_file) in out
    assert mode(stdin_file) == 0o600 and mode(stdin_file.parent) == 0o700
