"""Secrets kept out of records and output: values of variables whose names look secret are replaced.

A name looks secret when it contains TOKEN, KEY, SECRET, PASSWORD or PASSWD (any case): `HF_TOKEN`,
`WANDB_API_KEY`, `db_password`. Applied to what ctl records about a run (the registry, the container's
`LOG.ctl.json`) and to what it prints (`ctl show`, `ctl diff`, `--json`), so a value the inventory passes to
the training's environment is never written or shown by ctl after the deploy that needs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
# `NAME=value` and `export NAME=value` lines of a rendered shell script
_ASSIGN = re.compile(r"^(?P<lead>[ \t]*(?:export[ \t]+)?)(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)$", re.MULTILINE)


def is_secret(name: object) -> bool:
    return isinstance(name, str) and bool(_SECRET.search(name))


def redact_vars(value: Any) -> Any:
    """A copy of a variables document (nested mappings and lists) with the value of every secret-looking key
    replaced, at any depth: `vars.env.HF_TOKEN`, `vars.api_key`."""
    if isinstance(value, Mapping):
        return {k: (REDACTED if is_secret(k) and v not in (None, "") else redact_vars(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_vars(v) for v in value]
    return value


def redact_text(text: str) -> str:
    """A shell script's text with the values of secret-looking assignments replaced (`export HF_TOKEN=<redacted>`)."""
    return _ASSIGN.sub(lambda m: f"{m['lead']}{m['name']}={REDACTED}" if is_secret(m["name"]) else m[0], text)


def redact_rendered(rendered: Mapping[str, str]) -> dict[str, str]:
    return {dest: redact_text(text) for dest, text in rendered.items()}


def redact_run(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A run's record (registry row or LOG.ctl.json) with its variables and rendered scripts redacted."""
    out = dict(doc)
    if isinstance(out.get("vars"), Mapping):
        out["vars"] = redact_vars(out["vars"])
    if isinstance(out.get("rendered"), Mapping):
        out["rendered"] = redact_rendered(out["rendered"])
    return out
