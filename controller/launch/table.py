"""The command table: which cli module registers each verb, and the verb of a command line.

A leaf: it imports nothing of ctl, so every start-up module (main, served, early, the command server) can read
it without importing another, and nothing imports back up.
"""

from __future__ import annotations

# verb -> the cli module that registers it (tests/test_cli_startup.py checks it against the modules).
COMMANDS: dict[str, str] = {
    "deploy": "deploy", "ping": "inventory", "inventory": "inventory",
    "mark-good": "metrics", "status": "metrics", "watch": "metrics", "plot": "metrics", "metrics": "metrics",
    "launch": "runs", "tail": "runs", "runs": "runs", "show": "runs", "stop": "runs", "attach": "runs",
    "diff": "runs", "export": "runs", "rollback": "snapshot", "snapshot": "snapshot", "supervise": "supervise",
    "events": "supervise", "config": "config", "env": "env", "cache": "env", "mux": "mux", "runbook": "runbook",
    "store": "store", "dashboard": "dashboard", "doctor": "doctor",
}
MODULES = ("config", "dashboard", "deploy", "doctor", "env", "inventory", "metrics", "mux", "runbook", "runs",
           "snapshot", "store", "supervise")  # in the order `ctl --help` lists their commands
_GLOBAL_VALUE = ("-i", "--inventory")  # global options that take a value
HELP_WIDTH = 80  # click renders help at min(terminal width, 80)


def verb(argv: list[str]) -> str | None:
    """The verb of a command line (its first word after the global options); None when there is none."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[i + 1] if i + 1 < len(argv) else None
        if a in _GLOBAL_VALUE:
            i += 2
            continue
        if not a.startswith("-"):
            return a
        i += 1
    return None
