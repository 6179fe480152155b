"""Every CTL_* environment variable ctl reads, the user config file, and their defaults, in one place.

Precedence everywhere: a command-line flag > the CTL_* variable > the user config file > the inventory > the
default below. The config file (`ctl config path`; CTL_CONFIG moves it) is YAML with the keys of CONFIG_KEYS, a
standing set of CTL_* values: `inventory`, `output` (json | text), `persist` (seconds), `notify` (sinks).
A malformed value is an InputError naming the variable or the file and key, never a traceback.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from controller.errors import InputError

TYPE_CHECKING = False  # this module answers a shell's TAB (launch/complete.py): no typing, no dataclasses to import
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

CONFIG = "CTL_CONFIG"  # the user config file (default: platformdirs' user config dir for "ctl", config.yaml)
INVENTORY = "CTL_INVENTORY"  # the inventory file (default ./inventory.yaml); -i/--inventory wins
OUTPUT = "CTL_OUTPUT"  # json | text: what commands print by default (--json / --text win)
NOTIFY = "CTL_NOTIFY"  # comma-separated sinks of `ctl supervise` (--notify wins; the inventory's runs.supervise.notify
#                        applies when neither this nor the config file names any)
STATE_DIR = "CTL_STATE_DIR"  # registry, dry-run stdin files, session sockets (default: platformdirs' user state dir)
PERSIST = "CTL_PERSIST"  # idle seconds of persistent host sessions (0: off); wins over each host's `persist:`
CHECKPOINT_GLOB = "CTL_CHECKPOINT_GLOB"  # checkpoints to hash, relative to a run's directory
NOTIFY_RETRIES = "CTL_NOTIFY_RETRIES"  # seconds between a notification's attempts, e.g. "1,4,15"
# Silent hosts. Each wins over the host's inventory key named after it (hosts.H.keepalive.interval, ...).
KEEPALIVE_INTERVAL = "CTL_KEEPALIVE_INTERVAL"  # seconds between SSH keepalive probes (0: no keepalive)
KEEPALIVE_COUNT = "CTL_KEEPALIVE_COUNT"  # unanswered probes in a row after which the connection is dropped
CONNECT_TIMEOUT = "CTL_CONNECT_TIMEOUT"  # seconds for TCP connect, SSH banner and authentication
TIMEOUT = "CTL_TIMEOUT"  # deadline in seconds of every request that is not a follow (0: none)
FOLLOW_RECONNECT = "CTL_FOLLOW_RECONNECT"  # seconds `tail -f` keeps trying to reconnect to a silent host
REGISTRY_WAIT = "CTL_REGISTRY_WAIT_S"  # seconds a registry write waits for another writer to let go

DEFAULT_INVENTORY = "inventory.yaml"
DEFAULT_CHECKPOINT_GLOB = "checkpoints/**/*.pt"  # step_N/drafter.pt, train_state.pt (and older step_N.pt)
DEFAULT_KEEPALIVE_INTERVAL = 15.0  # OpenSSH's ServerAliveInterval, as commonly set
DEFAULT_KEEPALIVE_COUNT = 3  # OpenSSH's ServerAliveCountMax default
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_TIMEOUT = 60.0  # a status, launch, stop or deploy round trip; long verbs (cache, env sync) set their own
DEFAULT_FOLLOW_RECONNECT = 300.0
DEFAULT_PERSIST = 60  # idle seconds a host session outlives its last command (Ansible's ControlPersist default)
LONG_TIMEOUT = 6 * 3600.0  # verbs whose work is legitimately long (cache save/restore/warm, env sync build)


DEFAULT_OUTPUT = "text"

# --- the user config file ------------------------------------------------------------------------

# config key -> (the variable it stands in for, what the value must be)
CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "inventory": (INVENTORY, "a path"),
    "output": (OUTPUT, "json or text"),
    "persist": ("CTL_PERSIST", "whole seconds >= 0"),
    "notify": (NOTIFY, "a list of sinks (https://..., slack:https://..., cmd:PROGRAM)"),
}


def config_path() -> Path:
    """CTL_CONFIG, else platformdirs' user_config_dir("ctl")/config.yaml (~/.config/ctl/config.yaml on Linux)."""
    env = os.environ.get(CONFIG)
    if env:
        return Path(os.path.expanduser(env))
    import platformdirs

    return Path(platformdirs.user_config_dir("ctl")) / "config.yaml"


_cache: dict[tuple[str, int, int], dict[str, Any]] = {}


def config_file(path: Path | None = None) -> dict[str, Any]:
    """The config file's values, checked ({} when there is none); read again only when it changed."""
    p = path or config_path()
    try:
        st = p.stat()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise InputError(f"config file {p}: cannot read: {e.strerror}") from None
    key = (str(p), st.st_mtime_ns, st.st_size)
    if key in _cache:
        return _cache[key]
    import yaml

    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506
    except OSError as e:
        raise InputError(f"config file {p}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise InputError(f"config file {p}{where}: not valid YAML") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"config file {p}: expected a mapping of {', '.join(CONFIG_KEYS)}")
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k not in CONFIG_KEYS:
            raise InputError(f"config file {p}: unknown key {k!r} (known: {', '.join(CONFIG_KEYS)})")
        try:
            out[k] = _check(k, v)
        except ValueError:
            raise InputError(f"config file {p}: {k}: expected {CONFIG_KEYS[k][1]}, got {v!r}") from None
    _cache.clear()
    _cache[key] = out
    return out


def _check(key: str, v: Any) -> Any:
    if v is None:
        raise ValueError(key)
    if key == "inventory":
        if not isinstance(v, str) or not v.strip():
            raise ValueError(key)
        return os.path.expanduser(v)
    if key == "output":
        if v not in ("json", "text"):
            raise ValueError(key)
        return v
    if key == "persist":
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(key)
        return v
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        raise ValueError(key)
    return [x.strip() for x in v]


class Setting:
    """One setting's value and where it came from (flag | env CTL_X | config FILE | default). A plain class:
    dataclasses would make every import of this module, a shell's TAB included, pay for inspect and ast."""

    __slots__ = ("name", "source", "value")

    def __init__(self, name: str, value: Any, source: str) -> None:
        self.name, self.value, self.source = name, value, source

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Setting) and (self.name, self.value, self.source) == (
            other.name, other.value, other.source)

    def __repr__(self) -> str:
        return f"Setting(name={self.name!r}, value={self.value!r}, source={self.source!r})"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "source": self.source}


def _env_value(key: str) -> Any:
    var = CONFIG_KEYS[key][0]
    raw = os.environ.get(var, "").strip()
    if not raw:
        return None
    if key == "persist":
        return persist_env()
    if key == "notify":
        return [x.strip() for x in raw.split(",") if x.strip()]
    if key == "output" and raw not in ("json", "text"):
        raise InputError(f"{var}: expected json or text, got {raw!r}")
    return raw


_DEFAULTS: dict[str, Any] = {"inventory": DEFAULT_INVENTORY, "output": DEFAULT_OUTPUT, "persist": None,
                             "notify": None}


def resolve(key: str, flag: Any = None) -> Setting:
    """One setting with where it came from: flag > CTL_* > config file > default (None: the inventory decides)."""
    if flag is not None and flag != []:
        return Setting(key, flag, "flag")
    env = _env_value(key)
    if env is not None:
        return Setting(key, env, f"env {CONFIG_KEYS[key][0]}")
    conf = config_file()
    if key in conf:
        return Setting(key, conf[key], f"config {config_path()}")
    return Setting(key, _DEFAULTS[key], "default")


def effective(flags: dict[str, Any] | None = None) -> list[Setting]:
    """Every config setting, resolved (what `ctl config show` prints)."""
    return [resolve(k, (flags or {}).get(k)) for k in CONFIG_KEYS]


def inventory_path(flag: str | None = None) -> Path:
    """-i PATH > CTL_INVENTORY > the config file's `inventory` > ./inventory.yaml."""
    return Path(resolve("inventory", flag or None).value)


def output_format(flag: str | None = None) -> str:
    """--json / --text > CTL_OUTPUT > the config file's `output` > text."""
    return str(resolve("output", flag).value)


def notify_sinks(flag: list[str] | None = None) -> list[str] | None:
    """--notify > CTL_NOTIFY > the config file's `notify`; None: the inventory's runs.supervise.notify decides."""
    value = resolve("notify", flag or None).value
    return list(value) if value is not None else None


def supervise_env_path() -> Path:
    """The file the supervisor's systemd unit reads its secrets from (EnvironmentFile), next to config.yaml:
    ~/.config/ctl/supervise.env on Linux."""
    return config_path().parent / "supervise.env"


def secret_lookup(name: str) -> str | None:
    """A secret's value (a Slack URL, a webhook key): the environment's NAME, else supervise.env's, a file that
    must be the user's own and 0600 (KEY=VALUE lines, as systemd's EnvironmentFile reads them)."""
    if os.environ.get(name):
        return os.environ[name]
    p = supervise_env_path()
    try:
        st = p.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise InputError(f"{p}: holds secrets, so it must be yours and 0600 (chmod 600 {p}); not read")
    for raw in p.read_text().splitlines():
        key, sep, value = raw.strip().partition("=")
        if sep and key.strip() == name:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            return value
    return None


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
    """CTL_PERSIST > the config file's `persist`: idle seconds a host session outlives its last client (0: no
    session); None when neither is set (then each host's inventory `persist:` decides, else DEFAULT_PERSIST)."""
    value = resolve("persist").value
    return None if value is None else int(value)


def persist_env() -> int | None:
    """CTL_PERSIST alone (None when unset)."""
    return _whole(PERSIST, 0, "whole seconds >= 0 (0 turns persistent host sessions off)")


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


def _number(name: str, kind: type[int] | type[float], fits: Callable[[float], bool], need: str) -> float | None:
    """A CTL_* variable holding a number of that kind that fits (None when unset); else an InputError naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = float("nan")  # fits nothing
    if not fits(value):
        raise InputError(f"{name}: expected {need}, got {raw!r}")
    return value


def _whole(name: str, minimum: int, need: str) -> int | None:
    """A CTL_* variable holding a whole number >= minimum (None when unset); else an InputError naming it."""
    value = _number(name, int, lambda v: v >= minimum, need)
    return None if value is None else int(value)


def _seconds(name: str, *, allow_zero: bool) -> float | None:
    """A CTL_* variable holding seconds (None when unset); malformed or out of range: InputError naming it."""
    if allow_zero:
        return _number(name, float, lambda v: 0 <= v < float("inf"), "seconds >= 0")
    return _number(name, float, lambda v: 0 < v < float("inf"), "seconds > 0")


def keepalive_interval() -> float | None:
    """CTL_KEEPALIVE_INTERVAL: seconds between keepalive probes, 0 turns them off; None when unset."""
    return _seconds(KEEPALIVE_INTERVAL, allow_zero=True)


def keepalive_count() -> int | None:
    """CTL_KEEPALIVE_COUNT: unanswered probes before the connection counts as dropped; None when unset."""
    return _whole(KEEPALIVE_COUNT, 1, "a whole number >= 1")


def connect_timeout() -> float | None:
    """CTL_CONNECT_TIMEOUT: seconds to connect and authenticate; None when unset."""
    return _seconds(CONNECT_TIMEOUT, allow_zero=False)


def request_timeout() -> float | None:
    """CTL_TIMEOUT: the deadline of one request (0: none); None when unset (the host's `timeout:` decides)."""
    return _seconds(TIMEOUT, allow_zero=True)


def registry_wait() -> float:
    """CTL_REGISTRY_WAIT_S: how long a registry writer waits for another one (30 s unless set)."""
    value = _seconds(REGISTRY_WAIT, allow_zero=False)
    return 30.0 if value is None else value


def follow_reconnect() -> float:
    """CTL_FOLLOW_RECONNECT: how long a follow keeps reconnecting after its connection dropped."""
    value = _seconds(FOLLOW_RECONNECT, allow_zero=True)
    return DEFAULT_FOLLOW_RECONNECT if value is None else value


# --- what ctl is ---------------------------------------------------------------------------------


def version() -> str:
    """ctl's version as installed (importlib.metadata); "unknown" when it is not installed (a bare checkout)."""
    from importlib import metadata

    try:
        return metadata.version("ctl")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_commit() -> str:
    """The git commit ctl runs from when its package directory sits in a checkout (`git rev-parse HEAD`, with
    "-dirty" when tracked files under it changed), else "unknown". Never fails, and gives up after 2 s."""
    import subprocess

    pkg = Path(__file__).resolve().parent
    if not any((d / ".git").exists() for d in (pkg.parent, pkg.parent.parent)):
        return "unknown"  # installed into site-packages: no checkout around it
    try:
        env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
        head = subprocess.run(["git", "-C", str(pkg), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=2, env=env)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(pkg), "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=2, env=env)
        return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def file_stamps(*paths: str, packages: tuple[str, ...] = ()) -> bytes:
    """What a cache entry depends on besides its input: each file's path, size and mtime, and each installed
    package's by its package file (found without importing it)."""
    import importlib.util

    files = list(paths)
    for name in packages:
        spec = importlib.util.find_spec(name)
        files.append(spec.origin if spec is not None and spec.origin else name)
    parts = []
    for f in files:
        try:
            st = os.stat(f)
            parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{f}:?")
    return "\0".join(parts).encode()


def cache_get(name: str, key: str) -> bytes | None:
    """The content kept under `key` in the state directory's cache `name` (see cache_put), or None: missing,
    unreadable, or not matching the sha256 it was written with (a file cut short is never used)."""
    import hashlib

    hit = state_dir() / name / key
    try:
        head, _, content = hit.read_bytes().partition(b"\n")
    except OSError:
        return None
    if head != hashlib.sha256(content).hexdigest().encode():
        return None
    with contextlib.suppress(OSError):
        os.utime(hit)  # pruning drops the least recently used
    return content


def cache_put(name: str, key: str, content: bytes, keep: int) -> None:
    """Keep `content` under `key` (its sha256 first, written whole then renamed) in the private cache `name` of
    the state directory, and only the `keep` most recently used entries. A cache that cannot be written is
    skipped: the caller computes the content again next time."""
    import hashlib
    import uuid

    cache = state_dir() / name
    try:
        private_dir(cache)
        tmp = private_file(cache / f".{key}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(hashlib.sha256(content).hexdigest().encode() + b"\n" + content)
        tmp.replace(cache / key)
        old = sorted(cache.iterdir(), key=lambda p: p.stat().st_mtime)
        for p in old[:max(0, len(old) - keep)]:
            p.unlink(missing_ok=True)
    except OSError:
        pass
