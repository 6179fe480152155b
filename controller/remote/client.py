"""Calling the agent (controller/remote/agent.py) inside a container: one exec per operation."""

from __future__ import annotations

import json
from typing import Any, NoReturn

from controller.errors import CtlError, RemoteCommandError
from controller.remote import source
from controller.transport.base import Result, Transport

BOOT = "import sys;n=int(sys.argv[1]);exec(compile(sys.stdin.buffer.read(n),'ctl-agent','exec'))"


def agent_source() -> bytes:
    return source("agent.py")


def agent_argv(verb: str, *args: str) -> list[str]:
    # -I -S: the agent is stdlib only; ignore PYTHON* variables and site-packages of the container.
    return ["python3", "-I", "-S", "-c", BOOT, str(len(agent_source())), verb, *args]


def root_of(t: Transport) -> str:
    """The agent's ROOT argument: "/" in a real container, the stand-in directory for `local`."""
    return t.path("/")


def call(t: Transport, verb: str, *args: str, payload: bytes = b"", timeout: float | None = None) -> dict[str, Any]:
    """Run one agent verb; return its JSON. A report with ok=false is returned, not raised."""
    argv = agent_argv(verb, *args)
    res = t.run(argv, stdin=agent_source() + payload, timeout=timeout)
    try:
        doc = json.loads(res.out) if res.out.strip() else None
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        raise_agent_failure(t, verb, res)
    assert isinstance(doc, dict)
    return doc


def raise_agent_failure(t: Transport, verb: str, res: Result) -> NoReturn:
    """The agent gave no JSON answer: python3 missing, or it died; say which, with its stderr."""
    if res.returncode == 127 or "python3: not found" in res.err or "No such file" in res.err[:200]:
        raise CtlError(f"{t.name}: python3 is not available in the container (ctl's agent needs it)")
    raise RemoteCommandError(t.name, ["python3", "<agent>", verb], res.returncode, res.err, what=f"agent {verb}")


def shell_line(t: Transport, verb: str, *args: str) -> str:
    """The copy-pasteable line a user could run by hand (stdin: agent source + payload)."""
    return t.script(agent_argv(verb, *args))
