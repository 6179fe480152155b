"""A world for the command server's tests (tests/test_served.py, tests/test_harden_served.py): the installed `ctl`
script, a local inventory, and an environment of its own (runtime directory, state, config)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

CTL = Path(sys.executable).with_name("ctl")

class World:
    def __init__(self, tmp: Path, run: Path) -> None:
        self.tmp, self.run, self.ctl = tmp, run, [str(CTL)]
        self.root = tmp / "root"
        self.root.mkdir()
        (tmp / "a.txt").write_text("a\n")
        (tmp / "inventory.yaml").write_text(yaml.safe_dump({
            "containers": {"loc": {"transport": "local", "root": str(self.root)}},
            "payload": [{"src": "a.txt", "dest": "/root/sub/a.txt"}]}))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CTL_", "TYPER_"))}
        self.env.update(XDG_RUNTIME_DIR=str(run), CTL_STATE_DIR=str(tmp / "state"), CTL_INVENTORY="inventory.yaml",
                        CTL_CONFIG=str(tmp / "no-config.yaml"))

    @property
    def sockets(self) -> Path:
        return self.run / "ctl"

    def __call__(self, *args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.ctl, *args], capture_output=True, text=True, cwd=self.tmp,
                              env=env or self.env, timeout=60, **kw)  # type: ignore[call-overload]

    def here(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The same command in a process of its own (`python -m controller` is never served), same environment."""
        return subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True,
                              cwd=self.tmp, env=self.env, timeout=60)

    def servers(self) -> list[dict[str, object]]:
        r = self("mux", "status")
        assert r.returncode == 0, r.stderr
        return [{"pid": int(m[1]), "served": int(m[2]), "running": int(m[3])} for m in re.finditer(
            r"command server: pid (\d+), (\d+) commands served, (\d+) running", r.stdout)]

    def up(self) -> dict[str, object]:
        """The one server, once a command started it and it listens."""
        deadline = time.time() + 20
        while time.time() < deadline:
            if list(self.sockets.glob("cmd-*.sock")):
                found = self.servers()
                if found:
                    assert len(found) == 1, found
                    return found[0]
            time.sleep(0.05)
        logs = "".join(p.read_text() for p in self.sockets.glob("cmd-*.log"))
        raise AssertionError(f"no command server came up; its log: {logs}")


def served_world(tmp: Path) -> Iterator[World]:
    """A World with a runtime directory of its own (short: a socket path must fit in 104 bytes); its command
    server and sessions are stopped, and the directory removed, when the test ends."""
    run = Path(tempfile.mkdtemp(prefix="ctl-srv-"))
    os.chmod(run, 0o700)
    w = World(tmp, run)
    try:
        yield w
    finally:
        subprocess.run([*w.ctl, "mux", "stop", "--grace", "0"], capture_output=True, env=w.env, cwd=w.tmp, timeout=60)
        shutil.rmtree(run, ignore_errors=True)

