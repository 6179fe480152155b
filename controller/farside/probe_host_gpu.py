"""A Proxmox host's side of GPU passthrough; prints ONE JSON document (stdlib only, Python >= 3.8).

Run by `ctl doctor` on the host as `python3 - SPEC` with this source on stdin: one exec for every container of
that host it examines. It only reads: the kernel module's version file, /proc/devices (the majors of this boot),
the host's /dev/nvidia* nodes, pve-manager's version (dpkg's status file), `nvidia-smi` (its header, the GPUs and
the compute processes, all three at once), `pct config VMID` for each container (side by side), and for each
compute process the cgroup that says which container it runs in (`/lxc/VMID/...` on Proxmox).

SPEC (JSON): {"vmids": [VMID, ...]}.

CTL_GPU_HOST_ROOT, when set, is a directory that stands for the host's / for the file reads above (what a test
host without a GPU, a driver or Proxmox sets in its sshd's environment); a real host has no such variable.
"""

import json
import os
import platform
import re
import sys
import time

from .procs import _finish, _start

ROOT = os.environ.get("CTL_GPU_HOST_ROOT", "").rstrip("/")
_TIMEOUT = 30.0
_CGROUP = re.compile(r"(?:^|/)lxc(?:\.payload)?[./](\d+)(?:/|$)")


def _read(path, limit=65536):
    try:
        with open(ROOT + path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return None


def _wait(proc, deadline):
    return _finish(proc, max(0.1, deadline - time.monotonic()), "no answer within %ss" % _TIMEOUT, 65536)


def _nodes():
    """The host's NVIDIA device nodes (names only: their majors come from /proc/devices)."""
    out = []
    try:
        names = sorted(os.listdir(ROOT + "/dev"))
    except OSError:
        names = []
    for n in names:
        if n.startswith("nvidia") and n != "nvidia-caps":
            out.append("/dev/" + n)
    try:
        out += sorted("/dev/nvidia-caps/" + n for n in os.listdir(ROOT + "/dev/nvidia-caps"))
    except OSError:
        pass
    return out


def _owner(pid):
    """The container a host process runs in, from its cgroup (None: the host's own, or gone)."""
    text = _read("/proc/%d/cgroup" % pid, 8192) or ""
    for line in text.splitlines():
        m = _CGROUP.search(line.split(":", 2)[-1])
        if m:
            return int(m.group(1))
    return None


def main(argv):
    try:
        spec = json.loads(argv[0]) if argv else {}
    except ValueError:
        spec = {}
    vmids = [int(v) for v in spec.get("vmids", []) if str(v).isdigit()]
    deadline = time.monotonic() + _TIMEOUT
    smi = {
        "table": _start(["nvidia-smi"]),
        "gpus": _start(["nvidia-smi", "--query-gpu=index,uuid,name,persistence_mode,pci.bus_id",
                        "--format=csv,noheader"]),
        "apps": _start(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                        "--format=csv,noheader,nounits"]),
    }
    configs = {str(v): _start(["pct", "config", str(v)]) for v in vmids}
    doc = {
        "driver_file": _read("/proc/driver/nvidia/version", 4096),
        "devices": _read("/proc/devices"),
        "dpkg": _pve_manager(),
        "machine": platform.machine(),
        "nodes": _nodes(),
    }
    doc["smi"] = {k: _wait(p, deadline) for k, p in smi.items()}
    doc["configs"] = {k: _wait(p, deadline) for k, p in configs.items()}
    owners = {}
    for line in doc["smi"]["apps"]["out"].splitlines() if doc["smi"]["apps"]["rc"] == 0 else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].isdigit():
            owners[parts[1]] = _owner(int(parts[1]))
    doc["owners"] = owners
    sys.stdout.write(json.dumps(doc) + "\n")
    return 0


def _pve_manager():
    """pve-manager's paragraph of dpkg's status file (its version says whether `devN:` entries exist)."""
    text = _read("/var/lib/dpkg/status", 64 << 20) or ""
    at = text.find("Package: pve-manager\n")
    if at < 0:
        return None
    end = text.find("\n\n", at)
    return text[at:end if end >= 0 else len(text)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
