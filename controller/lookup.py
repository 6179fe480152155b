"""Read-only look-ups of the inventory's names and the registry's runs, for a shell's TAB (launch/complete.py,
through cli/names.py) and the early start of host sessions (launch/early.py).

Apart from inventory.py and registry.py on purpose: importing those (their dataclasses, the schema, the JSON
codecs) would double what a TAB costs (bench/completion.py). So this module imports nothing at its top, reads
the inventory's YAML without checking it, and asks the registry's `runs` table (registry.py's SCHEMA) with
one read-only query: nothing created or migrated, nothing waited for.
"""

from __future__ import annotations

TYPE_CHECKING = False  # a TAB's answer does not pay for importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")


def names_only(path: str | None = None) -> dict[str, list[str]]:
    """The inventory's host, container and group names, read without checking anything (a TAB's answer needs only
    names); {} when the file is missing or does not parse: the command itself will say why."""
    import yaml

    from controller import settings

    try:
        text = settings.inventory_path(path).read_text(encoding="utf-8")
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader
    except Exception:  # a missing or broken inventory completes nothing; the command itself will say why
        return {}
    if not isinstance(doc, dict):
        return {}
    return {key: [str(k) for k in doc[key]] for key in ("hosts", "containers", "groups")
            if isinstance(doc.get(key), dict)}


def read_only(query: Callable[[Any], T], default: T) -> T:
    """query(db) on a read-only connection to the registry; `default` without a registry or one that cannot be
    read now (being migrated, locked): a TAB or a guess at start-up never waits and never writes."""
    import sqlite3

    from controller.settings import state_dir

    try:
        path = state_dir() / "registry.sqlite3"
        if not path.is_file():
            return default
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=0.2)
        try:
            return query(db)
        finally:
            db.close()
    except (sqlite3.Error, OSError):
        return default


def recent_run_names(limit: int = 1000) -> list[tuple[str, str]]:
    """(ct, name) of the newest runs, newest first; [] without a registry."""
    none: list[tuple[str, str]] = []
    rows = read_only(lambda db: db.execute("SELECT ct, name FROM runs ORDER BY created DESC LIMIT ?",
                                           (limit,)).fetchall(), none)
    return [(str(ct).partition("@")[0], str(name)) for ct, name in rows]  # a `local` target's key: NAME@ROOT


def containers_ran_in(ref: str | None) -> list[str]:
    """The containers a run ran in, as Registry.find_run reads its reference (NAME, CT/NAME, #ID; a node of a run
    across containers stands for the whole run), or with None those of the live runs; [] without a registry or
    for a reference that does not resolve to one run."""

    def query(db: Any) -> list[str]:
        if ref is None:
            from controller.lifecycle import LIVE  # one enum module: the live states are said once

            live = sorted(s.value for s in LIVE)
            marks = ", ".join("?" * len(live))
            rows = db.execute(f"SELECT DISTINCT ct FROM runs WHERE state IN ({marks})", live).fetchall()  # noqa: S608
            return sorted({str(r[0]).partition("@")[0] for r in rows})
        if ref.startswith("#") and ref[1:].isdigit():
            ids = db.execute("SELECT id FROM runs WHERE id = ?", (int(ref[1:]),)).fetchall()
        elif "/" in ref:
            ct, _, name = ref.partition("/")
            ids = db.execute("SELECT id FROM runs WHERE ct = ? AND name = ?", (ct, name)).fetchall()
        else:
            ids = db.execute("SELECT id FROM runs WHERE name = ? AND member_of IS NULL", (ref,)).fetchall()
        if len(ids) != 1:
            return []
        (whole,) = db.execute("SELECT COALESCE(member_of, id) FROM runs WHERE id = ?", (ids[0][0],)).fetchone()
        rows = db.execute("SELECT DISTINCT ct FROM runs WHERE id = ? OR member_of = ?", (whole, whole)).fetchall()
        return sorted({str(r[0]).partition("@")[0] for r in rows})

    return read_only(query, [])


def containers_with_runs(names: list[str]) -> list[str]:
    """Those of names the registry has runs in (none without a registry)."""

    def query(db: Any) -> list[str]:
        have = {str(r[0]) for r in db.execute("SELECT DISTINCT ct FROM runs").fetchall()}
        return [n for n in names if n in have]

    return read_only(query, [])
