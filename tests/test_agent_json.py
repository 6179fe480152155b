"""The agent's json (controller/farside/agent/, _Json): the C accelerator's scanner and encoder without importing
json, so every answer and every reading must be exactly json's, errors included."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

from controller import farside
from controller.remote.client import agent_source
from tests.conftest import REPO
from tests.relay_fakes import json_values

agent_mod = farside.load("agent")

AJ = agent_mod._Json()

values = json_values


@settings(max_examples=300, deadline=None)
@given(values)
def test_dumps_and_loads_are_jsons(v: object) -> None:
    assert AJ.dumps(v) == json.dumps(v)
    text = json.dumps(v)
    assert AJ.loads(text) == json.loads(text)
    assert AJ.loads(f" \n\t{text}\r\n ") == v or v != v  # whitespace around a document, as json allows


def test_options_files_and_non_finite_numbers_are_jsons() -> None:
    doc = {"b": [1, 2.5, None], "a": {"z": True}}
    assert AJ.dumps(doc, indent=2, sort_keys=True) == json.dumps(doc, indent=2, sort_keys=True)
    assert AJ.dumps({"p": object()}, default=str).startswith('{"p": "<object object')
    assert AJ.dumps([math.inf, -math.inf]) == "[Infinity, -Infinity]"
    assert math.isnan(AJ.loads("NaN")) and AJ.loads("[-Infinity]") == [-math.inf]
    f = io.StringIO()
    AJ.dump(doc, f)
    assert AJ.load(io.StringIO(f.getvalue())) == doc
    assert AJ.loads(b'{"x": 1}') == {"x": 1}  # bytes: json's own detection of the encoding
    assert AJ.dumps("\u00e9\n") == json.dumps("\u00e9\n")


@pytest.mark.parametrize("bad", ["", "  ", "{", "{not json", "{\"a\"", '{"a": 1} x', "[1,]", "nul", '{"a" 1}', "1 2"])
def test_bad_documents_raise_jsons_error(bad: str) -> None:
    with pytest.raises(json.JSONDecodeError) as ours:
        AJ.loads(bad)
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(bad)
    assert (ours.value.msg, ours.value.pos) == (theirs.value.msg, theirs.value.pos)


def test_bad_documents_raise_jsons_error_where_json_was_never_imported() -> None:
    """The C scanner raises its errors through json.decoder, which an agent has not imported: json's own error
    still comes out, not a SystemError."""
    code = ("import sys;from controller import farside;a=farside.load('agent')\n"
            "assert 'json' not in sys.modules\n"
            "for bad in ('{not json', '{\"a\"', '[1,'):\n"
            " try:a.json.loads(bad)\n"
            " except ValueError as e:print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.stdout.splitlines() == [
        "JSONDecodeError Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        "JSONDecodeError Expecting ':' delimiter: line 1 column 5 (char 4)",
        "JSONDecodeError Expecting value: line 1 column 4 (char 3)"], r.stdout + r.stderr


def test_what_json_cannot_encode_is_refused_as_json_refuses_it() -> None:
    for v in ({"s": {1, 2}}, [b"bytes"]):
        with pytest.raises(TypeError) as ours:
            AJ.dumps(v)
        with pytest.raises(TypeError) as theirs:
            json.dumps(v)
        assert str(ours.value) == str(theirs.value)
    AJ.dumps([1])  # an encoder that failed leaves nothing behind: the next call is not a "circular reference"
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        AJ.dumps(loop)
    assert AJ.dumps([loop[:0]]) == "[[]]"


def _imports_of(verb: str, arg: str, cwd: Path) -> tuple[bytes, list[str]]:
    """What the agent prints for `verb arg`, and which of the modules it avoids it imported."""
    src = agent_source()
    r = subprocess.run([sys.executable, "-I", "-S", "-c",
                        "import sys;n=int(sys.argv[1]);src=sys.stdin.buffer.read(n);"
                        "g={'__name__':'__main__'};sys.argv=['-c']+sys.argv[1:];"
                        "e=None\ntry:exec(compile(src,'ctl-agent','exec'),g)\nexcept SystemExit as x:e=x\n"
                        "print('\\nMODS',','.join(m for m in ('json','re','enum','subprocess','shutil')"
                        " if m in sys.modules))",
                        str(len(src)), verb, arg], input=src, capture_output=True, cwd=cwd)
    out, _, mods = r.stdout.rstrip(b"\n").rpartition(b"\nMODS ")
    assert _, r.stdout + r.stderr
    return out, [m for m in mods.decode().split(",") if m]


def test_an_agent_that_says_hello_or_polls_imports_no_json_re_subprocess_or_shutil(tmp_path: Path) -> None:
    """What the changes are for: an agent start that answers hello (`ctl ping`) or polls a run (`ctl status`,
    `ctl supervise`: a tmux has-session per run) loads none of them: ~40 ms of CPU per container on Debian's
    Python 3.11, in every container a cold command reaches."""
    out, mods = _imports_of("hello", "{}", tmp_path)
    assert b'"ok": true' in out and mods == [], (out, mods)
    log = tmp_path / "r1.log"
    log.write_text("step=1 loss=2.0\n")
    (tmp_path / "r1.log.pid").write_text(str(os.getpid()))  # alive, and not the run's: an impostor
    poll = json.dumps({"root": "/", "max_bytes": 4096, "runs": [
        {"name": "r1", "log": str(log), "session": "ctl-test-no-such-session", "state": True,
         "read": {"offset": 0, "max_bytes": 4096}}]})
    out, mods = _imports_of("poll", poll, tmp_path)
    head = json.loads(out.split(b"\n", 1)[0])
    state = head["runs"][0]["state"]
    assert state["log_size"] == log.stat().st_size and "impostor" in state
    assert state["session"] is (False if shutil.which("tmux") else None)  # tmux asked, and said no such session
    assert mods == [], mods


@pytest.mark.parametrize("path", [None, "", "/usr/bin:/bin", ":/usr/bin", "/nonexistent"])
def test_the_agents_which_is_shutils(path: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The agent's _which (no shutil import) finds what shutil.which finds, for every PATH shape."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").write_text("")
    (tmp_path / "here").chmod(0o755)  # only an empty PATH entry (the current directory) finds it
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "tool").write_text("")
    (tmp_path / "adir" / "tool").chmod(0o755)
    if path is None:
        monkeypatch.delenv("PATH", raising=False)
    else:
        monkeypatch.setenv("PATH", path)
    for name in ("sh", "ls", "here", "adir", "no-such-tool", "adir/tool", "adir/none", "/bin/sh"):
        assert agent_mod._which(name) == shutil.which(name), (path, name)
