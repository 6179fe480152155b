"""The agent's own glob for checkpoint scans (controller/farside/agent/, _glob and _wild): the same paths as
glob.glob(recursive=True) on a real directory tree, hidden names, symlinks and names with wildcard characters in
them included; patterns it does not handle go to glob itself."""

from __future__ import annotations

import fnmatch
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import farside

agent_mod = farside.load("agent")

FILES = ["checkpoints/a.pt", "checkpoints/b.pth", "checkpoints/.x.pt", "checkpoints/star*.pt", "checkpoints/q?.pt",
         "checkpoints/weird\nname.pt", "checkpoints/step_1/model.pt", "checkpoints/step_1/opt.pt",
         "checkpoints/step_2/model.pt", "checkpoints/step_10/model.pt", "checkpoints/.hidden/model.pt",
         "checkpoints/deep/er/still/x.pt", "checkpoints/deep/model.pt", "other/model.pt", "model.pt"]

PATTERNS = ["checkpoints/**/*.pt", "**", "**/*.pt", "checkpoints/*.pt", "checkpoints/*", "checkpoints/.*",
            "checkpoints/step_?/model.pt", "checkpoints/step_*/*", "checkpoints/**/model.pt", "checkpoints/**",
            "checkpoints/**/**/*.pt", "checkpoints/a.pt", "checkpoints/nope.pt", "nope/**/*.pt", "*/*/*.pt",
            "checkpoints/*.p?", "checkpoints/**/.hidden/*.pt", "checkpoints/.hidden/*", "checkpoints/st*p_*/m*.pt",
            "checkpoints/**/deep/**/*.pt", "checkpoints/star*.pt", "checkpoints/q?.pt", "checkpoints/*name*",
            "checkpoints/dangling.pt", "checkpoints/a.pt/x", "checkpoints/link/*.pt", "checkpoints/*/model.pt",
            "*", "checkpoints/step_[12]/model.pt", "checkpoints//a.pt", "checkpoints/./a.pt", "checkpoints/"]


@pytest.fixture(scope="module", params=["run1", "run[1]*?"])  # glob's own characters in a run directory's name
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("glob") / request.param
    for f in FILES:
        p = root / f
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    (root / "checkpoints" / "link").symlink_to("step_1")
    (root / "checkpoints" / "dangling.pt").symlink_to("gone")
    return str(root)


def both(base: str, pattern: str) -> tuple[set[str], set[str]]:
    """The files each finds (the scan keeps only paths that stat as regular files). Compared on files, not on every
    path: glob itself yields a literal directory that does not exist ("deep/" for "deep/**") when the escaped
    directory before the pattern holds no `[`, `*` or `?`, and checks that it exists when it does."""
    ours = {os.path.relpath(p, base) for p in agent_mod._glob(base, pattern) if os.path.isfile(p)}
    theirs = {os.path.relpath(p, base) for p in glob.glob(os.path.join(glob.escape(base), pattern), recursive=True)
              if os.path.isfile(p)}
    return ours, theirs


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_paths_are_globs(base: str, pattern: str) -> None:
    ours, theirs = both(base, pattern)
    assert ours == theirs


def test_the_fixture_is_worth_comparing(base: str) -> None:
    """The default pattern finds checkpoints at several depths and through the symlink, and skips hidden ones."""
    ours, _ = both(base, "checkpoints/**/*.pt")
    assert {"checkpoints/a.pt", "checkpoints/deep/er/still/x.pt", "checkpoints/link/model.pt"} <= ours
    assert not any("hidden" in p or "/.x" in p for p in ours)


SEGMENTS = ["**", "*", "?", "*.pt", "step_*", "step_?", "model.pt", "checkpoints", ".*", "*p*", "deep", "a.pt",
            "link", "*?", "s*_1?"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4))
def test_any_pattern_of_these_parts_is_globs(base: str, parts: list[str]) -> None:
    ours, theirs = both(base, "/".join(parts))
    assert ours == theirs


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="ab.*?\n", max_size=8), st.text(alphabet="ab.*?", max_size=6))
def test_wild_is_fnmatchcase(name: str, pat: str) -> None:
    assert agent_mod._wild(name, pat) == fnmatch.fnmatchcase(name, pat)


def test_a_status_poll_imports_neither_glob_nor_hashlib(base: str, tmp_path: Path) -> None:
    """What the scan is for: an agent answering `ctl status` about checkpoints it was told of before loads no
    more than a hello does (glob brings re, fnmatch and enum; hashlib brings OpenSSL)."""
    log = tmp_path / "train.log"
    log.write_bytes(b"step=1 loss=2.0\n" * 100)
    known = {}
    for p in glob.glob(os.path.join(glob.escape(base), "checkpoints/**/*.pt"), recursive=True):
        if not os.path.isfile(p):
            continue
        st_ = os.stat(p)
        known[os.path.relpath(p, base)] = [st_.st_size, st_.st_mtime_ns, "0" * 64]
    args = {"root": "/", "log": str(log), "offset": 0, "ident": "1:2:3", "known": known,
            "checkpoints": {"dir": base, "glob": "checkpoints/**/*.pt"}}
    (tmp_path / "agent.py").write_bytes(farside.source("agent"))  # the agent as it ships, importable there
    code = (f"import sys; sys.argv = ['agent']; sys.path.insert(0, {str(tmp_path)!r});"
            f"import agent; head, data = agent._logread({args!r});"
            f"assert sorted(head['checkpoints']) == {sorted(known)!r}, head;"
            "print(' '.join(m for m in ('glob', 'fnmatch', 're', 'hashlib', '_hashlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
