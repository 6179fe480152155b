"""The GPU part of `ctl launch`'s preflight: the cheap subset of `ctl doctor` (the split's device nodes open, the
container's user space is the driver's version), from the container's own view, in the round trip the preflight
already makes: probe_gpu.py takes the slot of agent.py `probe` that runs the environment probe, and runs that
probe inside itself. A failure refuses the launch and names `ctl doctor CT`, instead of a run dying in CUDA init.

Shared by the launch paths (commands/runs.py, and the jobs' nodes through it); nothing here prints.
"""

from __future__ import annotations

from typing import Any

from controller.core.doctor import CORE_NODES, quick
from controller.core.gpu import driver_version
from controller.errors import CtlError, GpuSetupError
from controller.inventory import Container
from controller.remote.client import Agent
from controller.remote.gpuprobe import container_source, container_spec, split_reply


def request(ct: Container, env: tuple[dict[str, Any], bytes] | None) -> tuple[dict[str, Any], bytes] | None:
    """The `env_probe` slot of the preflight's agent `probe` for this container: probe_gpu.py, which runs the
    environment probe `env` (environment.probe_request's) inside itself. `env` itself when the container has no
    GPUs in the inventory (nothing to check)."""
    split = ct.spec.gpus.all
    if not split:
        return env
    nodes = [*(f"/dev/nvidia{i}" for i in split), *CORE_NODES]
    spec = container_spec(nodes, caps=False, smi=False, net=False, env=env is not None)
    src = container_source()
    argv = [spec, *(env[0].get("argv", []) if env is not None else [])]
    return {"argv": argv, "n": len(src), "timeout": 140}, src


def unwrap(ct: Container, probed: dict[str, Any], env: tuple[dict[str, Any], bytes] | None
           ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the probe's answer as the preflight reads it, with "env_probe" the environment probe's own output again,
    or absent when none was asked; the GPU document, None when `request` added none)."""
    if not ct.spec.gpus.all:
        return probed, None
    reply = probed.get("env_probe")
    if not isinstance(reply, dict) or not isinstance(reply.get("stdout"), str):
        raise CtlError(f"{ct.name}: agent probe: malformed 'env_probe' in its reply")
    doc = Agent.json_line(reply["stdout"].strip())
    if doc is None:
        raise CtlError(f"{ct.name}: GPU probe exited {reply.get('rc')}: {str(reply.get('stderr', ''))[-300:]}")
    gpu, inner = split_reply(ct.name, doc)
    out = {k: v for k, v in probed.items() if k != "env_probe"}
    if env is not None and inner is not None:
        out["env_probe"] = inner
    return out, gpu


def check(ct: Container, gpu: dict[str, Any] | None, *, force: bool) -> tuple[str, bool, str, bool] | None:
    """(name, ok, detail, forced) for the preflight's list; raises GpuSetupError on a broken setup unless
    `force`. None when nothing was probed."""
    if gpu is None:
        return None
    problems = quick(tuple(ct.spec.gpus.all), gpu)
    if not problems:
        seen = isinstance(gpu.get("driver_file"), str) and driver_version(gpu["driver_file"]) is not None
        return ("gpu setup", True, "nodes open, user space matches the driver" if seen else
                "no NVIDIA driver visible in the container (the GPU check says more)", False)
    msg = f"{ct.name}: GPU setup is broken: {'; '.join(problems)}"
    if not force:
        raise GpuSetupError(msg, hint=f"`ctl doctor {ct.name}` says why and prints the lines that fix it")
    return ("gpu setup", False, msg, True)
