"""The host relay's compiled code kept on the host (BOOT from controller/farside/__init__.py, hostrelay.py
keep_compiled), as the agent keeps its own in a container: written once after the hello, read back by the next
session's relay, never taken from a file that someone else could have written, and old ones pruned. The relay runs
here as it runs on a host (python3 -I -S -c BOOT N, its source on stdin); CTL_AGENT_CODE_DIR stands for /run/ctl."""

from __future__ import annotations

import hashlib
import marshal
import os
import subprocess
import time
import types
from pathlib import Path

from controller import farside
from controller.transport.relay import BOOT, relay_source

COMPILED_KEEP = farside.load("relay").COMPILED_KEEP

PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"


def start(code_dir: Path) -> subprocess.CompletedProcess[bytes]:
    """One relay start: its hello, then the end of its input ends it."""
    src = relay_source()
    return subprocess.run([PY, "-I", "-S", "-c", BOOT, str(len(src))], input=src, capture_output=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "CTL_AGENT_CODE_DIR": str(code_dir)})


def kept(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("relay-*") if not p.name.endswith(".tmp"))


def test_the_relay_keeps_its_compiled_code_and_reads_it_back(tmp_path: Path) -> None:
    d = tmp_path / "run-ctl"
    r = start(d)
    assert r.returncode == 0 and r.stdout.startswith(b"H"), r.stderr
    (path,) = kept(d)
    assert path.name.startswith("relay-" + hashlib.sha256(relay_source()).hexdigest()[:32] + "-")
    assert os.stat(d).st_mode & 0o777 == 0o700 and os.stat(path).st_mode & 0o777 == 0o600
    assert isinstance(marshal.loads(path.read_bytes()), types.CodeType)

    # the next start runs what is kept (that is the point): this one only leaves a mark
    mark = tmp_path / "ran"
    planted = marshal.dumps(compile(f"open({str(mark)!r}, 'w').write('x')", "planted", "exec"))
    path.write_bytes(planted)
    start(d)
    assert mark.exists()
    mark.unlink()

    # ... and never a copy others could have written: the source is compiled and the copy replaced
    path.write_bytes(planted)
    os.chmod(path, 0o620)
    r = start(d)
    assert r.stdout.startswith(b"H") and not mark.exists()
    assert os.stat(path).st_mode & 0o777 == 0o600 and isinstance(marshal.loads(path.read_bytes()), types.CodeType)


def test_a_directory_others_may_enter_gets_nothing(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert start(d).stdout.startswith(b"H")
    assert kept(d) == []


def test_old_relays_and_abandoned_parts_are_pruned(tmp_path: Path) -> None:
    d = tmp_path / "run-ctl"
    d.mkdir(mode=0o700)
    now = time.time()
    for n in range(COMPILED_KEEP + 2):  # other ctl versions' relays, older than this one
        old = d / f"relay-{n:032x}-30b02f0"
        old.write_bytes(b"x")
        os.utime(old, (now - 1000 + n, now - 1000 + n))
    stale, young = d / "relay-dead.123.tmp", d / "relay-writing.124.tmp"
    for p, age in ((stale, 7200), (young, 5)):
        p.write_bytes(b"partial")
        os.utime(p, (now - age, now - age))
    agent = d / "agent-0000-30b02f0"  # the agent's are the agent's to prune
    agent.write_bytes(b"x")
    os.utime(agent, (1, 1))
    assert start(d).returncode == 0
    ours = "relay-" + hashlib.sha256(relay_source()).hexdigest()[:32]
    names = {p.name for p in kept(d)}
    newest_old = {f"relay-{n:032x}-30b02f0" for n in range(COMPILED_KEEP + 2)[-(COMPILED_KEEP - 1):]}
    assert len(names) == COMPILED_KEEP and newest_old < names and any(n.startswith(ours) for n in names)
    assert not stale.exists() and young.exists() and agent.exists()
