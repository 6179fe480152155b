"""The user's persistent host sessions (transport/mux/), for `ctl mux status|stop`: listed and stopped by the
state directory's records alone, without reading an inventory."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def listed() -> tuple[Path, list[dict[str, Any]]]:
    """(the sessions' directory, what each session's record and its socket say of it)."""
    from controller.transport import mux

    return mux.mux_dir(), mux.sessions()


def stop(host: str | None, *, grace: float) -> list[dict[str, Any]]:
    """Stop the sessions (of `host` only, when given): each lets its running commands finish for up to `grace`
    seconds. The records of those stopped."""
    from controller.transport import mux

    return mux.stop(host, grace=grace)
