"""The local Proxmox test host behaves like shared/pve-facts.md says a real one does.

Everything goes over real SSH (the `ssh` client, host keys verified) into real LXC containers.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from tests.pvehost import NodeSpec, PveHost, find_free_port, leftover_processes

pytestmark = pytest.mark.pvehost

ROW = "%-10s %-10s %-12s %-20s"


def run(h: PveHost, host: str, *argv: str, input: bytes | None = None) -> tuple[int, str, str]:
    r = h.ssh(host, *argv, input=input)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


def pct(h: PveHost, vmid: int, *argv: str, input: bytes | None = None) -> tuple[int, str, str]:
    return run(h, h.node_of(vmid).name, "pct", *argv, input=input)


def ct(h: PveHost, vmid: int, *argv: str, input: bytes | None = None) -> tuple[int, str, str]:
    """Run argv inside the container through `pct exec VMID -- argv`."""
    return pct(h, vmid, "exec", str(vmid), "--", *argv, input=input)


def stage(h: PveHost, host: str, name: str, data: bytes) -> str:
    """Put a file on the simulated host (its /tmp is this machine's) and return its path there."""
    path = h.base / f"stage-{host}-{name}"
    path.write_bytes(data)
    return str(path)


@pytest.fixture
def h(pvehost: PveHost) -> PveHost:
    """The host with every container running (tests that stop one leave it stopped)."""
    for vmids in pvehost.vmids.values():
        for vmid in vmids:
            pvehost.start(vmid)
    return pvehost


# --- the SSH side -------------------------------------------------------------------------------


def test_ssh_sessions_get_pct_and_node_from_setenv(h: PveHost) -> None:
    for host, (_, _, node) in h.hosts.items():
        rc, out, _ = run(h, host, "sh", "-c", 'echo "$PVE_NODE"; command -v pct')
        assert rc == 0
        # like real Proxmox, PATH finds /usr/sbin/pct (an overlay in the sshd's own mount namespace); without
        # overlayfs, the node's bin/ comes first on PATH instead
        assert out.split() == [node, "/usr/sbin/pct" if h._overlay else str(h.base / node / "bin" / "pct")]
        rc, out, _ = run(h, host, "/usr/sbin/pct", "list")
        assert (rc, out.split()[4]) == (0, str(h.vmids[node][0]))
    assert not Path("/usr/sbin/pct").exists()  # not on this machine
    assert ct(h, 200, "test", "-e", "/usr/sbin/pct")[0] == 1  # nor in the containers


def test_ssh_sessions_read_debians_root_dotfiles_not_this_machines(h: PveHost) -> None:
    """What bash reads for each command sshd runs is a Proxmox host's (Debian's default), not a developer's
    pyenv or conda init from this machine's /root/.bashrc."""
    if not h._overlay:
        pytest.skip("without overlayfs sshd runs in this machine's mount namespace")
    for f in ("bashrc", "profile"):
        default = Path(f"/usr/share/base-files/dot.{f}")
        if default.exists() and (Path.home() / f".{f}").exists():
            rc, out, _ = run(h, "pve1", "cat", f"/root/.{f}")
            assert (rc, out) == (0, default.read_text())


def test_ssh_sessions_attach_by_name_as_on_proxmox_and_the_journal_counts_it(h: PveHost) -> None:
    """A plain `lxc-attach -n VMID` finds the node's own container (its lxcpath is the sessions' default), and
    lands in the node's journal beside pct's calls; pct's own attach does not."""
    before = len(h.pct_calls("pve1"))
    rc, out, err = run(h, "pve1", "lxc-attach", "-n", "200", "--", "sh", "-c", "echo in-200; exit 3")
    assert (rc, out.strip()) == (3, "in-200"), err
    rc, _, err = run(h, "pve1", "lxc-attach", "-n", "300", "--", "true")  # pve2's: not this node's
    assert rc != 0
    assert run(h, "pve1", "pct", "exec", "200", "--", "true")[0] == 0
    calls = h.pct_calls("pve1")[before:]
    assert [(c["cmd"], c["args"], c["argv"][:1]) for c in calls] == [
        ("attach", ["200"], ["sh"]), ("attach", ["300"], ["true"]), ("exec", ["200"], ["true"])], calls


def test_host_keys_are_verified(h: PveHost, tmp_path: Path) -> None:
    lines = h.known_hosts.read_text().splitlines()
    assert [ln.split()[0] for ln in lines] == [
        f"[127.0.0.2]:{h.port}", f"[127.0.0.3]:{h.port}", f"[127.0.0.4]:{h.port}"]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    argv = [a.replace(str(h.known_hosts), str(empty)) for a in h.ssh_argv("pve1")]
    r = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 255
    assert "Host key verification failed" in r.stderr


def test_inventory_matches_the_controller_model(h: PveHost, tmp_path: Path) -> None:
    from controller.inventory import load

    path = h.write_inventory(tmp_path / "inventory.yaml", runs={"series": "fresh", "session": "dflash"})
    inv = load(path)
    assert sorted(inv.model.containers) == ["ct200", "ct201", "ct300", "ct301"]
    assert inv.container("ct200").host is not None
    assert inv.container("ct200").host.address == "127.0.0.2"
    assert inv.model.containers["ct300"].transport == "pct"
    assert inv.model.containers["ct301"].transport == "ssh"
    assert inv.model.containers["ct301"].address == "127.0.0.4"
    assert inv.model.runs.series == "fresh"


# --- general pct rules --------------------------------------------------------------------------


def test_pct_list_shows_only_this_nodes_containers(h: PveHost) -> None:
    for host, (_, _, node) in h.hosts.items():
        rc, out, _ = run(h, host, "pct", "list")
        assert rc == 0
        expect = [ROW % ("VMID", "Status", "Lock", "Name")]
        expect += [ROW % (v, "running", "", f"ct{v}") for v in sorted(h.vmids[node])]
        assert out.splitlines() == expect


def test_pct_list_prints_nothing_without_containers(h: PveHost) -> None:
    confs = h.base / "pve2" / "etc-pve" / "nodes" / "pve2" / "lxc"
    aside = confs.with_name("lxc.aside")
    confs.rename(aside)
    try:
        assert run(h, "pve2", "pct", "list") == (0, "", "")
    finally:
        aside.rename(confs)


def test_pct_runs_only_as_root(h: PveHost) -> None:
    rc, _, err = run(h, "pve1", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "pct", "list")
    assert rc != 0
    assert err == "please run as root\n"


@pytest.mark.parametrize("vmid", ["abc", "99", "0200x"])
def test_vmid_is_verified(h: PveHost, vmid: str) -> None:
    rc, _, err = run(h, "pve1", "pct", "status", vmid)
    assert rc != 0
    assert err.startswith("400 Parameter verification failed.\nvmid: ")


def test_options_anywhere_and_unknown_options(h: PveHost) -> None:
    assert pct(h, 200, "status", "--verbose", "200")[0] == 0
    assert pct(h, 200, "status", "200", "-verbose")[0] == 0
    for opt in ("--bogus", "-bogus"):
        rc, _, err = pct(h, 200, "status", "200", opt)
        assert rc != 0
        assert err.startswith("Unknown option: bogus\n400 unable to parse option\n")
    # without `--`, `-la` of `ls -la` is a pct option
    rc, _, err = pct(h, 200, "exec", "200", "ls", "-la")
    assert rc != 0
    assert err.startswith("Unknown option: la\n")


def test_missing_config(h: PveHost) -> None:
    msg = "Configuration file 'nodes/pve1/lxc/999.conf' does not exist\n"
    for argv in (["exec", "999", "--", "true"], ["status", "999"], ["config", "999"], ["start", "999"]):
        rc, _, err = run(h, "pve1", "pct", *argv)
        assert (rc != 0, err) == (True, msg)
    # containers of the other node do not exist here
    rc, _, err = run(h, "pve1", "pct", "status", "300")
    assert rc != 0
    assert err == "Configuration file 'nodes/pve1/lxc/300.conf' does not exist\n"


def test_status_and_config(h: PveHost) -> None:
    assert pct(h, 200, "status", "200") == (0, "status: running\n", "")
    rc, out, _ = pct(h, 200, "status", "200", "--verbose")
    keys = [ln.split(": ", 1)[0] for ln in out.splitlines()]
    assert keys == sorted(keys)
    fields = dict(ln.split(": ", 1) for ln in out.splitlines())
    assert fields["status"] == "running" and fields["type"] == "lxc" and fields["vmid"] == "200"
    assert fields["name"] == "ct200" and int(fields["pid"]) > 1
    rc, out, _ = pct(h, 300, "config", "300")
    assert rc == 0
    lines = out.splitlines()
    plain = [ln for ln in lines if not ln.startswith("lxc.")]
    assert lines[: len(plain)] == plain == sorted(plain)  # sorted keys, raw lxc.* last
    assert "hostname: ct300" in lines and "arch: amd64" in lines and "ostype: debian" in lines
    assert any(ln.startswith("mp0: ") and "mp=/workspace/small" in ln for ln in lines)
    assert any(ln.startswith("net0: name=eth0,") for ln in lines)


# --- exec ---------------------------------------------------------------------------------------


def test_exec_runs_argv_without_a_shell(h: PveHost) -> None:
    assert ct(h, 200, "echo", "$HOME", "a  b", ";", "true") == (0, "$HOME a  b ; true\n", "")


def test_exec_exit_codes(h: PveHost) -> None:
    assert ct(h, 200, "sh", "-c", "exit 3")[0] == 3
    assert ct(h, 200, "sh", "-c", "kill -TERM $$")[0] == 128 + 15
    assert ct(h, 200, "sh", "-c", "kill -KILL $$")[0] == 128 + 9
    assert ct(h, 200, "/no/such/program")[0] == 127
    assert ct(h, 200, "/etc/passwd")[0] == 126


def test_exec_checks_running_then_command(h: PveHost) -> None:
    rc, _, err = pct(h, 200, "exec", "200")
    assert (rc != 0, err) == (True, "missing command\n")
    rc, _, err = pct(h, 200, "exec", "200", "--")
    assert (rc != 0, err) == (True, "missing command\n")


def test_exec_streams_separate_and_binary_stdin(h: PveHost) -> None:
    rc, out, err = ct(h, 200, "sh", "-c", "echo out; echo err >&2")
    assert (rc, out, err) == (0, "out\n", "err\n")
    blob = os.urandom(300_000) + bytes(range(256))
    rc, out, _ = ct(h, 200, "sha256sum", input=blob)
    assert out.split()[0] == hashlib.sha256(blob).hexdigest()
    # a tar archive streamed over the exec's stdin (how deploy batches files)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("tarred/hello.txt")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"hello\n"))
    assert ct(h, 200, "tar", "-C", "/root", "-xf", "-", input=buf.getvalue())[0] == 0
    assert ct(h, 200, "cat", "/root/tarred/hello.txt") == (0, "hello\n", "")


def test_exec_environment(h: PveHost) -> None:
    rc, out, _ = ct(h, 200, "env")
    env = dict(ln.split("=", 1) for ln in out.splitlines() if "=" in ln)
    assert env["PATH"] == "/sbin:/bin:/usr/sbin:/usr/bin"
    assert env["PVE_NODE"] == "pve1"  # keep-env 1: the SSH session's environment
    rc, out, _ = pct(h, 200, "exec", "200", "--keep-env", "0", "--", "env")
    assert rc == 0 and "PVE_NODE=" not in out


# --- isolation, tmux ----------------------------------------------------------------------------


def test_files_and_processes_are_private_to_a_container(h: PveHost) -> None:
    src = stage(h, "pve1", "iso", b"only in 200\n")
    assert pct(h, 200, "push", "200", src, "/root/iso.txt")[0] == 0
    assert ct(h, 200, "cat", "/root/iso.txt") == (0, "only in 200\n", "")
    assert ct(h, 201, "test", "-e", "/root/iso.txt")[0] == 1
    assert (h.rootfs(200) / "root" / "iso.txt").read_text() == "only in 200\n"

    assert ct(h, 200, "tmux", "new-session", "-d", "-s", "iso", "sleep 4321")[0] == 0
    try:
        assert "sleep 4321" in ct(h, 200, "ps", "-eo", "args")[1]
        assert "sleep 4321" not in ct(h, 201, "ps", "-eo", "args")[1]
        assert ct(h, 201, "tmux", "has-session", "-t", "iso")[0] != 0
    finally:
        ct(h, 200, "tmux", "kill-session", "-t", "iso")


def test_tmux_detached_session_inside(h: PveHost) -> None:
    script = "echo started; python3 -c 'print(6*7)'; sleep 30"
    assert ct(h, 201, "tmux", "new-session", "-d", "-s", "job",
              f"bash -c {script!r} 2>&1 | tee /workspace/job.log")[0] == 0
    try:
        deadline = time.monotonic() + 10
        while ct(h, 201, "cat", "/workspace/job.log")[1] != "started\n42\n":
            assert time.monotonic() < deadline, "tmux job never wrote its log"
            time.sleep(0.1)
        assert ct(h, 201, "tmux", "ls", "-F", "#{session_name}") == (0, "job\n", "")
    finally:
        ct(h, 201, "tmux", "kill-server")


# --- push / pull --------------------------------------------------------------------------------


def test_push_new_relative_and_missing_parent(h: PveHost) -> None:
    src = stage(h, "pve1", "p1", b"pushed\n")
    assert pct(h, 200, "push", "200", src, "root/rel.txt") == (0, "", "")
    assert ct(h, 200, "stat", "-c", "%a %U", "/root/rel.txt") == (0, "644 root\n", "")
    assert ct(h, 200, "cat", "/root/rel.txt")[1] == "pushed\n"
    rc, _, err = pct(h, 200, "push", "200", src, "/root/no/such/dir/f")
    assert rc != 0
    assert err == "failed to create file: /root/no/such/dir/f: No such file or directory\n"
    assert os.stat(src).st_mode & 0o777 == 0o644  # the host-side source is not touched


def test_push_rewrites_in_place_and_keeps_mode(h: PveHost) -> None:
    first = stage(h, "pve1", "p2a", b"x" * 1000)
    second = stage(h, "pve1", "p2b", b"short\n")
    assert pct(h, 200, "push", "200", first, "/root/inplace")[0] == 0
    assert ct(h, 200, "chmod", "600", "/root/inplace")[0] == 0
    inode = ct(h, 200, "stat", "-c", "%i", "/root/inplace")[1]
    assert pct(h, 200, "push", "200", second, "/root/inplace")[0] == 0
    assert ct(h, 200, "stat", "-c", "%i %a %s", "/root/inplace")[1] == f"{inode.strip()} 600 6\n"
    assert pct(h, 200, "push", "200", second, "/root/inplace", "--perms", "0755")[0] == 0
    assert ct(h, 200, "stat", "-c", "%a", "/root/inplace")[1] == "755\n"


def test_push_is_not_atomic_a_reader_sees_a_partial_file(h: PveHost) -> None:
    size = 1 << 20
    src = stage(h, "pve1", "slow", os.urandom(size))
    argv = [*h.ssh_argv("pve1", multiplex=True), "--",
            f"PVEHOST_PUSH_CHUNK_DELAY=0.03 pct push 200 {src} /root/slow.bin"]
    pusher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: set[int] = set()
    path = h.rootfs(200) / "root" / "slow.bin"
    while pusher.poll() is None:
        if path.exists():
            seen.add(path.stat().st_size)
        time.sleep(0.01)
    assert pusher.wait() == 0
    assert any(0 < s < size for s in seen), seen
    assert path.stat().st_size == size


def test_push_failing_midway_exits_zero(h: PveHost) -> None:
    """THE TRAP: the tmpfs at /workspace/small (4 MiB) fills; pct prints the error and exits 0."""
    src = stage(h, "pve2", "big", os.urandom(6 << 20))
    rc, out, err = pct(h, 300, "push", "300", src, "/workspace/small/big.bin")
    try:
        assert (rc, out) == (0, "")
        assert "No space left on device" in err
        size = int(ct(h, 300, "stat", "-c", "%s", "/workspace/small/big.bin")[1])
        assert 0 < size < 6 << 20  # partial, and nothing on the host side says so
        assert not (h.rootfs(300) / "workspace" / "small" / "big.bin").exists()  # the tmpfs is the CT's
    finally:
        ct(h, 300, "rm", "-f", "/workspace/small/big.bin")


def test_pull(h: PveHost) -> None:
    dest = h.base / "pulled"
    assert ct(h, 200, "sh", "-c", "printf 'from ct\\n' > /root/pullme")[0] == 0
    assert pct(h, 200, "pull", "200", "/root/pullme", str(dest)) == (0, "", "")
    assert dest.read_text() == "from ct\n"
    assert dest.stat().st_mode & 0o777 == 0o644
    missing = h.base / "pulled-missing"
    rc, _, err = pct(h, 200, "pull", "200", "/root/does-not-exist", str(missing))
    assert rc != 0 and "No such file or directory" in err
    assert missing.exists() and missing.stat().st_size == 0  # the trap: an empty file is left behind


# --- lifecycle ----------------------------------------------------------------------------------


def test_stopped_container_messages_and_lifecycle(h: PveHost) -> None:
    src = stage(h, "pve1", "life", b"x")
    assert pct(h, 201, "stop", "201") == (0, "", "")
    assert pct(h, 201, "status", "201") == (0, "status: stopped\n", "")
    rc, out, _ = pct(h, 201, "status", "201", "--verbose")
    assert "status: stopped" in out and "pid:" not in out
    assert ROW % (201, "stopped", "", "ct201") in run(h, "pve1", "pct", "list")[1].splitlines()
    expect = {
        ("stop", "201"): "CT 201 not running\n",
        ("shutdown", "201"): "CT 201 not running\n",
        ("exec", "201", "--", "true"): "container '201' not running!\n",
        ("push", "201", src, "/root/x"): "can only push files to a running CT\n",
    }
    for argv, msg in expect.items():
        rc, _, err = pct(h, 201, *argv)
        assert (rc != 0, err) == (True, msg), argv
    rc, _, err = pct(h, 201, "pull", "201", "/etc/hostname", str(h.base / "x"))
    assert rc != 0
    assert err.startswith("can only pull files from a running VM at ") and err.endswith(" line 596.\n")
    assert pct(h, 201, "start", "201") == (0, "", "")
    rc, _, err = pct(h, 201, "start", "201")
    assert (rc != 0, err) == (True, "CT 201 already running\n")
    assert pct(h, 201, "shutdown", "201")[0] == 0
    assert not h.running(201)


# --- snapshots ----------------------------------------------------------------------------------


def test_snapshot_rollback_restores_a_changed_file(h: PveHost) -> None:
    v1, v2 = stage(h, "pve1", "v1", b"v1\n"), stage(h, "pve1", "v2", b"v2\n")
    assert pct(h, 201, "push", "201", v1, "/workspace/state.txt")[0] == 0
    assert pct(h, 201, "snapshot", "201", "before", "--description", "known good") == (0, "", "")
    assert pct(h, 201, "push", "201", v2, "/workspace/state.txt")[0] == 0
    rc, out, _ = pct(h, 201, "listsnapshot", "201")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("`-> before ") and lines[0].endswith("known good")
    assert lines[1].strip().startswith("`-> current") and lines[1].endswith("You are here!")
    assert "parent: before" in pct(h, 201, "config", "201")[1].splitlines()
    assert "snaptime: " in pct(h, 201, "config", "201", "--snapshot", "before")[1]

    assert pct(h, 201, "rollback", "201", "before") == (0, "", "")
    assert pct(h, 201, "status", "201")[1] == "status: stopped\n"  # stopped first, not restarted
    assert (h.rootfs(201) / "workspace" / "state.txt").read_text() == "v1\n"
    assert pct(h, 201, "rollback", "201", "before", "--start")[0] == 0
    assert ct(h, 201, "cat", "/workspace/state.txt") == (0, "v1\n", "")

    rc, _, err = pct(h, 201, "rollback", "201", "nope")
    assert (rc != 0, err) == (True, "snapshot 'nope' does not exist\n")
    assert pct(h, 201, "delsnapshot", "201", "before")[0] == 0
    assert "before" not in pct(h, 201, "listsnapshot", "201")[1]


@pytest.mark.parametrize(("name", "msg"), [
    ("current", "unable to use snapshot name 'current' (reserved name)\n"),
    ("vzdump", "unable to use snapshot name 'vzdump' (reserved name)\n"),
    ("1st", "400 Parameter verification failed.\nsnapname: invalid format - invalid configuration ID '1st'\n"),
    ("a" * 41, "400 Parameter verification failed.\nsnapname: value may only be 40 characters long\n"),
])
def test_snapshot_names(h: PveHost, name: str, msg: str) -> None:
    rc, _, err = pct(h, 200, "snapshot", "200", name)
    assert (rc != 0, err) == (True, msg)


def test_snapshot_name_already_used(h: PveHost) -> None:
    assert pct(h, 200, "snapshot", "200", "Twice_1")[0] == 0
    try:
        rc, _, err = pct(h, 200, "snapshot", "200", "Twice_1")
        assert (rc != 0, err) == (True, "snapshot name 'Twice_1' already used\n")
    finally:
        pct(h, 200, "delsnapshot", "200", "Twice_1")


# --- nvidia-smi ---------------------------------------------------------------------------------


def test_nvidia_smi_without_driver(h: PveHost) -> None:
    h.clear_gpus(200)
    rc, out, _ = ct(h, 200, "nvidia-smi")
    assert rc == 9
    assert out.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_nvidia_smi_forms(h: PveHost) -> None:
    h.set_gpus(200, count=8, busy={3: [(4242, 30000, "python3")]}, memory_used={5: 1234})
    try:
        q = "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu"
        rc, out, _ = ct(h, 200, "nvidia-smi", q, "--format=csv,noheader,nounits")
        rows = [ln.split(", ") for ln in out.splitlines()]
        assert rc == 0 and len(rows) == 8
        assert rows[3][0] == "3" and rows[3][1].startswith("GPU-") and rows[3][2] == "NVIDIA H100 80GB HBM3"
        assert rows[3][3:] == ["30000", "81559", "97"]
        assert rows[5][3:] == ["1234", "81559", "0"] and rows[0][3:] == ["0", "81559", "0"]
        rc, out, _ = ct(h, 200, "nvidia-smi", "--query-gpu=memory.used,index", "--format=csv")
        assert out.splitlines()[:2] == ["memory.used [MiB], index", "0 MiB, 0"]
        assert "utilization.gpu [%]" in ct(h, 200, "nvidia-smi", q, "--format=csv")[1].splitlines()[0]
        apps = "--query-compute-apps=gpu_uuid,pid,process_name,used_memory"
        rc, out, _ = ct(h, 200, "nvidia-smi", apps, "--format=csv,noheader,nounits")
        assert out == f"{rows[3][1]}, 4242, python3, 30000\n"
        rc, out, _ = ct(h, 200, "nvidia-smi", "-L")
        assert out.splitlines()[3] == f"GPU 3: NVIDIA H100 80GB HBM3 (UUID: {rows[3][1]})"
        rc, out, _ = ct(h, 200, "nvidia-smi")
        assert rc == 0 and "NVIDIA-SMI" in out and "python3" in out
        h.set_gpus(200, count=2)
        assert ct(h, 200, "nvidia-smi", apps, "--format=csv,noheader,nounits") == (0, "", "")
        assert ct(h, 201, "nvidia-smi")[0] == 9  # per container
    finally:
        h.clear_gpus(200)


# --- the container with its own sshd ------------------------------------------------------------


def test_container_over_direct_ssh(h: PveHost) -> None:
    assert h.ct_ssh == ("127.0.0.4", h.port)
    assert run(h, "ct_ssh", "hostname")[1] == "ct301\n"
    src = stage(h, "pve2", "ctssh", b"via pct\n")
    assert pct(h, 301, "push", "301", src, "/root/seen.txt")[0] == 0
    assert run(h, "ct_ssh", "cat", "/root/seen.txt") == (0, "via pct\n", "")
    h.set_gpus(301, count=1)
    try:
        assert run(h, "ct_ssh", "nvidia-smi", "-L")[1].startswith("GPU 0: ")
    finally:
        h.clear_gpus(301)


# --- bring-up and teardown of another, smaller host ---------------------------------------------


def test_up_and_down_leave_nothing_behind(pvehost: PveHost) -> None:
    # A short base: ssh's ControlPath under it must fit a Unix socket's 108 bytes, which pytest's own temp paths
    # (…/pytest-of-root/pytest-N/popen-gw0/minihost0/cm/<40 hex>.<16>) do not under xdist.
    base = Path(tempfile.mkdtemp(prefix="ctl-mini-"))
    port = find_free_port(["127.0.0.5"], start=pvehost.port + 1)
    mini = PveHost(base=base, port=port, nodes=(NodeSpec("pve9", "127.0.0.5", (900,)),),
                   ct_ssh_vmid=None, small_tmpfs={})
    mini.up()
    try:
        rc, out, err = run(mini, "pve9", "pct", "list")
        assert out.splitlines()[1:2] and out.splitlines()[1].startswith("900 "), (rc, out, err)
        assert ct(mini, 900, "tmux", "new-session", "-d", "-s", "left", "sleep 999")[0] == 0
        assert leftover_processes(base)
    finally:
        mini.down()
    assert not base.exists()
    assert leftover_processes(base) == {}
