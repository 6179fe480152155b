"""A GPU setup for the test host, which has neither GPUs nor NVIDIA's driver: what `ctl doctor` reads, faked on
each side with the real thing wherever it can run here.

Host side (a node's `hostroot/`, which its sshd names in CTL_GPU_HOST_ROOT): the kernel module's version file,
/proc/devices with this boot's majors, the /dev/nvidia* names, dpkg's status of pve-manager, each compute
process's /proc/PID/cgroup, and the state of the host's nvidia-smi stand-in.

Container side, inside the running container (lxc-attach: its own mount namespace and /dev):
- device nodes are real character devices made with mknod: `ok` is major 1 minor 3 (the kernel's null device:
  it opens), `denied` is 1:7 (full) refused by the container's devices cgroup (a deny rule written from the
  host, as a missing allow rule leaves it: open() gets EPERM), `nodriver` a major no driver registered on this
  machine (open() gets ENXIO), `file` an empty plain file (what `create=file` leaves when the bind mount found no
  node on the host);
- /proc/driver is a tmpfs holding nvidia/version (the container's view of the host's module);
- libnvidia-ml.so.1 / libcuda.so.1 link to versioned (empty) files in /opt/nvidia/lib, named in
  /etc/ld.so.conf.d as the dynamic linker reads it;
- /dev/shm is a tmpfs of the size asked.
`reset_ct` undoes all of it (a restart, which drops the mounts, nodes and cgroup rules, and the files).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.pvehost.host import GPU_STATE, PveHost

NO_DRIVER_MAJOR = 240  # LANANA's "local/experimental use": nothing registers it here (checked in place())
NODE_KINDS = {"ok": (1, 3), "denied": (1, 7), "nodriver": (NO_DRIVER_MAJOR, 0)}


def version_file(driver: str, date: str = "Tue Feb 20 19:38:48 UTC 2024") -> str:
    """/proc/driver/nvidia/version of the open kernel module (two lines, as the driver writes it)."""
    return (f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver}  Release Build  "
            f"(dvs-builder@U16-I3-B03-4-3)  {date}\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


def set_host(h: PveHost, node: str, *, driver: str = "550.54.15", cuda: str = "12.4", count: int = 8,
             uvm_major: int = 508, caps_major: int = 511, caps: bool = False, pve: str | None = "8.2.4",
             apps: Sequence[tuple[int, int, str, int, int | None]] = (), persistence: bool = True) -> None:
    """A host with `count` GPUs of driver `driver`; apps = [(gpu, host pid, name, MiB, vmid or None)]."""
    root = h.node_dir(node) / "hostroot"
    clear_host(h, node)
    (root / "proc" / "driver" / "nvidia").mkdir(parents=True)
    (root / "proc" / "driver" / "nvidia" / "version").write_text(version_file(driver))
    chars = [(1, "mem"), (4, "tty"), (5, "/dev/tty"), (10, "misc"), (136, "pts"), (195, "nvidia-frontend"),
             (uvm_major, "nvidia-uvm"), (caps_major, "nvidia-caps")]
    (root / "proc" / "devices").write_text(
        "Character devices:\n" + "".join(f"{m:3d} {n}\n" for m, n in sorted(chars))
        + "\nBlock devices:\n  7 loop\n259 blkext\n")
    dev = root / "dev"
    dev.mkdir()
    for name in [*(f"nvidia{i}" for i in range(count)), "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
                 "nvidia-modeset"]:
        (dev / name).touch()
    if caps:
        (dev / "nvidia-caps").mkdir()
        for name in ("nvidia-cap1", "nvidia-cap2"):
            (dev / "nvidia-caps" / name).touch()
    if pve is not None:
        (root / "var" / "lib" / "dpkg").mkdir(parents=True)
        (root / "var" / "lib" / "dpkg" / "status").write_text(
            "Package: libc6\nStatus: install ok installed\nVersion: 2.36-9+deb12u7\n\n"
            f"Package: pve-manager\nStatus: install ok installed\nArchitecture: amd64\nVersion: {pve}\n\n")
    gpus = [{"index": i, "uuid": f"GPU-{node}-{i:04x}-4c7a-8f00-0000000000{i:02x}", "name": "NVIDIA H100 80GB HBM3",
             "bus_id": f"00000000:{0x18 + i * 0x10:02X}:00.0", "memory_total": 81559,
             "memory_used": sum(a[3] for a in apps if a[0] == i), "utilization": 0, "persistence": persistence}
            for i in range(count)]
    procs = []
    for gpu, pid, name, mib, vmid in apps:
        procs.append({"gpu": gpu, "pid": pid, "name": name, "used_memory": mib})
        (root / "proc" / str(pid)).mkdir(parents=True)
        # cgroup v2 on PVE 8: a container's processes are under /lxc/VMID/ns/
        (root / "proc" / str(pid) / "cgroup").write_text(
            f"0::/lxc/{vmid}/ns/user.slice\n" if vmid is not None else "0::/system.slice/ollama.service\n")
    (root / GPU_STATE).write_text(json.dumps({"gpus": gpus, "processes": procs, "driver_version": driver,
                                              "cuda_version": cuda}))


def clear_host(h: PveHost, node: str) -> None:
    """No NVIDIA driver on the host at all (and no Proxmox package list): only hostroot/etc stays."""
    root = h.node_dir(node) / "hostroot"
    for entry in root.iterdir():
        if entry.name != "etc":
            shutil.rmtree(entry)
    (root / GPU_STATE).unlink(missing_ok=True)


def _attach(h: PveHost, vmid: int, script: str) -> None:
    node = h.node_of(vmid).name
    r = subprocess.run(["lxc-attach", "-P", str(h.lxcpath(node)), "-n", str(vmid), "--", "/bin/sh", "-ec", script],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise AssertionError(f"in CT {vmid}: {script!r} exited {r.returncode}: {r.stderr}")


def _devices_cgroup(h: PveHost, vmid: int) -> Path:
    """The container's cgroup v1 devices directory (where a deny rule takes effect at once)."""
    node = h.node_of(vmid).name
    pid = subprocess.run(["lxc-info", "-P", str(h.lxcpath(node)), "-n", str(vmid), "-p", "-H"], capture_output=True,
                         text=True, check=True).stdout.strip()
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "devices" in controllers.split(","):
            return Path("/sys/fs/cgroup/devices") / path.lstrip("/")
    raise AssertionError(f"CT {vmid} has no devices cgroup (cgroup v1 devices controller needed)")


def place(h: PveHost, vmid: int, nodes: Mapping[str, str], *, driver: str | None = "550.54.15",
          libs: str | None = "550.54.15", shm_mib: int | None = 16384) -> None:
    """Inside running CT vmid: nodes = {path: ok|denied|nodriver|file}; the driver the container sees (None: no
    /proc/driver/nvidia); user-space libraries of version `libs` (None: none); /dev/shm of shm_mib MiB."""
    assert f"{NO_DRIVER_MAJOR} " not in Path("/proc/devices").read_text().split("Block")[0]
    lines = []
    for path, kind in nodes.items():
        lines.append(f"mkdir -p {Path(path).parent}")
        if kind == "file":
            lines.append(f": > {path}")
        else:
            major, minor = NODE_KINDS[kind]
            lines.append(f"rm -f {path}; mknod -m 0666 {path} c {major} {minor}")
    if driver is not None:
        lines.append("mount -t tmpfs -o size=1m,mode=0555 ctl-test-driver /proc/driver && mkdir -p /proc/driver/nvidia")
        lines.append("cat > /proc/driver/nvidia/version <<'EOF'\n" + version_file(driver) + "EOF")
    if shm_mib is not None:
        lines.append(f"mkdir -p /dev/shm && mount -t tmpfs -o size={shm_mib}m,mode=1777 shm /dev/shm")
    _attach(h, vmid, "\n".join(lines) or "true")
    root = h.rootfs(vmid)
    if libs is not None:
        lib = root / "opt" / "nvidia" / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        for name in ("libnvidia-ml.so", "libcuda.so"):
            (lib / f"{name}.{libs}").touch()
            (lib / f"{name}.1").unlink(missing_ok=True)
            (lib / f"{name}.1").symlink_to(f"{name}.{libs}")
        (root / "etc" / "ld.so.conf.d").mkdir(exist_ok=True)
        (root / "etc" / "ld.so.conf.d" / "nvidia.conf").write_text("/opt/nvidia/lib\n")
        if not (root / "etc" / "ld.so.conf").exists():
            (root / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    denied = [NODE_KINDS["denied"] for kind in nodes.values() if kind == "denied"]
    if denied:
        (_devices_cgroup(h, vmid) / "devices.deny").write_text("c 1:7 rw\n")


def set_config(h: PveHost, vmid: int, lines: Sequence[str], *, unprivileged: bool = False) -> None:
    """Replace the GPU lines of the container's Proxmox config (what `pct config` prints) with `lines`."""
    conf = h.conf_path(vmid)
    keep = [x for x in conf.read_text().splitlines()
            if not x.startswith(("dev", "lxc.cgroup2.devices", "lxc.mount.entry: /dev/nvidia", "unprivileged"))]
    plain = sorted([*[x for x in keep if not x.startswith("lxc.")], *[x for x in lines if not x.startswith("lxc.")],
                    *(["unprivileged: 1"] if unprivileged else [])])
    raw = [x for x in keep if x.startswith("lxc.")] + [x for x in lines if x.startswith("lxc.")]
    conf.write_text("\n".join(plain + raw) + "\n")


def reset_ct(h: PveHost, vmid: int, config: Sequence[str] = ("lxc.cgroup2.devices.allow: c 195:* rwm",)) -> None:
    """Back to the test host's plain container: restarted (nodes, mounts and cgroup rules gone), no libraries,
    the config's GPU lines as up() writes them."""
    root = h.rootfs(vmid)
    shutil.rmtree(root / "opt" / "nvidia", ignore_errors=True)
    (root / "etc" / "ld.so.conf.d" / "nvidia.conf").unlink(missing_ok=True)
    set_config(h, vmid, list(config))
    h.stop(vmid)
    h.start(vmid)


def messages() -> dict[str, Any]:
    """tests/data/gpu_messages.json: the real tools' messages for each failure, with where each was read."""
    return json.loads((Path(__file__).resolve().parents[1] / "data" / "gpu_messages.json").read_text())
