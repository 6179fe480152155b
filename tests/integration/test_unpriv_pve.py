"""An unprivileged container (CT 202 on pve1: `unprivileged: 1`, container root is host uid 100000) with a rootfs of
its own whose python3 (3.9, Debian bullseye) is older than this machine's: what Proxmox creates by default, and
what an operator's older containers run. pct push/pull, `ctl deploy`, `ctl launch -f`, `ctl runs` and `ctl tail`
must all work there, and what ctl writes must belong to container root (host uid 100000), never to host root
(which the container sees as nobody, and its root could then neither change nor remove)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import fill_cache
from tests.helpers import sha_file
from tests.integration.conftest import PveEnv, container_venv
from tests.pvehost import PveHost
from tests.pvehost import rootfs as ctroot

pytestmark = pytest.mark.pvehost

VMID = 202
CT_ROOT = ctroot.ID_BASE  # container uid/gid 0 on the host


@pytest.fixture(scope="module")
def ct202(pvehost: PveHost) -> Iterator[int]:
    """CT 202 for this module only (the shared host's other modules never see it in `pct list` or inventories)."""
    if not (ctroot.cache_dir() / ctroot.tarball_name()).is_file():
        why = ctroot.why_cannot_build()
        if why:
            pytest.skip(f"no rootfs for the unprivileged container: {why}")
    pvehost.add_unprivileged(VMID, "pve1")
    try:
        yield VMID
    finally:
        pvehost.remove_container(VMID)


@pytest.fixture
def env202(pve_env: PveEnv, ct202: int) -> PveEnv:
    pve_env.write()  # the inventory again: ct202 came after pve_env wrote it
    pve_env.host.set_gpus(ct202, count=8)
    return pve_env


def inside(host: PveHost, *argv: str) -> str:
    r = host.ssh("pve1", "pct", "exec", str(VMID), "--", *argv)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()


def owner_mode(path: Path) -> tuple[int, int, str]:
    st = path.lstat()
    return st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)


def test_unprivileged_config_idmap_and_older_python(pvehost: PveHost, ct202: int) -> None:
    conf = pvehost.ssh("pve1", "pct", "config", str(ct202)).stdout.decode().splitlines()
    assert "unprivileged: 1" in conf and "ostype: debian" in conf
    lxc_conf = (pvehost.lxcpath("pve1") / str(ct202) / "config").read_text().splitlines()
    assert lxc_conf.count("lxc.idmap = u 0 100000 65536") == 1 and lxc_conf.count("lxc.idmap = g 0 100000 65536") == 1
    # The kernel's map, as the container's processes see it: their root is host uid 100000.
    assert inside(pvehost, "cat", "/proc/self/uid_map").split() == ["0", "100000", "65536"]
    assert inside(pvehost, "cat", "/proc/self/gid_map").split() == ["0", "100000", "65536"]
    # Its own rootfs, not the host's /usr: Debian 11's python3, older than the one running this test.
    version = inside(pvehost, "python3", "-c", "import sys; print(*sys.version_info[:2])").split()
    assert tuple(map(int, version)) == (3, 9) and sys.version_info[:2] > (3, 9)
    assert inside(pvehost, "cat", "/etc/debian_version").startswith("11.")
    assert owner_mode(pvehost.rootfs(ct202) / "usr" / "bin" / "python3.9")[:2] == (CT_ROOT, CT_ROOT)


def test_pct_push_and_pull_map_ownership(pvehost: PveHost, ct202: int, tmp_path: Path) -> None:
    src = tmp_path / "secret.txt"
    src.write_bytes(b"pushed\n")
    src.chmod(0o600)
    r = pvehost.ssh("pve1", "pct", "push", str(ct202), str(src), "/root/pushed.txt")
    assert r.returncode == 0, r.stderr.decode()
    # A new file is container root's with pct's 0644 (the source's mode does not travel): host uid 100000.
    assert inside(pvehost, "stat", "-c", "%u %g %a", "/root/pushed.txt").split() == ["0", "0", "644"]
    assert owner_mode(pvehost.rootfs(ct202) / "root" / "pushed.txt") == (CT_ROOT, CT_ROOT, "0o644")
    # --user/--group name container ids (as getpwnam in the container answers): nobody is host 165534.
    r = pvehost.ssh("pve1", "pct", "push", str(ct202), str(src), "/root/nobodys.txt", "--user", "nobody",
                    "--group", "nogroup", "--perms", "0640")
    assert r.returncode == 0, r.stderr.decode()
    assert owner_mode(pvehost.rootfs(ct202) / "root" / "nobodys.txt") == (CT_ROOT + 65534, CT_ROOT + 65534, "0o640")
    # pull: the host's copy is host root's; the bytes are the container's.
    out = tmp_path / "pulled.txt"
    r = pvehost.ssh("pve1", "pct", "pull", str(ct202), "/root/pushed.txt", str(out))
    assert r.returncode == 0, r.stderr.decode()
    assert out.read_bytes() == b"pushed\n" and owner_mode(out)[:2] == (0, 0)
    # A host root's file in the rootfs is nobody's to the container: its root may not read a 0600 one (the mapping
    # is real, not a relabelling). pull still can, as real pct's does: it enters the container's mount namespace
    # only, as host root (push enters the user namespace too).
    hosts_own = pvehost.rootfs(ct202) / "root" / "hosts-own.txt"
    hosts_own.write_bytes(b"host root's\n")
    hosts_own.chmod(0o600)
    assert inside(pvehost, "stat", "-c", "%u %g", "/root/hosts-own.txt").split() == ["65534", "65534"]
    r = pvehost.ssh("pve1", "pct", "exec", str(ct202), "--", "cat", "/root/hosts-own.txt")
    assert r.returncode == 1 and b"Permission denied" in r.stderr
    out2 = tmp_path / "hosts-own.txt"
    r = pvehost.ssh("pve1", "pct", "pull", str(ct202), "/root/hosts-own.txt", str(out2))
    assert r.returncode == 0, r.stderr.decode()
    assert out2.read_bytes() == b"host root's\n"


def test_deploy_keeps_modes_and_container_ownership(env202: PveEnv) -> None:
    tag = env202.tag
    (env202.dir / "token.txt").write_text("not for other users\n")
    env202.write(payload=[*env202.base_extra["payload"],
                          {"src": "token.txt", "dest": f"/root/{tag}/token.txt", "mode": "0600"}])
    r = env202.ctl("deploy", "ct202", "--allow-dirty", "--json", check=True)
    (res,) = json.loads(r.stdout)
    assert res["ok"] and sorted((f["dest"].rsplit("/", 1)[1], f["action"]) for f in res["files"]) == [
        ("emit_metrics.py", "create"), ("start_training.sh", "create"), ("token.txt", "create")], res
    d = env202.host.rootfs(VMID) / "root" / tag
    assert owner_mode(d) == (CT_ROOT, CT_ROOT, "0o755")
    assert owner_mode(d / "token.txt") == (CT_ROOT, CT_ROOT, "0o600")
    assert owner_mode(d / "start_training.sh") == (CT_ROOT, CT_ROOT, "0o755")
    assert owner_mode(d / "emit_metrics.py") == (CT_ROOT, CT_ROOT, "0o644")
    assert sha_file(d / "emit_metrics.py") == sha_file(env202.dir / "emit_metrics.py")
    assert inside(env202.host, "stat", "-c", "%u %g %a", f"/root/{tag}/token.txt").split() == ["0", "0", "600"]
    # Deployed again: nothing travels, nothing changes (no mode or owner drift reported through the mapping).
    r = env202.ctl("deploy", "ct202", "--allow-dirty", "--json", check=True)
    (res,) = json.loads(r.stdout)
    assert res["ok"] and {f["action"] for f in res["files"]} == {"same"} and res["bytes_sent"] == 0, res
    assert env202.ctl("deploy", "ct202", "--check").returncode == 0
    assert owner_mode(d / "token.txt") == (CT_ROOT, CT_ROOT, "0o600")


def test_launch_runs_and_tail(env202: PveEnv) -> None:
    env202.ctl("deploy", "ct202", "--allow-dirty", check=True)
    r = env202.ctl("launch", "ct202", "-f")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "launched fresh1" in r.stdout and "finished, exit status 0" in r.stdout and "step=6" in r.stdout
    runs = json.loads(env202.ctl("runs", "--json", check=True).stdout)
    assert [(x["name"], x["ct"], x["state"], x["exit_status"]) for x in runs] == [("fresh1", "ct202", "finished", 0)]
    # What the run wrote is container root's, next to the log ctl reads back.
    log = env202.host.rootfs(VMID) / "workspace" / env202.tag / "train_stdout_fresh1.log"
    for path in (log, Path(f"{log}.exit"), Path(f"{log}.ctl.json")):
        assert owner_mode(path)[:2] == (CT_ROOT, CT_ROOT), path
    assert Path(f"{log}.exit").read_text().strip() == "0"
    tail = env202.ctl("tail", "ct202", "--run", "fresh1", "-n", "50")
    assert tail.returncode == 0, tail.stderr
    lines = [line for line in tail.stdout.splitlines() if "step=" in line]
    assert [line.split("step=")[1].split()[0] for line in lines] == ["1", "2", "3", "4", "5", "6"], tail.stdout


def test_a_log_directory_the_host_made_is_refused_in_one_line_and_the_name_released(env202: PveEnv) -> None:
    """A directory host root made in the rootfs (or a host directory mounted in) is nobody's to the container:
    its root may not write there. The launch says so in one line and starts nothing; once the directory is the
    container root's (the hint's chown), the same name launches."""
    env202.ctl("deploy", "ct202", "--allow-dirty", check=True)
    logdir = env202.host.rootfs(VMID) / "workspace" / env202.tag
    logdir.mkdir(mode=0o755)
    r = env202.ctl("launch", "ct202", "--run", "hostdir1")
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and "may have started" not in err, err
    assert (f"run record /workspace/{env202.tag}/train_stdout_hostdir1.log.ctl.json: Permission denied "
            f"(/workspace/{env202.tag} belongs to uid 65534, no user of this container") in err, err
    assert "chown it on the host to the container's root, uid 100000" in err, err
    assert json.loads(env202.ctl("runs", "--json", check=True).stdout) == []  # the claim was released
    assert list(logdir.iterdir()) == []
    env202.host.own_as_ct_root(VMID, logdir)
    r = env202.ctl("launch", "ct202", "--run", "hostdir1", "-f")
    assert r.returncode == 0 and "finished, exit status 0" in r.stdout, r.stdout + r.stderr


def test_cache_save_where_container_root_may_not_write_is_one_line(env202: PveEnv) -> None:
    """A compile cache in a directory the host made (a host directory mounted in, typically): container root may
    read it but not write its marker or the store beside it. ctl says so in one line, naming the file and why."""
    inside, _ = container_venv(env202, VMID)
    cache = f"/workspace/{env202.tag}/inductor"
    env202.write(containers={"ct202": {"vars": {"venv": inside, "compile_cache_dir": cache,
                                                "cache_store": f"/workspace/{env202.tag}/caches"}}})
    host_cache = env202.host.rootfs(VMID) / cache.lstrip("/")
    fill_cache(host_cache)  # host root's, as a bind mount from the host would be: nobody's inside
    r = env202.ctl("cache", "save", "ct202", "good")
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and "ctl-agent" not in err, err
    assert f"cannot save the cache: {cache}/ctl-cache.json.tmp" in err and "Permission denied" in err, err
    assert f"({cache} belongs to uid 65534, no user of this container" in err, err
    env202.host.own_as_ct_root(VMID, host_cache.parent, tree=True)
    assert env202.ctl("cache", "save", "ct202", "good").returncode == 0
