"""The user config file and `ctl --version`: flag > CTL_* > config file > default, one test per level, and the
`ctl config path|show` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller import settings
from controller.errors import InputError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    p = tmp_path / "config.yaml"
    monkeypatch.setenv(settings.CONFIG, str(p))
    for var in (settings.INVENTORY, settings.OUTPUT, settings.PERSIST, settings.NOTIFY):
        monkeypatch.delenv(var, raising=False)
    return p


def test_default_path_is_the_user_config_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import platformdirs

    monkeypatch.delenv(settings.CONFIG, raising=False)
    assert settings.config_path() == Path(platformdirs.user_config_dir("ctl")) / "config.yaml"


def test_default_level(conf: Path) -> None:
    assert not conf.exists()
    got = {s.name: (s.value, s.source) for s in settings.effective()}
    assert got == {"inventory": ("inventory.yaml", "default"), "output": ("text", "default"),
                   "persist": (None, "default"), "notify": (None, "default")}
    assert settings.persist_seconds() is None and settings.notify_sinks() is None


def test_config_file_level(conf: Path) -> None:
    conf.write_text("# mine\ninventory: ~/lab/inventory.yaml\noutput: json\npersist: 60\n"
                    "notify: [https://hooks.example/ctl, 'cmd:notify-send']\n")
    src = f"config {conf}"
    got = {s.name: (s.value, s.source) for s in settings.effective()}
    assert got == {"inventory": (os.path.expanduser("~/lab/inventory.yaml"), src), "output": ("json", src),
                   "persist": (60, src), "notify": (["https://hooks.example/ctl", "cmd:notify-send"], src)}
    assert settings.inventory_path() == Path(os.path.expanduser("~/lab/inventory.yaml"))
    assert settings.persist_seconds() == 60 and settings.output_format() == "json"


def test_environment_level_beats_the_file(conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf.write_text("inventory: a.yaml\noutput: json\npersist: 60\nnotify: [cmd:a]\n")
    monkeypatch.setenv(settings.INVENTORY, "b.yaml")
    monkeypatch.setenv(settings.OUTPUT, "text")
    monkeypatch.setenv(settings.PERSIST, "0")
    monkeypatch.setenv(settings.NOTIFY, "cmd:b, https://x.example/h")
    got = {s.name: (s.value, s.source) for s in settings.effective()}
    assert got == {"inventory": ("b.yaml", "env CTL_INVENTORY"), "output": ("text", "env CTL_OUTPUT"),
                   "persist": (0, "env CTL_PERSIST"), "notify": (["cmd:b", "https://x.example/h"], "env CTL_NOTIFY")}
    assert settings.persist_seconds() == 0  # 0 from the environment turns sessions off over the file's 60


def test_flag_level_beats_the_environment(conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf.write_text("inventory: a.yaml\noutput: text\nnotify: [cmd:a]\n")
    monkeypatch.setenv(settings.INVENTORY, "b.yaml")
    monkeypatch.setenv(settings.OUTPUT, "text")
    monkeypatch.setenv(settings.NOTIFY, "cmd:b")
    assert settings.inventory_path("c.yaml") == Path("c.yaml")
    assert settings.output_format("json") == "json"
    assert settings.notify_sinks(["cmd:c"]) == ["cmd:c"]
    got = {s.name: s.source for s in settings.effective({"inventory": "c.yaml", "output": "json"})}
    assert got == {"inventory": "flag", "output": "flag", "persist": "default", "notify": "env CTL_NOTIFY"}


@pytest.mark.parametrize(("text", "why"), [
    ("output: yaml\n", "output: expected json or text, got 'yaml'"),
    ("persist: -1\n", "persist: expected whole seconds >= 0"),
    ("persist: true\n", "persist: expected whole seconds >= 0"),
    ("notify: cmd:x\n", "notify: expected a list of sinks"),
    ("colour: red\n", "unknown key 'colour'"),
    ("[1, 2]\n", "expected a mapping"),
    ("output: [\n", "line 2: not valid YAML"),
])
def test_bad_config_is_one_line_naming_the_file(conf: Path, text: str, why: str) -> None:
    conf.write_text(text)
    with pytest.raises(InputError) as ei:
        settings.effective()
    assert str(conf) in str(ei.value) and why in str(ei.value) and "\n" not in str(ei.value)


def test_bad_environment_value_names_the_variable(conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.OUTPUT, "yaml")
    with pytest.raises(InputError, match="CTL_OUTPUT: expected json or text"):
        settings.output_format()


def ctl(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CTL_")}
    return subprocess.run([sys.executable, "-m", "controller.launch.main", *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**base, "PYTHONPATH": str(REPO),
                                                         "CTL_CONFIG": str(tmp_path / "config.yaml"), **env})


def test_config_commands(tmp_path: Path) -> None:
    r = ctl(tmp_path, "config", "path")
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "config.yaml")
    (tmp_path / "config.yaml").write_text("output: json\npersist: 30\n")
    r = ctl(tmp_path, "config", "show")  # the file's `output: json` makes this JSON
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    got = {s["name"]: (s["value"], s["source"]) for s in doc["settings"]}
    assert got["persist"] == (30, f"config {tmp_path / 'config.yaml'}") and got["output"][0] == "json"
    r = ctl(tmp_path, "-i", "x.yaml", "config", "show", "--text")
    assert r.returncode == 0 and "x.yaml" in r.stdout and "flag" in r.stdout and not r.stdout.startswith("{")
    (tmp_path / "config.yaml").write_text("output: yaml\n")
    assert ctl(tmp_path, "config", "path").returncode == 0  # a broken file can still be found
    r = ctl(tmp_path, "inventory")
    assert r.returncode != 0 and r.stderr.startswith("ctl: error: config file ") and "output" in r.stderr


def test_version(tmp_path: Path) -> None:
    r = ctl(tmp_path, "--version")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith(f"ctl {settings.version()} (commit ") and line.endswith(")")
    commit = line.rsplit("(commit ", 1)[1].rstrip(")")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True)
    if head.returncode == 0:
        assert commit.removesuffix("-dirty") == head.stdout.strip()


def test_build_commit_never_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no git at all
    assert settings.build_commit() == "unknown"
    assert settings.version()
