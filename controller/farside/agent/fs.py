"""Files and paths: walked from the container's root without following symlinks, hashed, read as JSON; the
refusal codes and texts every verb answers with."""

import os
import stat

from .base import hashlib, json

_BLOCK = 1 << 20
def _under(root, path):
    return os.path.join(root, path.lstrip("/")) if root not in ("", "/") else path


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_BLOCK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


# --- paths resolved without following symlinks ------------------------------------------------------
# The agent runs as root; a container user who owns a directory on a destination's path could otherwise swap
# a component for a symlink and redirect a write anywhere (/etc/cron.d). Every write (and the hashes that
# decide one) walks the path one component at a time with O_NOFOLLOW from the container's root, holding each
# directory open, and then works relative to the last one (openat, renameat): there is no window in which a
# swapped component changes where the bytes go. A symlink is followed only under a prefix the inventory
# lists (`follow_symlinks:`).

_DIRFLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Refused(ValueError):
    """A path that goes through a symlink the inventory does not allow ctl to follow."""


def _followable(path, follow):
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in follow or ())


def _refuse_link(fd, name, at):
    try:
        target = os.readlink(name, dir_fd=fd)
    except OSError:
        target = "?"
    raise Refused("%s is a symlink (to %s); ctl does not follow symlinks in a destination's path "
                  "(list a prefix under follow_symlinks: in the inventory to allow it)" % (at, target))


def _is_link(fd, name):
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _opendir(root, path, follow=(), created=None, mode=0o755):
    """A descriptor of the directory `path` (as the container sees it) opened from `root` one component at a
    time, never through a symlink unless under a `follow` prefix (Refused names the component). With
    `created` (a list), missing directories are made (mode `mode`) and appended to it; else missing raises."""
    fd = os.open(root or "/", _DIRFLAGS)
    at = ""
    try:
        for part in [p for p in path.split("/") if p not in ("", ".")]:
            at += "/" + part
            nfd = None
            for _attempt in (0, 1):
                try:
                    nfd = os.open(part, _DIRFLAGS | _NOFOLLOW, dir_fd=fd)
                    break
                except FileNotFoundError:
                    if created is None or _attempt:
                        raise
                    try:
                        os.mkdir(part, mode, dir_fd=fd)
                        created.append(at)
                    except FileExistsError:
                        pass
                except OSError:
                    if not _is_link(fd, part):
                        raise
                    if not _followable(at, follow):
                        _refuse_link(fd, part, at)
                    nfd = os.open(part, _DIRFLAGS, dir_fd=fd)
                    break
            os.close(fd)
            fd = nfd
    except OSError as e:
        os.close(fd)
        if e.filename in (None, at.rsplit("/", 1)[-1]):  # name the component as the container sees it
            raise OSError(e.errno, e.strerror, at) from None
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def _container_path(root, path):
    """A host path under `root` (the store: STORE arrives already joined to the root) as the container sees it."""
    if root not in ("", "/") and (path == root or path.startswith(root.rstrip("/") + "/")):
        return path[len(root.rstrip("/")):] or "/"
    return path


def _stat_at(fd, name, where, follow=()):
    """sha256/size/mode of `name` in directory `fd` (None when missing); a symlink is an error unless followed."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    flags = os.O_RDONLY | _NOFOLLOW
    if stat.S_ISLNK(st.st_mode):
        if not _followable(where, follow):
            try:
                target = os.readlink(name, dir_fd=fd)
            except OSError:
                target = "?"
            return {"error": "a symlink (to %s); ctl does not replace or follow one unless follow_symlinks: "
                             "allows it" % target, "code": "symlink"}
        try:
            st = os.stat(name, dir_fd=fd)
        except FileNotFoundError:
            return None
        flags = os.O_RDONLY
    if not stat.S_ISREG(st.st_mode):
        return {"error": "not a regular file"}
    h = hashlib.sha256()
    rfd = os.open(name, flags, dir_fd=fd)
    with os.fdopen(rfd, "rb") as f:
        for b in iter(lambda: f.read(_BLOCK), b""):
            h.update(b)
    return {"sha256": h.hexdigest(), "size": st.st_size, "mode": "%04o" % stat.S_IMODE(st.st_mode)}


def _stat_path(root, path, follow=()):
    """_stat_at for a container path: None when it or a parent is missing, an error (with the component)
    when a parent is a symlink ctl may not follow or not a directory."""
    parent, name = path.rsplit("/", 1)
    try:
        fd = _opendir(root, parent, follow)
    except FileNotFoundError:
        return None
    except Refused as e:
        return {"error": "behind a symlink: %s" % e, "code": "symlink"}
    except NotADirectoryError:
        return {"error": "under a path component that is not a directory"}
    try:
        return _stat_at(fd, name, path, follow)
    finally:
        os.close(fd)


def hashes(root, paths, follow=()):
    return {"ok": True, "files": {p: _stat_path(root, p, follow) for p in paths}}


def _close_all(fds):
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _opendir_at(fd, name):
    try:
        os.mkdir(name, 0o700, dir_fd=fd)
    except FileExistsError:
        pass
    return os.open(name, _DIRFLAGS | _NOFOLLOW, dir_fd=fd)


def _copy_at(src_fd, src_name, dst_fd, dst_name, mode, follow_src=False):
    """Copy src to a NEW file dst (O_EXCL, never through a symlink) with `mode`, fsynced; its sha256."""
    h = hashlib.sha256()
    rfd = os.open(src_name, os.O_RDONLY | (0 if follow_src else _NOFOLLOW), dir_fd=src_fd)
    try:
        wfd = os.open(dst_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=dst_fd)
        try:
            with os.fdopen(rfd, "rb", closefd=False) as src, os.fdopen(wfd, "wb", closefd=False) as out:
                for b in iter(lambda: src.read(_BLOCK), b""):
                    h.update(b)
                    out.write(b)
                out.flush()
                os.fchmod(wfd, mode)
                os.fsync(wfd)
        finally:
            os.close(wfd)
    except BaseException:
        _unlink_at(dst_fd, dst_name)
        raise
    finally:
        os.close(rfd)
    return h.hexdigest()


def _unlink_at(fd, name):
    try:
        os.unlink(name, dir_fd=fd)
    except OSError:
        pass


def _lexists_at(fd, name):
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _code(e):
    """The refusal code ctl maps to its exit codes (controller/remote/client.py, ERRORS)."""
    import errno
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk"
    if isinstance(e, VerifyFailed):
        return "verify"
    if isinstance(e, Refused):
        return "symlink"
    return "io"


class VerifyFailed(ValueError):
    """Received bytes whose sha256 differs from the manifest's, or a bundle that ended early."""


def _describe(e):
    if isinstance(e, OSError) and e.filename:
        return "%s: %s" % (e.filename, e.strerror)
    return "%s: %s" % ("ValueError" if isinstance(e, ValueError) else type(e).__name__, e)


def _unmapped_owner(path):
    """A note for a write refused under `path`: when it (or its nearest existing parent) belongs to the kernel's
    overflow uid, no user of this container owns it. In an unprivileged container (Proxmox's default) that is a
    directory the host made, or a host directory mounted in, which the container's root may not write."""
    while path and path != "/" and not os.path.lexists(path):
        path = os.path.dirname(path)
    try:
        uid = os.stat(path).st_uid
        with open("/proc/sys/kernel/overflowuid") as f:
            overflow = int(f.read())
    except (OSError, ValueError):
        return ""
    if uid != overflow:
        return ""
    return (" (%s belongs to uid %d, no user of this container: in an unprivileged container, one the host made; "
            "chown it on the host to the container's root, uid 100000 by default)" % (path, uid))


def _which(name):
    """shutil.which(name) as it is on POSIX, without importing shutil: with subprocess, ~36 ms of CPU that every
    `ctl status` of a live run paid in each container it polled (Debian's Python 3.11), for one has-session."""
    def runs(p):
        return os.path.exists(p) and os.access(p, os.X_OK) and not os.path.isdir(p)

    if os.path.dirname(name):  # a path: that file alone, as shutil looks
        return name if runs(name) else None
    path = os.environ.get("PATH")
    if path is None:
        path = os.confstr("CS_PATH") or os.defpath
    for d in path.split(os.pathsep) if path else ():
        if runs(os.path.join(d, name)):
            return os.path.join(d, name)
    return None


def _read_json(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
