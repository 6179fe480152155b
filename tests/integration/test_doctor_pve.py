"""`ctl doctor` end to end against the local Proxmox host: real sshd, `pct config` of the test host, real LXC
containers whose device nodes, /proc/driver, libraries and /dev/shm are set up inside them (tests/pvehost/gpu.py),
a host side faked under CTL_GPU_HOST_ROOT, and the real tools' messages from tests/data/gpu_messages.json. CT 201
on pve1 is the patient; each test gives it back as up() made it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from controller.core.gpu import mount_entry
from tests.conftest import install_torch
from tests.integration.conftest import PveEnv, container_venv
from tests.pvehost import gpu

VMID, CT, NODE = 201, "ct201", "pve1"
SPLIT = [0, 1]
HEALTHY_NODES = {"/dev/nvidia0": "ok", "/dev/nvidia1": "ok", "/dev/nvidiactl": "ok", "/dev/nvidia-uvm": "ok",
                 "/dev/nvidia-uvm-tools": "ok"}
DEV_CONFIG = ["dev0: /dev/nvidia0", "dev1: /dev/nvidia1", "dev2: /dev/nvidiactl", "dev3: /dev/nvidia-uvm",
              "dev4: /dev/nvidia-uvm-tools"]
CGROUP_CONFIG = ["lxc.cgroup2.devices.allow: c 195:* rwm", "lxc.cgroup2.devices.allow: c 508:* rwm",
                 *(mount_entry(n) for n in ("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
                                            "/dev/nvidia-uvm-tools"))]


@pytest.fixture
def patient(pve_env: PveEnv) -> Iterator[PveEnv]:
    """ct201 with a split of two GPUs and a training venv (torch for CUDA 12.4); pve1 with 2 GPUs of driver
    550.54.15 (CUDA 12.4), PVE 8.2. Afterwards: no GPUs on pve1, ct201 restarted plain."""
    inside, venv = container_venv(pve_env, VMID)
    install_torch(venv, "2.9.0+cu124", "12.4")
    pve_env.write(containers={CT: {"gpus": {"target": SPLIT, "drafter": []}, "vars": {"venv": inside}}})
    gpu.set_host(pve_env.host, NODE, count=2)
    try:
        yield pve_env
    finally:
        gpu.clear_host(pve_env.host, NODE)
        gpu.reset_ct(pve_env.host, VMID)


def doctor(env: PveEnv, *names: str) -> tuple[int, dict[str, Any], str]:
    r = env.ctl("doctor", *names, "--json")
    docs = json.loads(r.stdout) if r.stdout.strip() else []
    checks = {c["check"]: c for doc in docs for c in doc.get("checks", [])}
    text = env.ctl("doctor", *names)
    assert text.returncode == r.returncode, (text.stdout, text.stderr)
    return r.returncode, checks, text.stdout + text.stderr


def statuses(checks: dict[str, Any]) -> dict[str, str]:
    return {k: v["status"] for k, v in checks.items()}


def test_a_healthy_container_passes_every_check(patient: PveEnv) -> None:
    gpu.set_config(patient.host, VMID, DEV_CONFIG)
    gpu.place(patient.host, VMID, HEALTHY_NODES)
    rc, checks, text = doctor(patient, CT)
    assert rc == 0, text
    assert set(statuses(checks).values()) == {"ok"}, text
    assert checks["host driver"]["seen"] == "550.54.15 (CUDA 12.4 at most), 2 GPUs, persistence mode on"
    assert checks["config"]["seen"] == "devN entries, privileged, PVE 8.2"
    assert checks["user space"]["seen"] == "libnvidia-ml, libcuda 550.54.15 = host driver"
    assert "torch 2.9.0+cu124 built for CUDA 12.4" in checks["torch CUDA"]["seen"]
    assert checks["GPU split"]["seen"] == "GPUs 0,1, CUDA_VISIBLE_DEVICES=0,1, none used by another container"
    assert "ct201 (pve1/201)" in text and "  ok    device nodes" in text


@pytest.mark.parametrize("style", ["dev", "cgroup"])
def test_a_missing_nvidia_uvm_gets_the_lines_of_the_containers_own_style(patient: PveEnv, style: str) -> None:
    config = [x for x in (DEV_CONFIG if style == "dev" else CGROUP_CONFIG) if "nvidia-uvm" not in x
              and "508" not in x]
    gpu.set_config(patient.host, VMID, config)
    gpu.place(patient.host, VMID, {k: v for k, v in HEALTHY_NODES.items() if "uvm" not in k})
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    uvm = checks["node /dev/nvidia-uvm"]
    assert uvm["status"] == "FAIL" and "missing in the container (ENOENT)" in uvm["seen"]
    lines = [line for f in uvm["fix"] for line in f["lines"]]
    # both uvm nodes in one set of lines (distinct devN, one allow rule for their major), under the first
    if style == "dev":
        assert lines == ["pct set 201 --dev3 /dev/nvidia-uvm", "pct set 201 --dev4 /dev/nvidia-uvm-tools",
                         "dev3: /dev/nvidia-uvm", "dev4: /dev/nvidia-uvm-tools", "pct reboot 201"]
    else:
        assert lines == ["lxc.cgroup2.devices.allow: c 508:* rwm",
                         "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file",
                         "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file",
                         "pct reboot 201"]
    tools = checks["node /dev/nvidia-uvm-tools"]
    assert tools["status"] == "warn" and tools["fix"] == [] and "lines under node /dev/nvidia-uvm" in tools["seen"]
    for line in lines:  # the text output prints each line as it is to be pasted
        assert f"\n          {line}\n" in text


def test_a_cgroup_deny_is_eperm_and_gets_its_allow_rule(patient: PveEnv) -> None:
    """The config mounts nvidia-uvm but has no allow rule for its major: the node is there, open() gets EPERM."""
    gpu.set_config(patient.host, VMID, [x for x in CGROUP_CONFIG if "508" not in x])
    gpu.place(patient.host, VMID, {**HEALTHY_NODES, "/dev/nvidia-uvm": "denied"})
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    uvm = checks["node /dev/nvidia-uvm"]
    assert "cgroup denies opening it (EPERM) (mount entry passes it)" in uvm["seen"], uvm
    assert [line for f in uvm["fix"] for line in f["lines"]] == ["lxc.cgroup2.devices.allow: c 508:* rwm",
                                                                 "pct reboot 201"]


def test_a_node_without_a_driver_is_enxio(patient: PveEnv) -> None:
    gpu.set_config(patient.host, VMID, DEV_CONFIG)
    gpu.place(patient.host, VMID, {**HEALTHY_NODES, "/dev/nvidia-uvm": "nodriver"})
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    seen = checks["node /dev/nvidia-uvm"]["seen"]
    assert "no driver behind it (ENXIO)" in seen and f"major is {gpu.NO_DRIVER_MAJOR} but" in seen, seen


def test_a_driver_library_mismatch_names_both_and_launch_refuses(patient: PveEnv) -> None:
    msg = gpu.messages()["nvml_mismatch"]
    gpu.set_config(patient.host, VMID, DEV_CONFIG)
    gpu.place(patient.host, VMID, HEALTHY_NODES, libs="550.54.14")
    patient.host.set_gpus(VMID, count=2, error=(msg["text"], msg["rc"]))
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    us = checks["user space"]
    assert us["status"] == "FAIL" and "libnvidia-ml 550.54.14, libcuda 550.54.14" in us["seen"]
    assert "the host's driver is 550.54.15" in us["seen"]
    assert "Failed to initialize NVML: Driver/library version mismatch / NVML library version: 550.54" in us["seen"]
    assert us["fix"][0]["lines"] == ["sh NVIDIA-Linux-x86_64-550.54.15.run --no-kernel-module"]
    patient.ctl("deploy", CT, "--allow-dirty", check=True)
    r = patient.ctl("launch", CT, "--run", "gpu1")
    assert r.returncode == 14, r.stdout + r.stderr
    assert "libnvidia-ml 550.54.14 but the driver is 550.54.15" in r.stderr
    assert "`ctl doctor ct201` says why" in r.stderr
    assert json.loads(patient.ctl("runs", CT, "--json", check=True).stdout) == []  # nothing started or kept


def test_torch_built_for_a_newer_cuda_than_the_driver(patient: PveEnv) -> None:
    """The seeds' cu128/cu130 story told the other way round: a cu130 build on a driver of CUDA 12.4."""
    inside = f"/root/{patient.tag}/venv"  # the fixture's
    install_torch(patient.host.rootfs(VMID) / inside.lstrip("/"), "2.11.0+cu130", "13.0")
    gpu.set_config(patient.host, VMID, DEV_CONFIG)
    gpu.place(patient.host, VMID, HEALTHY_NODES)
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    c = checks["torch CUDA"]
    assert c["status"] == "FAIL"
    assert c["seen"] == ("torch 2.11.0+cu130 is built for CUDA 13.0, the host's driver 550.54.15 supports CUDA 12.4 "
                         "at most")
    assert c["fix"][0]["lines"] == [f"{inside}/bin/pip install --force-reinstall torch==2.11.0 --index-url "
                                    "https://download.pytorch.org/whl/cu124"]


def test_a_split_index_the_container_lacks(patient: PveEnv) -> None:
    patient.write(containers={CT: {"gpus": {"target": [0, 1, 2], "drafter": []}}})
    gpu.set_host(patient.host, NODE, count=4)
    gpu.set_config(patient.host, VMID, DEV_CONFIG)
    gpu.place(patient.host, VMID, HEALTHY_NODES)
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    n2 = checks["node /dev/nvidia2"]
    assert n2["status"] == "FAIL" and next(f["lines"] for f in n2["fix"]) == ["pct set 201 --dev5 /dev/nvidia2"]


def test_a_gpu_of_the_split_used_by_another_container(patient: PveEnv) -> None:
    gpu.set_host(patient.host, NODE, count=2, apps=[(1, 73311, "python3", 30000, 200)])
    gpu.set_config(patient.host, VMID, DEV_CONFIG)
    gpu.place(patient.host, VMID, HEALTHY_NODES)
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    assert "GPU 1 is used by CT 200: pid 73311 python3 (30000 MiB)" in checks["GPU split"]["seen"]


def test_a_64mb_dev_shm_warns(patient: PveEnv) -> None:
    gpu.set_config(patient.host, VMID, DEV_CONFIG)
    gpu.place(patient.host, VMID, HEALTHY_NODES, shm_mib=64)
    rc, checks, text = doctor(patient, CT)
    assert rc == 0, text
    shm = checks["/dev/shm"]
    assert shm["status"] == "warn" and shm["seen"].startswith("/dev/shm is 64 MiB")
    assert shm["fix"][0]["lines"] == ["mount -o remount,size=16G /dev/shm"]


def test_bad_input_is_one_clear_line_each(patient: PveEnv) -> None:
    r = patient.ctl("doctor", "nope")
    assert r.returncode == 4 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "unknown container 'nope'" in r.stderr
    patient.host.stop(VMID)
    r = patient.ctl("doctor", CT)
    assert r.returncode == 7, r.stdout + r.stderr
    assert r.stdout == f"FAIL {CT}: CT 201 on pve1 is stopped (start it with `pct start 201` on the host)\n"
    patient.host.start(VMID)
    gpu.clear_host(patient.host, NODE)
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    assert list(checks) == ["host driver"]
    assert checks["host driver"]["seen"].startswith("no NVIDIA driver loaded on pve1: /proc/driver/nvidia/version is "
                                                    "missing; nvidia-smi: NVIDIA-SMI has failed")


def test_a_job_node_without_its_address_or_nccl_interface(patient: PveEnv) -> None:
    """A node of a job: its `address:` must be one of the container's own, `nccl.socket_ifname` must select one of
    its interfaces, and the memlock limit is reported (NCCL over InfiniBand pins memory)."""
    venv = f"/root/{patient.tag}/venv"
    patient.write(containers={"ct200": {"address": "10.77.0.1", "gpus": {"target": SPLIT, "drafter": []}},
                              CT: {"address": "10.77.0.2", "nccl": {"socket_ifname": "=eth9"},
                                   "gpus": {"target": SPLIT, "drafter": []}, "vars": {"venv": venv}}},
                  jobs={"pair": {"nodes": ["ct200", CT]}})
    gpu.set_config(patient.host, VMID, DEV_CONFIG)
    gpu.place(patient.host, VMID, HEALTHY_NODES)
    rc, checks, text = doctor(patient, CT)
    assert rc == 14, text
    addr = checks["node address"]
    assert addr["status"] == "FAIL" and addr["seen"].startswith(
        "10.77.0.2 (containers.ct201.address, a node of job pair) is not an address of the container"), addr
    nccl = checks["NCCL interface"]
    assert nccl["status"] == "FAIL" and nccl["seen"].startswith("NCCL_SOCKET_IFNAME==eth9 selects none of the "
                                                                "container's interfaces (lo"), nccl
    assert checks["memlock"]["status"] in ("warn", "ok") and checks["memlock"]["seen"].startswith("memlock")
