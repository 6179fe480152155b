"""Every CTL_* environment variable ctl reads, with its default, in one place.

Precedence everywhere: a command-line flag > the CTL_* variable > the inventory > the default below.
A malformed value is an InputError naming the variable, never a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from controller.errors import InputError

INVENTORY = "CTL_INVENTORY"  # the inventory file (default ./inventory.yaml); -i/--inventory wins
STATE_DIR = "CTL_STATE_DIR"  # registry, dry-run stdin files, session sockets (default: platformdirs' user state dir)
PERSIST = "CTL_PERSIST"  # idle seconds of persistent host sessions; wins over each host's `persist:`
CHECKPOINT_GLOB = "CTL_CHECKPOINT_GLOB"  # checkpoints to hash, relative to a run's directory
NOTIFY_RETRIES = "CTL_NOTIFY_RETRIES"  # seconds between a notification's attempts, e.g. "1,4,15"

DEFAULT_INVENTORY = "inventory.yaml"
DEFAULT_CHECKPOINT_GLOB = "checkpoints/*.pt"


def inventory_path(flag: str | None = None) -> Path:
    """-i PATH > CTL_INVENTORY > ./inventory.yaml."""
    return Path(flag or os.environ.get(INVENTORY) or DEFAULT_INVENTORY)


def state_dir() -> Path:
    """Where ctl keeps its local state: CTL_STATE_DIR, else the platform's user state directory."""
    env = os.environ.get(STATE_DIR)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_state_dir("ctl"))


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner can enter (0700): made so, or narrowed when it is ours (never the
    home directory). ctl's state holds run records, deploy stdin files and sockets."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == os.getuid() and path.resolve() != Path.home().resolve():
        path.chmod(0o700)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty if missing, 0600 (narrowed when it exists and is ours)."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o600))
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        path.chmod(0o600)
    return path


def persist_seconds() -> int | None:
    """CTL_PERSIST: idle seconds a host session outlives its last client (0: no session); None when unset
    (then each host's inventory `persist:` decides)."""
    raw = os.environ.get(PERSIST, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InputError(f"{PERSIST}: expected whole seconds >= 0 (0 turns persistent host sessions off), got {raw!r}")
    return value


def checkpoint_glob(flag: str | None = None) -> str:
    """--checkpoints > CTL_CHECKPOINT_GLOB > checkpoints/*.pt; a relative pattern inside the run directory."""
    g = flag or os.environ.get(CHECKPOINT_GLOB) or DEFAULT_CHECKPOINT_GLOB
    if g.startswith("/") or ".." in g.split("/") or "\0" in g or not g.strip():
        raise InputError(f"checkpoint glob {g!r} must be a relative pattern inside the run directory")
    return g


def notify_retries() -> tuple[float, ...]:
    """CTL_NOTIFY_RETRIES: the waits between a failed notification's attempts (default 1, 4, 15 s)."""
    raw = os.environ.get(NOTIFY_RETRIES, "").strip()
    if not raw:
        return (1.0, 4.0, 15.0)
    try:
        waits = tuple(float(x) for x in raw.split(","))
    except ValueError:
        waits = (-1.0,)
    if any(w < 0 or w > 3600 for w in waits):
        raise InputError(f"{NOTIFY_RETRIES}: expected seconds between attempts such as 1,4,15, got {raw!r}")
    return waits
