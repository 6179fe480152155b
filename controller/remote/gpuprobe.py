"""The client of the two GPU probes: probe_host_gpu.py on a Proxmox host, probe_gpu.py in a container.

Each is stdlib Python sent over an exec's stdin (`python3 - SPEC ...`), one exec per host and one per container;
both only read. The container's probe carries the environment probe (probe_env.py) inside it, so `ctl doctor`
learns torch's CUDA in the same exec, and `ctl launch` can run it in the slot its preflight gives the environment
probe (agent.py `probe`, "env_probe") without an exec of its own.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from controller.errors import CtlError, NotRunning, OutputTooLarge, RemoteCommandError
from controller.farside import source
from controller.transport.base import Transport

MAX_REPLY = 8 << 20  # both answer a few KiB; pct config of 64 containers included
_SLOT = b"ENV_PROBE_SOURCE = None"


@functools.cache
def container_source() -> bytes:
    """probe_gpu.py with probe_env.py's source put into it (one program: `python3 -` reads only one)."""
    src = source("probe_gpu")
    at = src.find(_SLOT)
    if at < 0:
        raise CtlError("probe_gpu.py has no ENV_PROBE_SOURCE line: a broken install of ctl")
    return src[:at] + b"ENV_PROBE_SOURCE = " + repr(source("probe_env")).encode() + src[at + len(_SLOT):]


def container_spec(nodes: Sequence[str], *, caps: bool, smi: bool, net: bool, env: bool) -> str:
    return json.dumps({"nodes": list(nodes), "caps": caps, "smi": smi, "net": net, "env": env})


def _doc(name: str, what: str, argv: list[str], rc: int, out: bytes, err: str) -> dict[str, Any]:
    try:
        doc = json.loads(out.decode("utf-8", "replace").strip() or "null")
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        if "not running" in err:
            raise NotRunning(f"{name}: the container is not running", hint="pct start it, then ask again")
        if rc == 127 or "python3: not found" in err or ("No such file or directory" in err and "python3" in err):
            raise CtlError(f"{name}: python3 is not available there ({what} needs it)")
        raise RemoteCommandError(name, argv, rc, err, what=what)
    return doc


def run_container(t: Transport, spec: str, env_args: Sequence[str] = (), *, timeout: float = 150
                  ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One exec in the container: (its GPU document, the environment probe's output as agent.py's `probe` gives
    it back, or None when the spec did not ask for it)."""
    argv = ["python3", "-", spec, *env_args]
    try:
        res = t.run(argv, stdin=container_source(), timeout=timeout, max_output=MAX_REPLY)
    except OutputTooLarge:
        raise CtlError(f"{t.name}: GPU probe: reply over {MAX_REPLY:,} bytes refused") from None
    doc = _doc(t.name, "GPU probe", ["python3", "-", "<probe_gpu.py>"], res.returncode, res.stdout, res.err)
    return split_reply(t.name, doc)


def split_reply(name: str, doc: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(gpu, env) of probe_gpu.py's answer, each of the shape the callers read, else one line naming the container."""
    gpu, env = (doc.get("gpu"), doc.get("env")) if isinstance(doc, dict) else (None, None)
    if not isinstance(gpu, dict) or not (env is None or (isinstance(env, dict) and isinstance(env.get("rc"), int)
                                                          and isinstance(env.get("stdout"), str)
                                                          and isinstance(env.get("stderr"), str))):
        raise CtlError(f"{name}: GPU probe: malformed reply")
    return gpu, env


def run_host(t: Transport, vmids: Sequence[int], *, timeout: float = 60) -> dict[str, Any]:
    """One exec on the Proxmox host: its driver, majors, nvidia-smi and `pct config` of each of `vmids`."""
    argv = ["python3", "-", json.dumps({"vmids": [int(v) for v in vmids]})]
    try:
        res = t.run(argv, stdin=source("probe_host_gpu"), timeout=timeout, max_output=MAX_REPLY)
    except OutputTooLarge:
        raise CtlError(f"{t.name}: host GPU probe: reply over {MAX_REPLY:,} bytes refused") from None
    return _doc(t.name, "host GPU probe", ["python3", "-", "<probe_host_gpu.py>"], res.returncode, res.stdout,
                res.err)
