"""The states a run goes through, as the registry records them.

    starting -> running -> finished | failed | stopped | crashed | lost

`starting`: the name is claimed and the preflight runs, or the launch got no answer (its note says so; the name
stays claimed and the next command that refreshes the container reconciles it from the log, pid file, tmux
session and LOG.ctl.json); `running`: tmux started the training; `finished` /
`failed`: it exited 0 / non-zero (its exit status is beside the log); `stopped`: `ctl stop` ended it;
`crashed`: a crash signature was seen while following it; `lost`: neither alive nor an exit status (the
container was restarted, or the launcher was killed).
"""

from __future__ import annotations

from enum import StrEnum


class Lifecycle(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    CRASHED = "crashed"
    LOST = "lost"

    @property
    def live(self) -> bool:
        return self in LIVE


LIVE = frozenset({Lifecycle.STARTING, Lifecycle.RUNNING})
