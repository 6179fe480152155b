"""Stream ids through a real persistent session (CTL_PERSIST) on the local Proxmox host: after the session's ids
wrap around, commands still run (tests/test_relay_ids.py drives 70,000 of them through a local relay)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from controller.inventory import load
from controller.transport.mux import MuxRelay
from controller.transport.mux.client import session_env
from controller.transport.mux.sock import private_dir, session_key, socket_dir
from controller.transport.pool import Pool
from controller.transport.relay import MAX_SID
from tests.integration.conftest import REPO, PveEnv

pytestmark = pytest.mark.pvehost

# The session process, started by the test instead of by ctl, with one change: after its 100th stream it jumps
# to the end of the id space, so 300 commands wrap around ids the relay has already used (the real session
# gets there after 65,535 commands).
_DAEMON = f"""
import json, sys
from controller.transport.mux import daemon
_alloc = daemon._Mux._alloc
def alloc(self, client, csid):
    if self.next_gsid == 101:
        self.next_gsid = {MAX_SID - 20}
    return _alloc(self, client, csid)
daemon._Mux._alloc = alloc
sys.exit(daemon.serve(json.loads(sys.argv[1])))
"""


def test_a_session_runs_commands_after_its_stream_ids_wrap(pve_env: PveEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTL_STATE_DIR", str(pve_env.state))
    monkeypatch.setenv("CTL_PERSIST", "60")
    pve_env.env["CTL_PERSIST"] = "60"
    inv = load(pve_env.inventory)
    with Pool(inv) as pool:
        ep = pool.host("pve1")
        d = private_dir(create=True)
        key = session_key(ep)
        path = socket_dir(create=True) / f"{key}.sock"
        spec = {"name": ep.name, "address": ep.address, "port": ep.port, "user": ep.user,
                "identity_file": ep.identity_file, "known_hosts": ep.known_hosts,
                "connect_timeout": ep.connect_timeout, "idle": 60, "socket": str(path), "info": str(d / f"{key}.json")}
        proc = subprocess.Popen([sys.executable, "-c", _DAEMON, json.dumps(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=REPO,
                                env={**session_env(os.environ, d.parent), "PYTHONPATH": str(REPO)},
                                start_new_session=True)
        try:
            assert proc.stdout is not None
            assert json.loads(proc.stdout.readline()) == {"ready": True}
            relay = MuxRelay(ep, 60)
            assert relay.available() and relay.hello["pid"] == proc.pid  # ours, not one ctl started
            for i in range(300):
                res = relay.open(["echo", str(i)]).finish(timeout=30)
                assert (res.returncode, res.stdout) == (0, f"{i}\n".encode()), (i, res.err)
            relay.close()
            # A ctl command through the same session, after the wrap: the relay forgot every finished id.
            r = pve_env.ctl("--debug", "ping", "ct200", "ct201")
            assert r.returncode == 0, r.stdout + r.stderr
            assert f"reused ctl's persistent session (pid {proc.pid}," in r.stderr
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
