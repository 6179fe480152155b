"""A container's environment as launches and the env verbs see it: the inventory's settings for it, the probe
(controller/farside/probe_env.py, run by the container's python3 in one exec, or inside the launch preflight's
round trip) and its lock. A launch refuses an environment that differs from its lock (exit 11).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.core import envlock
from controller.core.envlock import Lock, Probe
from controller.errors import EnvMismatch, InputError
from controller.inventory import Container, Inventory
from controller.names import check_container_path
from controller.remote.client import Agent
from controller.transport.base import Transport


@dataclass(frozen=True)
class EnvSettings:
    """What the inventory says about a container's environment (vars < container vars, as templates see it)."""

    venv: str | None
    cache_dir: str
    python: str
    lock_path: Path | None


def settings(inv: Inventory, ct: Container) -> EnvSettings:
    from controller.core.render import context

    ctx = context(inv, ct)
    venv = ctx.get("venv")
    if venv is not None:
        venv = check_container_path(str(venv), f"{ct.name}: vars.venv")
    cache_dir = check_container_path(str(ctx.get("compile_cache_dir")), f"{ct.name}: vars.compile_cache_dir")
    lock = inv.base_dir / ct.spec.lock if ct.spec.lock else None
    return EnvSettings(venv, cache_dir, str(ctx.get("python") or "python3"), lock)


def run_probe(t: Transport, *, venv: str | None, cache_dir: str | None) -> dict[str, Any]:
    """One exec: probe_env.py over stdin, run by the container's python3 (`--venv` names the training venv)."""
    return Agent.of(t).probe_env(venv=venv, cache_dir=cache_dir)


def probe_doc(inv: Inventory, ct: Container, t: Transport, *, venv: str | None = None) -> dict[str, Any]:
    s = settings(inv, ct)
    return run_probe(t, venv=venv or s.venv, cache_dir=s.cache_dir)


def probe(inv: Inventory, ct: Container, t: Transport) -> Probe:
    return Probe.from_json(json.dumps(probe_doc(inv, ct, t)), ct.name)


def read_lock(path: Path) -> Lock:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"lock file {path} not found (write one with `ctl env lock CT -o {path}`)") from None
    except OSError as e:
        raise InputError(f"cannot read lock file {path}: {e.strerror}") from None
    return Lock.parse(text, str(path))


def container_lock(inv: Inventory, ct: Container, override: str | None = None) -> Lock:
    """The lock to hold the container to: --lock PATH, else the inventory's `lock:` (relative to it)."""
    if override:
        return read_lock(Path(override))
    s = settings(inv, ct)
    if s.lock_path is None:
        raise InputError(
            f"{ct.name}: no lock configured (add `lock: env/{ct.name}.lock` to the container in {inv.path}, "
            f"write it with `ctl env lock {ct.name} -o env/{ct.name}.lock`, or pass --lock PATH)"
        )
    return read_lock(s.lock_path)


def preflight_env(inv: Inventory, ct: Container, probe_json: dict[str, Any] | None) -> None:
    """Launch preflight: a container with a lock must match it (EnvMismatch, exit 11); no lock, no check."""
    if ct.spec.lock is None:
        return
    lock = container_lock(inv, ct)
    if probe_json is None:
        raise EnvMismatch(f"{ct.name}: has lock {lock.path} but its environment could not be probed")
    envlock.require_match(lock, Probe.from_json(json.dumps(probe_json), ct.name), ct.name)


def probe_request(inv: Inventory, ct: Container, t: Transport) -> tuple[dict[str, Any], bytes]:
    """What makes the launch preflight's agent `probe` run the environment probe too (Agent.env_probe_request)."""
    s = settings(inv, ct)
    return Agent.of(t).env_probe_request(venv=s.venv, cache_dir=s.cache_dir)


def probe_for_launch(inv: Inventory, ct: Container, t: Transport, *, allow_mismatch: bool = False,
                     reply: Any = None) -> dict[str, Any] | None:
    """What `ctl launch` records (the probe JSON), after refusing an environment that differs from its lock.
    `reply`: the probe's output as the agent's `probe` returned it (env_probe); None runs the probe now."""
    doc = probe_doc(inv, ct, t) if reply is None else Agent.of(t).env_from_probe(reply)
    if not allow_mismatch:
        preflight_env(inv, ct, doc)
    return doc
