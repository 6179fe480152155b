"""Host sessions that start while ctl is still loading.

A cold command spends its first ~0.1 s importing typer and its command module before it asks for a connection,
and only then starts the host's session process (paramiko, the handshake, the relay). When the command line
names containers, read here against the generated command tree (compspec.py, as a TAB is) and the inventory as
last parsed, the sessions of their hosts begin to start in the background before those imports
(Pool.start_sessions, mux.start_early); the command's own requests wait for them and meet their outcome, an
error included, as if they had started them. A line this cannot read for certain (no such command or name, an
inventory that does not load, --help, a dry run that does not connect) begins nothing: the command then starts
its sessions itself, as it always did, and says what is wrong.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:

    from controller.inventory import Container, Inventory

# Positional words of these kinds name containers (run names: RUN_REACHES, LIVE_WHEN_NONE, through the registry).
NAME_KINDS = ("targets", "containers", "container_or_run")
# Commands that, given no names, act on every container (`ctl ping`), or on the one the inventory has.
ALL_WHEN_NONE = ("ping", "doctor")
ONLY_WHEN_NONE = ("deploy", "store prune", "store status", "launch", "env probe", "env check", "env lock", "env sync",
                  "cache status", "cache warm", "snapshot list")
DRY_RUN_CONNECTS = ("deploy",)  # its plan is made against the containers' files
# Commands that, given no names, act on the live runs: the containers those ran in (the registry says).
LIVE_WHEN_NONE = ("status", "supervise", "runs")
# Commands whose run argument reaches the container the run ran in (NAME, or CT/NAME).
RUN_REACHES = ("tail", "stop", "watch", "metrics pull")
# Commands that, given containers, reach only those the registry has runs in (the others: "no runs recorded").
RUNS_ONLY = ("status",)
# Lines on which the command never connects (eager options that print and exit), or after `--` names are not
# what they seem.
NEVER = frozenset({"--", "--help", "--version", "--install-completion", "--show-completion"})


def containers(argv: list[str]) -> tuple[Inventory, list[Container]] | None:
    """The inventory and the containers `ctl ARGV` will reach, when the line says so for certain; else None."""
    from controller.launch.complete import Line

    if NEVER & set(argv):
        return None
    line = Line(argv)
    command = " ".join(line.path)
    if not line.path or line.node.get("commands") or ("--dry-run" in line.options
                                                      and command not in DRY_RUN_CONNECTS):
        return None
    if command == "runs" and "--no-refresh" in line.options:
        return None
    words = list(zip(line.words, line.kinds(), strict=True))
    if not any(kind in NAME_KINDS or (kind == "runs" and command in RUN_REACHES) for _, kind in words) and not (
            command in ALL_WHEN_NONE or command in ONLY_WHEN_NONE or command in LIVE_WHEN_NONE):
        return None
    from controller import inventory
    from controller.errors import CtlError

    try:
        inv = inventory.load(line.inventory)
        names: list[str] = []
        for word, kind in words:
            if kind in NAME_KINDS and (kind != "container_or_run" or word.split("/", 1)[0] in inv.model.containers):
                names.append(word.split("/", 1)[0])
            elif kind in ("runs", "container_or_run") and command in RUN_REACHES:
                ran = _ran_in(word)
                if not ran:
                    return None  # not a run the registry knows: the command says so
                names += ran
        if not names and command in LIVE_WHEN_NONE and not line.words:
            names = [ct for ct in _ran_in(None) if ct in inv.model.containers]
            if not names:
                return None
        elif names and command in RUNS_ONLY:
            # `ctl status CT|GROUP` reaches only the containers that have runs (a group's, once expanded)
            names = _with_runs([ct.name for ct in inv.select(names)])
            if not names:
                return None
        if names:
            cts = inv.select(names)
        elif command in ALL_WHEN_NONE or "--all" in line.options:
            cts = inv.select([])
        else:
            cts = inv.targets([], all_=False, purpose="")
    except CtlError:
        return None  # the command says what is wrong
    return inv, cts


def _ran_in(run: str | None) -> list[str]:
    """The containers a run ran in (or with None those of the live runs); [] when the registry cannot say for
    certain. The command reads the registry itself; this only says where it will connect."""
    from controller.lookup import containers_ran_in

    return containers_ran_in(run)


def _with_runs(names: list[str]) -> list[str]:
    """Those of names the registry has runs in (read-only; none without a registry)."""
    from controller.lookup import containers_with_runs

    return containers_with_runs(names)


PERSIST_VAR = "CTL_PERSIST"  # settings.PERSIST, read here before settings is imported (tests/test_mux_spare.py)


def _sessions_off() -> bool:
    """CTL_PERSIST=0: this command starts no session (its other values are the command's to check and refuse)."""
    return os.environ.get(PERSIST_VAR, "").strip() == "0"


# Verbs whose lines may reach containers (those start() may begin sessions for): a spare session process starts
# for them at once (spare.py). tests/test_early.py checks the list against the command tree.
SPARE_VERBS = frozenset({"cache", "dashboard", "deploy", "doctor", "env", "launch", "metrics", "ping", "rollback",
                         "runs", "snapshot", "status", "stop", "store", "supervise", "tail", "watch"})


def spare(argv: list[str]) -> bool:
    """Start a spare session process (spare.py) when `ctl ARGV` is of a kind that connects, sessions are on and
    none of the user's is up: it imports what a session needs while the command reads its line and inventory.
    True when one was started."""
    from controller.launch.table import verb

    if NEVER & set(argv) or verb(argv) not in SPARE_VERBS or _sessions_off():
        return False
    from controller.transport.mux import spare as spare_process

    return spare_process.start(os.environ)


def start(argv: list[str]) -> list[str]:
    """Begin starting the sessions `ctl ARGV` will use (see the module doc); the hosts begun."""
    from controller.errors import CtlError

    if _sessions_off():
        return []
    from controller.transport.mux import spare

    begun: list[str] = []
    try:
        found = containers(argv)
        if found is None:
            return []
        inv, cts = found
        from controller.core.terminal import clean_line
        from controller.transport.pool import Pool

        def warn(line: str) -> None:
            sys.stderr.write(f"ctl: warning: {clean_line(line)}\n")

        begun = Pool(inv, warn=warn).start_sessions(cts)
    except (CtlError, OSError):
        return []  # a setting or directory the command will refuse, in its own words
    finally:
        if not begun:
            spare.release()  # nothing begun: the command's CPU is its own
    if begun and "--debug" in argv:
        sys.stderr.write(f"ctl: debug: starting ctl's persistent session for {', '.join(begun)} while ctl loads\n")
    return begun
