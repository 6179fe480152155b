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
# Silent hosts. Each wins over the host's inventory key named after it (hosts.H.keepalive.interval, ...).
KEEPALIVE_INTERVAL = "CTL_KEEPALIVE_INTERVAL"  # seconds between SSH keepalive probes (0: no keepalive)
KEEPALIVE_COUNT = "CTL_KEEPALIVE_COUNT"  # unanswered probes in a row after which the connection is dropped
CONNECT_TIMEOUT = "CTL_CONNECT_TIMEOUT"  # seconds for TCP connect, SSH banner and authentication
TIMEOUT = "CTL_TIMEOUT"  # deadline in seconds of every request that is not a follow (0: none)
FOLLOW_RECONNECT = "CTL_FOLLOW_RECONNECT"  # seconds `tail -f` keeps trying to reconnect to a silent host

DEFAULT_INVENTORY = "inventory.yaml"
DEFAULT_CHECKPOINT_GLOB = "checkpoints/**/*.pt"  # step_N/drafter.pt, train_state.pt (and older step_N.pt)
DEFAULT_KEEPALIVE_INTERVAL = 15.0  # OpenSSH's ServerAliveInterval, as commonly set
DEFAULT_KEEPALIVE_COUNT = 3  # OpenSSH's ServerAliveCountMax default
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_TIMEOUT = 60.0  # a status, launch, stop or deploy round trip; long verbs (cache, env sync) set their own
DEFAULT_FOLLOW_RECONNECT = 300.0
LONG_TIMEOUT = 6 * 3600.0  # verbs whose work is legitimately long (cache save/restore/warm, env sync build)


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
    """--checkpoints > CTL_CHECKPOINT_GLOB > checkpoints/**/*.pt; a relative pattern inside the run directory."""
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


def _seconds(name: str, *, allow_zero: bool) -> float | None:
    """A CTL_* variable holding seconds (None when unset); malformed or out of range: InputError naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        need = ">= 0" if allow_zero else "> 0"
        raise InputError(f"{name}: expected seconds {need}, got {raw!r}")
    return value


def keepalive_interval() -> float | None:
    """CTL_KEEPALIVE_INTERVAL: seconds between keepalive probes, 0 turns them off; None when unset."""
    return _seconds(KEEPALIVE_INTERVAL, allow_zero=True)


def keepalive_count() -> int | None:
    """CTL_KEEPALIVE_COUNT: unanswered probes before the connection counts as dropped; None when unset."""
    raw = os.environ.get(KEEPALIVE_COUNT, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InputError(f"{KEEPALIVE_COUNT}: expected a whole number >= 1, got {raw!r}")
    return value


def connect_timeout() -> float | None:
    """CTL_CONNECT_TIMEOUT: seconds to connect and authenticate; None when unset."""
    return _seconds(CONNECT_TIMEOUT, allow_zero=False)


def request_timeout() -> float | None:
    """CTL_TIMEOUT: the deadline of one request (0: none); None when unset (the host's `timeout:` decides)."""
    return _seconds(TIMEOUT, allow_zero=True)


def follow_reconnect() -> float:
    """CTL_FOLLOW_RECONNECT: how long a follow keeps reconnecting after its connection dropped."""
    value = _seconds(FOLLOW_RECONNECT, allow_zero=True)
    return DEFAULT_FOLLOW_RECONNECT if value is None else value
