"""Shell completion: `ctl --install-completion` in a real bash, and typer's completion protocol (the variables
its scripts set) answered by ctl's entry point with the names of the inventory and the registry: containers,
groups, hosts, runs, commands and options, for bash, zsh, fish and PowerShell. How fast: bench/completion.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from controller.launch import specgen
from controller.launch.compspec import SPEC
from controller.registry import Registry
from tests.conftest import REPO, bin_dir

HEAVY = ("typer", "click", "rich", "pydantic", "paramiko", "jinja2", "proxmoxer", "matplotlib", "torch", "requests",
         "controller.registry", "controller.inventory", "controller.commands", "dataclasses")


@pytest.fixture
def world(tmp_path: Path) -> dict[str, str]:
    """An inventory (two hosts, four containers, a group) and a registry of runs; the environment ctl runs in."""
    inv = {"hosts": {"pve1": {"address": "127.0.0.2"}, "pve2": {"address": "127.0.0.3"}},
           "containers": {"ct200": {"host": "pve1", "vmid": 200, "transport": "pct"},
                          "ct201": {"host": "pve1", "vmid": 201, "transport": "pct"},
                          "ct300": {"host": "pve2", "vmid": 300, "transport": "pct"},
                          "loc": {"transport": "local", "root": str(tmp_path / "root")}},
           "groups": {"gpus": ["ct200", "ct201"]}}
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inv))
    (tmp_path / "other.yaml").write_text(yaml.safe_dump({"containers": {"elsewhere": {"transport": "local",
                                                                                      "root": "/tmp"}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CTL_", "_CTL_", "COMP_", "_TYPER_"))}
    env.update(CTL_STATE_DIR=str(tmp_path / "state"), CTL_CONFIG=str(tmp_path / "no-config.yaml"),
               PYTHONPATH=str(REPO), HOME=str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    os.environ["CTL_STATE_DIR"] = env["CTL_STATE_DIR"]
    try:
        reg = Registry()
        for name, ct in (("fresh5", "ct200"), ("fresh6", "ct200"), ("fresh7", "ct201"), ("good1", "loc")):
            reg.claim_run(name, ct)
        reg.close()
    finally:
        del os.environ["CTL_STATE_DIR"]
    return {**env, "PWD": str(tmp_path)}


def tab(env: dict[str, str], line: str, shell: str = "bash", **extra: str) -> subprocess.CompletedProcess[str]:
    """What the shell's completion script runs for `line` (the cursor at its end): ctl with typer's variables."""
    e = {**env, "_CTL_COMPLETE": f"complete_{shell}", **extra}
    if shell == "bash":
        words = line.split(" ")
        e.update(COMP_WORDS=" ".join(words), COMP_CWORD=str(len(words) - 1))
    else:
        e["_TYPER_COMPLETE_ARGS"] = line
    return subprocess.run([sys.executable, "-m", "controller"], capture_output=True, text=True, env=e,
                          cwd=env["PWD"], timeout=60)


def names(env: dict[str, str], line: str) -> list[str]:
    r = tab(env, line)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout.split("\n") if r.stdout else []


def test_names_come_from_the_inventory_and_the_registry(world: dict[str, str]) -> None:
    assert sorted(names(world, "ctl deploy ")) == ["ct200", "ct201", "ct300", "gpus", "loc"]  # containers, groups
    assert names(world, "ctl deploy ct2") == ["ct200", "ct201"]
    assert sorted(names(world, "ctl status ct200 ")) == ["ct200", "ct201", "ct300", "gpus", "loc"]  # variadic
    assert names(world, "ctl deploy --json ct3") == ["ct300"]  # a flag ctl takes anywhere does not count
    assert sorted(names(world, "ctl launch ")) == ["ct200", "ct201", "ct300", "loc"]  # one container: no groups
    assert names(world, "ctl show ") == ["good1", "fresh7", "fresh6", "fresh5"]  # newest first
    assert names(world, "ctl show fresh") == ["fresh7", "fresh6", "fresh5"]
    assert names(world, "ctl show ct200/") == ["ct200/fresh6", "ct200/fresh5"]
    assert names(world, "ctl diff fresh5 fresh") == ["fresh7", "fresh6", "fresh5"]  # the second run
    assert names(world, "ctl metrics export fresh5 fresh6 f") == ["fresh7", "fresh6", "fresh5"]
    assert names(world, "ctl tail ct20") == ["ct200", "ct201"]  # a container, or once `/` is typed, a run
    assert names(world, "ctl tail ct201/") == ["ct201/fresh7"]
    assert names(world, "ctl tail ct200 --run ") == ["good1", "fresh7", "fresh6", "fresh5"]
    assert names(world, "ctl env diff good1 ") == ["good1", "fresh7", "fresh6", "fresh5", "ct200", "ct201", "ct300",
                                                  "loc"]
    assert names(world, "ctl mux stop ") == ["pve1", "pve2"]
    assert names(world, "ctl inventory discover --host pve") == ["pve1", "pve2"]
    assert names(world, "ctl -i other.yaml deploy ") == ["elsewhere"]  # -i names the inventory completed from
    assert names(world, "ctl --inventory=other.yaml ping ") == ["elsewhere"]
    assert names(world, "ctl -i missing.yaml deploy ") == []  # nothing to offer, and no error in the shell
    assert names(world, "ctl snapshot create ct200 ") == []  # a new snapshot's name: nothing to offer
    assert names(world, "ctl plot fresh5 -o ") == []  # an option's value: the shell completes file names
    assert names(world, "ctl dashboard --port ") == []


def test_commands_and_options_come_from_the_command_tree(world: dict[str, str]) -> None:
    assert names(world, "ctl st") == ["status", "stop", "store"]
    assert names(world, "ctl metrics ") == ["export", "pull"]
    assert names(world, "ctl metrics export --fo") == ["--force", "--format"]
    assert names(world, "ctl dashboard --b") == ["--bind"]
    assert "--install-completion" in names(world, "ctl --")
    assert names(world, "ctl status --j") == ["--json"]
    assert names(world, "ctl nosuch ") == []


def test_the_other_shells_get_their_formats(world: dict[str, str]) -> None:
    zsh = tab(world, "ctl show fresh", "zsh")
    assert zsh.stdout == "_arguments '*: :((\"fresh7\"\n\"fresh6\"\n\"fresh5\"))'"
    assert tab(world, "ctl show zzz", "zsh").stdout == "_files"
    fish = tab(world, "ctl deploy ct2", "fish", _TYPER_COMPLETE_FISH_ACTION="get-args")
    assert fish.stdout == "ct200\nct201"
    assert tab(world, "ctl deploy ct2", "fish", _TYPER_COMPLETE_FISH_ACTION="is-args").returncode == 0
    assert tab(world, "ctl deploy zz", "fish", _TYPER_COMPLETE_FISH_ACTION="is-args").returncode == 1
    ps = tab(world, "ctl mux stop pve2", "powershell", _TYPER_COMPLETE_WORD_TO_COMPLETE="pve2")
    assert ps.stdout == "pve2::: "
    bad = tab(world, "ctl ", "tcsh")
    assert bad.returncode == 1 and "unsupported completion instruction" in bad.stderr


def test_the_answer_imports_nothing_heavy(world: dict[str, str]) -> None:
    """A TAB pays for the inventory's YAML and a SQLite query, not for typer, pydantic, paramiko and the rest."""
    code = ("import os, sys\n"
            "from controller.launch.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"sys.stderr.write(repr(sorted(m for m in sys.modules if m.startswith({HEAVY!r}))))\n")
    for line in ("ctl show f", "ctl deploy ", "ctl st"):
        e = {**world, "_CTL_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(line.split(" ")) - 1)}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=world["PWD"],
                           timeout=60)
        assert r.stdout and r.stderr == "[]", (line, r.stderr)


def test_typers_own_answer_agrees(world: dict[str, str]) -> None:
    """The app's autocompletion callbacks are the same functions: typer's path (the whole command tree) gives the
    same names, so the generated spec and the app cannot drift apart unseen."""
    for line in ("ctl show fresh", "ctl deploy ct", "ctl mux stop ", "ctl st"):
        e = {**world, "_CTL_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(line.split(" ")) - 1)}
        typer_path = subprocess.run([sys.executable, "-c", "from controller.launch.main import _main; _main()"],
                                    capture_output=True, text=True, env=e, cwd=world["PWD"], timeout=60)
        assert typer_path.stdout.split() == names(world, line), line


def test_the_spec_is_the_apps_command_tree() -> None:
    assert specgen.build_spec() == SPEC, "run `python -m controller.launch.specgen --write` after changing a command"


ORPHAN = """
import os, subprocess, sys, time
import shellingham
parent = os.getpid()
if os.fork():
    os._exit(0)  # the child goes on as an orphan: no shell among its parents, as under a CI runner or cron
deadline = time.monotonic() + 10
while os.getppid() == parent and time.monotonic() < deadline:
    time.sleep(0.01)
try:
    shell = shellingham.detect_shell()[0]
except shellingham.ShellDetectionFailure:
    shell = "-"
r = subprocess.run(sys.argv[2:], capture_output=True, text=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{r.returncode} {shell}\\n{r.stdout}{r.stderr}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
"""


def test_completion_without_a_detectable_shell(world: dict[str, str], tmp_path: Path) -> None:
    """With no shell among its parents, `--install-completion` alone asks for the shell in one line (typer says
    'Shell None is not supported'), and `--install-completion bash` installs for bash (typer ignored the name)."""
    def orphan(*args: str) -> tuple[int, str, str]:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        parent = subprocess.Popen([sys.executable, "-c", ORPHAN, str(out), sys.executable, "-m", "controller", *args],
                                  env=world, cwd=world["PWD"])
        parent.wait(timeout=30)
        for _ in range(600):
            if out.exists():
                head, text = out.read_text().split("\n", 1)
                code, shell = head.split(" ")
                return int(code), shell, text
            time.sleep(0.05)
        raise AssertionError(f"ctl {' '.join(args)} never answered")

    code, shell, text = orphan("--install-completion")
    if shell == "-":
        assert code == 2 and text.count("\n") == 1 and "name it: ctl --install-completion bash" in text, text
        assert not (Path(world["HOME"]) / ".bash_completions").exists()
    else:  # this machine's process 1 (or a subreaper) is itself a shell: detection works even for an orphan
        assert code == 0 and f"{shell} completion installed" in text, text
    code, _, text = orphan("--install-completion", "bash")
    assert code == 0 and "bash completion installed" in text, text
    assert "_CTL_COMPLETE=complete_bash" in (Path(world["HOME"]) / ".bash_completions" / "ctl.sh").read_text()
    code, _, text = orphan("--show-completion", "tcsh")
    assert code == 2 and "'tcsh': not a shell ctl completes" in text, text


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_install_completion_in_a_real_bash(world: dict[str, str], tmp_path: Path) -> None:
    """`ctl --install-completion bash` writes the script and sources it from ~/.bashrc; bash's own completion
    machinery (complete -F) then asks ctl, through a `ctl` found on PATH as an operator's would be."""
    path = bin_dir(tmp_path, {"ctl": f"#!/bin/sh\nexec {sys.executable} -m controller \"$@\"\n"})
    env = {**world, "PATH": f"{path}:{world.get('PATH', '/usr/bin:/bin')}", "SHELL": "/bin/bash"}
    r = subprocess.run(["ctl", "--install-completion", "bash"], capture_output=True, text=True, env=env,
                       cwd=world["PWD"], timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    home = Path(world["HOME"])
    script = home / ".bash_completions" / "ctl.sh"
    assert "_CTL_COMPLETE=complete_bash" in script.read_text()
    assert str(script) in (home / ".bashrc").read_text() or ".bash_completions/ctl.sh" in (home / ".bashrc").read_text()
    probe = ('source ~/.bashrc; COMP_WORDS=(ctl show ct200/); COMP_CWORD=2; '
             'f=$(complete -p ctl | sed -E "s/.*-F ([^ ]+) .*/\\1/"); "$f" ctl; printf "%s\\n" "${COMPREPLY[@]}"')
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env, cwd=world["PWD"], timeout=60)
    assert out.stdout.split() == ["ct200/fresh6", "ct200/fresh5"], out.stdout + out.stderr
    shown = subprocess.run(["ctl", "--show-completion", "bash"], capture_output=True, text=True, env=env,
                           cwd=world["PWD"], timeout=60)
    assert shown.returncode == 0 and "complete -o default -F _ctl_completion ctl" in shown.stdout
