"""Deploys (apply, sync: plan and apply in one exec) and the store they keep versions in (storelist,
storeprune)."""

import os
import stat
import sys
import time

from .base import hashlib, json, tarfile
from .fs import (
    _BLOCK,
    _DIRFLAGS,
    _NOFOLLOW,
    Refused,
    VerifyFailed,
    _close_all,
    _code,
    _container_path,
    _copy_at,
    _describe,
    _followable,
    _opendir,
    _opendir_at,
    _stat_at,
    _stat_path,
    _unlink_at,
)


def _store_dirs(root, store, create=True):
    """(objects, deploys) directory descriptors of the store. To keep versions in (create): made where missing,
    and 0700 (versions of 0600 files live there). To read or prune (not create): None for a store that is not
    there yet, None for either directory that is not."""
    try:
        fd = _opendir(root, _container_path(root, store), (), [] if create else None, 0o700)
    except FileNotFoundError:
        if create:
            raise
        return None
    out = []
    try:
        if create:
            os.fchmod(fd, 0o700)
        for sub in ("objects", "deploys"):
            if create:
                out.append(_opendir_at(fd, sub))
                os.fchmod(out[-1], 0o700)
                continue
            try:
                out.append(os.open(sub, _DIRFLAGS | _NOFOLLOW, dir_fd=fd))
            except FileNotFoundError:
                out.append(None)
        return out
    except BaseException:
        _close_all(out)  # a staying agent (serve) would keep them request after request
        raise
    finally:
        os.close(fd)


def _store_object(ofd, src_fd, src_name, sha, mode, follow_src=False):
    """Keep the version `sha` in the store (objects directory `ofd`) with the file's own mode, at most:
    an object kept earlier from a more open file is narrowed. The copy is hashed as it is read: a file that
    changed since it was hashed is refused, never stored under a name that is not its content's."""
    mode &= 0o777
    try:
        st = os.stat(sha, dir_fd=ofd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode):
        if stat.S_IMODE(st.st_mode) & ~mode:
            fd = os.open(sha, os.O_RDONLY | _NOFOLLOW, dir_fd=ofd)
            try:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & mode)
            finally:
                os.close(fd)
        return
    tmp = ".%s.tmp%d" % (sha, os.getpid())
    got = _copy_at(src_fd, src_name, ofd, tmp, mode, follow_src)
    if got != sha:
        _unlink_at(ofd, tmp)
        raise VerifyFailed("%s changed while it was being kept in the store (sha256 %s, expected %s)"
                           % (src_name, got[:12], sha[:12]))
    os.replace(tmp, sha, src_dir_fd=ofd, dst_dir_fd=ofd)


class _Staged:
    """One received file: its directory (held open), its temporary name there, its name, its manifest entry."""

    def __init__(self, fd, tmp, name, entry):
        self.fd, self.tmp, self.name, self.entry = fd, tmp, name, entry


def _release(staged):
    for s in staged:
        if s.tmp is not None:
            _unlink_at(s.fd, s.tmp)
            s.tmp = None
        try:
            os.close(s.fd)
        except OSError:
            pass


def apply(root, store, deploy_id, stream, manifest=None, follow=()):
    staged = []  # _Staged, in manifest order
    created = []
    by_index = {}
    if manifest is not None:
        follow = manifest.get("follow", follow)
        by_index = {e["index"]: e for e in manifest["files"] if e.get("from") == "tar"}
    try:
        ofd, dfd = _store_dirs(root, store)
    except BaseException as e:
        return {"ok": False, "error": "store %s: %s" % (store, _describe(e)), "code": _code(e), "stage": "receive"}
    try:
        tar = tarfile.open(fileobj=stream, mode="r|") if (manifest is None or by_index) else []
        for member in tar:
            data = tar.extractfile(member)
            if member.name == "manifest.json":
                manifest = json.loads(data.read().decode())
                follow = manifest.get("follow", follow)
                by_index = {e["index"]: e for e in manifest["files"] if e.get("from") == "tar"}
                continue
            if manifest is None or not member.name.startswith("f"):
                raise ValueError("unexpected member %r in bundle" % member.name)
            entry = by_index[int(member.name[1:])]
            staged.append(_receive(root, entry, data, created, deploy_id, follow))
        if manifest is None:
            raise ValueError("bundle has no manifest (connection dropped?)")
        for entry in manifest["files"]:
            if entry.get("from") == "store":
                try:
                    ifd = os.open(entry["sha256"], os.O_RDONLY | _NOFOLLOW, dir_fd=ofd)
                except FileNotFoundError:
                    raise ValueError("%s: version %s is not in the store"
                                     % (entry["dest"], entry["sha256"][:12])) from None
                with os.fdopen(ifd, "rb") as data:
                    staged.append(_receive(root, entry, data, created, deploy_id, follow))
        if len(staged) != len(manifest["files"]):
            raise VerifyFailed("bundle incomplete: %d of %d files (connection dropped?)"
                               % (len(staged), len(manifest["files"])))
        # Keep old and new versions before anything is replaced.
        results = []
        for s in staged:
            previous = _stat_at(s.fd, s.name, s.entry["dest"], follow)
            if previous and "error" in previous:
                raise Refused("%s: %s" % (s.entry["dest"], previous["error"]))
            prev_sha = previous.get("sha256") if previous else None
            if prev_sha:
                _store_object(ofd, s.fd, s.name, prev_sha, int(previous["mode"], 8),
                              follow_src=_followable(s.entry["dest"], follow))
            _store_object(ofd, s.fd, s.tmp, s.entry["sha256"], int(s.entry["mode"], 8))
            results.append({"dest": s.entry["dest"], "sha256": s.entry["sha256"], "mode": s.entry["mode"],
                            "previous": prev_sha, "previous_mode": previous.get("mode") if previous else None})
    except BaseException as e:
        _release(staged)
        os.close(ofd)
        os.close(dfd)
        return {"ok": False, "error": _describe(e), "code": _code(e), "stage": "receive"}
    try:
        return _commit(staged, results, ofd, dfd, deploy_id, created)
    finally:
        _release(staged)
        os.close(ofd)
        os.close(dfd)


def _commit(staged, results, ofd, dfd, deploy_id, created):
    """Rename each file into place (atomic per file) and read it back. On any failure the renames already done
    are undone from the store's old versions (a file this deploy created is removed again), so every file is
    the old one; only when that undo fails too does the answer name exactly what stays replaced ("partial"),
    and the deploy record lists those files so that `ctl deploy --rollback` restores them."""
    done = []
    try:
        for s, res in zip(staged, results):
            os.replace(s.tmp, s.name, src_dir_fd=s.fd, dst_dir_fd=s.fd)
            s.tmp = None
            done.append((s, res))
            back = _stat_at(s.fd, s.name, s.entry["dest"])
            res["verified"] = bool(back) and back.get("sha256") == s.entry["sha256"]
            if not res["verified"]:
                raise VerifyFailed("%s: read back sha256 %s, expected %s"
                                   % (s.entry["dest"], str((back or {}).get("sha256"))[:12], s.entry["sha256"][:12]))
    except BaseException as e:
        failed = _describe(e)
        stuck = []
        for s, res in reversed(done):
            try:
                _undo(s, res, ofd, deploy_id)
            except BaseException as u:
                res["undo_error"] = _describe(u)
                stuck.append(res)
        out = {"ok": False, "code": _code(e), "stage": "commit", "dirs_created": created}
        if not stuck:
            out.update(error=failed + (" (the %d file(s) already replaced were put back)" % len(done) if done
                                       else ""), files=[], replaced=[])
            return out
        stuck.reverse()
        _write_record(dfd, deploy_id, stuck, partial=True)
        out.update(error="%s; putting the old versions back failed too (%s)" % (failed, stuck[0]["undo_error"]),
                   partial=True, files=stuck, replaced=[r["dest"] for r in stuck])
        return out
    _write_record(dfd, deploy_id, results)
    return {"ok": True, "files": results, "dirs_created": created}


def _undo(s, res, ofd, deploy_id):
    """Put the old version of one renamed file back (from the store), or remove the file this deploy created."""
    if not res["previous"]:
        os.unlink(s.name, dir_fd=s.fd)
        return
    tmp = ".%s.ctl-undo-%s" % (s.name, deploy_id)
    got = _copy_at(ofd, res["previous"], s.fd, tmp, int(res["previous_mode"], 8))
    if got != res["previous"]:
        _unlink_at(s.fd, tmp)
        raise VerifyFailed("store object %s is damaged" % res["previous"][:12])
    try:
        os.replace(tmp, s.name, src_dir_fd=s.fd, dst_dir_fd=s.fd)
    except BaseException:
        _unlink_at(s.fd, tmp)
        raise


def _write_record(dfd, deploy_id, files, partial=False):
    record = {"id": deploy_id, "time": time.time(), "files": files}
    if partial:
        record["partial"] = True
    name = deploy_id + ".json"
    tmp = "." + name + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600, dir_fd=dfd)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)


def _receive(root, entry, data, created, deploy_id, follow=()):
    parent, name = entry["dest"].rsplit("/", 1)
    try:
        fd = _opendir(root, parent, follow, created)
    except Refused as e:
        raise Refused("%s: %s" % (entry["dest"], e)) from None
    tmp = ".%s.ctl-%s" % (name, deploy_id)
    h = hashlib.sha256()
    try:
        wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=fd)
        try:
            with os.fdopen(wfd, "wb") as out:
                while True:
                    b = data.read(_BLOCK)
                    if not b:
                        break
                    h.update(b)
                    out.write(b)
                out.flush()
                os.fchmod(out.fileno(), int(entry["mode"], 8))
                os.fsync(out.fileno())
        except BaseException:
            _unlink_at(fd, tmp)
            raise
        if h.hexdigest() != entry["sha256"]:
            _unlink_at(fd, tmp)
            raise VerifyFailed("%s: received content has sha256 %s, expected %s (truncated transfer?)"
                               % (entry["dest"], h.hexdigest()[:12], entry["sha256"][:12]))
    except BaseException:
        os.close(fd)
        raise
    return _Staged(fd, tmp, name, entry)


def sync(root, store, deploy_id, stream):
    """Plan and apply in ONE exec: a header line lists the pinned files; the agent answers with what it
    has and which it needs; the controller then sends a tar of just those (or closes stdin)."""
    header = json.loads(stream.readline().decode())
    files = header["files"]
    follow = header.get("follow", ())
    have = {e["dest"]: _stat_path(root, e["dest"], follow) for e in files}
    need = [e["index"] for e in files
            if not have[e["dest"]] or have[e["dest"]].get("sha256") != e["sha256"]
            or have[e["dest"]].get("mode") != e["mode"]]
    sys.stdout.write(json.dumps({"have": have, "need": need}) + "\n")
    sys.stdout.flush()
    if not need or header.get("dry_run"):
        return {"ok": True, "files": [], "dirs_created": [], "applied": False}
    go = stream.readline().strip()
    if go != b"apply":
        return {"ok": True, "files": [], "dirs_created": [], "applied": False, "note": "not applied"}
    entries = [dict(e, **{"from": "tar"}) for e in files if e["index"] in need]
    out = apply(root, store, deploy_id, stream, manifest={"files": entries, "follow": follow})
    out["applied"] = True
    return out


# --- the store (ctl store status / prune) ----------------------------------------------------------------

_HEX = frozenset("0123456789abcdef")


def storelist(args):
    """Every object of the store (bytes, mode, mtime; stray temporary copies apart) and every deploy record."""
    fds = _store_dirs(args["root"], args["store"], create=False)
    out = {"ok": True, "now": time.time(), "objects": {}, "temps": {}, "deploys": []}
    if fds is None:
        return out
    ofd, dfd = fds
    try:
        for name in (os.listdir(ofd) if ofd is not None else []):
            st = os.stat(name, dir_fd=ofd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue
            doc = {"bytes": st.st_size, "mode": "%04o" % stat.S_IMODE(st.st_mode), "mtime": st.st_mtime}
            if len(name) == 64 and set(name) <= _HEX:
                out["objects"][name] = doc
            elif name.startswith("."):
                out["temps"][name] = doc
        for name in sorted(os.listdir(dfd) if dfd is not None else []):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dfd)
                with os.fdopen(fd) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict):
                out["deploys"].append({"id": rec.get("id"), "time": rec.get("time"), "partial": rec.get("partial"),
                                       "files": [{"dest": f.get("dest"), "sha256": f.get("sha256"),
                                                  "previous": f.get("previous")} for f in rec.get("files", [])]})
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
    return out


def storeprune(args):
    """Delete the named objects (and stray temporary copies) of the store; the controller decides which."""
    fds = _store_dirs(args["root"], args["store"], create=False)
    if fds is None or fds[0] is None:
        return {"ok": True, "deleted": [], "bytes": 0}
    ofd, dfd = fds
    deleted, freed = [], 0
    try:
        for name in args["objects"]:
            ok_name = (len(name) == 64 and set(name) <= _HEX) or (name.startswith(".") and "/" not in name
                                                                  and ".tmp" in name)
            if not ok_name:
                return {"ok": False, "code": "missing", "error": "not a store object: %r" % name,
                        "deleted": deleted, "bytes": freed}
            try:
                st = os.stat(name, dir_fd=ofd, follow_symlinks=False)
                os.unlink(name, dir_fd=ofd)
            except FileNotFoundError:
                continue
            deleted.append(name)
            freed += st.st_size
    finally:
        os.close(ofd)
        if dfd is not None:
            os.close(dfd)
    return {"ok": True, "deleted": deleted, "bytes": freed}
