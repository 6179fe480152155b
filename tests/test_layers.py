"""The layers of controller/ stay apart (docs/concepts/layout.md), checked on the source's imports.

launch starts a command line, cli renders, commands decide, remote speaks to the agent, transport moves bytes,
core is pure; the bottom (errors, names, settings, lifecycle, inventory, registry, lookup, ...) is usable by all.
Arrows point down only, and there is no import cycle anywhere in controller/ (a cycle is two modules that can
only be understood together). web (the dashboard's HTTP server and page) renders too, beside cli: it is given
what to show (commands' Board, through a Protocol) and imports no layer that could reach a host.

Inside commands/, verb modules (one per verb group) never import each other: they share the modules in SHARED
(fan-out, pins, the environment probe, preflight, reconciliation, starting and stopping runs, metrics and
verdicts, notification sinks), which import only each other. runbook.py is the one module above the verbs: a
runbook step is a verb, so it binds step kinds to them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "controller"
BOTTOM = {"errors", "names", "settings", "lifecycle", "inventory", "registry", "scope", "schema", "yamlpos", "lookup",
          "files", "farside"}
LAYERS = ["launch", "cli", "web", "commands", "remote", "transport", "core"]
# What each layer may import from controller/ (besides the bottom and itself).
ALLOWED = {
    "launch": {"cli", "commands", "core", "transport"},
    "cli": {"web", "commands", "core"},
    "web": {"core"},
    "commands": {"remote", "transport", "core"},
    "remote": {"transport"},
    "transport": set(),
    "core": set(),
    "bottom": set(),
}
# The few imports across that the rules above refuse, each with why it is right.
EXCEPTIONS = {
    # the command's connection pool: cli/app.py is the one cli module that builds connections
    ("cli/app.py", "transport"),
    # `ctl mux status|stop` lists and stops the command servers: the one verb about the start-up machinery itself
    ("cli/mux.py", "launch"),
}
# The parts of the programs that run over there import nothing of ctl: joined, they travel alone over an exec's
# stdin (controller/farside/__init__.py, the loader, is ctl's own and imports nothing of it either).
STANDALONE = {p.relative_to(PKG).as_posix() for p in (PKG / "farside").rglob("*.py")} - {"farside/__init__.py"}
# commands/ modules that verb modules may import (see the module doc); the rest are verb modules.
SHARED = {"fanout", "pins", "envprobe", "preflight", "gpupreflight", "reconcile", "launcher", "monitor", "notify"}
COMPOSERS = {"runbook"}


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


def module_name(path: Path, pkg: Path = PKG) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(sources: list[Path], pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the modules of the package it imports (`from a import b` counts b when b is a module)."""
    mods = {module_name(p, pkg): p for p in sources}

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for _line, dotted in imports(p):
            t = resolve(dotted)
            if t is not None and t != m and not m.startswith(t + "."):  # a package's own __init__ is no edge back
                edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_every_module_sits_in_a_layer() -> None:
    loose = [p.relative_to(PKG).as_posix() for p in SOURCES
             if p.parent == PKG and p.stem not in BOTTOM | {"__init__", "__main__"}]
    assert not loose, f"modules outside the layers: {loose}"


def test_no_import_cycles() -> None:
    assert cycles(graph(SOURCES)) == []


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
        if theirs is None or theirs == mine or (theirs == "bottom" and mine != "bottom"):
            continue
        if theirs not in ALLOWED[mine] and (rel, theirs) not in EXCEPTIONS:
            bad.append(f"{rel}:{line} imports {dotted} ({mine} -> {theirs})")
    assert not bad, "\n".join(bad)


def sideways(sources: list[Path], pkg: Path = PKG) -> list[str]:
    """commands/ imports that break the rule of the module doc."""
    bad = []
    for path in sources:
        rel = path.relative_to(pkg).as_posix()
        if not rel.startswith("commands/") or path.stem == "__init__":
            continue
        me = path.stem
        for line, dotted in imports(path):
            parts = dotted.split(".")
            if parts[:2] != ["controller", "commands"] or len(parts) < 3 or parts[2] == me:
                continue
            other = parts[2]
            if not (pkg / "commands" / f"{other}.py").is_file():
                continue  # a name imported from the package itself, e.g. `from controller.commands import x`
            if other in SHARED or me in COMPOSERS:
                continue
            bad.append(f"{rel}:{line} imports commands.{other}: a verb module; move what both need to a shared "
                       "module")
    return sorted(set(bad))


def test_commands_do_not_reach_sideways() -> None:
    assert sideways(SOURCES) == []
    assert {p.stem for p in (PKG / "commands").glob("*.py")} >= SHARED | COMPOSERS  # no stale names


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
    # launch/early.py builds one only to begin starting the sessions the command's own pool (cli/app.py) will use
    assert sorted(builders) == ["cli/app.py", "launch/early.py"], builders


def test_libraries_stay_in_their_layers() -> None:
    """paramiko and proxmoxer in transport, typer in cli and launch (the entry point builds the click command),
    rich in cli, a listening server in web, torch nowhere."""
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
                if top in ("typer", "click") and not rel.startswith(("cli/", "launch/")):
                    bad.append(f"{rel} imports {m}")
                if top == "rich" and not rel.startswith("cli/"):
                    bad.append(f"{rel} imports {m}")
                if top == "torch":
                    bad.append(f"{rel} imports torch")
                if m in ("http.server", "socketserver") and not rel.startswith("web/"):
                    bad.append(f"{rel} imports {m}: a listening server belongs in web/")
    assert not bad, "\n".join(bad)


def test_no_module_is_a_monolith() -> None:
    """A module over 900 lines holds more than one idea (the far side's programs are written in parts)."""
    big = {p.relative_to(PKG).as_posix(): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 900
           and p.name != "compspec.py"}  # generated
    assert big == {}


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The layering test itself can fail: a core module importing transport is reported, a cycle is found, a verb
    module importing another verb module is refused."""
    f = tmp_path / "bad.py"
    f.write_text("from controller.transport.pool import Pool\nfrom controller import errors\n")
    found = imports(f)
    assert (1, "controller.transport.pool") in found
    assert target_layer("controller.transport.pool") == "transport" not in ALLOWED["core"]
    assert target_layer("controller.commands.dashboard") == "commands" not in ALLOWED["web"]
    assert target_layer("controller.launch.main") == "launch" not in ALLOWED["cli"]
    pkg = tmp_path / "controller"
    (pkg / "commands").mkdir(parents=True)
    for name, text in {"__init__": "", "commands/__init__": "", "commands/a": "from controller.commands import b\n",
                       "commands/b": "from controller.commands.a import x\n",
                       "commands/fanout": "from controller.commands import a\n"}.items():
        (pkg / f"{name}.py").write_text(text)
    srcs = sorted(pkg.rglob("*.py"))
    assert cycles(graph(srcs, pkg)) == [["controller.commands.a", "controller.commands.b"]]
    assert len(sideways(srcs, pkg)) == 3  # a -> b, b -> a, and the shared fanout -> the verb a
