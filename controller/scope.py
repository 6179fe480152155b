"""Whose rows of the registry a checkout sees. The registry is the user's, shared by every checkout of every
project, and a row names its container by key: the name, or NAME@ROOT for a `local` target (a directory of the
checkout standing for the container's /), so two checkouts' `local` are two containers, each with its runs.

Rows recorded before a root was part of the key carry the bare name: nothing tells whose they were, so they stay
readable from every checkout as they always were.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from controller.errors import InputError


def name_of(key: str) -> str:
    return key.partition("@")[0]


@dataclass(frozen=True)
class Scope:
    """The inventory's containers whose key is more than their name, by name. None: no inventory to judge by;
    every row is seen and a bare name stands for all its roots."""

    here: Mapping[str, str] | None = None

    def of(self, ct: str) -> tuple[str, tuple[str, ...]]:
        """(SQL condition, parameters) for the rows of one container (its name or key) or job: its key's and
        those under its bare name."""
        key = self.here.get(ct, ct) if self.here is not None else ct
        name = name_of(key)
        if name != key:
            return "ct IN (?, ?)", (key, name)
        if self.here is None:
            return "(ct = ? OR ct GLOB ?)", (name, f"{name}@*")
        return "ct = ?", (name,)

    def mine(self) -> tuple[str, tuple[str, ...]]:
        """(SQL condition, parameters) leaving out other checkouts' rows."""
        if self.here is None:
            return "1", ()
        keys = tuple(self.here.values())
        return f"(instr(ct, '@') = 0 OR ct IN ({', '.join('?' * len(keys))}))", keys

    def elsewhere(self, key: str) -> bool:
        return self.here is not None and "@" in key and key not in self.here.values()

    def refusal(self, ref: str, key: str) -> InputError:
        name, _, root = key.partition("@")
        ours = (self.here or {}).get(name)
        where = f"this inventory's {name} is {ours.partition('@')[2]}" if ours else f"this inventory has no {name}"
        return InputError(f"run {ref!r} is another checkout's: it ran in {name} at {root}, and {where}")
