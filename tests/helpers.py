"""Helpers more than one test module uses, written once: waiting on a condition, a free port, sha256 hex digests.
Standard library only, so the payload's tests (tests/payload, run where only the payload's packages are) use them
too. The relay's stand-ins are in tests/relay_fakes.py; fixtures in tests/conftest.py."""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, cond: Callable[[], T], timeout: float = 120, every: float = 0.2) -> T:
    """cond()'s first truthy answer, polled every `every` s; fails naming `what` after `timeout` s. The timeout is a
    hang detector (wide on purpose: a loaded machine is slow), never a measure of speed."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick), on every address."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def sha_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# Runs one command line in this process as `ctl` does (launch.main.run_here), with every Agent made counted by
# the name of its container; the counts are written to the file named first when the command exits.
COUNTED = """
import atexit, collections, json, sys
from controller.remote import client
made = collections.Counter()
plain = client.Agent.__init__
def counted(self, t):
    made[t.name] += 1
    plain(self, t)
client.Agent.__init__ = counted
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(made)))
from controller.launch.main import run_here
sys.argv[0] = "ctl"
run_here()
"""
