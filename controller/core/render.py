"""Jinja2 templates rendered for one container, with StrictUndefined.

The context, lowest precedence first: inventory `vars` < container `vars` < what ctl computes
(container identity, GPU split, run naming, payload destinations). A missing variable is an
`InputError` naming the template, its line and the variable.
"""

from __future__ import annotations

import posixpath
import shlex
from pathlib import Path
from typing import Any

from controller.errors import InputError
from controller.inventory import Container, Inventory

_BUILTIN_DEFAULTS: dict[str, Any] = {
    "python": "python3",
    "venv": None,
    "payload_dir": "/root",
    "compile_cache_dir": "/workspace/.cache/torchinductor",
    "data_cache_dir": "/workspace/.cache/dflash",  # tokenised data, taught tiny targets: kept across runs
    "env": {},
    "train_args": {},
}


def context(inv: Inventory, ct: Container) -> dict[str, Any]:
    ctx: dict[str, Any] = dict(_BUILTIN_DEFAULTS)
    ctx.update(inv.model.vars)
    ctx.update(ct.spec.vars)
    gpus = ct.spec.gpus
    order = gpus.all
    runs = inv.model.runs
    job = inv.job_of(ct.name)
    nproc = (len(gpus.target) or 1) + (len(gpus.drafter) or 1)
    nccl = dict(job.spec.nccl.env()) if job is not None and job.spec.nccl is not None else {}
    nccl.update(ct.spec.nccl.env() if ct.spec.nccl is not None else {})
    if job is not None and isinstance(job.spec.nproc_per_node, int):
        nproc = job.spec.nproc_per_node
    ctx.update(
        {
            "ct": {"name": ct.name, "vmid": ct.spec.vmid, "host": ct.host_name, "transport": ct.spec.transport},
            "root": str(ct.root) if ct.root is not None else "",
            "gpus": {"target": list(gpus.target), "drafter": list(gpus.drafter), "all": order},
            "cuda_visible_devices": ",".join(str(i) for i in order),
            # Per-rank CUDA ordinal after CUDA_VISIBLE_DEVICES renumbering: targets first, then drafters.
            "rank_gpus": ",".join(str(order.index(i)) for i in [*gpus.target, *gpus.drafter]),
            "n_targets": len(gpus.target) or 1,
            "n_drafters": len(gpus.drafter) or 1,
            "nproc": nproc,
            "device": "cuda" if order else "cpu",
            "runs": {"series": runs.series, "session": runs.session, "log": runs.log, "dir": runs.dir},
            "payload": {posixpath.basename(e.dest): e.dest for e in inv.model.payload},
            # NCCL_SOCKET_IFNAME (and gloo's), NCCL_IB_DISABLE, NCCL_P2P_DISABLE from `nccl:` (job, then container)
            "nccl_env": nccl,
            # A node of a multi-node job: torchrun's c10d rendezvous (the run name, CTL_RUN, is its id); None for
            # a container of its own, whose script runs torchrun --standalone.
            "job": None if job is None else {
                "name": job.name, "nnodes": job.nnodes, "node_rank": job.rank(ct.name),
                "nodes": [c.name for c in job.nodes], "rdzv_endpoint": job.rdzv_endpoint,
                "rdzv_port": job.spec.rdzv_port, "master_addr": job.master_addr, "address": ct.spec.address,
            },
        }
    )
    return ctx


def _shquote(value: Any) -> str:
    return shlex.quote(str(value))


def _cli_args(mapping: dict[str, Any]) -> str:
    """{"steps": 10, "compile": True, "no-x": False} -> "--steps 10 --compile" (quoted)."""
    parts: list[str] = []
    for key, value in mapping.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is False or value is None:
            continue
        else:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


def render(template_path: Path, ctx: dict[str, Any], *, display_name: str | None = None) -> bytes:
    import jinja2

    name = display_name or str(template_path)
    try:
        source = template_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"template {name} not found") from None
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
        autoescape=False,  # noqa: S701 - renders shell, not HTML
    )
    env.filters["shquote"] = _shquote
    env.filters["cli_args"] = _cli_args
    try:
        tmpl = env.from_string(source)
        tmpl.filename = name
        return tmpl.render(**ctx).encode("utf-8")
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"{name}:{e.lineno}: template syntax error: {e.message}") from None
    except jinja2.UndefinedError as e:
        line = _template_line(e, name)
        where = f"{name}:{line}" if line else name
        raise InputError(
            f"{where}: {e.message} (set it under `vars:` in the inventory, globally or for the container)"
        ) from None


def _template_line(e: BaseException, filename: str) -> int | None:
    tb = e.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in (filename, "<template>"):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
