"""`ctl doctor`'s judgement: a container's GPU setup, seen from its Proxmox host and from inside, as one line per
check (ok, warn, FAIL), what was seen, and for a failure the exact lines that fix it. Pure: no I/O.

The host's answer (farside/probe_host_gpu.py) becomes a `HostView`; the container's (farside/probe_gpu.py) stays
the document it is, read defensively (it comes from a container: untrusted); `judge` puts them against what the
inventory expects of the container (`Expect`). `quick` is the subset `ctl launch` runs from the container's view
alone: nodes that open, and user space of the driver's version.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from controller.core.gpu import (
    MIN_DRIVER,
    CtConfig,
    Fix,
    char_majors,
    cuda_wheel_tag,
    driver_version,
    installer_line,
    lib_version,
    node_fixes,
    node_major,
    parse_config,
    pve_release,
    smi_header,
    version_tuple,
)

OK, WARN, FAIL = "ok", "warn", "FAIL"
SHM_MIN = 1 << 30  # NCCL's shared-memory transport and the pipeline's IPC want more than a container's 64 MB default
CORE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
#: Nodes that only some tools need (profilers, MIG): missing is a warning, not a failure.
SOFT_NODES = ("/dev/nvidia-uvm-tools",)
_CAPS = "/dev/nvidia-caps/"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | FAIL
    seen: str
    fixes: tuple[Fix, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"check": self.name, "status": self.status, "seen": self.seen,
                "fix": [f.to_json() for f in self.fixes]}


@dataclass(frozen=True)
class HostGpu:
    """One GPU as the host's nvidia-smi lists it."""

    index: int
    uuid: str
    name: str
    persistence: bool | None


@dataclass(frozen=True)
class App:
    gpu_uuid: str
    pid: int
    name: str
    mib: int | None
    vmid: int | None  # the container it runs in; None: the host's own


@dataclass(frozen=True)
class HostView:
    """One host's answer, parsed."""

    host: str
    driver: str | None
    cuda: str | None  # the highest CUDA the driver supports (nvidia-smi's header)
    smi_error: str | None
    gpus: tuple[HostGpu, ...]
    apps: tuple[App, ...]
    majors: dict[str, int]
    pve: tuple[int, int] | None
    machine: str
    nodes: tuple[str, ...]
    configs: dict[int, CtConfig] = field(default_factory=dict)
    config_errors: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Expect:
    """What the inventory says of a container: where it runs, its GPU split, its job's network."""

    ct: str
    host: str | None
    vmid: int | None
    split: tuple[int, ...]
    cuda_visible: str
    venv: str | None = None
    job: str | None = None  # the job it is a node of
    address: str | None = None  # a job node's `address:`
    ifname: str | None = None  # NCCL_SOCKET_IFNAME from `nccl:`
    inventory: str = "inventory.yaml"

    @property
    def where(self) -> str:
        return self.host or self.ct


def clean(text: str, limit: int = 300) -> str:
    """A tool's message as one short line: control characters out, lines joined."""
    lines = [re.sub(r"[\x00-\x1f\x7f]", "", x).strip() for x in text.splitlines()]
    out = " / ".join(x for x in lines if x)
    return out if len(out) <= limit else out[:limit] + "..."


def _dict(v: Any) -> dict[str, Any]:
    """v when it is a mapping (a container's answer is read defensively), else an empty one."""
    return v if isinstance(v, dict) else {}


def _out(doc: Any, key: str) -> tuple[int, str, str]:
    r = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(r, dict):
        return 127, "", ""
    rc = r.get("rc")
    return (rc if isinstance(rc, int) else 1, str(r.get("out") or ""), str(r.get("err") or ""))


def host_view(host: str, doc: dict[str, Any]) -> HostView:
    """probe_host_gpu.py's document, parsed (it comes from the host: trusted, but read defensively)."""
    driver = driver_version(doc.get("driver_file") if isinstance(doc.get("driver_file"), str) else None)
    rc, out, err = _out(doc.get("smi"), "table")
    head_driver, cuda = smi_header(out) if rc == 0 else (None, None)
    smi_error = None if rc == 0 else clean(out + "\n" + err) or f"nvidia-smi exited {rc}"
    gpus: list[HostGpu] = []
    rc, out, _ = _out(doc.get("smi"), "gpus")
    for line in out.splitlines() if rc == 0 else []:
        p = [x.strip() for x in line.split(",")]
        if len(p) >= 4 and p[0].isdigit():
            gpus.append(HostGpu(int(p[0]), p[1], p[2], {"Enabled": True, "Disabled": False}.get(p[3])))
    owners = _dict(doc.get("owners"))
    apps: list[App] = []
    rc, out, _ = _out(doc.get("smi"), "apps")
    for line in out.splitlines() if rc == 0 else []:
        p = [x.strip() for x in line.split(",")]
        if len(p) >= 4 and p[1].isdigit():
            owner = owners.get(p[1])
            apps.append(App(p[0], int(p[1]), p[2], int(p[3]) if p[3].isdigit() else None,
                            owner if isinstance(owner, int) else None))
    configs: dict[int, CtConfig] = {}
    errors: dict[int, str] = {}
    for key, r in (doc.get("configs") or {}).items():
        if not str(key).isdigit() or not isinstance(r, dict):
            continue
        if r.get("rc") == 0:
            configs[int(key)] = parse_config(str(r.get("out") or ""))
        else:
            errors[int(key)] = clean(str(r.get("err") or "") or str(r.get("out") or "")) or f"exit {r.get('rc')}"
    return HostView(host, driver or head_driver, cuda, smi_error, tuple(gpus), tuple(apps),
                    char_majors(str(doc.get("devices") or "")), pve_release(doc.get("dpkg")),
                    str(doc.get("machine") or "x86_64"), tuple(n for n in doc.get("nodes") or [] if isinstance(n, str)),
                    configs, errors)


def needed_nodes(split: tuple[int, ...], host_nodes: tuple[str, ...] = ()) -> list[str]:
    """Every node the split needs in the container: each GPU's, nvidiactl, both uvm nodes, and the host's
    nvidia-caps nodes (MIG), where it has them."""
    caps = [n for n in host_nodes if n.startswith(_CAPS)]
    return [*(f"/dev/nvidia{i}" for i in split), *CORE_NODES, *SOFT_NODES, *caps]


def _nodes(node_docs: Any) -> dict[str, dict[str, Any]]:
    return {str(k): v for k, v in node_docs.items() if isinstance(v, dict)} if isinstance(node_docs, dict) else {}


# --- the checks ------------------------------------------------------------------------------------


def host_driver(h: HostView) -> Check:
    if h.driver is None:
        seen = (f"no NVIDIA driver loaded on {h.host}: /proc/driver/nvidia/version is missing"
                + (f"; nvidia-smi: {h.smi_error}" if h.smi_error else ""))
        return Check("host driver", FAIL, seen, (Fix(h.host, "install the driver on the host and load it (the "
                                                      "containers get only its user space)",
                                                      ("apt install proxmox-default-headers",
                                                       "sh NVIDIA-Linux-x86_64-<VERSION>.run  # from nvidia.com",
                                                       "nvidia-modprobe -u -c=0")),))
    n = len(h.gpus)
    pm = [g.index for g in h.gpus if g.persistence is False]
    seen = f"{h.driver}" + (f" (CUDA {h.cuda} at most)" if h.cuda else "") + f", {n} GPU{'s' * (n != 1)}"
    if h.smi_error:
        return Check("host driver", WARN, f"{seen}; nvidia-smi on {h.host}: {h.smi_error}")
    if pm:
        return Check("host driver", WARN, f"{seen}; persistence mode off on GPU {','.join(map(str, pm))} "
                     "(each CUDA start re-initialises them)", (Fix(h.host, "turn it on (or run nvidia-persistenced)",
                                                                   ("nvidia-smi -pm 1",)),))
    return Check("host driver", OK, seen + (", persistence mode on" if h.gpus else ""))


def node_checks(e: Expect, h: HostView | None, nodes: dict[str, dict[str, Any]]) -> list[Check]:
    """Each node the split needs, present and openable in the container; a failing one names why (the errno).
    The config lines for every node that is missing or denied are computed together (one set of devN indexes,
    one allow rule per major) and shown once, under the first of them."""
    want = needed_nodes(e.split, h.nodes if h else ())
    cfg = h.configs.get(e.vmid) if h and e.vmid is not None else None
    problems: list[tuple[str, bool, str, list[Fix], str | None]] = []  # path, soft, seen, own fixes, config need
    fine: list[str] = []
    for path in want:
        d = nodes.get(path, {})
        if d.get("opens") and d.get("char"):
            fine.append(path)
            continue
        seen, fixes, need = _node_problem(e, h, cfg, path, d)
        problems.append((path, path in SOFT_NODES or path.startswith(_CAPS), seen, fixes, need))
    if not problems:
        return [Check("device nodes", OK, f"{len(fine)} present and openable: " + ", ".join(
            p.removeprefix("/dev/") for p in fine))]
    config = [p[0] for p in problems if p[4] is not None]
    denied = frozenset(p[0] for p in problems if p[4] == "denied")
    shared = _config_fixes(e, h, cfg, config, denied) if config else []
    out: list[Check] = []
    for path, soft, seen, fixes, need in problems:
        if need is not None and path != config[0]:
            seen += f" (the lines under node {config[0]} cover it)"
        elif need is not None:
            fixes = [*fixes, *shared]
        out.append(Check(f"node {path}", WARN if soft else FAIL, seen, tuple(fixes)))
    return out


def _config_fixes(e: Expect, h: HostView | None, cfg: CtConfig | None, paths: list[str], denied: frozenset[str]
                  ) -> list[Fix]:
    if h is None or cfg is None or e.vmid is None:
        return [Fix(e.where, "pass them through in the container's Proxmox config (the inventory names no Proxmox "
                    "host: ctl cannot read it)", tuple(f"# {p}" for p in paths))]
    fixes = node_fixes(h.host, e.vmid, paths, cfg, h.majors, h.pve, denied=denied)
    return fixes or [Fix(h.host, "the config already passes them: restart the container so it applies",
                         (f"pct reboot {e.vmid}",))]


def _node_problem(e: Expect, h: HostView | None, cfg: CtConfig | None, path: str, d: dict[str, Any]
                  ) -> tuple[str, list[Fix], str | None]:
    """(what is wrong, the fixes of this node alone, whether the config must pass it: 'missing', 'denied' or
    None)."""
    err = str(d.get("errno") or "")
    major = node_major(path, h.majors) if h else None
    passed = cfg.passes(path) if cfg else None
    how = f" ({passed} passes it)" if passed else ""
    where = h.host if h else e.where
    restart = [Fix(h.host, "then restart the container", (f"pct reboot {e.vmid}",))] if h and e.vmid else []
    if not d.get("exists"):
        if h is not None and path not in h.nodes and path.startswith("/dev/nvidia-uvm"):
            return (f"missing in the container, and on {h.host} too: nvidia-uvm is not loaded there",
                    [Fix(h.host, "load nvidia-uvm and make its nodes (and at every boot)",
                         ("nvidia-modprobe -u -c=0", "echo nvidia-uvm >> /etc/modules-load.d/nvidia.conf"))],
                    "missing")
        return f"missing in the container (ENOENT): not passed through{how}", [], "missing"
    if not d.get("char"):
        return (f"a plain file, not a device{how}: the bind mount found no {path} on the host when the container "
                "started (optional mount, create=file)",
                [Fix(where, "load the module and make the node on the host", ("nvidia-modprobe -u -c=0",)),
                 *restart], None)
    if err == "EPERM":
        return f"present but the cgroup denies opening it (EPERM){how}", [], "denied"
    if err == "ENXIO":
        rdev = d.get("rdev") if isinstance(d.get("rdev"), list) else None
        stale = (f"; its major is {rdev[0]} but {path}'s driver has {major} since this boot (a stale node)"
                 if rdev and major is not None and rdev[0] != major else "")
        return (f"present but no driver behind it (ENXIO){stale}",
                [Fix(where, "load the driver's module on the host (nvidia-uvm for the uvm nodes)",
                     ("nvidia-modprobe -u -c=0",)), *restart], None)
    if err == "EACCES":
        owner = f"mode {d.get('mode')}, uid {d.get('uid')} gid {d.get('gid')}"
        unpriv = cfg is not None and cfg.unprivileged
        why = ("an unprivileged container sees the host's root as nobody:nogroup, so only the mode's 'other' "
               "bits count" if unpriv else "its mode does not let root of the container read and write it")
        if h is not None and e.vmid is not None and passed and passed.startswith("dev"):
            return (f"present but not openable (EACCES: {owner}): {why}",
                    [Fix(h.host, f"give {passed} NVIDIA's default mode for the container's root",
                         (f"pct set {e.vmid} --{passed} {path},mode=0666",)), *restart], None)
        return (f"present but not openable (EACCES: {owner}): {why}",
                [Fix(where, "give the node NVIDIA's default mode (on the host; the module option "
                     "NVreg_DeviceFileMode=0666 keeps it)", (f"chmod 0666 {path}",)), *restart], None)
    return f"present but does not open ({err or '?'}: {clean(str(d.get('error') or ''))})", restart, None


def userspace(e: Expect, h: HostView | None, gpu: dict[str, Any]) -> Check:
    driver = h.driver if h else driver_version(gpu.get("driver_file") if isinstance(gpu.get("driver_file"), str)
                                               else None)
    libs = _dict(gpu.get("libs"))
    found = {name: lib_version(str(v.get("real"))) for name, v in libs.items() if isinstance(v, dict)}
    smi = _dict(gpu.get("smi")) or None
    said = ""
    if smi and smi.get("rc") not in (0, None):
        said = "; nvidia-smi in the container: " + clean(str(smi.get("out") or "") + "\n" + str(smi.get("err") or ""))
    machine = h.machine if h else "x86_64"
    fix = (Fix(e.ct, f"install the user space of {driver} in the container (the .run of exactly the host's version, "
               "without its kernel module)", (installer_line(driver, machine),)),) if driver else ()
    if not any(found.values()):
        return Check("user space", FAIL, "no libnvidia-ml.so.1 / libcuda.so.1 in the container's library path"
                     + said, fix)
    wrong = {n: v for n, v in found.items() if v and driver and v != driver}
    if wrong:
        names = ", ".join(f"{n.split('.so')[0]} {v}" for n, v in wrong.items())
        return Check("user space", FAIL, f"container has {names}, the host's driver is {driver}{said}", fix)
    if said:
        return Check("user space", FAIL, f"libraries {driver}{said}", fix)
    return Check("user space", OK, "libnvidia-ml, libcuda " + ", ".join(sorted({v for v in found.values() if v}))
                 + (" = host driver" if driver else ""))


def cuda(e: Expect, h: HostView | None, env: dict[str, Any] | None) -> Check:
    torch = env.get("torch") if isinstance(env, dict) else None
    if not isinstance(torch, dict) or torch.get("error") or not torch.get("version"):
        why = torch.get("error") if isinstance(torch, dict) and torch.get("error") else "no torch found"
        return Check("torch CUDA", WARN, f"{clean(str(why))} (venv {e.venv or 'python3'}): not checked")
    version, built = str(torch.get("version")), torch.get("cuda")
    top = h.cuda if h else None
    pip = f"{e.venv}/bin/pip" if e.venv else "pip"
    base = version.split("+", 1)[0]
    if not built:
        return Check("torch CUDA", FAIL, f"torch {version} is a CPU build", (
            Fix(e.ct, "install a CUDA build the driver supports", (
                f"{pip} install --force-reinstall torch=={base} --index-url "
                f"https://download.pytorch.org/whl/{cuda_wheel_tag(top or '12.4')}",)),))
    if top is None:
        return Check("torch CUDA", WARN, f"torch {version} (CUDA {built}); the driver's CUDA is unknown")
    b, t = version_tuple(str(built)), version_tuple(top)
    if b <= t:
        return Check("torch CUDA", OK, f"torch {version} built for CUDA {built}; the driver supports up to {top}")
    wheel = (f"{pip} install --force-reinstall torch=={base} --index-url "
             f"https://download.pytorch.org/whl/{cuda_wheel_tag(top)}")
    fixes: tuple[Fix, ...] = (Fix(e.ct, f"a torch build for CUDA {top} or older (the newest cuXYZ PyTorch publishes "
                                  f"at or below {cuda_wheel_tag(top)})", (wheel,)),)
    need = MIN_DRIVER.get(str(built))
    if need and h is not None:
        fixes += (Fix(h.host, f"or upgrade {h.host}'s driver to {need} or newer (CUDA {built}), then the "
                      "containers' user space to the same version", (installer_line(need, h.machine)
                                                                     .replace(" --no-kernel-module", ""),)),)
    driver = h.driver if h is not None else "?"
    seen = f"torch {version} is built for CUDA {built}, the host's driver {driver} supports CUDA {top} at most"
    if b[:1] == t[:1]:
        return Check("torch CUDA", WARN, seen + " (runs through minor version compatibility: no PTX JIT, newer "
                     "features fail)", fixes)
    return Check("torch CUDA", FAIL, seen, fixes)


def split_check(e: Expect, h: HostView | None, gpu: dict[str, Any]) -> Check:
    if not e.split:
        return Check("GPU split", OK, "no GPUs in the inventory (cpu)")
    problems: list[str] = []
    fixes: list[Fix] = []
    if h is not None and h.gpus:
        have = {g.index for g in h.gpus}
        extra = [i for i in e.split if i not in have]
        if extra:
            problems.append(f"GPU {','.join(map(str, extra))} in the split: {h.host} has {len(have)} GPUs "
                            f"({min(have)}-{max(have)})")
            fixes.append(Fix(e.inventory, f"containers.{e.ct}.gpus: only indexes {h.host} has", (
                f"# containers.{e.ct}.gpus in {e.inventory}",)))
        by_uuid = {g.uuid: g.index for g in h.gpus}
        for a in h.apps:
            i = by_uuid.get(a.gpu_uuid)
            if i in e.split and a.vmid != e.vmid:
                who = f"CT {a.vmid}" if a.vmid is not None else f"the host {h.host}"
                problems.append(f"GPU {i} is used by {who}: pid {a.pid} {a.name}"
                                + (f" ({a.mib} MiB)" if a.mib is not None else ""))
    smi = _dict(gpu.get("smi")) or None
    if smi and smi.get("rc") == 0:
        seen_idx = {int(p.split(",")[0]) for p in str(smi.get("out") or "").splitlines() if p.split(",")[0].strip()
                    .isdigit()}
        lacking = [i for i in e.split if i not in seen_idx]
        if lacking:
            problems.append(f"nvidia-smi in the container does not list GPU {','.join(map(str, lacking))}")
    visible = [x for x in e.cuda_visible.split(",") if x]
    if visible != [str(i) for i in e.split]:
        problems.append(f"CUDA_VISIBLE_DEVICES renders as {e.cuda_visible!r}, the split is {list(e.split)}")
    seen = f"GPUs {','.join(map(str, e.split))}, CUDA_VISIBLE_DEVICES={e.cuda_visible}"
    if problems:
        return Check("GPU split", FAIL, seen + ": " + "; ".join(problems), tuple(fixes))
    return Check("GPU split", OK, seen + (", none used by another container" if h is not None else ""))


def _ifname_match(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME selects: prefixes, `=` exact names, `^` excludes."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    pats = [p for p in (body[1:] if exact else body).split(",") if p]

    def hit(n: str) -> bool:
        return any(n == p if exact else n.startswith(p) for p in pats)

    return [n for n in names if (not hit(n)) == exclude]


def hygiene(e: Expect, gpu: dict[str, Any]) -> list[Check]:
    out: list[Check] = []
    shm = _dict(gpu.get("shm"))
    size = shm.get("size")
    if isinstance(size, int):
        seen = f"/dev/shm is {size / 2**20:.0f} MiB"
        if size < SHM_MIN:
            out.append(Check("/dev/shm", WARN, seen + " (NCCL's shared memory and the pipeline's IPC want GiBs: "
                             "'Error while creating shared memory segment')", (
                                 Fix(e.ct, "now (in the container)", ("mount -o remount,size=16G /dev/shm",)),
                                 Fix(e.ct, "and at every start: a line in the container's /etc/fstab",
                                     ("tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=16G 0 0",)))))
        else:
            out.append(Check("/dev/shm", OK, seen))
    elif shm.get("error"):
        out.append(Check("/dev/shm", WARN, clean(str(shm["error"]))))
    mem = gpu.get("memlock")
    if isinstance(mem, int):
        seen = "memlock unlimited" if mem < 0 else f"memlock {mem // 1024} KiB"
        if mem >= 0 and e.job:
            out.append(Check("memlock", WARN, seen + " (NCCL over InfiniBand/RoCE pins memory)", (
                Fix(e.where, "raise it for the container (add to its /etc/pve/lxc/VMID.conf, then restart it)",
                    ("lxc.prlimit.memlock: unlimited",)),)))
        else:
            out.append(Check("memlock", OK, seen))
    if e.job and e.address:
        addrs = [str(a) for a in gpu.get("addresses") or [] if isinstance(a, str)]
        try:
            ip = str(ipaddress.ip_address(e.address))
        except ValueError:
            ip = None
        if ip is None:
            out.append(Check("node address", WARN, f"{e.address} (jobs.{e.job}) is a name: not checked against the "
                             f"container's addresses ({', '.join(addrs) or 'none'})"))
        elif ip in addrs:
            out.append(Check("node address", OK, f"{ip} is the container's"))
        else:
            out.append(Check("node address", FAIL, f"{ip} (containers.{e.ct}.address, a node of job {e.job}) is not "
                             f"an address of the container: it has {', '.join(addrs) or 'none'}", (
                                 Fix(e.inventory, f"set containers.{e.ct}.address to one of the container's",
                                     (f"address: {next((a for a in addrs if not a.startswith(('127.', '::1'))), '?')}",
                                      )),)))
    if e.ifname:
        names = [str(n) for n in gpu.get("ifaces") or [] if isinstance(n, str)]
        hit = _ifname_match(e.ifname, names)
        if hit:
            out.append(Check("NCCL interface", OK, f"NCCL_SOCKET_IFNAME={e.ifname} selects {', '.join(hit)}"))
        else:
            out.append(Check("NCCL interface", FAIL, f"NCCL_SOCKET_IFNAME={e.ifname} selects none of the container's "
                             f"interfaces ({', '.join(names) or 'none'})", (
                                 Fix(e.inventory, f"nccl.socket_ifname of {e.ct} (or its job): an interface it has",
                                     (f"socket_ifname: {next((n for n in names if n != 'lo'), 'eth0')}",)),)))
    return out


def judge(e: Expect, h: HostView | None, gpu: dict[str, Any], env: dict[str, Any] | None) -> list[Check]:
    """Every check of one container, in the order a newcomer fixes them: the host's driver (nothing else
    matters without it), the nodes, user space, torch's CUDA, the split, then NCCL's hygiene."""
    if not e.split:  # a CPU container: nothing of the GPUs' concerns it, not even a host without a driver
        return [Check("GPU split", OK, "no GPUs in the inventory (cpu): nothing to check")]
    if h is not None:
        first = host_driver(h)
        if first.status == FAIL:
            return [first]
        checks = [first]
    else:
        checks = [Check("host driver", WARN, f"{e.ct} names no Proxmox host: the host's side is not checked")]
    if h is not None and e.vmid is not None and e.vmid in h.config_errors:
        checks.append(Check("config", FAIL, f"pct config {e.vmid} on {h.host}: {h.config_errors[e.vmid]}"))
    elif h is not None and e.vmid is not None and e.vmid in h.configs:
        cfg = h.configs[e.vmid]
        style = cfg.style(h.pve)
        checks.append(Check("config", OK, ("devN entries" if style == "dev" else "lxc.cgroup2 + mount entries")
                            + (", unprivileged" if cfg.unprivileged else ", privileged")
                            + (f", PVE {h.pve[0]}.{h.pve[1]}" if h.pve else "")))
    checks += node_checks(e, h, _nodes(gpu.get("nodes")))
    checks.append(userspace(e, h, gpu))
    checks.append(cuda(e, h, env))
    checks.append(split_check(e, h, gpu))
    checks += hygiene(e, gpu)
    return checks


def quick(split: tuple[int, ...], gpu: dict[str, Any]) -> list[str]:
    """What `ctl launch` refuses on, from the container's view alone: a needed node that does not open (with its
    errno), user space of another version than the driver the container sees. Empty when fine, or when no NVIDIA
    driver is visible at all (the preflight's nvidia-smi check speaks for that case)."""
    driver = driver_version(gpu.get("driver_file") if isinstance(gpu.get("driver_file"), str) else None)
    if driver is None or not split:
        return []
    problems = []
    nodes = _nodes(gpu.get("nodes"))
    for path in [*(f"/dev/nvidia{i}" for i in split), *CORE_NODES]:
        d = nodes.get(path, {})
        if not (d.get("opens") and d.get("char")):
            why = "missing" if not d.get("exists") else ("not a device" if not d.get("char") else
                                                         f"does not open ({d.get('errno') or '?'})")
            problems.append(f"{path} {why}")
    libs = _dict(gpu.get("libs"))
    for name, v in libs.items():
        got = lib_version(str(v.get("real"))) if isinstance(v, dict) else None
        if got and got != driver:
            problems.append(f"{name.split('.so')[0]} {got} but the driver is {driver}")
    if not any(isinstance(v, dict) for v in libs.values()):
        problems.append("no libnvidia-ml.so.1 in the container")
    return problems


def failed(checks: list[Check]) -> bool:
    return any(c.status == FAIL for c in checks)
