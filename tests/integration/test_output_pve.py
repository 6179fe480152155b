"""What containers say reaches the operator's terminal harmlessly and in bounded size, on the local Proxmox host:
escape sequences and rich markup from logs and agent errors are neutralised (`--json` keeps them raw), a log
whose last line is a tqdm `\\r` storm is tailed from a bounded window with lines cut, and a python3 in the
container that answers garbage is one `ctl: error: CT: ...` line, never a traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.core.loglines import CUT_OPEN, LINE_CAP
from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost

RAW = ("\x1b", "\x07", "\x9b", "\x9d", "\x90")  # ESC, BEL and the 8-bit CSI/OSC/DCS introducers
MARKUP = "[link=http://x]click[/link] [conceal]hidden[/conceal]"
# What the "training" prints: OSC 52 (clipboard), a window title, a screen clear, a cursor-position query
# (the terminal would type its answer into ctl's input), a lone BEL, a DCS string, 8-bit CSI, rich markup.
EVIL_SCRIPT = r"""#!/usr/bin/env bash
printf 'osc52 \033]52;c;aGFja2Vk\007 title \033]0;pwned\033\\ clear \033[2J query \033[6n bell \007 end\n'
printf 'dcs \033Pq#0;2;0;0;0\033\\ csi8 \302\233 2J done\n'
echo '""" + MARKUP + r"""'
echo 'step=1 loss=1.0 tok/s=100'
"""


def assert_harmless(text: str) -> None:
    for c in RAW:
        assert c not in text, (c, text)


def test_escape_sequences_and_markup_from_a_log_never_reach_the_terminal(pve_env: PveEnv) -> None:
    (pve_env.dir / "templates" / "evil.sh.j2").write_text(EVIL_SCRIPT)
    pve_env.write(payload=[{"template": "templates/evil.sh.j2", "dest": f"/root/{pve_env.tag}/start_training.sh",
                            "mode": "0755"}])
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    shown = [pve_env.ctl("launch", "ct200", "--run", "evil1", "-f"),
             pve_env.ctl("tail", "ct200", "--run", "evil1", "-n", "50"),
             pve_env.ctl("tail", "ct200", "--run", "evil1", "-f")]
    for r in shown:
        assert r.returncode == 0, r.stdout + r.stderr
        assert_harmless(r.stdout + r.stderr)
        assert MARKUP in r.stdout  # printed literally: no link, nothing hidden
        assert "osc52  title  clear  query  bell \\x07 end" in r.stdout  # sequences gone, the lone BEL visible
    log = pve_env.host.rootfs(200) / "workspace" / pve_env.tag / "train_stdout_evil1.log"
    assert b"\x1b]52;c;aGFja2Vk\x07" in log.read_bytes()  # the log itself is the training's, untouched


@pytest.fixture
def live_on_201(pve_env: PveEnv) -> Iterator[tuple[PveEnv, Path]]:
    """A live run on ct201 (for runs/status/tail); yields the host path where a fake python3 shadows the
    container's (its PATH starts with /sbin, a directory of its own); removed and the run stopped after."""
    pve_env.write(vars={**pve_env.base_extra["vars"], "steps": 100000, "interval": 0.2})
    pve_env.ctl("deploy", "ct201", "--allow-dirty", check=True)
    pve_env.ctl("launch", "ct201", "--run", "live1", check=True)
    fake = pve_env.host.rootfs(201) / "sbin" / "python3"
    try:
        yield pve_env, fake
    finally:
        fake.unlink(missing_ok=True)
        pve_env.ctl("stop", "live1", "--grace", "2")


BROKEN = {
    "garbage": "echo 'this is not json'",
    "missing-keys": """echo '{"ok": true}'""",
    "wrong-types": """echo '{"ok": true, "runs": 5, "text": 7, "size": "x", "files": "nope", "series_logs": 3,
      "offset": "0", "ident": 1, "length": "9", "started": "soon"}'""",
    "short-logread": r"""printf '{"ok": true, "length": 100, "offset": 0, "size": 100, "ident": "1:1:x"}\nabc'""",
    "hostile-stderr": r"""printf 'boom \033]52;c;aGk=\007 \033]0;t\007 \033[2J \033[6n \007 ' >&2
echo '[link=http://x]click[/link]' >&2
exit 1""",
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_agent_reply_is_one_line_naming_the_container(live_on_201: tuple[PveEnv, Path], kind: str) -> None:
    env, fake = live_on_201
    # A staying agent is started as `python3 ... serve`: this one writes the same junk instead of a hello, so the
    # session's relay runs each request as an exec of it. The launch's session (its staying agent is the real
    # python3) is ended first.
    serve = 'case " $* " in *" serve "*) ' + BROKEN[kind] + "\nexit 1;; esac\n"
    fake.write_text("#!/bin/sh\n" + serve + "cat >/dev/null\n" + BROKEN[kind] + "\n")
    fake.chmod(0o755)
    env.ctl("mux", "stop", check=True)
    for args in (("tail", "ct201", "--run", "live1"), ("tail", "ct201", "--run", "live1", "-f"),
                 ("launch", "ct201", "--run", "x1")):
        r = env.ctl(*args)
        lines = r.stderr.splitlines()
        assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("ctl: error: ct201"), (args, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr
        assert_harmless(r.stdout + r.stderr)
        if kind == "hostile-stderr":
            assert "[link=http://x]click[/link]" in r.stderr
    for args in (("runs", "ct201"), ("status", "ct201")):  # several containers: a warning per one not asked
        r = env.ctl(*args)
        assert "Traceback" not in r.stdout + r.stderr, r.stderr
        assert r.stderr and all(line.startswith("ctl: warning: ct201") for line in r.stderr.splitlines()), r.stderr
        assert_harmless(r.stdout + r.stderr)
    if kind == "hostile-stderr":  # --json keeps the container's text as it was
        doc = json.loads(env.ctl("status", "ct201", "--json").stdout)
        assert "\x1b]52;c;aGk=\x07" in doc[0]["error"]


def _finished_run(env: PveEnv, run: str) -> Path:
    env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    r = env.ctl("launch", "ct200", "--run", run, "-f")
    assert r.returncode == 0, r.stdout + r.stderr
    return env.host.rootfs(200) / "workspace" / env.tag / f"train_stdout_{run}.log"


def test_tail_of_a_huge_progress_line_is_bounded_and_cut(pve_env: PveEnv) -> None:
    log = _finished_run(pve_env, "tqdm1")
    with log.open("ab") as f:  # ~50 MB of tqdm redraws, no newline, the last one longer than the cap
        update = b"\r 50%%|" + b"#" * 90 + b"| %07d/1000000"
        for block in range(50):
            f.write(b"".join(update % (block * 10000 + i) for i in range(10000)))
        f.write(b"\rfinal " + b"Z" * 20000)
    assert log.stat().st_size > 50_000_000
    for args in (("-n", "5"), ("-n", "5", "-f")):
        r = pve_env.ctl("tail", "ct200", "--run", "tqdm1", *args)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        if "-f" in args:
            assert lines.pop() == "run tqdm1: finished, exit status 0"
        assert len(lines) == 5 and len(r.stdout) < 5 * (LINE_CAP + 100)
        assert lines[-2].endswith("| 0499999/1000000")  # the updates before it, one a line
        assert lines[-1] == "final " + "Z" * (LINE_CAP - 6) + f" ... [cut: {20006 - LINE_CAP} bytes]"


def test_tail_f_never_holds_more_than_a_line_cap_of_an_unfinished_line(pve_env: PveEnv) -> None:
    log = _finished_run(pve_env, "blob1")
    with log.open("ab") as f:
        f.write(b"B" * 3_000_000)  # one 3 MB line, no separator at all
    r = pve_env.ctl("tail", "ct200", "--run", "blob1", "-f", "-n", "-1")  # the whole log, through follow
    assert r.returncode == 0, r.stderr
    big = [line for line in r.stdout.splitlines() if line.startswith("BBB")]
    assert big == ["B" * LINE_CAP + CUT_OPEN.decode()]
    assert max(len(line) for line in r.stdout.splitlines()) <= LINE_CAP + 100


# A container that answers an agent request with far more than a reply may hold (256 MiB), through each way ctl
# reaches it: its own exec (no session, one container), the host relay (no session, two containers) and the
# persistent session. Run in a process of its own so that its peak memory says what was held.
_FLOOD = """
import json, os, sys
from controller.errors import CtlError
from controller.inventory import load
from controller.remote.client import Agent, agent_source
from controller.transport.pool import Pool

def peak():  # this process's high-water RSS in bytes (VmHWM: ru_maxrss would carry its parent's over the exec)
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

prog = "import sys,os\\nsys.stdin.buffer.read(int(sys.argv[1]))\\nb=b'x'*(1<<20)\\nfor _ in range(256): os.write(1,b)"
inv = load(sys.argv[1])
cts = [inv.container(n) for n in sys.argv[2:]]
with Pool(inv) as pool:
    pool.share_exec(cts)
    agent = Agent(pool.container(cts[0]))
    src = agent_source()
    agent.call("hello", {})  # connected, imports done: what grows from here is the reply
    before = peak()
    try:
        agent.exec("flood", ["python3", "-I", "-S", "-c", prog, str(len(src)), "flood"], src, 60, limit=1 << 20)
        error = None
    except CtlError as e:
        error = str(e)
    grown = peak() - before
    after = agent.call("hello", {})  # the transport still works
    # the control: with room for it all, the same reply is held whole (the measure sees it)
    whole = agent.exec("flood", ["python3", "-I", "-S", "-c", prog, str(len(src)), "flood"], src, 120,
                       limit=1 << 30)
    held = peak() - before
print(json.dumps({"error": error, "grown": grown, "after": after.get("ok"), "whole": len(whole.stdout),
                  "held": held}))
"""


@pytest.mark.parametrize(("persist", "cts"), [("0", ["ct200"]), ("0", ["ct200", "ct201"]), (None, ["ct200"])],
                         ids=["exec", "relay", "session"])
def test_a_reply_past_its_limit_is_stopped_as_it_arrives_on_every_path(pve_env: PveEnv, persist: str | None,
                                                                       cts: list[str]) -> None:
    import subprocess
    import sys

    env = dict(pve_env.env)
    if persist is not None:
        env["CTL_PERSIST"] = persist
    r = subprocess.run([sys.executable, "-c", _FLOOD, str(pve_env.inventory), *cts], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["error"] == ("ct200: agent flood: reply over 1,048,576 bytes refused (stopped there; the rest was "
                            "not read)"), doc
    assert doc["grown"] < 48 << 20, doc  # of 256 MiB sent: never held whole
    assert doc["after"] is True
    assert doc["whole"] == 256 << 20 and doc["held"] > 200 << 20, doc
