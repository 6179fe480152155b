"""What the agent and the host relay both need (a part of each, joined before their own parts)."""

import marshal
import os
import stat
import time

COMPILED_KEEP = 4  # compiled programs of one kind kept in /run/ctl (one per ctl version met), newest first
# A temporary name is written and renamed within milliseconds; one this old was left by a program killed while it
# wrote. Taking a live one away costs only that program's keeping (its rename fails, and is ignored).
COMPILED_STALE_S = 600


def keep_compiled(entry):
    """Keep the code BOOT just compiled (entry: (path, code), set by BOOT only when it compiled), so that the
    next start of the same program reads it instead of compiling the source again. Best effort, never in the
    way: only in a directory of our own that nobody else may enter, written under a temporary name then renamed;
    of the programs of this kind (the name's prefix: agent-, relay-), the oldest beyond COMPILED_KEEP go, and
    temporary names older than COMPILED_STALE_S."""
    if not entry:
        return
    path, code = entry
    d, name = os.path.split(path)
    try:
        os.makedirs(d, 0o700, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return
        tmp = "%s.%d.tmp" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(marshal.dumps(code))
        os.replace(tmp, path)
        prefix = name.split("-")[0] + "-"
        mine = [(e.stat(follow_symlinks=False).st_mtime, e.name, e.path) for e in os.scandir(d)
                if e.name.startswith(prefix)]
        kept = sorted((m for m in mine if not m[1].endswith(".tmp")), reverse=True)
        stale = [m for m in mine if m[1].endswith(".tmp") and time.time() - m[0] > COMPILED_STALE_S]
        for _, _, p in kept[COMPILED_KEEP:] + stale:
            os.unlink(p)
    except (OSError, ValueError):
        pass


def _pid_alive(pid: int) -> bool:  # (ctl's session client uses it too: transport/mux/client.py)
    """pid runs (a zombie, a child that exited and was not reaped yet, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
