"""The programs that run over there, joined from their parts (controller/farside/__init__.py): what ships is one
stdlib source that compiles, imports nothing of ctl, holds every part exactly once in the declared order, and is
the same bytes in every process (its sha256 keys the compiled code kept on the far side)."""

from __future__ import annotations

import ast
import builtins
import hashlib
import subprocess
import symtable
import sys
from pathlib import Path

import pytest

from controller import farside
from tests.conftest import REPO

PKG = Path(farside.__file__).parent
NAMES = sorted(farside.PROGRAMS)


def _relative(tree: ast.Module) -> list[ast.ImportFrom]:
    return [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.level]


def _defined(tree: ast.Module) -> set[str]:
    """The names a part binds at its top level (in an if/try too: the agent's and relay's fallbacks)."""
    names: set[str] = set()
    for top in tree.body:
        if isinstance(top, ast.ImportFrom) and top.level:
            continue
        nodes = [top] if isinstance(top, ast.FunctionDef | ast.ClassDef) else list(ast.walk(top))
        for n in nodes:
            if isinstance(n, ast.FunctionDef | ast.ClassDef):
                names.add(n.name)
            elif isinstance(n, ast.Import | ast.ImportFrom):
                names |= {(a.asname or a.name).split(".")[0] for a in n.names}
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
    return names


@pytest.mark.parametrize("name", NAMES)
def test_the_joined_source_compiles_and_imports_nothing_of_ctl(name: str) -> None:
    src = farside.source(name)
    compile(src, f"ctl-{name}", "exec")
    bad = []
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "controller"):
            bad.append(f"line {n.lineno}: from {'.' * n.level}{n.module or ''} import ...")
        elif isinstance(n, ast.Import):
            bad += [f"line {n.lineno}: import {a.name}" for a in n.names if a.name.split(".")[0] == "controller"]
    assert not bad, f"{name} ships imports of ctl or of its own parts: {bad}"


@pytest.mark.parametrize("name", NAMES)
def test_the_join_is_the_same_bytes_in_every_join_and_process(name: str) -> None:
    here = farside.source(name)
    again = farside.source.__wrapped__(name)  # a second join, past the process's cache
    assert again == here and again is not here
    code = f"import hashlib;from controller import farside;print(hashlib.sha256(farside.source({name!r})).hexdigest())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert other.stdout.strip() == hashlib.sha256(here).hexdigest()


def test_every_part_is_in_a_program_once() -> None:
    written = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")} - {"__init__.py"}
    listed = [rel for parts in farside.PROGRAMS.values() for rel in parts]
    assert written == set(listed), f"parts no program joins: {written - set(listed)}"
    for name, parts in farside.PROGRAMS.items():
        assert len(parts) == len(set(parts)), f"{name} joins a part twice: {parts}"
        src = farside.source(name)
        for rel in parts:
            shipped = farside._shipped(farside.part(rel))
            assert src.count(shipped) == 1, f"{name}: {rel} is not in the joined source exactly once"


@pytest.mark.parametrize("name", NAMES)
def test_the_join_leaves_out_the_relative_imports_and_nothing_else(name: str) -> None:
    """The joined statements are the parts' own, in order, less the `from .x import ...` lines."""
    want = [ast.dump(n) for rel in farside.PROGRAMS[name]
            for n in ast.parse(farside.part(rel)).body if not (isinstance(n, ast.ImportFrom) and n.level)]
    assert [ast.dump(n) for n in ast.parse(farside.source(name)).body] == want


@pytest.mark.parametrize("name", NAMES)
def test_a_part_uses_only_what_the_parts_before_it_define(name: str) -> None:
    """A relative import names an earlier part of the same program and names it defines; any other global a part
    reads is its own, imported there, or a builtin. So the declared order is one the joined source can run in."""
    parts = farside.PROGRAMS[name]
    defined: dict[str, set[str]] = {}
    bad = []
    for rel in parts:
        tree = ast.parse(farside.part(rel))
        mine = _defined(tree)
        here = rel.rsplit("/", 1)[0] if "/" in rel else ""
        seen: set[str] = set()
        for imp in _relative(tree):
            base = here.split("/")[: len(here.split("/")) - (imp.level - 1)] if here else []
            target = "/".join([*base, *(imp.module or "").split(".")]).strip("/") + ".py"
            if target not in defined:
                bad.append(f"{rel}:{imp.lineno} imports {target}, not a part joined before it")
                continue
            for a in imp.names:
                if a.name not in defined[target]:
                    bad.append(f"{rel}:{imp.lineno} imports {a.name}, which {target} does not define")
                seen.add(a.asname or a.name)
        unknown = _globals_read(farside.part(rel).decode(), rel) - mine - seen - set(dir(builtins))
        bad += [f"{rel} reads {n}, defined by no earlier part it imports" for n in sorted(unknown)]
        defined[rel] = mine
    assert not bad, "\n".join(bad)


def _globals_read(text: str, rel: str) -> set[str]:
    """The module-level names a part reads, at its top level or from inside its functions and classes."""
    out: set[str] = set()

    def walk(t: symtable.SymbolTable) -> None:
        for sym in t.get_symbols():
            if t.get_type() == "module":
                if sym.is_referenced() and not sym.is_assigned() and not sym.is_imported():
                    out.add(sym.get_name())
            elif sym.is_global() and sym.is_referenced():
                out.add(sym.get_name())
        for child in t.get_children():
            walk(child)

    walk(symtable.symtable(text, rel, "exec"))
    return out


def test_no_part_is_over_900_lines() -> None:
    long = {p.relative_to(PKG).as_posix(): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 900}
    assert not long, long


def test_the_loaded_program_is_the_joined_source() -> None:
    """What the tests import (farside.load) is the shipped source itself, not the parts as modules."""
    agent = farside.load("agent")
    assert agent.keep_compiled.__code__.co_filename == "ctl-agent"
    assert agent.__name__ != "__main__" and "serve" in vars(agent) and "_store_dirs" in vars(agent)
    assert farside.load("relay").keep_compiled.__code__ is not agent.keep_compiled.__code__


def test_ctl_names_the_relays_frame_kinds_by_its_letters() -> None:
    """transport/wire.py's Kind spells each frame kind as the relay does (the relay, stdlib and alone, keeps its
    letters): every letter the relay sends or reads has its name on ctl's side, and no name is a letter it lacks.
    R is the relay's own frame to a staying agent; STOP, ENDED and NOTHING are the session socket's."""
    from controller.transport.wire import Kind

    letters = {n.value for n in ast.walk(ast.parse(farside.source("relay"))) if isinstance(n, ast.Constant)
               and isinstance(n.value, bytes) and len(n.value) == 1 and n.value.isupper()}
    ours = {v for k, v in vars(Kind).items() if k.isupper()}
    assert len(ours) == len([k for k in vars(Kind) if k.isupper()]), "two kinds share a letter"
    assert letters - {b"R"} == ours - {Kind.STOP, Kind.ENDED, Kind.NOTHING}
