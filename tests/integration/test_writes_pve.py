"""Hardened writes against the local Proxmox host (real LXC containers): a symlinked directory on a
destination's path is refused, naming it, and a rename that fails midway leaves every old file in place."""

from __future__ import annotations

import json
import subprocess

import pytest

from controller.errors import ExitCode
from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost


def pct(env: PveEnv, *argv: str) -> subprocess.CompletedProcess[bytes]:
    return env.host.ssh("pve1", "pct", "exec", "200", "--", *argv)


def test_symlinked_directory_on_the_path_is_refused_and_nothing_lands(pve_env: PveEnv) -> None:
    tag = pve_env.tag
    root = pve_env.host.rootfs(200)
    (root / "root" / tag).mkdir(parents=True)
    (root / "etc" / "cron.d").mkdir(parents=True, exist_ok=True)
    (root / "root" / tag / "sub").symlink_to("/etc/cron.d")  # what a container user who owns /root/<tag> can do
    pve_env.host.own_as_ct_root(200, root / "root" / tag, root / "root" / tag / "sub", root / "etc" / "cron.d")
    before = sorted(p.name for p in (root / "etc" / "cron.d").iterdir())
    pve_env.write(payload=[{"src": "emit_metrics.py", "dest": f"/root/{tag}/sub/x"}])
    r = pve_env.ctl("deploy", "ct200", "--allow-dirty")
    assert r.returncode == ExitCode.INPUT, r.stdout + r.stderr
    assert f"/root/{tag}/sub is a symlink (to /etc/cron.d)" in r.stdout + r.stderr
    after = sorted(p.name for p in (root / "etc" / "cron.d").iterdir())
    assert after == before and "x" not in after
    # Allowed explicitly, it deploys through the link.
    pve_env.write(payload=[{"src": "emit_metrics.py", "dest": f"/root/{tag}/sub/x"}],
                  containers={"ct200": {"follow_symlinks": [f"/root/{tag}/sub"]}})
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    assert (root / "etc" / "cron.d" / "x").exists()
    (root / "etc" / "cron.d" / "x").unlink()


def test_rename_onto_a_mount_point_midway_puts_every_old_file_back(pve_env: PveEnv) -> None:
    tag = pve_env.tag
    root = pve_env.host.rootfs(200)
    for n in ("a.txt", "b.txt", "c.txt"):
        (pve_env.dir / n).write_text(f"{n} v1\n")
    pve_env.write(payload=[{"src": n, "dest": f"/root/{tag}/{n}"} for n in ("a.txt", "b.txt", "c.txt")])
    pve_env.ctl("deploy", "ct200", "--allow-dirty", check=True)
    # b.txt becomes a mount point inside the container: rename(2) onto it fails with EBUSY.
    (root / "root" / tag / "b.src").write_text("b.txt v1\n")
    m = pct(pve_env, "mount", "--bind", f"/root/{tag}/b.src", f"/root/{tag}/b.txt")
    if m.returncode != 0:
        pytest.skip(f"cannot bind-mount inside the container: {m.stderr!r}")
    try:
        for n in ("a.txt", "b.txt", "c.txt"):
            (pve_env.dir / n).write_text(f"{n} v2\n")
        r = pve_env.ctl("deploy", "ct200", "--allow-dirty", "--json")
        assert r.returncode != 0
        (res,) = json.loads(r.stdout)
        assert "busy" in res["error"].lower() and "nothing was replaced" in res["error"], res
        got = {n: pct(pve_env, "cat", f"/root/{tag}/{n}").stdout.decode() for n in ("a.txt", "b.txt", "c.txt")}
        assert got == {n: f"{n} v1\n" for n in ("a.txt", "b.txt", "c.txt")}
        listing = pct(pve_env, "ls", "-a", f"/root/{tag}").stdout.decode()
        assert ".ctl-" not in listing, listing
    finally:
        pct(pve_env, "umount", f"/root/{tag}/b.txt")
