"""The host relay without json and subprocess (controller/farside/relay/: Proc, loads, dumps): its children
start, end and report as subprocess.Popen's would, and its documents read and write as json's. Real processes,
pipes and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings

from controller import farside
from controller.transport.relay import relay_source
from tests.relay_fakes import json_values

hostrelay = farside.load("relay")
Proc, TimeoutExpired, dumps, loads = hostrelay.Proc, hostrelay.TimeoutExpired, hostrelay.dumps, hostrelay.loads

PY = sys.executable


def run(argv: list[str], data: bytes = b"", env: dict[str, str] | None = None) -> tuple[int, bytes, bytes]:
    p = Proc(argv, env)
    p.stdin.write(data)
    p.stdin.close()
    out, err = p.stdout.read(), p.stderr.read()
    p.stdout.close()
    p.stderr.close()
    return p.wait(), out, err


def test_streams_and_exit_status_are_popens() -> None:
    code = "import sys; d = sys.stdin.buffer.read(); sys.stdout.buffer.write(d[::-1]); sys.stderr.write('e'); exit(7)"
    assert run([PY, "-c", code], b"abc") == (7, b"cba", b"e")
    p = subprocess.run([PY, "-c", code], input=b"abc", capture_output=True)
    assert (p.returncode, p.stdout, p.stderr) == (7, b"cba", b"e")


def test_a_signal_is_a_negative_status_and_the_relay_reports_128_plus_it() -> None:
    p = Proc([PY, "-c", "import time; time.sleep(30)"])
    assert p.poll() is None
    with pytest.raises(TimeoutExpired):
        p.wait(timeout=0.05)
    p.kill()
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert p.poll() == -signal.SIGKILL
    p.kill()  # reaped: no signal goes to a pid that may have been reused


def test_the_child_gets_sigpipe_back_at_its_default() -> None:
    """Python ignores SIGPIPE; a child of the relay (tar, cat, pct) must die of it as from a shell. What a program
    starts with ignored is in its /proc status (SigIgn, a mask: SIGPIPE is bit 12). Compared on signals 1-31:
    glibc's posix_spawn leaves its own two internal ones (32, 33) ignored, which no program sees (glibc installs
    its handlers for them at every start) and which Python's subprocess also leaves when it uses posix_spawn."""

    def ignored(status: bytes) -> int:
        return int(next(ln for ln in status.splitlines() if ln.startswith(b"SigIgn:")).split()[1], 16)

    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN  # this test's own Python, as the relay's
    ours = ignored(run(["cat", "/proc/self/status"])[1]) & 0x7FFFFFFF
    theirs = ignored(subprocess.run(["cat", "/proc/self/status"], capture_output=True).stdout) & 0x7FFFFFFF
    assert not ours & (1 << (signal.SIGPIPE - 1))
    assert ours == theirs


def test_no_descriptor_of_the_relay_leaks_into_a_child(tmp_path: Path) -> None:
    keep = os.open(tmp_path / "held", os.O_WRONLY | os.O_CREAT)  # what a relay holds: CLOEXEC, as Python opens it
    try:
        rc, out, _ = run([PY, "-c", "import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"])
    finally:
        os.close(keep)
    assert rc == 0
    assert json.loads(out)[:3] == [0, 1, 2] and keep not in json.loads(out)[3:]


def test_the_program_is_found_on_the_childs_path_as_subprocess_finds_it(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "tool").write_text("not executable")  # found first but refused: subprocess reports this one
    (second / "tool").write_text("#!/bin/sh\necho from-b\n")
    (second / "tool").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'nowhere'}:{second}"}
    assert run(["tool"], env=env) == (0, b"from-b\n", b"")
    assert run(["tool"], env={"PATH": f"{first}:{second}"}) == (0, b"from-b\n", b"")  # past the refused one
    for start in (lambda: Proc(["tool"], {"PATH": str(first)}),
                  lambda: subprocess.Popen(["tool"], env={"PATH": str(first)})):
        with pytest.raises(PermissionError):
            start()
    with pytest.raises(FileNotFoundError):
        Proc(["no-such-tool-here"], {"PATH": str(tmp_path)})
    with pytest.raises(FileNotFoundError):
        Proc([str(tmp_path / "missing")])


def test_a_child_the_relay_cannot_start_answers_127(tmp_path: Path) -> None:
    """Child (an S frame): one that cannot start says why on E and exits 127, as a shell would."""
    frames: list[tuple[bytes, int, bytes]] = []
    orig = hostrelay._emit
    hostrelay._emit = lambda kind, sid, data=b"": frames.append((kind, sid, data))  # type: ignore[assignment]
    try:
        hostrelay.Child(5, [str(tmp_path / "nothing-here")])
    finally:
        hostrelay._emit = orig  # type: ignore[assignment]
    assert frames[-1] == (b"X", 5, b"127")
    assert b"cannot start" in frames[0][2] and b"No such file" in frames[0][2]


def test_a_wait_from_two_threads_reaps_once() -> None:
    import threading

    p = Proc([PY, "-c", "import time; time.sleep(0.3); exit(3)"])
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(p.wait())) for _ in range(3)]
    for t in threads:
        t.start()
    while p.poll() is None:  # polls while the others block in wait
        time.sleep(0.01)
    for t in threads:
        t.join(10)
    assert got == [3, 3, 3] and p.returncode == 3


@settings(max_examples=300, deadline=None)
@given(json_values)  # the agent's own json is held to the same documents
def test_documents_read_and_write_as_jsons(v: object) -> None:
    assert dumps(v) == json.dumps(v)
    assert loads(json.dumps(v)) == v


@pytest.mark.parametrize("text", ["", " [1]", "[1] ", "[1, 2", "{\"a\": 1}x", "nul", "[NaN]", "\"\\ud800\""])
def test_what_json_refuses_it_refuses_in_jsons_words(text: str) -> None:
    try:
        want: object = json.loads(text)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            loads(text)
        assert str(got.value) == str(e)
        return
    assert json.dumps(loads(text)) == json.dumps(want)


def test_a_relay_start_imports_neither_json_nor_subprocess() -> None:
    """What this is for: the relay's imports, before its hello, are its own (json and subprocess bring re, enum,
    locale and selectors: ~17 ms of CPU of every session's start)."""
    src = relay_source()
    code = ("import sys; n = int(sys.argv[1]); g = {'__name__': 'relay'};"
            "exec(compile(sys.stdin.buffer.read(n), 'ctl-relay', 'exec'), g); g['main']();"
            "sys.stderr.write(' '.join(m for m in ('json', 'subprocess', 're', 'enum', 'locale') if m in sys.modules))")
    p = subprocess.run([PY, "-I", "-S", "-c", code, str(len(src))], input=src, capture_output=True, timeout=30)
    assert p.stdout.startswith(b"H"), p.stderr  # its hello; then the end of its input ended it
    assert p.stderr.decode().strip() == ""
