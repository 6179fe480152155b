"""The `local` target keeps the agent's compiled code under its own root, as a container does in its /run/ctl,
and never in the operator's own /run (controller/transport/local.py, BOOT in controller/remote/client.py)."""

from __future__ import annotations

import hashlib
import marshal
import os
import types
from pathlib import Path

from controller.remote.client import BOOT, Agent, agent_source
from controller.transport.local import LocalContainer


def _mine(d: Path, prefix: str) -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in d.glob(prefix + "*")} if d.is_dir() else {}


def test_the_local_target_keeps_the_compiled_agent_in_its_own_root(tmp_path: Path) -> None:
    prefix = "agent-" + hashlib.sha256(agent_source()).hexdigest()[:32] + "-"
    machine = Path("/run/ctl")
    before = _mine(machine, prefix)
    agent = Agent(LocalContainer("local", tmp_path / "ct"))
    for _ in range(2):  # the first compiles and keeps it, the second reads it back
        assert agent.call("hello", {})["ok"] is True
    (kept,) = (tmp_path / "ct" / "run" / "ctl").glob(prefix + "*")
    assert isinstance(marshal.loads(kept.read_bytes()), types.CodeType)
    assert os.stat(kept).st_mode & 0o777 == 0o600
    assert _mine(machine, prefix) == before  # the operator's /run: untouched
    # BOOT takes the variable out of the environment: what the agent starts (a training) never sees it
    probe = b"import os, sys\nsys.stdout.write(repr('CTL_AGENT_CODE_DIR' in os.environ))\n"
    res = LocalContainer("local", tmp_path / "ct").run(["python3", "-I", "-S", "-c", BOOT, str(len(probe)), "x"],
                                                        stdin=probe)
    assert (res.returncode, res.stdout) == (0, b"False"), res
