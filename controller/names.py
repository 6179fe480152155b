"""Validation of every name and path a user hands to ctl, before it reaches a command line."""

from __future__ import annotations

import posixpath
import re

from controller.errors import InputError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SNAPSHOT = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{1,39}$")


def check_name(value: str, what: str = "name") -> str:
    """Run, container, host, group and cache names: letters, digits, '.', '_', '-'; no leading dot/dash."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise InputError(
            f"invalid {what} {value!r}: use letters, digits, '.', '_' and '-' "
            "(at most 64, starting with a letter or digit)"
        )
    return value


def check_snapshot_name(value: str) -> str:
    """Proxmox's rule: ^[a-z][a-z0-9_-]+$ (case-insensitive), at most 40 chars, not current/vzdump."""
    if not _SNAPSHOT.fullmatch(value) or value.lower() in {"current", "vzdump"}:
        raise InputError(
            f"invalid snapshot name {value!r}: start with a letter, then letters, digits, '_' or '-' "
            "(2-40 chars; 'current' and 'vzdump' are reserved)"
        )
    return value


def check_container_path(value: str, what: str = "path", allowed: tuple[str, ...] = ()) -> str:
    """An absolute, normalised path inside a container, optionally under one of `allowed` prefixes."""
    if not value.startswith("/"):
        raise InputError(f"{what} {value!r} must be an absolute path inside the container")
    if any(part == ".." for part in value.split("/")):
        raise InputError(f"{what} {value!r} must not contain '..'")
    if "\x00" in value or "\n" in value:
        raise InputError(f"{what} {value!r} contains a control character")
    norm = posixpath.normpath(value)
    if allowed and not any(norm == a.rstrip("/") or norm.startswith(a.rstrip("/") + "/") for a in allowed):
        raise InputError(f"{what} {value!r} is outside the allowed paths ({', '.join(allowed)})")
    return norm
