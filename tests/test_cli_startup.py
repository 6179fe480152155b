"""A thin start-up: `ctl --help` prints typer's text without importing typer, and a command line imports the cli
module of its verb only. (What `ctl` loads through a warm session: tests/integration/test_mux_pve.py; the
timings: bench/cli_startup.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Runs `ctl ARGS` (python -m controller) and writes the modules it imported to OUT when it exits.
_HOOK = ("import atexit, json, runpy, sys\n"
         "out = sys.argv.pop(1)\n"
         "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(sys.modules))))\n"
         "sys.argv[0] = 'ctl'\n"
         "runpy.run_module('controller', run_name='__main__')\n")


def modules(tmp_path: Path, *args: str, columns: int = 120) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    out = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns), "CTL_STATE_DIR": str(tmp_path / "s")}
    r = subprocess.run([sys.executable, "-c", _HOOK, str(out), *args], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    return r, set(json.loads(out.read_text()))


def test_help_text_is_what_typer_prints() -> None:
    from controller.launch.helptext import TEXT
    from controller.launch.main import render_help

    assert render_help() == TEXT, "commands changed: run `python scripts/gen_helptext.py`"


def test_ctl_help_imports_no_typer_and_prints_the_same_text(tmp_path: Path) -> None:
    from controller.launch.helptext import TEXT

    r, mods = modules(tmp_path, "--help")
    assert r.returncode == 0 and r.stdout == TEXT
    assert not {"typer", "click", "rich", "pydantic", "yaml", "paramiko", "jinja2"} & mods
    assert not any(m.startswith("controller.cli.") and m not in ("controller.launch.main", "controller.launch.helptext")
                   for m in mods), sorted(m for m in mods if m.startswith("controller"))
    narrow, mods = modules(tmp_path, "--help", columns=60)  # a narrow terminal: typer wraps it itself
    assert narrow.returncode == 0 and "typer" in mods
    assert narrow.stdout != TEXT and all(f"\n  {v} " in narrow.stdout for v in ("deploy", "mux", "store"))


def test_every_verb_maps_to_the_module_that_registers_it() -> None:
    from controller.launch.main import COMMANDS, MODULES, load

    load(["--help"])
    from controller.cli.app import app

    found: dict[str, str] = {}
    for c in app.registered_commands:
        assert c.callback is not None
        found[c.name or c.callback.__name__] = c.callback.__module__
    for g in app.registered_groups:
        assert g.typer_instance is not None and g.name is not None
        (mod,) = {c.callback.__module__ for c in g.typer_instance.registered_commands if c.callback is not None}
        found[g.name] = mod
    assert {v: f"controller.cli.{m}" for v, m in COMMANDS.items()} == found
    assert set(MODULES) == set(COMMANDS.values())


@pytest.mark.parametrize(("argv", "module"), [
    (["mux", "status"], "mux"), (["--json", "config", "path"], "config"), (["-i", "x.yaml", "runs", "--help"], "runs"),
    (["deploy", "--help"], "deploy"),
])
def test_a_command_imports_only_its_verbs_cli_module(tmp_path: Path, argv: list[str], module: str) -> None:
    from controller.launch.main import MODULES

    r, mods = modules(tmp_path, *argv)
    assert r.returncode == 0, r.stdout + r.stderr
    loaded = {m for m in MODULES if f"controller.cli.{m}" in mods}
    assert loaded == {module}
    # pydantic: typer converts option values through adapters it builds on every run (0.13 s); launch/coerce.py
    # converts ctl's plain options itself. This fails when a typer release moves what coerce.py relies on.
    assert not {"paramiko", "jinja2", "proxmoxer", "torch", "matplotlib", "pydantic"} & mods


@pytest.mark.parametrize(("argv", "message"), [
    (["tail", "r1", "-n", "abc"], "Invalid value for '-n' / '--lines': 'abc' is not an integer"),
    (["tail", "r1", "-n", "1.5"], "Invalid value for '-n' / '--lines': '1.5' is not an integer"),
    (["stop", "r1", "--grace", "soon"], "Invalid value for '--grace': 'soon' is not a number"),
    (["stop", "r1", "--grace", "inf"], "Invalid value for '--grace': 'inf' is not a finite number"),
    (["mux", "stop", "--grace", "-1"], "Invalid value for '--grace': must be >= 0, not -1"),
    (["cache", "warm", "local", "--gpu", "0", "--gpu", "x"], "Invalid value for '--gpu': 'x' is not an integer"),
])
def test_a_bad_option_value_is_one_usage_error_naming_the_option(tmp_path: Path, argv: list[str], message: str
                                                                  ) -> None:
    r, mods = modules(tmp_path, *argv)
    assert r.returncode == 2 and r.stderr.strip().endswith(f"Error: {message}"), r.stderr
    assert "pydantic" not in mods


def test_option_values_reach_the_command_converted() -> None:
    import typer
    import typer.main

    from controller.launch.coerce import install

    app = typer.Typer()
    got: dict[str, object] = {}

    @app.command()
    def cmd(name: str = typer.Argument(...), n: int = typer.Option(3, "-n"), ratio: float = typer.Option(0.5),
            gpu: list[int] = typer.Option(None, "--gpu"), out: Path = typer.Option(Path("x"), "-o"),
            colour: str | None = typer.Option(None), flag: bool | None = typer.Option(None, "--flag/--no-flag"),
            grace: float = typer.Option(1.0, min=0, max=10)) -> None:
        got.update(name=name, n=n, ratio=ratio, gpu=gpu, out=out, colour=colour, flag=flag, grace=grace)

    command = typer.main.get_command(app)
    assert install(command) == 11  # the eight parameters, --install- and --show-completion, --help
    command(["r1", "-n", " 007", "--ratio", "2", "--gpu", "1", "--gpu", "2", "-o", "a/b", "--no-flag",
             "--grace", "10"], standalone_mode=False)
    assert got == {"name": "r1", "n": 7, "ratio": 2.0, "gpu": [1, 2], "out": Path("a/b"), "colour": None,
                   "flag": False, "grace": 10.0}
    assert type(got["ratio"]) is float
    command(["r2"], standalone_mode=False)
    assert got == {"name": "r2", "n": 3, "ratio": 0.5, "gpu": None, "out": Path("x"), "colour": None, "flag": None,
                   "grace": 1.0}
    for bad, message in ((["--grace", "11"], "must be <= 10, not 11"), (["-n", "x"], "'x' is not an integer")):
        with pytest.raises(Exception, match=message):
            command(["r3", *bad], standalone_mode=False)


def test_paramiko_is_imported_without_invoke_or_importlib_metadata_and_knows_its_version() -> None:
    """ssh._paramiko leaves out what paramiko's import does not need (invoke, importlib.metadata) and leaves
    nothing of that behind: its banner's version is the installed one, and both modules import as usual later."""
    code = (
        "import sys, json\n"
        "from controller.transport.ssh import _paramiko\n"
        "p = _paramiko()\n"
        "skipped = [m for m in ('invoke', 'importlib.metadata') if m in sys.modules]\n"
        "import importlib.metadata\n"
        "print(json.dumps([skipped, p.__version__, importlib.metadata.version('paramiko'),\n"
        "                  type(sys.modules['importlib.metadata']).__name__]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    skipped, banner, installed, kind = json.loads(r.stdout)
    assert skipped == [] and banner == installed and kind == "module", r.stdout


def test_importlib_metadata_imported_by_another_thread_while_paramiko_loads_works() -> None:
    """_Versions stands in for importlib.metadata in sys.modules while paramiko imports: another thread that
    imports importlib.metadata then (`import importlib.metadata; importlib.metadata.version(...)`) must get a
    working module, and two threads that both load paramiko must both get it."""
    code = (
        "import sys, threading, json\n"
        "from controller.transport.ssh import _paramiko\n"
        "out = []\n"
        "def other():\n"
        "    while type(sys.modules.get('importlib.metadata')).__name__ != '_Versions':\n"
        "        pass\n"
        "    try:\n"
        "        import importlib.metadata\n"
        "        out.append(importlib.metadata.version('paramiko'))\n"
        "    except Exception as e:\n"
        "        out.append(repr(e))\n"
        "def para():\n"
        "    try:\n"
        "        out.append(_paramiko().__version__)\n"
        "    except Exception as e:\n"
        "        out.append(repr(e))\n"
        "ts = [threading.Thread(target=other), threading.Thread(target=para), threading.Thread(target=para)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(json.dumps([sorted(out), 'invoke' in sys.modules]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                       timeout=60)
    out, invoke = json.loads(r.stdout)
    import paramiko

    assert out == [paramiko.__version__] * 3 and not invoke, r.stdout


def test_a_deploy_that_changes_nothing_leaves_out_what_it_does_not_use(tmp_path: Path) -> None:
    """Measured in bench/RESULTS.md (eighth pass): rich, tarfile, concurrent.futures and importlib.resources
    cost a warm deploy that changes nothing ~40 ms of its ~200 ms, and it uses none of them."""
    (tmp_path / "root").mkdir()
    (tmp_path / "a.txt").write_text("a\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"containers:\n  box:\n    transport: local\n    root: {tmp_path / 'root'}\n"
                   "payload:\n- src: a.txt\n  dest: /srv/a.txt\n")
    first, mods = modules(tmp_path, "-i", str(inv), "deploy", "box", "--allow-dirty")
    assert first.returncode == 0 and "deployed 1 of 1" in first.stdout, first.stdout + first.stderr
    assert "tarfile" in mods  # what travels is a tar
    again, mods = modules(tmp_path, "-i", str(inv), "deploy", "box", "--allow-dirty")
    assert again.returncode == 0 and "up to date" in again.stdout, again.stdout + again.stderr
    assert not {"rich", "tarfile", "concurrent.futures", "importlib.resources", "statistics"} & mods


def test_status_loads_no_launch_machinery() -> None:
    code = ("import sys, controller.cli.metrics, controller.commands.monitor\n"
            "print(' '.join(sorted(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    mods = set(r.stdout.split())
    assert "controller.commands.reconcile" in mods  # (it does load the run-state requests)
    assert not {"controller.core.envlock", "controller.commands.environment", "controller.commands.envprobe",
                "controller.commands.deploy", "controller.commands.pins", "controller.commands.launcher",
                "controller.commands.preflight", "statistics", "rich"} & mods
