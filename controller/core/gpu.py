"""GPU passthrough facts of a Proxmox host and one LXC container, read from text. Pure: no I/O.

What the host says (the kernel module's version file, /proc/devices, nvidia-smi's header and CSV, `pct config`)
and what a container says (its library file names) become small values here, and `fix_lines` writes the lines
that pass a device node through, in the style the container's config already uses: PVE's `devN:` entries
(ctl proposes them from PVE 8.2, which shows them in its GUI; the key exists since 8.1) or the older
`lxc.cgroup2.devices.allow` + `lxc.mount.entry` pair with the character-device majors of this host's boot
(nvidia-uvm's and nvidia-caps' majors are given out at module load and may change with a driver or a reboot).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024" (proprietary) and
# "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  (dvs-builder@...)" (open).
_NVRM = re.compile(r"NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
_SMI_HEAD = re.compile(r"Driver Version:\s*(\d+\.\d+(?:\.\d+)?)\s+CUDA Version:\s*(\d+\.\d+)")
_VERSION_SUFFIX = re.compile(r"\.so\.(\d+\.\d+(?:\.\d+)?)$")
_DEV_KEY = re.compile(r"^dev(\d+)$")
_ALLOW = re.compile(r"^lxc\.cgroup2?\.devices\.allow$")
_RULE = re.compile(r"^\s*([abc])\s+(\*|\d+):(\*|\d+)\s+([rwm]+)\s*$|^\s*a\s*$")
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")

#: The character devices' names in /proc/devices for each node (nvidia-frontend is 195 on every host; older
#: drivers call it "nvidia").
FRONTEND = ("nvidia-frontend", "nvidia")
UVM = "nvidia-uvm"
CAPS = "nvidia-caps"
#: The release from which `pct set --devN` is proposed (the `devN:` key itself exists since 8.1; 8.2 shows it in
#: the GUI).
DEV_STYLE_FROM = (8, 2)


def driver_version(version_file: str | None) -> str | None:
    """The kernel module's version from /proc/driver/nvidia/version; None when it is not there or unreadable."""
    if not version_file:
        return None
    m = _NVRM.search(version_file)
    return m.group(1) if m else None


def smi_header(text: str) -> tuple[str | None, str | None]:
    """(driver version, highest CUDA version the driver supports) from nvidia-smi's table header."""
    m = _SMI_HEAD.search(text)
    return (m.group(1), m.group(2)) if m else (None, None)


def char_majors(proc_devices: str) -> dict[str, int]:
    """name -> major of the character devices in /proc/devices (the block section is left out)."""
    out: dict[str, int] = {}
    section = ""
    for line in proc_devices.splitlines():
        s = line.strip()
        if s.endswith(":"):
            section = s
            continue
        parts = s.split(None, 1)
        if section.startswith("Character") and len(parts) == 2 and parts[0].isdigit():
            out.setdefault(parts[1], int(parts[0]))
    return out


def node_major(node: str, majors: dict[str, int]) -> int | None:
    """The major a node's driver registered on this host: 195 for the GPUs and nvidiactl, nvidia-uvm's for both
    uvm nodes, nvidia-caps' for the capability nodes (MIG). None when its module is not loaded."""
    if _GPU_NODE.match(node) or node == "/dev/nvidiactl":
        return next((majors[n] for n in FRONTEND if n in majors), None)
    if node in ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        return majors.get(UVM)
    if node.startswith("/dev/nvidia-caps/"):
        return majors.get(CAPS)
    return None


def lib_version(path: str | None) -> str | None:
    """550.54.15 from .../libnvidia-ml.so.550.54.15 (the file libnvidia-ml.so.1 links to)."""
    if not path:
        return None
    m = _VERSION_SUFFIX.search(path)
    return m.group(1) if m else None


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def pve_release(dpkg_status: str | None) -> tuple[int, int] | None:
    """(major, minor) of the installed pve-manager, from /var/lib/dpkg/status; None when it is not installed."""
    if not dpkg_status:
        return None
    for para in dpkg_status.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in para.splitlines() if ": " in line and not line[0].isspace())
        if fields.get("Package") == "pve-manager" and "installed" in fields.get("Status", "installed"):
            m = re.match(r"(\d+)\.(\d+)", fields.get("Version", ""))
            if m:
                return int(m.group(1)), int(m.group(2))
    return None


@dataclass(frozen=True)
class Rule:
    """One `lxc.cgroup2.devices.allow` rule: kind c/b/a, major and minor (None: any), access letters."""

    kind: str
    major: int | None
    minor: int | None
    access: str

    def allows(self, major: int, minor: int | None = None) -> bool:
        if self.kind == "a":
            return True
        return (self.kind == "c" and self.major in (None, major) and (self.minor is None or self.minor == minor)
                and set("rw") <= set(self.access))


@dataclass(frozen=True)
class CtConfig:
    """What of `pct config VMID` matters to GPU passthrough."""

    devs: dict[int, str] = field(default_factory=dict)  # N -> node path of `devN: /dev/x[,uid=..,gid=..,mode=..]`
    allow: tuple[Rule, ...] = ()
    mounts: tuple[str, ...] = ()  # the source path of every `lxc.mount.entry`
    unprivileged: bool = False
    lines: int = 0

    def passes(self, node: str) -> str | None:
        """How the config passes `node` through: 'devN', 'mount entry', or None."""
        for n, path in sorted(self.devs.items()):
            if path == node:
                return f"dev{n}"
        return "mount entry" if node in self.mounts else None

    def allowed(self, major: int | None, minor: int | None = None) -> bool:
        return major is not None and any(r.allows(major, minor) for r in self.allow)

    def style(self, pve: tuple[int, int] | None) -> str:
        """'dev' or 'cgroup': the style of the lines a fix adds. The container's own style wins; a container
        with neither gets devN entries on PVE 8.2 and later."""
        nvidia_dev = any(p.startswith("/dev/nvidia") for p in self.devs.values())
        nvidia_raw = any(p.startswith("/dev/nvidia") for p in self.mounts) or any(
            r.major is not None and r.major == 195 for r in self.allow)
        if nvidia_dev:
            return "dev"
        if nvidia_raw:
            return "cgroup"
        return "dev" if pve is not None and pve >= DEV_STYLE_FROM else "cgroup"

    def free_devs(self) -> list[int]:
        """devN indexes not taken, lowest first (enough for every node a container can need)."""
        return [n for n in range(64) if n not in self.devs]


def parse_config(text: str) -> CtConfig:
    """`pct config VMID` output: sorted `key: value` lines, raw `lxc.*` lines last; a snapshot's `[name]`
    section (which `pct config` does not print, but the file has) ends what counts."""
    devs: dict[int, str] = {}
    allow: list[Rule] = []
    mounts: list[str] = []
    unprivileged = False
    n = 0
    for line in text.splitlines():
        if line.startswith("["):
            break
        key, sep, value = line.partition(":")
        if not sep:
            continue
        n += 1
        key, value = key.strip(), value.strip()
        m = _DEV_KEY.match(key)
        if m:
            opts = value.split(",")
            path = opts[0].removeprefix("path=")
            for o in opts[1:]:
                if o.startswith("path="):
                    path = o[5:]
            devs[int(m.group(1))] = path
        elif _ALLOW.match(key):
            r = _RULE.match(value)
            if r and r.group(1):
                allow.append(Rule(r.group(1), None if r.group(2) == "*" else int(r.group(2)),
                                  None if r.group(3) == "*" else int(r.group(3)), r.group(4)))
            elif r:
                allow.append(Rule("a", None, None, "rwm"))
        elif key == "lxc.mount.entry":
            src = value.split()
            if src:
                mounts.append(src[0])
        elif key == "unprivileged":
            unprivileged = value == "1"
    return CtConfig(devs, tuple(allow), tuple(mounts), unprivileged, n)


def mount_entry(node: str) -> str:
    """The bind mount of a device node, as the PVE wiki and forum guides write it (optional: the container still
    starts when the node is missing on the host; create=file: LXC makes the mount point)."""
    return f"lxc.mount.entry: {node} {node.lstrip('/')} none bind,optional,create=file"


@dataclass(frozen=True)
class Fix:
    """What fixes a failing check: `where` it is done ('pve1', 'ct200', '/etc/pve/lxc/200.conf on pve1'), a
    `lead` that says what the lines are, and the exact `lines`."""

    where: str
    lead: str
    lines: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"where": self.where, "what": self.lead, "lines": list(self.lines)}


def node_fixes(host: str, vmid: int, nodes: list[str], cfg: CtConfig, majors: dict[str, int],
               pve: tuple[int, int] | None, *, denied: frozenset[str] = frozenset()) -> list[Fix]:
    """The config lines that pass `nodes` through to container `vmid`, in the style its config uses, and the pct
    commands that write them (devN style), then the restart that applies them. `denied`: nodes that are there
    but the cgroup refuses: in the cgroup style only their allow rules are missing, not their mount entries."""
    conf = f"/etc/pve/lxc/{vmid}.conf"
    out: list[Fix] = []
    if cfg.style(pve) == "dev":
        free = cfg.free_devs()
        todo = [node for node in nodes if not (cfg.passes(node) or "").startswith("dev")]
        pairs = list(zip(free, todo, strict=False))
        if pairs:
            out.append(Fix(host, f"run on {host} (or add the lines below to {conf})",
                           tuple(f"pct set {vmid} --dev{n} {node}" for n, node in pairs)))
            out.append(Fix(f"{conf} on {host}", "the lines that command writes", tuple(
                f"dev{n}: {node}" for n, node in pairs)))
    else:
        lines: list[str] = []
        unknown: list[str] = []
        for node in nodes:
            major = node_major(node, majors)
            if major is None:
                unknown.append(node)
                continue
            rule = f"lxc.cgroup2.devices.allow: c {major}:* rwm"
            if not cfg.allowed(major) and rule not in lines:
                lines.append(rule)
        lines += [mount_entry(node) for node in nodes if node not in cfg.mounts and node not in denied]
        if lines:
            out.append(Fix(f"{conf} on {host}", f"add to {conf} (majors from {host}'s /proc/devices)", tuple(lines)))
        if unknown:
            out.append(Fix(host, "load the module first: the host has no major for " + ", ".join(unknown),
                           ("nvidia-modprobe -u -c=0",)))
    if out:
        out.append(Fix(host, "then restart the container (passthrough applies at start)", (f"pct reboot {vmid}",)))
    return out


def installer_line(version: str, machine: str = "x86_64") -> str:
    """NVIDIA's .run installer of the host's driver version, without its kernel module: what a container needs
    (the user-space libraries and nvidia-smi of exactly the host's version)."""
    return f"sh NVIDIA-Linux-{machine}-{version}.run --no-kernel-module"


# The lowest Linux driver of each CUDA release (CUDA toolkit release notes, "CUDA Toolkit and Corresponding
# Driver Versions"). A build for a newer minor of the same major may still run on an older driver of that major
# (minor version compatibility), without PTX JIT and newer features; a newer major never does.
MIN_DRIVER = {
    "11.8": "520.61.05", "12.0": "525.60.13", "12.1": "530.30.02", "12.2": "535.54.03", "12.3": "545.23.06",
    "12.4": "550.54.14", "12.5": "555.42.02", "12.6": "560.28.03", "12.8": "570.26", "12.9": "575.51.03",
    "13.0": "580.65.06",
}


def cuda_wheel_tag(cuda: str) -> str:
    """12.4 -> cu124: the suffix of PyTorch's wheel index (download.pytorch.org/whl/cu124)."""
    return "cu" + cuda.replace(".", "")
