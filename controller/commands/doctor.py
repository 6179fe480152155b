"""`ctl doctor [CT|GROUP|JOB ...]`: why a container's GPUs do not work, and the exact lines that fix it.

Read-only. One exec per Proxmox host (probe_host_gpu.py: the driver, this boot's majors, nvidia-smi, `pct config`
of every container asked about there) and one per container (probe_gpu.py, with the environment probe inside),
hosts and containers side by side; then core/doctor.py judges each container against what the inventory expects.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from controller.commands.fanout import Outcome, fanout
from controller.core.doctor import Check, Expect, HostView, failed, host_view, judge, needed_nodes
from controller.core.render import context
from controller.errors import CtlError, ExitCode
from controller.inventory import Container, Inventory
from controller.names import check_container_path
from controller.remote.gpuprobe import container_spec, run_container, run_host
from controller.transport.base import Transport
from controller.transport.pool import Pool


@dataclass(frozen=True)
class Report:
    """One container's check list: its name, how it is shown (host/vmid), and each check in order."""

    ct: str
    label: str
    checks: tuple[Check, ...]

    @property
    def failed(self) -> bool:
        return failed(list(self.checks))

    def to_json(self) -> dict[str, Any]:
        return {"ct": self.ct, "ok": not self.failed, "checks": [c.to_json() for c in self.checks]}


def expect(inv: Inventory, ct: Container) -> Expect:
    """What the inventory expects of the container's GPUs and network (as its start script is rendered)."""
    ctx = context(inv, ct)
    job = inv.job_of(ct.name)
    venv = ctx.get("venv")
    if venv is not None:  # it reaches a command line in the container (the environment probe's --venv)
        venv = check_container_path(str(venv), f"{ct.name}: vars.venv")
    host = ct.host_name if ct.host is not None and ct.spec.vmid is not None else None
    return Expect(ct=ct.name, host=host, vmid=ct.spec.vmid if host else None, split=tuple(ct.spec.gpus.all),
                  cuda_visible=str(ctx.get("cuda_visible_devices") or ""), venv=str(venv) if venv else None,
                  job=job.name if job is not None and job.nnodes > 1 else None,
                  address=ct.spec.address if job is not None and job.nnodes > 1 else None,
                  ifname=(ctx.get("nccl_env") or {}).get("NCCL_SOCKET_IFNAME"), inventory=str(inv.path))


def _env_args(t: Transport, e: Expect) -> list[str]:
    return ["--venv", t.path(e.venv)] if e.venv else []


def _hosts(inv: Inventory, pool: Pool, cts: list[Container]) -> dict[str, HostView | CtlError]:
    """Each host's answer (or its error), all hosts side by side; one exec each."""
    by_host: dict[str, list[int]] = {}
    for ct in cts:
        e = expect(inv, ct)
        if e.host is not None and e.vmid is not None:
            by_host.setdefault(e.host, []).append(e.vmid)
    out: dict[str, HostView | CtlError] = {}
    lock = threading.Lock()

    def one(host: str, vmids: list[int]) -> None:
        try:
            got: HostView | CtlError = host_view(host, run_host(pool.host_exec(host), vmids))
        except CtlError as exc:
            got = exc
        with lock:
            out[host] = got

    threads = [threading.Thread(target=one, args=(h, v), name=f"doctor-{h}") for h, v in by_host.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def doctor(inv: Inventory, pool: Pool, cts: list[Container]) -> list[Outcome[Report]]:
    """Every container's checks; a container that cannot be examined (stopped, unreachable) is an error outcome
    of one line. Hosts are asked while the containers are."""
    hosts: dict[str, HostView | CtlError] = {}
    asker = threading.Thread(target=lambda: hosts.update(_hosts(inv, pool, cts)), name="doctor-hosts")
    asker.start()

    def one(ct: Container, t: Transport) -> tuple[dict[str, Any], dict[str, Any] | None]:
        e = expect(inv, ct)
        spec = container_spec(needed_nodes(e.split), caps=True, smi=bool(e.split), net=True,
                              env=bool(e.split))
        return run_container(t, spec, _env_args(t, e) if e.split else [])

    try:
        probed = fanout(pool, cts, one)
    finally:
        asker.join()
    out: list[Outcome[Report]] = []
    for ct, o in zip(cts, probed, strict=True):
        e = expect(inv, ct)
        h = hosts.get(e.host) if e.host else None
        if isinstance(h, CtlError):
            out.append(Outcome(ct.name, None, str(h), int(h.exit_code)))
            continue
        if not o.ok or o.value is None:
            out.append(Outcome(ct.name, None, o.error, o.exit_code))
            continue
        gpu, env_reply = o.value
        env = _env_doc(env_reply)
        checks = judge(e, h, gpu, env)
        out.append(Outcome(ct.name, Report(ct.name, ct.label, tuple(checks)), None, 0))
    return out


def _env_doc(reply: dict[str, Any] | None) -> dict[str, Any] | None:
    """The environment probe's document from its output, or one with the error (torch's CUDA is then unknown)."""
    if reply is None:
        return None
    from controller.remote.client import Agent

    doc = Agent.json_line(reply["stdout"].strip())
    if doc is None:
        return {"torch": {"error": f"environment probe exited {reply['rc']}: {reply['stderr'][-200:]}"}}
    return doc


def exit_code(outcomes: list[Outcome[Report]]) -> int:
    """GPU_SETUP when a check failed; else the first container's error's code; else 0."""
    if any(o.value is not None and o.value.failed for o in outcomes):
        return int(ExitCode.GPU_SETUP)
    for o in outcomes:
        if not o.ok:
            return o.exit_code or int(ExitCode.FAILURE)
    return 0
