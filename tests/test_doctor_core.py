"""core/gpu.py and core/doctor.py: parsing what a Proxmox host and a container say about their GPUs, the fix lines
in each config style, and the verdict of each check (no I/O: the end-to-end cases are in
tests/integration/test_doctor_pve.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from controller.core import doctor as d
from controller.core import gpu as g

MESSAGES = json.loads((Path(__file__).parent / "data" / "gpu_messages.json").read_text())
DEVICES = """Character devices:
  1 mem
  5 /dev/tty
195 nvidia-frontend
236 nvidia-caps-imex-channels
508 nvidia-uvm
511 nvidia-caps

Block devices:
  7 loop
508 blkext
"""
SMI = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""
PVE82 = "Package: pve-manager\nStatus: install ok installed\nVersion: 8.2.4\n"
PVE80 = "Package: pve-manager\nStatus: install ok installed\nVersion: 8.0.3\n"
DEV_CONF = """arch: amd64
dev0: /dev/nvidia0
dev1: /dev/nvidiactl,mode=0666
hostname: ct200
unprivileged: 1
"""
CGROUP_CONF = """arch: amd64
hostname: ct200
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file
"""


def test_driver_version_from_both_kernel_modules() -> None:
    assert g.driver_version(MESSAGES["proc_driver_version"]["text"]) == "580.173.02"
    open_module = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  "
                   "(dvs-builder@U16-I3-B03-4-3)  Tue Feb 20 19:38:48 UTC 2024\n")
    assert g.driver_version(open_module) == "550.54.15"
    assert g.driver_version(None) is None and g.driver_version("garbage") is None


def test_char_majors_ignore_block_devices() -> None:
    majors = g.char_majors(DEVICES)
    assert majors["nvidia-uvm"] == 508 and majors["nvidia-frontend"] == 195 and majors["nvidia-caps"] == 511
    assert "blkext" not in majors
    assert g.node_major("/dev/nvidia3", majors) == 195 and g.node_major("/dev/nvidia-uvm-tools", majors) == 508
    assert g.node_major("/dev/nvidia-caps/nvidia-cap1", majors) == 511
    assert g.node_major("/dev/nvidia-uvm", {"nvidia-frontend": 195}) is None


def test_smi_header_and_library_versions() -> None:
    assert g.smi_header(SMI) == ("550.54.15", "12.4")
    assert g.smi_header("Failed to initialize NVML: Unknown Error") == (None, None)
    assert g.lib_version("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.14") == "550.54.14"
    assert g.lib_version("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1") is None


def test_pve_release_from_dpkg_status() -> None:
    assert g.pve_release("Package: a\nVersion: 1\n\n" + PVE82) == (8, 2)
    assert g.pve_release(None) is None and g.pve_release("Package: pve-manager\nVersion: x\n") is None


def test_parse_config_both_styles() -> None:
    dev = g.parse_config(DEV_CONF)
    assert dev.devs == {0: "/dev/nvidia0", 1: "/dev/nvidiactl"} and dev.unprivileged
    assert dev.passes("/dev/nvidiactl") == "dev1" and dev.passes("/dev/nvidia-uvm") is None
    assert dev.style(None) == "dev" and dev.free_devs()[:2] == [2, 3]
    cg = g.parse_config(CGROUP_CONF)
    assert cg.style((8, 2)) == "cgroup" and cg.allowed(195) and not cg.allowed(508)
    assert cg.passes("/dev/nvidia0") == "mount entry"
    bare = g.parse_config("arch: amd64\nhostname: x\n")
    assert bare.style((8, 2)) == "dev" and bare.style((8, 0)) == "cgroup" and bare.style(None) == "cgroup"


def test_fix_lines_in_the_devN_style() -> None:
    cfg = g.parse_config(DEV_CONF)
    fixes = g.node_fixes("pve1", 200, ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"], cfg, g.char_majors(DEVICES),
                         (8, 2))
    assert fixes[0].lines == ("pct set 200 --dev2 /dev/nvidia-uvm", "pct set 200 --dev3 /dev/nvidia-uvm-tools")
    assert fixes[1].where == "/etc/pve/lxc/200.conf on pve1"
    assert fixes[1].lines == ("dev2: /dev/nvidia-uvm", "dev3: /dev/nvidia-uvm-tools")
    assert fixes[-1].lines == ("pct reboot 200",)


def test_fix_lines_in_the_cgroup_style_use_this_hosts_majors() -> None:
    cfg = g.parse_config(CGROUP_CONF)
    fixes = g.node_fixes("pve1", 200, ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"], cfg, g.char_majors(DEVICES),
                         (8, 2))
    assert fixes[0].lines == (
        "lxc.cgroup2.devices.allow: c 508:* rwm",
        "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file",
        "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file")
    other = g.node_fixes("pve1", 200, ["/dev/nvidia-uvm"], cfg, {**g.char_majors(DEVICES), "nvidia-uvm": 237},
                         (8, 2), denied=frozenset({"/dev/nvidia-uvm"}))
    assert other[0].lines == ("lxc.cgroup2.devices.allow: c 237:* rwm",)  # denied: the mount entry is there


def host(**over: Any) -> d.HostView:
    doc: dict[str, Any] = {
        "driver_file": "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n",
        "devices": DEVICES, "dpkg": PVE82, "machine": "x86_64",
        "nodes": ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"],
        "smi": {"table": {"rc": 0, "out": SMI, "err": ""},
                "gpus": {"rc": 0, "out": "0, GPU-a, NVIDIA H100, Enabled, 00000000:18:00.0\n"
                                         "1, GPU-b, NVIDIA H100, Enabled, 00000000:28:00.0\n", "err": ""},
                "apps": {"rc": 0, "out": "", "err": ""}},
        "configs": {"200": {"rc": 0, "out": DEV_CONF, "err": ""}}, "owners": {},
    }
    doc.update(over)
    return d.host_view("pve1", doc)


OK_NODE = {"exists": True, "char": True, "opens": True, "rdev": [195, 0]}


def container(**over: Any) -> dict[str, Any]:
    lib = {"path": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
           "real": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15"}
    doc: dict[str, Any] = {
        "nodes": {p: OK_NODE for p in ("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
                                       "/dev/nvidia-uvm-tools")},
        "libs": {"libnvidia-ml.so.1": lib, "libcuda.so.1": {**lib, "real": "/usr/lib/libcuda.so.550.54.15"}},
        "smi": {"rc": 0, "out": "0, GPU-a, 00000000:18:00.0\n1, GPU-b, 00000000:28:00.0\n", "err": ""},
        "shm": {"size": 32 << 30}, "memlock": -1, "addresses": ["127.0.0.1", "10.0.0.7"], "ifaces": ["eth0", "lo"],
    }
    doc.update(over)
    return doc


ENV = {"torch": {"version": "2.9.0+cu124", "cuda": "12.4", "cuda_tag": "cu124"}}
EXPECT = d.Expect("ct200", "pve1", 200, (0, 1), "0,1", venv="/opt/venv")


def by_name(checks: list[d.Check]) -> dict[str, d.Check]:
    return {c.name: c for c in checks}


def test_a_healthy_container_is_all_ok() -> None:
    checks = d.judge(EXPECT, host(), container(), ENV)
    assert [c.status for c in checks] == ["ok"] * len(checks), checks
    assert {"host driver", "config", "device nodes", "user space", "torch CUDA", "GPU split", "/dev/shm",
            "memlock"} == {c.name for c in checks}
    assert not d.failed(checks)


def test_each_errno_gets_its_own_reason_and_fix() -> None:
    nodes = container()["nodes"]
    bad = {**nodes, "/dev/nvidia-uvm": {"exists": False, "errno": "ENOENT"},
           "/dev/nvidiactl": {"exists": True, "char": True, "errno": "EPERM", "rdev": [195, 255]},
           "/dev/nvidia1": {"exists": True, "char": True, "errno": "ENXIO", "rdev": [240, 0]}}
    checks = by_name(d.judge(EXPECT, host(), container(nodes=bad), ENV))
    assert "ENOENT" in checks["node /dev/nvidia-uvm"].seen and checks["node /dev/nvidia-uvm"].status == "FAIL"
    assert "cgroup denies" in checks["node /dev/nvidiactl"].seen and "dev1 passes it" in checks[
        "node /dev/nvidiactl"].seen
    # nvidia-uvm (missing) and nvidiactl (denied, passed by dev1 already) share one fix: one new devN, a restart
    # (under the first of them in the list)
    assert [f.lines for f in checks["node /dev/nvidiactl"].fixes] == [
        ("pct set 200 --dev2 /dev/nvidia-uvm",), ("dev2: /dev/nvidia-uvm",), ("pct reboot 200",)]
    assert checks["node /dev/nvidia-uvm"].fixes == ()
    assert "the lines under node /dev/nvidiactl cover it" in checks["node /dev/nvidia-uvm"].seen
    assert "no driver behind it" in checks["node /dev/nvidia1"].seen and "major is 240" in checks[
        "node /dev/nvidia1"].seen
    assert checks["node /dev/nvidia1"].fixes[0].lines == ("nvidia-modprobe -u -c=0",)


def test_a_plain_file_where_a_node_should_be() -> None:
    nodes = {**container()["nodes"], "/dev/nvidia-uvm": {"exists": True, "char": False}}
    c = by_name(d.judge(EXPECT, host(), container(nodes=nodes), ENV))["node /dev/nvidia-uvm"]
    assert c.status == "FAIL" and "plain file" in c.seen and c.fixes[0].lines == ("nvidia-modprobe -u -c=0",)


def test_library_mismatch_names_both_versions_and_the_installer() -> None:
    mis = {"path": "/usr/lib/libnvidia-ml.so.1", "real": "/usr/lib/libnvidia-ml.so.550.54.14"}
    smi = {"rc": 18, "out": MESSAGES["nvml_mismatch"]["text"], "err": ""}
    c = by_name(d.judge(EXPECT, host(), container(libs={"libnvidia-ml.so.1": mis}, smi=smi), ENV))["user space"]
    assert c.status == "FAIL" and "libnvidia-ml 550.54.14" in c.seen and "550.54.15" in c.seen
    assert "Driver/library version mismatch / NVML library version: 550.54" in c.seen
    assert c.fixes[0].lines == ("sh NVIDIA-Linux-x86_64-550.54.15.run --no-kernel-module",)
    none = by_name(d.judge(EXPECT, host(), container(libs={"libnvidia-ml.so.1": None}), ENV))["user space"]
    assert none.status == "FAIL" and "no libnvidia-ml" in none.seen


def test_torch_cuda_against_the_driver() -> None:
    newer_major = {"torch": {"version": "2.11.0+cu130", "cuda": "13.0"}}
    c = by_name(d.judge(EXPECT, host(), container(), newer_major))["torch CUDA"]
    assert c.status == "FAIL" and "CUDA 13.0" in c.seen and "12.4 at most" in c.seen
    assert "/opt/venv/bin/pip install --force-reinstall torch==2.11.0 --index-url " \
           "https://download.pytorch.org/whl/cu124" in c.fixes[0].lines
    assert c.fixes[1].lines == ("sh NVIDIA-Linux-x86_64-580.65.06.run",)
    newer_minor = {"torch": {"version": "2.9.0+cu128", "cuda": "12.8"}}
    assert by_name(d.judge(EXPECT, host(), container(), newer_minor))["torch CUDA"].status == "warn"
    cpu = {"torch": {"version": "2.9.0+cpu", "cuda": None}}
    assert by_name(d.judge(EXPECT, host(), container(), cpu))["torch CUDA"].status == "FAIL"


def test_split_index_missing_or_used_by_another_container() -> None:
    e = d.Expect("ct200", "pve1", 200, (0, 1, 2), "0,1,2")
    c = by_name(d.judge(e, host(), container(), ENV))
    assert c["GPU split"].status == "FAIL" and "GPU 2 in the split: pve1 has 2 GPUs" in c["GPU split"].seen
    assert c["node /dev/nvidia2"].status == "FAIL"
    apps = {"rc": 0, "out": "GPU-b, 4242, python3, 30000\n", "err": ""}
    h = host(smi={**host_doc_smi(), "apps": apps}, owners={"4242": 201})
    got = by_name(d.judge(EXPECT, h, container(), ENV))["GPU split"]
    assert got.status == "FAIL" and "GPU 1 is used by CT 201: pid 4242 python3 (30000 MiB)" in got.seen
    mine = host(smi={**host_doc_smi(), "apps": apps}, owners={"4242": 200})
    assert by_name(d.judge(EXPECT, mine, container(), ENV))["GPU split"].status == "ok"


def host_doc_smi() -> dict[str, Any]:
    return {"table": {"rc": 0, "out": SMI, "err": ""},
            "gpus": {"rc": 0, "out": "0, GPU-a, H100, Enabled, x\n1, GPU-b, H100, Enabled, y\n", "err": ""}}


def test_small_shm_warns_and_network_checks_for_a_job_node() -> None:
    c = by_name(d.judge(EXPECT, host(), container(shm={"size": 64 << 20}), ENV))["/dev/shm"]
    assert c.status == "warn" and "64 MiB" in c.seen
    assert c.fixes[0].lines == ("mount -o remount,size=16G /dev/shm",)
    job = d.Expect("ct200", "pve1", 200, (0, 1), "0,1", job="pair", address="10.0.0.9", ifname="=ens18")
    got = by_name(d.judge(job, host(), container(memlock=8 << 20), ENV))
    assert got["node address"].status == "FAIL" and "10.0.0.9" in got["node address"].seen
    assert got["NCCL interface"].status == "FAIL" and got["memlock"].status == "warn"
    ok = d.Expect("ct200", "pve1", 200, (0, 1), "0,1", job="pair", address="10.0.0.7", ifname="eth")
    fine = by_name(d.judge(ok, host(), container(), ENV))
    assert fine["node address"].status == "ok" and fine["NCCL interface"].seen.endswith("selects eth0")
    assert d._ifname_match("^lo,docker", ["lo", "docker0", "eth0"]) == ["eth0"]


def test_a_host_without_a_driver_is_one_line() -> None:
    h = host(driver_file=None, smi={"table": {"rc": 9, "out": MESSAGES["no_driver"]["text"], "err": ""}})
    checks = d.judge(EXPECT, h, container(), ENV)
    assert len(checks) == 1 and checks[0].status == "FAIL" and "no NVIDIA driver loaded on pve1" in checks[0].seen


def test_quick_preflight_subset() -> None:
    drv = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  x\n"
    assert d.quick((0, 1), {**container(), "driver_file": drv}) == []
    nodes = {**container()["nodes"], "/dev/nvidia-uvm": {"exists": True, "char": True, "errno": "EPERM"}}
    assert d.quick((0, 1), {**container(nodes=nodes), "driver_file": drv}) == ["/dev/nvidia-uvm does not open (EPERM)"]
    mis = {"libnvidia-ml.so.1": {"real": "/x/libnvidia-ml.so.550.54.14"}}
    assert d.quick((0, 1), {**container(libs=mis), "driver_file": drv}) == [
        "libnvidia-ml 550.54.14 but the driver is 550.54.15"]
    assert d.quick((0, 1), container(nodes={})) == []  # no driver visible: nvidia-smi's check speaks


def test_unprivileged_eacces_gets_a_mode_on_its_devN_entry() -> None:
    nodes = {**container()["nodes"], "/dev/nvidia0": {"exists": True, "char": True, "errno": "EACCES",
                                                      "mode": "0660", "uid": 65534, "gid": 65534}}
    c = by_name(d.judge(EXPECT, host(), container(nodes=nodes), ENV))["node /dev/nvidia0"]
    assert c.status == "FAIL" and "nobody:nogroup" in c.seen and "mode 0660, uid 65534" in c.seen
    assert [f.lines for f in c.fixes] == [("pct set 200 --dev0 /dev/nvidia0,mode=0666",), ("pct reboot 200",)]


def test_a_cpu_container_is_not_judged_on_gpus() -> None:
    cpu = d.Expect("ct9", "pve1", 200, (), "")
    h = host(driver_file=None, smi={"table": {"rc": 9, "out": MESSAGES["no_driver"]["text"], "err": ""}})
    assert [(c.name, c.status) for c in d.judge(cpu, h, container(), None)] == [("GPU split", "ok")]


def test_launch_refuses_a_broken_setup_unless_forced() -> None:
    import pytest

    from controller.commands import gpupreflight
    from controller.errors import ExitCode, GpuSetupError
    from controller.inventory import Container, ContainerSpec, GpuSplit

    ct = Container("ct9", ContainerSpec(transport="local", root="/x", gpus=GpuSplit(target=[0, 1])), None, None, None)
    drv = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  x\n"
    broken = {**container(libs={"libnvidia-ml.so.1": {"real": "/x/libnvidia-ml.so.550.54.14"}}), "driver_file": drv}
    with pytest.raises(GpuSetupError) as got:
        gpupreflight.check(ct, broken, force=False)
    assert got.value.exit_code == ExitCode.GPU_SETUP and "`ctl doctor ct9`" in str(got.value)
    assert gpupreflight.check(ct, broken, force=True) == (
        "gpu setup", False, "ct9: GPU setup is broken: libnvidia-ml 550.54.14 but the driver is 550.54.15", True)
    assert gpupreflight.check(ct, {**container(), "driver_file": drv}, force=False) == (
        "gpu setup", True, "nodes open, user space matches the driver", False)
