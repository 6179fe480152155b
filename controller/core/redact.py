"""Secrets kept out of records and output: values of variables whose names look secret are replaced.

A name looks secret when it contains TOKEN, KEY, SECRET, PASSWORD or PASSWD (any case): `HF_TOKEN`,
`WANDB_API_KEY`, `db_password`. Applied to what ctl records about a run (the registry, the container's
`LOG.ctl.json`) and to what it prints (`ctl show`, `ctl diff`, `--json`, the dashboard), so a value the
inventory passes to the training (its environment, or `vars.train_args` rendered as `--wandb-api-key VALUE`) is
never written or shown by ctl after the deploy that needs it.

Three nets, because a value can surface in any text: (1) the value of every secret-named key of the variables,
at any depth, is collected and replaced wherever it appears (bare or shell-quoted); (2) in text, every
`NAME=value` assignment with a secret-looking NAME, anywhere on a line (`export A=1 HF_TOKEN=x`); (3) every
`--secret-looking-option value` (or `=value`). Records made before a value was known are still caught by (2)
and (3).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"
# Shorter values are not replaced where they appear in text (a one-letter "secret" would shred every line);
# the key's own value is still replaced, and (2) and (3) still apply.
MIN_SCRUB = 4
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
_WORD = r"""(?:'[^'\n]*'|"(?:[^"\\\n]|\\.)*"|[^\s'"]+)+"""  # one shell word, quoted parts included
# `NAME=value` and `export NAME=value` lines of a rendered shell script: the rest of the line goes
_LINE = re.compile(r"^(?P<lead>[ \t]*(?:export[ \t]+)?)(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)$", re.MULTILINE)
# `NAME=value` anywhere a shell word may start: `export A=1 HF_TOKEN=x`, `env KEY=v cmd`
_ASSIGN = re.compile(rf"(?P<lead>(?:^|(?<=[\s;&|(]))(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)(?P<value>{_WORD})?",
                     re.MULTILINE)
# `--api-key VALUE`, `--api-key=VALUE` (not `--api-key --next`)
_OPTION = re.compile(rf"(?P<lead>(?:^|(?<=\s))--?(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)(?:=|[ \t]+))"
                     rf"(?P<value>(?!-)({_WORD}))", re.MULTILINE)


def is_secret(name: object) -> bool:
    return isinstance(name, str) and bool(_SECRET.search(name))


def _leaves(value: Any) -> Iterable[str]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif value is not None and not isinstance(value, bool) and str(value) not in ("", REDACTED):
        yield str(value)


def secret_values(value: Any) -> frozenset[str]:
    """Every value held under a secret-looking key of a variables document, at any depth (a mapping or list
    under such a key gives all its leaves)."""
    out: set[str] = set()
    if isinstance(value, Mapping):
        for k, v in value.items():
            if is_secret(k):
                out.update(_leaves(v))
            else:
                out |= secret_values(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            out |= secret_values(v)
    return frozenset(out)


def redact_vars(value: Any) -> Any:
    """A copy of a variables document (nested mappings and lists) with the value of every secret-looking key
    replaced, at any depth: `vars.env.HF_TOKEN`, `vars.api_key`."""
    if isinstance(value, Mapping):
        return {k: (REDACTED if is_secret(k) and v not in (None, "") else redact_vars(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_vars(v) for v in value]
    return value


def scrub(text: str, values: Iterable[str]) -> str:
    """`text` with each of `values` (long enough to be told apart) replaced, bare and as the shell quotes it;
    longest first, so a value holding another is replaced whole."""
    for v in sorted({v for v in values if len(v) >= MIN_SCRUB}, key=len, reverse=True):
        quoted = shlex.quote(v)
        if quoted != v:
            text = text.replace(quoted, REDACTED)
        text = text.replace(v, REDACTED)
    return text


def redact_text(text: str, values: Iterable[str] = ()) -> str:
    """Text (a shell script, a command line, a note) with secrets replaced: the known `values`, the values of
    secret-looking assignments (`export HF_TOKEN=<redacted>`) and of secret-looking options
    (`--wandb-api-key <redacted>`)."""
    text = scrub(text, values)
    text = _LINE.sub(lambda m: f"{m['lead']}{m['name']}={REDACTED}" if is_secret(m["name"]) else m[0], text)
    text = _ASSIGN.sub(lambda m: f"{m['lead']}{REDACTED}" if is_secret(m["name"]) and m["value"] else m[0], text)
    return _OPTION.sub(lambda m: f"{m['lead']}{REDACTED}" if is_secret(m["name"]) else m[0], text)


def redact_rendered(rendered: Mapping[str, str], values: Iterable[str] = ()) -> dict[str, str]:
    values = frozenset(values)
    return {dest: redact_text(text, values) for dest, text in rendered.items()}


def redact_any(value: Any, values: Iterable[str] = ()) -> Any:
    """Every string in a JSON-like document (keys kept) through redact_text."""
    values = frozenset(values)
    if isinstance(value, Mapping):
        return {k: redact_any(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_any(v, values) for v in value]
    if isinstance(value, str):
        return redact_text(value, values)
    return value


def redact_run(doc: Mapping[str, Any], values: Iterable[str] = ()) -> dict[str, Any]:
    """A run's record (registry row or LOG.ctl.json) with its variables redacted and every text in it (rendered
    scripts, command, note, ...) cleared of the secret values its variables hold and of secret assignments."""
    known = frozenset(values) | secret_values(doc.get("vars"))
    out = {k: redact_any(v, known) for k, v in doc.items() if k not in ("vars", "rendered")}
    if "vars" in doc:
        out["vars"] = redact_any(redact_vars(doc["vars"]), known) if isinstance(doc["vars"], Mapping) else doc["vars"]
    if "rendered" in doc:
        r = doc["rendered"]
        out["rendered"] = redact_rendered(r, known) if isinstance(r, Mapping) else r
    return out
