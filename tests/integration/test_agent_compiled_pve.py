"""The agent's compiled code kept in the container (/run/ctl, controller/remote/client.py BOOT and agent.py
keep_compiled), against the local Proxmox host: written once, read back on the next start, and never taken from a
file that someone other than the agent's own user could have written."""

from __future__ import annotations

import hashlib
import marshal
import os
import shutil
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.remote.client import agent_source
from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost


def _kept(run: Path) -> list[Path]:
    return sorted(p for p in run.glob("agent-*") if not p.name.endswith(".tmp"))


def test_the_compiled_agent_is_kept_and_only_a_trusted_copy_runs(pve_env: PveEnv,
                                                                 rootfs: Callable[[int], Path]) -> None:
    env = pve_env
    env.env["CTL_PERSIST"] = "0"  # one exec per request: every request starts an agent
    run = rootfs(200) / "run" / "ctl"
    shutil.rmtree(run, ignore_errors=True)
    env.ctl("ping", "ct200", check=True)
    kept = _kept(run)
    assert len(kept) == 1, kept
    path = kept[0]
    assert path.name.startswith("agent-" + hashlib.sha256(agent_source()).hexdigest()[:32] + "-"), path.name
    assert os.stat(run).st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert isinstance(marshal.loads(path.read_bytes()), types.CodeType)

    # A copy the agent's user wrote is what runs (that is the point): this one only leaves a mark and exits.
    mark = rootfs(200) / "root" / env.tag / "ran"
    mark.parent.mkdir(parents=True, exist_ok=True)
    env.host.own_as_ct_root(200, mark.parent)  # where the planted copy, run as container root, may write
    planted = marshal.dumps(compile(f"open({'/root/' + env.tag + '/ran'!r}, 'w').write('x')\nraise SystemExit(3)",
                                    "planted", "exec"))
    path.write_bytes(planted)
    assert env.ctl("ping", "ct200").returncode != 0
    assert mark.exists()
    mark.unlink()

    # ... and no copy anybody else could have written: each is set aside, the source compiled, the copy replaced.
    elsewhere = rootfs(200) / "root" / env.tag / "planted.bin"
    elsewhere.write_bytes(planted)
    os.chmod(elsewhere, 0o600)

    def other_owner() -> None:
        path.write_bytes(planted)
        os.chown(path, 1000, 1000)

    def writable_by_others() -> None:
        path.write_bytes(planted)
        os.chmod(path, 0o666)

    def symlink() -> None:
        path.unlink()
        path.symlink_to(f"/root/{env.tag}/planted.bin")

    def garbage() -> None:
        path.write_bytes(b"\x00not marshal")
        os.chmod(path, 0o600)

    left = run / (path.name + ".999.tmp")  # an agent killed while it wrote
    left.write_bytes(b"partial")
    os.utime(left, (1, 1))
    young = run / (path.name + ".998.tmp")  # one that may be writing now
    young.write_bytes(b"partial")
    for plant in (other_owner, writable_by_others, symlink, garbage):
        plant()
        r = env.ctl("ping", "ct200")
        assert r.returncode == 0, (plant.__name__, r.stdout, r.stderr)
        assert not mark.exists(), plant.__name__
        st = os.lstat(path)
        assert (st.st_uid, st.st_mode & 0o7777) == (env.host.ct_root_uid(200), 0o600) and not path.is_symlink(), \
            plant.__name__
        assert isinstance(marshal.loads(path.read_bytes()), types.CodeType), plant.__name__
    assert elsewhere.read_bytes() == planted  # a symlink's target is never written either
    assert not left.exists() and young.exists()
    young.unlink()
    assert _kept(run) == [path]
