"""The names an argument takes (containers, groups, hosts, runs): typer's `autocompletion=` callbacks of the cli
modules, and what a shell's TAB is answered with (launch/complete.py).

Read through lookup.py (the inventory's names, nothing checked; one read-only registry query): no network, no
typer, no paramiko, no pydantic. The callbacks are also how launch/specgen.py knows which argument takes which names.
"""

from __future__ import annotations

TYPE_CHECKING = False  # a TAB's answer does not pay for importing typing
if TYPE_CHECKING:
    from collections.abc import Callable


def names(kind: str, incomplete: str, inventory: str | None = None) -> list[str]:
    """The names an argument of `kind` takes that start with `incomplete`, from the inventory at `inventory`
    (-i; else CTL_INVENTORY, the config file, ./inventory.yaml) and the registry."""
    refs: list[str] = []
    if kind in ("runs", "run_or_container") or (kind == "container_or_run" and "/" in incomplete):
        from controller.lookup import recent_run_names

        refs = [f"{ct}/{name}" if "/" in incomplete else name for ct, name in recent_run_names()]
    if kind != "runs" and not (kind == "container_or_run" and "/" in incomplete):
        from controller.lookup import names_only

        doc = names_only(inventory)
        if kind == "hosts":
            refs += doc.get("hosts", [])
        else:
            refs += doc.get("containers", []) + (doc.get("groups", []) if kind == "targets" else [])
    return [r for r in dict.fromkeys(refs) if r.startswith(incomplete)]


# The arguments' `autocompletion=` callbacks (typer calls them with the word being completed, by the name
# `incomplete`). Each kind has its own function: specgen.py tells an argument's kind by which one it has.

def _completer(kind: str, doc: str) -> Callable[[str], list[str]]:
    def complete(incomplete: str) -> list[str]:
        return names(kind, incomplete)

    complete.__doc__ = doc
    complete.__name__ = complete.__qualname__ = kind
    return complete


containers = _completer("containers", "Container names of the inventory.")
targets = _completer("targets", "Container and group names of the inventory.")
hosts = _completer("hosts", "Host names of the inventory.")
runs = _completer("runs", "Run names of the registry, newest first: NAME, or CT/NAME once a `/` is typed.")
container_or_run = _completer("container_or_run", "A container, or one of its runs as CT/NAME once a `/` is typed "
                                                  "(ctl tail).")
run_or_container = _completer("run_or_container", "A run or a container (ctl env diff).")

KINDS = {"containers": containers, "targets": targets, "hosts": hosts, "runs": runs,
         "container_or_run": container_or_run, "run_or_container": run_or_container}
