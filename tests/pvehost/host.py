"""Bring up and tear down a local, faithful Proxmox VE test host: sshd per node, real LXC containers, pct.

Layout under the base directory (nothing is registered outside it; see `PveHost.down`):

    state.json                    what `down`/`status` need: port, nodes, pids, owner
    keys/                         client key (ed25519), authorized_keys, known_hosts
    cm/                           ssh ControlMaster sockets (ssh_argv(..., multiplex=True))
    <node>/sshd_config            one sshd per simulated host, own host key and PidFile
    <node>/node.json, bin/pct     the simulated pct (/usr/sbin/pct through the overlay below)
    <node>/bin/lxc-attach         journals each call (pct.journal, "cmd": "attach"), then runs the real one
    <node>/etc-lxc/lxc.conf       lxc.lxcpath = <node>/lxc: /etc/lxc in the node's SSH sessions
    <node>/etc-pve/nodes/<node>/lxc/<vmid>.conf   Proxmox-style config that `pct config` prints
    <node>/lxc/<vmid>/{config,rootfs}             the LXC container (lxcpath = <node>/lxc)
    <node>/snapshots/<vmid>/<name>/               snapshot copies of the private dirs
    api/                          the HTTPS PVE API (tests/pvehost/api.py): CA, cert, token, api.json, api.pid

Each sshd runs in its own mount namespace where /usr/sbin is a read-only overlay adding pct, so both
`pct` and `/usr/sbin/pct` work in SSH sessions, as on real Proxmox; nothing changes on this machine's
/usr/sbin (without overlayfs, sshd's SetEnv puts bin/ first on PATH instead). In that namespace root's
.bashrc and .profile are Debian's defaults (base-files), as on a Proxmox host, whatever this machine's are.

One container (ct_ssh_vmid, 301 by default) uses host networking (`lxc.net.0.type = none`) and runs its own
sshd on 127.0.0.4 as its init's child: the endpoint of the "container over direct SSH" transport.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.farside.common import _pid_alive  # a zombie (an API process not reaped yet) counts as gone
from tests.pvehost import rootfs as ctroot

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = "/tmp/ctl-pvehost"
DEFAULT_PORT = 2222
SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
INIT_LXC = "/usr/sbin/init.lxc"
GPU_STATE = "etc/ctl-fake-gpu.json"
HOST_PATH_TAIL = "/usr/sbin:/usr/bin:/sbin:/bin"
PRIVATE_DIRS = ("root", "workspace", "etc", "tmp", "run", "opt", "srv", "var")
ETC_FILES = ("passwd", "group", "shadow", "hosts", "nsswitch.conf", "ld.so.cache", "profile", "bash.bashrc",
             "debian_version", "login.defs")
_BIND_OPTS = "none ro,bind,create=dir 0 0"  # set_host_network's mount entries (the config has no others like it)
REQUIRED_TOOLS = ("lxc-start", "lxc-attach", "lxc-stop", "lxc-info", "lxc-wait", "ssh", "ssh-keygen", "tmux")


# bin/lxc-attach of a node: ahead of the real one on pct's PATH (/sbin, through the overlay), so an lxc-attach that
# ctl's relay runs itself, as pct would, lands in the node's journal beside pct's own invocations (the stand-in pct
# runs the real binary by its path). dash, no subprocess: it must cost next to nothing. Words of any other shape
# than a plain word are journaled as "?".
ATTACH_SHIM = r"""#!/bin/sh
vmid='?' words='' seen='' next='' i=0
for a in "$@"; do
  if [ -n "$seen" ]; then
    if [ "$i" -lt 8 ]; then
      case $a in ''|*[!A-Za-z0-9_.,:/=+@%-]*) a='?';; esac
      words="$words${words:+, }\"$a\""
      i=$((i + 1))
    fi
  elif [ "$a" = -- ]; then seen=1
  elif [ -n "$next" ]; then
    case $a in ''|*[!0-9]*) ;; *) vmid=$a;; esac
    next=''
  elif [ "$a" = -n ]; then next=1
  fi
done
printf '{"cmd": "attach", "args": ["%s"], "argv": [%s]}\n' "$vmid" "$words" >> @JOURNAL@
exec @REAL@ "$@"
"""


class PveHostError(RuntimeError):
    """The test host could not be brought up (the message says which piece and shows its log)."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    address: str
    vmids: tuple[int, ...]


DEFAULT_NODES = (NodeSpec("pve1", "127.0.0.2", (200, 201)), NodeSpec("pve2", "127.0.0.3", (300, 301)))


def missing_prerequisites() -> str | None:
    """Why this machine cannot run the test host, or None. Used by the pytest fixture to skip."""
    if os.geteuid() != 0:
        return "the local Proxmox test host needs root (LXC containers, sshd)"
    for path in (SSHD, SFTP_SERVER, INIT_LXC, "/usr/bin/python3"):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt install lxc openssh-server)"
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH (apt install lxc openssh-client tmux)"
    return None


def port_free(port: int, addresses: Sequence[str]) -> bool:
    for addr in addresses:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
            except OSError:
                return False
    return True


def find_free_port(addresses: Sequence[str], start: int = DEFAULT_PORT) -> int:
    for port in range(start, start + 200):
        if port_free(port, addresses):
            return port
    raise PveHostError(f"no free port from {start} on {', '.join(addresses)}")


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, cmdline) for every process we can see."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        table[int(entry)] = (ppid, cmd)
    return table


def _descendants(roots: set[int], table: dict[int, tuple[int, str]]) -> set[int]:
    found = set(roots)
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _) in table.items():
            if ppid in found and pid not in found:
                found.add(pid)
                changed = True
    return found


def shift_owners(root: Path, base: int, skip: Sequence[str] = ()) -> None:
    """Add `base` to the owner and group of root and everything under it (links themselves, not their targets),
    but for the top-level entries named in skip (mount points: their own directory is shifted, not what is in it)."""
    def shift(path: str) -> None:
        st = os.lstat(path)
        os.lchown(path, base + st.st_uid, base + st.st_gid)
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o6000:  # chown clears set-id bits; put them back
            os.chmod(path, stat.S_IMODE(st.st_mode))

    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            for name in skip:
                if name in dirnames:
                    dirnames.remove(name)
                    shift(os.path.join(dirpath, name))
        shift(dirpath)
        for name in filenames:
            shift(os.path.join(dirpath, name))
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                shift(os.path.join(dirpath, name))


def _run(argv: Sequence[str], what: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise PveHostError(f"{what} failed (exit {r.returncode}): {shlex.join(argv)}\n{r.stderr.strip()}")
    return r


@dataclass
class PveHost:
    """A running (or to-be-started) local Proxmox test host. See the module docstring for the layout."""

    base: Path
    port: int = DEFAULT_PORT
    nodes: tuple[NodeSpec, ...] = DEFAULT_NODES
    ct_ssh_vmid: int | None = 301
    ct_ssh_address: str = "127.0.0.4"
    small_tmpfs: Mapping[int, str] = field(default_factory=lambda: {300: "4m"})
    #: more containers on every node, numbered on from its last (benchmarks: 18 gives 20 a node); each only runs
    #: `sleep`, and starting one costs about 0.1 s at up()
    extra_cts: int = 0
    #: default containers made unprivileged (the idmap, their private dirs shifted to host uid 100000), for running
    #: whole modules against such containers: CTL_PVEHOST_UNPRIVILEGED=200,201 in the pvehost fixture
    unprivileged: tuple[int, ...] = ()
    _host_pub: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    _overlay: bool = field(default=True, repr=False, compare=False)  # up() finds out (_overlay_works)

    # --- naming ----------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        self.base = Path(self.base).resolve()
        if self.extra_cts:
            self.nodes = tuple(NodeSpec(n.name, n.address, (*n.vmids, *range(max(n.vmids) + 1,
                                                                             max(n.vmids) + 1 + self.extra_cts)))
                               for n in self.nodes)
            self.extra_cts = 0  # the nodes hold them now (load() of state.json must not add them again)

    @property
    def hosts(self) -> dict[str, tuple[str, int, str]]:
        """{host name: (address, port, node name)}; the host name is the node name."""
        return {n.name: (n.address, self.port, n.name) for n in self.nodes}

    @property
    def vmids(self) -> dict[str, list[int]]:
        return {n.name: list(n.vmids) for n in self.nodes}

    @property
    def ct_ssh(self) -> tuple[str, int]:
        """(address, port) of the sshd running inside container ct_ssh_vmid."""
        return (self.ct_ssh_address, self.port)

    @property
    def client_key(self) -> Path:
        return self.base / "keys" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.base / "keys" / "known_hosts"

    def node_of(self, vmid: int) -> NodeSpec:
        for n in self.nodes:
            if vmid in n.vmids:
                return n
        raise KeyError(f"no container {vmid} on this test host")

    def node_dir(self, node: str) -> Path:
        return self.base / node

    def lxcpath(self, node: str) -> Path:
        return self.node_dir(node) / "lxc"

    def rootfs(self, vmid: int) -> Path:
        """Host path of the container's root; /root, /tmp, /workspace, /etc there are private to it."""
        return self.lxcpath(self.node_of(vmid).name) / str(vmid) / "rootfs"

    def conf_path(self, vmid: int) -> Path:
        node = self.node_of(vmid).name
        return self.node_dir(node) / "etc-pve" / "nodes" / node / "lxc" / f"{vmid}.conf"

    def _lxc(self, tool: str, vmid: int, *args: str) -> list[str]:
        return [tool, "-P", str(self.lxcpath(self.node_of(vmid).name)), "-n", str(vmid), *args]

    # --- the PVE API (tests/pvehost/api.py) --------------------------------------------------------

    def _api_info(self) -> dict[str, Any]:
        try:
            info: dict[str, Any] = json.loads((self.base / "api" / "api.json").read_text())
        except (OSError, ValueError):
            raise PveHostError(f"the PVE API of the test host at {self.base} is not running") from None
        return info

    @property
    def api_url(self) -> str:
        """https://127.0.0.2:PORT (8006 when it was free); serves every node, as a cluster member does."""
        return str(self._api_info()["url"])

    @property
    def api_ca(self) -> Path:
        """The per-run CA that signed the API's certificate (IP SAN 127.0.0.2)."""
        return Path(self._api_info()["ca"])

    @property
    def api_token(self) -> tuple[str, str]:
        """(token id, secret): `root@pam!ctl` and a fresh uuid per run."""
        info = self._api_info()
        return str(info["token_id"]), str(info["token_secret"])

    def api_spec(self, node: str, secret_env: str = "PVE_TOKEN", **extra: Any) -> dict[str, Any]:
        """The inventory's `hosts.<node>.api` section for this API (put the secret into secret_env)."""
        return {"url": self.api_url, "node": node, "token_id": self.api_token[0], "token_secret_env": secret_env,
                "ca_file": str(self.api_ca), **extra}

    def set_api_auth_delay(self, seconds: float | None) -> None:
        """How long a bad token waits for its 401 (None: the default, 3 s like PVE). Takes effect at once."""
        f = self.base / "api" / "auth_delay"
        if seconds is None:
            f.unlink(missing_ok=True)
        else:
            f.write_text(f"{seconds}\n")

    def api_log_end(self) -> int:
        """Where the API's log ends now: api_requests(since=this) gives the requests that come after."""
        f = self.base / "api" / "api.log"
        return f.stat().st_size if f.exists() else 0

    def api_requests(self, since: int = 0) -> list[str]:
        """The requests the API answered after byte `since` of its log, each as "METHOD PATH STATUS" (the query
        left out), in the order it answered them."""
        with open(self.base / "api" / "api.log", "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return [f"{m.group(1)} {m.group(2)} {m.group(3)}"
                for m in re.finditer(r'"([A-Z]+) ([^ ?"]+)[^ "]* HTTP/1\.[01]" (\d{3}) ', text)]

    def _start_api(self) -> None:
        from tests.pvehost.api import make_certs

        d = self.base / "api"
        make_certs(d)
        token = d / "token.json"
        token.touch(mode=0o600)
        token.write_text(json.dumps({"id": "root@pam!ctl", "secret": str(uuid.uuid4())}))
        delay = os.environ.get("PVEHOST_API_AUTH_DELAY")
        if delay:
            self.set_api_auth_delay(float(delay))
        with open(d / "api.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.pvehost.api", "--base", str(self.base)], cwd=HERE.parents[1],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(HERE.parents[1])})
        (d / "api.pid").write_text(f"{proc.pid}\n")

    def _wait_api(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not (self.base / "api" / "api.json").exists():
            pid = int((self.base / "api" / "api.pid").read_text())
            if not _pid_alive(pid) or time.monotonic() > deadline:
                log = (self.base / "api" / "api.log").read_text(errors="replace")[-2000:]
                raise PveHostError(f"the PVE API did not come up:\n{log}")
            time.sleep(0.02)

    # --- client side -----------------------------------------------------------------------------

    def ssh_argv(self, host: str, *, multiplex: bool = False) -> list[str]:
        """`ssh ... root@addr` for a host name (pve1, pve2) or 'ct_ssh'; host keys are verified."""
        if host == "ct_ssh":
            address, port = self.ct_ssh
        else:
            address, port, _ = self.hosts[host]
        argv = [
            "ssh", "-F", "/dev/null", "-i", str(self.client_key), "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
            "-p", str(port),
        ]
        if multiplex:
            argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={self.base}/cm/%C",
                     "-o", "ControlPersist=120"]
        return [*argv, f"root@{address}"]

    def ssh(self, host: str, *argv: str, input: bytes | None = None, timeout: float = 60,
            multiplex: bool = True) -> subprocess.CompletedProcess[bytes]:
        """Run argv on a host over real SSH (quoted once with shlex.join); output is captured as bytes."""
        cmd = [*self.ssh_argv(host, multiplex=multiplex), "--", shlex.join(argv)]
        return subprocess.run(cmd, input=input, capture_output=True, timeout=timeout)

    # --- containers ------------------------------------------------------------------------------

    def running(self, vmid: int) -> bool:
        r = subprocess.run(self._lxc("lxc-info", vmid, "-s", "-H"), capture_output=True, text=True)
        return r.stdout.strip() == "RUNNING"

    def start(self, vmid: int) -> None:
        if self.running(vmid):
            return
        _run(self._lxc("lxc-start", vmid, "-d"), f"starting CT {vmid}")
        _run(self._lxc("lxc-wait", vmid, "-s", "RUNNING", "-t", "10"), f"waiting for CT {vmid}")

    def stop(self, vmid: int) -> None:
        if self.running(vmid):
            _run(self._lxc("lxc-stop", vmid, "-k"), f"stopping CT {vmid}")

    def set_host_network(self, vmid: int, on: bool, binds: Sequence[str | Path] = ()) -> None:
        """Restart CT `vmid` in the host's network namespace (`lxc.net.0.type = none`, as ct_ssh_vmid has) or back
        in an empty one of its own (loopback only), with read-only bind mounts of these host directories at the same
        paths (a venv with torch, and the python it links to). Containers that share the host's namespace reach
        each other on any 127.0.0.x, as nodes of a job do on a real network. What runs in the CT is lost."""
        ctdir = self.lxcpath(self.node_of(vmid).name) / str(vmid)
        lines = [line for line in (ctdir / "config").read_text().splitlines()
                 if not line.startswith("lxc.net.0.type") and not line.endswith(_BIND_OPTS)]
        lines.insert(4, f"lxc.net.0.type = {'none' if on else 'empty'}")
        for d in binds:
            d = str(Path(d).resolve())
            lines.append(f"lxc.mount.entry = {d} {d.lstrip('/')} {_BIND_OPTS}")
        conf = self.conf_path(vmid)
        pve = [line for line in conf.read_text().splitlines()
               if not line.startswith(("net0:", "lxc.net.0.type:"))]
        if on:
            pve.append("lxc.net.0.type: none")
        else:
            pve.append(f"net0: name=eth0,bridge=vmbr0,firewall=1,hwaddr=BC:24:11:{vmid >> 8 & 255:02X}:"
                       f"{vmid & 255:02X}:00,ip=dhcp,type=veth")
        self.stop(vmid)
        (ctdir / "config").write_text("\n".join(lines) + "\n")
        conf.write_text("\n".join(sorted(p for p in pve if not p.startswith("lxc."))
                                   + [p for p in pve if p.startswith("lxc.")]) + "\n")
        self.start(vmid)

    def add_unprivileged(self, vmid: int = 202, node: str = "pve1") -> None:
        """Add CT `vmid` to a running test host and start it: an unprivileged container (`unprivileged: 1`, the
        idmap pve-container writes: container ids 0..65535 are host ids 100000..165535) with a rootfs of its own,
        Debian bullseye with python3 3.9 (tests/pvehost/rootfs.py builds it once per machine), loopback only.

        Its files belong to host uid 100000 and up, so what container root writes (pct push, ctl's agent) does too;
        files a test writes through `rootfs(vmid)` from the host belong to host root, which the container sees as
        nobody (65534). `remove_container` takes it away again (state.json, `pct list` and inventory() follow)."""
        if any(vmid in n.vmids for n in self.nodes):
            raise PveHostError(f"CT {vmid} already exists on this test host")
        spec = next((n for n in self.nodes if n.name == node), None)
        if spec is None:
            raise PveHostError(f"no node {node} on this test host")
        why = ctroot.missing_subids()
        if why:
            raise PveHostError(why)
        tarball = ctroot.ensure()
        ctdir = self.lxcpath(node) / str(vmid)
        ctdir.mkdir()
        root = ctdir / "rootfs"
        try:
            ctroot.unpack(tarball, root)
        except BaseException:
            shutil.rmtree(ctdir, ignore_errors=True)
            raise
        uid = ctroot.ID_BASE
        smi = root / "usr" / "bin" / "nvidia-smi"  # where the driver's packages put it
        shutil.copyfile(HERE / "nvidia_smi.py", smi)
        smi.chmod(0o755)
        (root / "etc" / "hostname").write_text(f"ct{vmid}\n")
        (root / "workspace").mkdir(mode=0o755)
        for made in (smi, root / "etc" / "hostname", root / "workspace"):
            os.chown(made, uid, uid)  # as the container's own root made them
        lines = [
            f"lxc.uts.name = ct{vmid}",
            f"lxc.rootfs.path = dir:{root}",
            "lxc.mount.auto = proc:mixed sys:ro cgroup:mixed",
            "lxc.net.0.type = empty",
            "lxc.autodev = 1",
            "lxc.pty.max = 32",
            "lxc.apparmor.profile = unconfined",
            *ctroot.idmap_lines(),
            f"lxc.log.file = {ctdir / 'lxc.log'}",
            "lxc.log.level = WARN",
            # tini from the rootfs reaps orphans, as init.lxc does in the others (which this rootfs cannot run)
            "lxc.init.cmd = /usr/bin/tini -- /usr/bin/sleep infinity",
        ]
        (ctdir / "config").write_text("\n".join(lines) + "\n")
        pve = {
            "arch": "amd64", "cores": "8", "features": "nesting=1", "hostname": f"ct{vmid}", "memory": "65536",
            "net0": (f"name=eth0,bridge=vmbr0,firewall=1,hwaddr=BC:24:11:{vmid >> 8 & 255:02X}:{vmid & 255:02X}:00,"
                     "ip=dhcp,type=veth"),
            "ostype": "debian", "rootfs": f"local-zfs:subvol-{vmid}-disk-0,size=100G", "swap": "512",
            "unprivileged": "1",
        }
        self.nodes = tuple(NodeSpec(n.name, n.address, (*n.vmids, vmid)) if n.name == node else n
                           for n in self.nodes)
        self.conf_path(vmid).write_text("\n".join(f"{k}: {v}" for k, v in sorted(pve.items())) + "\n")
        self._rewrite_state()
        self.start(vmid)

    def ct_root_uid(self, vmid: int) -> int:
        """The host uid (and gid) of the container's root: 0, or 100000 in an unprivileged one."""
        conf = self.conf_path(vmid).read_text().splitlines()
        return ctroot.ID_BASE if "unprivileged: 1" in conf else 0

    def own_as_ct_root(self, vmid: int, *paths: Path, tree: bool = False) -> None:
        """Give what a test wrote through rootfs(vmid) to the container's root, as if it had made it there (in an
        unprivileged container, host root's files are nobody's and its root may not change them). With tree, also
        everything under each path that host root owns."""
        uid = self.ct_root_uid(vmid)
        for path in paths:
            todo = [Path(path)]
            if tree and Path(path).is_dir() and not Path(path).is_symlink():
                todo += [Path(d) / n for d, dirs, files in os.walk(path) for n in (*dirs, *files)]
            for p in todo:
                if p.lstat().st_uid == 0:
                    os.lchown(p, uid, uid)

    def remove_container(self, vmid: int) -> None:
        """Stop CT `vmid` and remove it: its config, its directory (rootfs and log), its snapshots."""
        node = self.node_of(vmid).name
        self.stop(vmid)
        self.conf_path(vmid).unlink(missing_ok=True)
        shutil.rmtree(self.lxcpath(node) / str(vmid))
        shutil.rmtree(self.node_dir(node) / "snapshots" / str(vmid), ignore_errors=True)
        self.nodes = tuple(NodeSpec(n.name, n.address, tuple(v for v in n.vmids if v != vmid)) for n in self.nodes)
        self._rewrite_state()

    def _rewrite_state(self) -> None:
        owner = _state(self.base).get("owner_pid")
        self._write_state(owner if isinstance(owner, int) else None)

    def set_gpus(
        self,
        vmid: int,
        count: int = 8,
        busy: Mapping[int, Sequence[tuple[int, int, str]]] | None = None,
        memory_used: Mapping[int, int] | None = None,
        *,
        utilization: Mapping[int, int] | None = None,
        name: str = "NVIDIA H100 80GB HBM3",
        memory_total: int = 81559,
        error: tuple[str, int] | None = None,
    ) -> None:
        """Give the container's nvidia-smi `count` GPUs; busy = {gpu: [(pid, used_mib, process_name)]}; `error`:
        NVML's failure (text, exit status) that nvidia-smi prints instead of answering.

        A GPU's memory.used is memory_used[gpu] if given, else the sum of its processes' memory;
        utilization.gpu is utilization[gpu] if given, else 97 when it has processes and 0 otherwise.
        """
        busy = dict(busy or {})
        memory_used = dict(memory_used or {})
        utilization = dict(utilization or {})
        gpus, procs = [], []
        for i in range(count):
            apps = busy.get(i, [])
            gpus.append({
                "index": i,
                "uuid": f"GPU-{vmid:08x}-{i:04x}-4c7a-8f00-{(vmid * 16 + i):012x}",
                "name": name,
                "bus_id": f"00000000:{0x18 + i * 0x10:02X}:00.0",
                "memory_total": memory_total,
                "memory_used": memory_used.get(i, sum(m for _, m, _ in apps)),
                "utilization": utilization.get(i, 97 if apps else 0),
            })
            procs += [{"gpu": i, "pid": pid, "used_memory": mib, "name": pname} for pid, mib, pname in apps]
        state: dict[str, Any] = {"gpus": gpus, "processes": procs}
        if error is not None:  # what NVML answers instead (tests/data/gpu_messages.json): (its text, exit status)
            state["error"] = {"text": error[0], "rc": error[1]}
        dest = self.rootfs(vmid) / GPU_STATE
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, dest)

    def clear_gpus(self, vmid: int) -> None:
        """No GPU state: nvidia-smi answers as if the driver were missing (exit 9)."""
        with contextlib.suppress(FileNotFoundError):
            (self.rootfs(vmid) / GPU_STATE).unlink()

    def pct_calls(self, node: str) -> list[dict[str, Any]]:
        """Every `pct` invocation on a node so far, oldest first, from its journal (<node>/pct.journal):
        {"t", "cmd", "args": positional arguments, "argv": an exec's first words}, each cut short; and every
        lxc-attach run outside pct (ctl's relay starting a staying agent as pct would): {"cmd": "attach",
        "args": [vmid], "argv": the words after `--`}, no "t"."""
        try:
            text = (self.node_dir(node) / "pct.journal").read_text()
        except FileNotFoundError:
            return []
        calls: list[dict[str, Any]] = [json.loads(line) for line in text.splitlines() if line.strip()]
        return calls

    # --- inventory -------------------------------------------------------------------------------

    def inventory(self, **extra: Any) -> dict[str, Any]:
        hosts: dict[str, Any] = {}
        for n in self.nodes:
            hosts[n.name] = {"address": n.address, "port": self.port, "user": "root",
                             "identity_file": str(self.client_key), "known_hosts": str(self.known_hosts)}
        containers: dict[str, Any] = {}
        gpus = {"target": [0, 1, 2, 3, 4], "drafter": [5, 6, 7]}
        for n in self.nodes:
            for vmid in n.vmids:
                if vmid == self.ct_ssh_vmid:
                    address, port = self.ct_ssh
                    containers[f"ct{vmid}"] = {
                        "host": n.name, "vmid": vmid, "transport": "ssh", "address": address, "port": port,
                        "user": "root", "identity_file": str(self.client_key),
                        "known_hosts": str(self.known_hosts), "gpus": gpus}
                else:
                    containers[f"ct{vmid}"] = {"host": n.name, "vmid": vmid, "transport": "pct", "gpus": gpus}
        doc: dict[str, Any] = {"hosts": hosts, "containers": containers}
        for key, value in extra.items():
            if key in ("hosts", "containers") and isinstance(value, Mapping):
                for name, fields in value.items():
                    if isinstance(fields, Mapping) and name in doc[key]:
                        doc[key][name] = {**doc[key][name], **fields}
                    else:
                        doc[key][name] = fields
            else:
                doc[key] = value
        return doc

    def write_inventory(self, path: str | Path, **extra: Any) -> Path:
        """Write inventory.yaml (DESIGN.md's shape) for these hosts and containers; extra = more keys."""
        import yaml

        p = Path(path)
        p.write_text(yaml.safe_dump(self.inventory(**extra), sort_keys=False))
        return p

    # --- bring-up --------------------------------------------------------------------------------

    def up(self, owner_pid: int | None = None) -> PveHost:
        """Tear down whatever is left at base, then build and start everything. Idempotent-ish.

        owner_pid marks a host that dies with that process (the pytest session): once the process is
        gone, `owner_alive` is false and a later session may reap the leftovers. None = manual, kept.
        """
        why = missing_prerequisites()
        if why:
            raise PveHostError(why)
        unknown = sorted(set(self.unprivileged) - {v for n in self.nodes for v in n.vmids})
        if unknown:
            raise PveHostError(f"unprivileged names CT {', '.join(map(str, unknown))}, which this test host does not "
                               "have (add_unprivileged adds one of its own)")
        if self.base.exists():
            down(self.base)
        addresses = [n.address for n in self.nodes] + ([self.ct_ssh_address] if self.ct_ssh_vmid else [])
        if not port_free(self.port, addresses):
            raise PveHostError(f"port {self.port} is taken on one of {', '.join(addresses)}")
        self.base.mkdir(parents=True, mode=0o755)
        try:
            self._write_state(owner_pid)
            self._keys()
            self._overlay = self._overlay_works()
            for n in self.nodes:
                self._node(n)
            self._known_hosts()
            self._start_api()
            for n in self.nodes:
                self._start_sshd(n)
            for n in self.nodes:
                for vmid in n.vmids:
                    self.start(vmid)
            self._wait_listening()
            self._wait_api()
        except BaseException:
            down(self.base)
            raise
        return self

    def down(self) -> None:
        down(self.base)

    def _write_state(self, owner_pid: int | None) -> None:
        state = {
            "base": str(self.base), "port": self.port, "owner_pid": owner_pid,
            "nodes": [{"name": n.name, "address": n.address, "vmids": list(n.vmids)} for n in self.nodes],
            "ct_ssh_vmid": self.ct_ssh_vmid, "ct_ssh_address": self.ct_ssh_address,
            "small_tmpfs": {str(k): v for k, v in self.small_tmpfs.items()},
            "unprivileged": list(self.unprivileged),
        }
        (self.base / "state.json").write_text(json.dumps(state, indent=1))

    def _keys(self) -> None:
        keys = self.base / "keys"
        keys.mkdir(mode=0o700)
        (self.base / "cm").mkdir(mode=0o700)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ctl-pvehost-client",
              "-f", str(self.client_key)], "ssh-keygen (client)")
        (keys / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())

    def _host_key(self, path: Path, comment: str) -> str:
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
             f"ssh-keygen ({comment})")
        kind, blob = Path(f"{path}.pub").read_text().split()[:2]
        return f"{kind} {blob}"

    def _known_hosts(self) -> None:
        lines = []
        for n in self.nodes:
            lines.append(f"{self._kh_name(n.address)} {self._host_pub[n.name]}")
        if self.ct_ssh_vmid:
            lines.append(f"{self._kh_name(self.ct_ssh_address)} {self._host_pub['ct_ssh']}")
        self.known_hosts.write_text("\n".join(lines) + "\n")

    def _kh_name(self, address: str) -> str:
        return address if self.port == 22 else f"[{address}]:{self.port}"

    def _node(self, n: NodeSpec) -> None:
        d = self.node_dir(n.name)
        (d / "bin").mkdir(parents=True)
        pct = d / "bin" / "pct"
        text = (HERE / "pct.py").read_text()
        pct.write_text(text.replace('NODE_JSON = ""', f"NODE_JSON = {json.dumps(str(d / 'node.json'))}", 1))
        pct.chmod(0o755)
        conf_dir = d / "etc-pve" / "nodes" / n.name / "lxc"
        conf_dir.mkdir(parents=True)
        (d / "snapshots").mkdir()
        self.lxcpath(n.name).mkdir()
        real_attach = os.path.realpath(shutil.which("lxc-attach", path=HOST_PATH_TAIL) or "/usr/bin/lxc-attach")
        if os.path.dirname(real_attach) in ("/usr/sbin", "/sbin"):  # the overlay would shadow it with the shim
            raise PveHostError(f"lxc-attach is {real_attach}: the journaling shim in /usr/sbin would hide it")
        (d / "node.json").write_text(json.dumps({
            "node": n.name, "address": n.address, "lxcpath": str(self.lxcpath(n.name)),
            "etc_pve": str(d / "etc-pve"), "snapdir": str(d / "snapshots"), "lxc_attach": real_attach}))
        shim = d / "bin" / "lxc-attach"
        shim.write_text(ATTACH_SHIM.replace("@JOURNAL@", shlex.quote(str(d / "pct.journal")))
                        .replace("@REAL@", shlex.quote(real_attach)))
        shim.chmod(0o755)
        # The host's nvidia-smi (its state under hostroot/, where tests/pvehost/gpu.py also fakes the host's /proc,
        # /dev and dpkg status for `ctl doctor`: CTL_GPU_HOST_ROOT below). No state: no driver, as in a container.
        (d / "hostroot" / "etc").mkdir(parents=True)
        smi = d / "bin" / "nvidia-smi"
        smi.write_text((HERE / "nvidia_smi.py").read_text().replace(
            'STATE = "/etc/ctl-fake-gpu.json"', f"STATE = {json.dumps(str(d / 'hostroot' / GPU_STATE))}", 1))
        smi.chmod(0o755)
        # The node's LXC at the default lxcpath of its SSH sessions (a bind over /etc/lxc in sshd's namespace),
        # as on Proxmox, where a plain `lxc-attach -n VMID` finds the container.
        (d / "etc-lxc").mkdir()
        for name in ("default.conf", "lxc.conf"):  # the machine's own, and then our lxcpath
            with contextlib.suppress(OSError):
                shutil.copy2(f"/etc/lxc/{name}", d / "etc-lxc" / name)
        with open(d / "etc-lxc" / "lxc.conf", "a") as f:
            f.write(f"lxc.lxcpath = {self.lxcpath(n.name)}\n")
        self._host_pub[n.name] = self._host_key(d / "ssh_host_ed25519_key", n.name)
        # With the overlay, pct is /usr/sbin/pct on the PATH, as on Proxmox (ctl's relay starts agents by
        # lxc-attach only where PATH finds that one); without it, bin/ goes first.
        path = HOST_PATH_TAIL if self._overlay else f"{d / 'bin'}:{HOST_PATH_TAIL}"
        (d / "sshd_config").write_text(f"""\
# sshd of the simulated Proxmox host {n.name}
Port {self.port}
ListenAddress {n.address}
HostKey {d / "ssh_host_ed25519_key"}
PidFile {d / "sshd.pid"}
AuthorizedKeysFile {self.base / "keys" / "authorized_keys"}
UsePAM no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
# the base dir lives under /tmp (world-writable), which StrictModes would refuse
StrictModes no
PrintMotd no
MaxStartups 64:30:128
MaxSessions 64
Subsystem sftp {SFTP_SERVER}
SetEnv PATH={path} PVE_NODE={n.name} SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt CTL_GPU_HOST_ROOT={d / "hostroot"}
""")
        for vmid in n.vmids:
            self._container(n, vmid)

    def _container(self, n: NodeSpec, vmid: int) -> None:
        ctdir = self.lxcpath(n.name) / str(vmid)
        root = ctdir / "rootfs"
        root.mkdir(parents=True)
        for sub in ("usr", "proc", "sys", "dev", *PRIVATE_DIRS, "var/tmp", "var/log", "var/lib", "run/sshd",
                    "etc/ssh"):
            (root / sub).mkdir(exist_ok=True)
        (root / "tmp").chmod(0o1777)
        (root / "var" / "tmp").chmod(0o1777)
        for link in ("bin", "lib", "lib64", "lib32", "libx32"):
            if os.path.isdir(f"/usr/{link}"):
                (root / link).symlink_to(f"usr/{link}")
        # /sbin comes first on pct's PATH: a real directory holding nvidia-smi and links to /usr/sbin.
        sbin = root / "sbin"
        sbin.mkdir()
        for entry in os.listdir("/usr/sbin"):
            (sbin / entry).symlink_to(f"/usr/sbin/{entry}")
        shutil.copyfile(HERE / "nvidia_smi.py", sbin / "nvidia-smi")
        (sbin / "nvidia-smi").chmod(0o755)
        for name in ETC_FILES:
            if os.path.exists(f"/etc/{name}"):
                shutil.copy2(f"/etc/{name}", root / "etc" / name)
        (root / "etc" / "os-release").symlink_to("../usr/lib/os-release")
        (root / "etc" / "hostname").write_text(f"ct{vmid}\n")
        host_net = vmid == self.ct_ssh_vmid
        init = "/usr/bin/sleep infinity"
        if host_net:
            self._host_pub["ct_ssh"] = self._host_key(root / "etc/ssh/ssh_host_ed25519_key", f"ct{vmid}")
            (root / "etc/ssh/authorized_keys").write_text((self.base / "keys" / "authorized_keys").read_text())
            (root / "etc/ssh/sshd_config").write_text(f"""\
# sshd inside CT {vmid} (host networking): the "container over direct SSH" endpoint
Port {self.port}
ListenAddress {self.ct_ssh_address}
HostKey /etc/ssh/ssh_host_ed25519_key
PidFile /run/sshd.pid
AuthorizedKeysFile /etc/ssh/authorized_keys
UsePAM no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PrintMotd no
MaxStartups 64:30:128
Subsystem sftp {SFTP_SERVER}
""")
            init = "/usr/sbin/sshd -D -f /etc/ssh/sshd_config -E /var/log/sshd.log"
        lines = [
            f"lxc.uts.name = ct{vmid}",
            f"lxc.rootfs.path = dir:{root}",
            "lxc.mount.entry = /usr usr none ro,bind 0 0",
            "lxc.mount.auto = proc:mixed sys:ro cgroup:mixed",
            f"lxc.net.0.type = {'none' if host_net else 'empty'}",
            "lxc.autodev = 1",
            "lxc.pty.max = 32",
            "lxc.apparmor.profile = unconfined",
            f"lxc.log.file = {ctdir / 'lxc.log'}",
            "lxc.log.level = WARN",
            # init.lxc reaps orphans (tmux servers, double forks) so no zombies pile up under a bare sleep
            f"lxc.init.cmd = {INIT_LXC} -n {vmid} -- {init}",
        ]
        pve_raw = ["lxc.cgroup2.devices.allow: c 195:* rwm"]
        pve = {
            "arch": "amd64", "cores": "8", "features": "nesting=1", "hostname": f"ct{vmid}",
            "memory": "65536", "ostype": "debian", "swap": "512",
            "rootfs": f"local-zfs:subvol-{vmid}-disk-0,size=100G",
        }
        if host_net:
            pve_raw.append("lxc.net.0.type: none")
        else:
            pve["net0"] = (f"name=eth0,bridge=vmbr0,firewall=1,hwaddr=BC:24:11:{vmid >> 8 & 255:02X}:"
                           f"{vmid & 255:02X}:00,ip=dhcp,type=veth")
        size = self.small_tmpfs.get(vmid)
        if size:
            (root / "workspace" / "small").mkdir()
            lines.append(f"lxc.mount.entry = tmpfs workspace/small tmpfs size={size},mode=0755 0 0")
            pve["mp0"] = f"local-zfs:subvol-{vmid}-disk-1,mp=/workspace/small,size={size.upper()}"
        if vmid in self.unprivileged:
            # The idmap pve-container writes for `unprivileged: 1`; the private dirs shifted to the mapped ids as a
            # restore into such a container leaves them (the host's /usr stays host root's: nobody's, inside).
            lines[-1:-1] = ctroot.idmap_lines()
            # Recursive: a container started by pct (in sshd's namespace, /usr/sbin an overlay) may not bind /usr
            # without what is mounted under it from a user namespace (EINVAL); it then sees pct in /usr/sbin.
            usr = lines.index("lxc.mount.entry = /usr usr none ro,bind 0 0")
            lines[usr] = "lxc.mount.entry = /usr usr none ro,rbind 0 0"
            pve["unprivileged"] = "1"
            shift_owners(root, ctroot.ID_BASE, skip=("usr",))
        (ctdir / "config").write_text("\n".join(lines) + "\n")
        conf = [f"{k}: {v}" for k, v in sorted(pve.items())] + pve_raw
        self.conf_path(vmid).write_text("\n".join(conf) + "\n")

    def _overlay_works(self) -> bool:
        """Whether this machine can lay an overlay on /usr/sbin in a mount namespace of its own (_start_sshd)."""
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                            'mount -t overlay pvehost -o ro,lowerdir="$1":/usr/sbin /usr/sbin', "sh", str(self.base)],
                           capture_output=True)
        return r.returncode == 0

    def _start_sshd(self, n: NodeSpec) -> None:
        """sshd in its own mount namespace where /usr/sbin is an overlay that adds pct (and the journaling
        lxc-attach), and /etc/lxc says that the node's lxcpath is the default one.

        Real Proxmox has /usr/sbin/pct and some peers call that absolute path. The overlay exists only in
        this sshd's namespace (gone with its last process); containers started from there still see the
        plain /usr/sbin, because their /usr is a non-recursive bind. Without overlayfs, plain sshd: pct is
        then only on PATH (SetEnv, bin/ first).
        """
        # sshd's privilege-separation directory is compiled in; the Debian unit creates it at boot.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        d = self.node_dir(n.name)
        sshd = [SSHD, "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")]
        # Root's dotfiles are Debian's defaults there, as on a Proxmox host: a developer's own (pyenv or conda
        # init in /root/.bashrc, which bash reads for every command sshd runs) would cost every SSH exec of the
        # simulated host, ctl's and the benchmark's floor alike, what no Proxmox host costs (~0.2 s here).
        script = ('mount -t overlay pvehost -o ro,lowerdir="$1":/usr/sbin /usr/sbin && '
                  '{ [ ! -d /etc/lxc ] || mount --bind "$2" /etc/lxc; } && '
                  'for f in bashrc profile; do h=$(getent passwd root | cut -d: -f6); '
                  '[ ! -f "$h/.$f" ] || [ ! -f "/usr/share/base-files/dot.$f" ] || '
                  'mount --bind -o ro "/usr/share/base-files/dot.$f" "$h/.$f" || exit; done && shift 2 && exec "$@"')
        if not self._overlay:  # its SetEnv PATH has bin/ first (_node)
            _run(sshd, f"sshd for {n.name}")
            return
        # The overlay works here (up() tried it): a failure now would leave sshd without the pct its PATH expects.
        _run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh", str(d / "bin"),
              str(d / "etc-lxc"), *sshd], f"sshd for {n.name} in its mount namespace")

    def _wait_listening(self, timeout: float = 10) -> None:
        targets = [n.address for n in self.nodes] + ([self.ct_ssh_address] if self.ct_ssh_vmid else [])
        deadline = time.monotonic() + timeout
        for addr in targets:
            while True:
                try:
                    socket.create_connection((addr, self.port), timeout=1).close()
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise PveHostError(f"nothing listens on {addr}:{self.port}: {e}") from None
                    time.sleep(0.05)


# --- teardown ------------------------------------------------------------------------------------


def _state(base: Path) -> dict[str, Any]:
    try:
        return json.loads((base / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def load(base: str | Path) -> PveHost:
    """The PveHost described by base/state.json (raises PveHostError when there is none)."""
    base = Path(base)
    st = _state(base)
    if not st:
        raise PveHostError(f"no test host at {base}")
    nodes = tuple(NodeSpec(n["name"], n["address"], tuple(n["vmids"])) for n in st["nodes"])
    return PveHost(base=base, port=st["port"], nodes=nodes, ct_ssh_vmid=st.get("ct_ssh_vmid"),
                   ct_ssh_address=st.get("ct_ssh_address", "127.0.0.4"),
                   small_tmpfs={int(k): v for k, v in st.get("small_tmpfs", {}).items()},
                   unprivileged=tuple(st.get("unprivileged", ())))


def leftover_processes(base: Path) -> dict[int, str]:
    """Processes that belong to the test host at base: sshd's (and their sessions), LXC monitors, ssh masters."""
    key = str(Path(base).resolve())
    table = _process_table()
    mine = {os.getpid()}
    pid = os.getpid()
    while pid in table and pid > 1:  # never our own ancestors (a shell running `down --dir BASE`)
        pid = table[pid][0]
        mine.add(pid)
    ours = (f"{SSHD} -f {key}/", f"sshd: {SSHD} -f {key}/", f"[lxc monitor] {key}/", f"ssh: {key}/cm/")
    roots = {pid for pid, (_, cmd) in table.items() if cmd.startswith(ours) and pid not in mine}
    for pidfile in [*Path(key).glob("*/sshd.pid"), Path(key) / "api" / "api.pid"]:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().split()[0])
            if pid in table:
                roots.add(pid)
    pids = _descendants(roots, table) - mine
    return {pid: table[pid][1] for pid in pids if pid in table}


def down(base: str | Path) -> None:
    """Kill the sshd's and everything under them, stop the containers, remove base. Safe to repeat."""
    base = Path(base).resolve()
    if not base.exists():
        return
    for sock in (base / "cm").glob("*") if (base / "cm").is_dir() else []:
        subprocess.run(["ssh", "-F", "/dev/null", "-o", f"ControlPath={sock}", "-O", "exit", "x"],
                       capture_output=True, timeout=10)
    # Stop the containers first: processes attached into them die with their pid namespace.
    for config in base.glob("*/lxc/*/config"):
        ctdir = config.parent
        subprocess.run(["lxc-stop", "-P", str(ctdir.parent), "-n", ctdir.name, "-k"], capture_output=True,
                       timeout=30)
    deadline = time.monotonic() + 5
    sig = signal.SIGTERM
    while True:
        procs = leftover_processes(base)
        if not procs:
            break
        if time.monotonic() > deadline:
            raise PveHostError("processes survived teardown: " + "; ".join(f"{p} {c}" for p, c in procs.items()))
        for pid in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(0.1)
        for pid in procs:  # the API server is a child of whoever ran up(): reap it, or it lingers as a zombie
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        sig = signal.SIGKILL
    shutil.rmtree(base, ignore_errors=True)
    if base.exists():  # a mount left behind (should not happen: tmpfs lives in the CT's namespace)
        raise PveHostError(f"could not remove {base}")


def owner_alive(base: Path) -> bool:
    """False only for a host whose owning process (see `PveHost.up`) has exited."""
    pid = _state(base).get("owner_pid")
    return not isinstance(pid, int) or _pid_alive(pid)
