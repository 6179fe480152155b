"""The layers of controller/ stay apart (README, "How the code is laid out"), checked on the source's imports.

cli renders, commands decide, remote speaks to the agent, transport moves bytes, core is pure; the bottom
(errors, names, settings, lifecycle, inventory, registry) is usable by all. Arrows point down only.
web (the dashboard's HTTP server and page) renders too, beside cli: it is given what to show (commands'
Board, through a Protocol) and imports no layer that could reach a host.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "controller"
BOTTOM = {"errors", "names", "settings", "lifecycle", "inventory", "registry", "schema", "yamlpos"}
LAYERS = ["cli", "web", "commands", "remote", "transport", "core"]
# What each layer may import from controller/ (besides the bottom and itself).
ALLOWED = {
    "cli": {"web", "commands", "core", "transport", "remote"},
    "web": {"core"},
    "commands": {"remote", "transport", "core"},
    "remote": {"transport"},
    "transport": set(),
    "core": set(),
    "bottom": set(),
}
# The scripts that run over there import nothing of ctl: they travel alone over an exec's stdin.
STANDALONE = {"remote/agent.py", "remote/hostrelay.py", "remote/probe_env.py", "remote/probe_gpu.py",
              "remote/probe_host_gpu.py"}
# Reading those scripts' bytes (controller.remote.source) and the line that starts one (controller.remote.boot) is
# no use of the agent client: the transport's relay sends hostrelay.py's source to the host and starts it there.
RESOURCES = {"controller.remote", "controller.remote.source", "controller.remote.boot"}


def layer_of(rel: str) -> str:
    head = rel.split("/", 1)[0].removesuffix(".py")
    return head if head in LAYERS else "bottom"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every controller import, at module level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("controller"):
            names = [node.module] if node.module != "controller" else [f"controller.{a.name}" for a in node.names]
            if node.module != "controller":
                names += [f"{node.module}.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("controller")]
    return out


def target_layer(dotted: str) -> str | None:
    parts = dotted.split(".")
    if len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else ("bottom" if parts[1] in BOTTOM else None)


SOURCES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_sits_in_a_layer() -> None:
    loose = [p.relative_to(PKG).as_posix() for p in SOURCES
             if p.parent == PKG and p.stem not in BOTTOM | {"__init__", "__main__"}]
    assert not loose, f"modules outside the layers: {loose}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_imports_point_down(path: Path) -> None:
    rel = path.relative_to(PKG).as_posix()
    if rel in {"__main__.py"}:
        return
    mine = layer_of(rel)
    found = imports(path)
    if rel in STANDALONE:
        assert not found, f"{rel} runs remotely and must import nothing of ctl: {found}"
        return
    bad = []
    for line, dotted in found:
        theirs = target_layer(dotted)
        if theirs is None or theirs == mine or (theirs == "bottom" and mine != "bottom") or dotted in RESOURCES:
            continue
        if theirs not in ALLOWED[mine]:
            bad.append(f"{rel}:{line} imports {dotted} ({mine} -> {theirs})")
    assert not bad, "\n".join(bad)


def test_bottom_imports_only_bottom() -> None:
    bad = []
    for path in SOURCES:
        rel = path.relative_to(PKG).as_posix()
        if layer_of(rel) != "bottom" or rel in {"__main__.py", "__init__.py"}:
            continue
        bad += [f"{rel}:{line} imports {d}" for line, d in imports(path) if target_layer(d) not in (None, "bottom")]
    assert not bad, "\n".join(bad)


def test_only_the_cli_session_builds_a_pool() -> None:
    builders = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Pool":
                builders.append(path.relative_to(PKG).as_posix())
    # cli/early.py builds one only to begin starting the sessions the command's own pool (cli/app.py) will use
    assert sorted(builders) == ["cli/app.py", "cli/early.py"], builders


def test_libraries_stay_in_their_layers() -> None:
    """paramiko and proxmoxer in transport, typer and rich in cli, a listening server in web, torch nowhere."""
    bad = []
    for path in SOURCES:
        rel = path.relative_to(PKG).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for m in mods:
                top = m.split(".")[0]
                if top in ("paramiko", "proxmoxer") and not rel.startswith("transport/"):
                    bad.append(f"{rel} imports {m}")
                if top in ("typer", "rich") and not rel.startswith("cli/"):
                    bad.append(f"{rel} imports {m}")
                if top == "torch":
                    bad.append(f"{rel} imports torch")
                if m in ("http.server", "socketserver") and not rel.startswith("web/"):
                    bad.append(f"{rel} imports {m}: a listening server belongs in web/")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The layering test itself can fail: a core module importing transport is reported."""
    f = tmp_path / "bad.py"
    f.write_text("from controller.transport.pool import Pool\nfrom controller import errors\n")
    found = imports(f)
    assert (1, "controller.transport.pool") in found
    assert target_layer("controller.transport.pool") == "transport" not in ALLOWED["core"]
    assert target_layer("controller.commands.dashboard") == "commands" not in ALLOWED["web"]
