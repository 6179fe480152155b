"""ctl's agent: runs INSIDE a container (stdlib only, Python >= 3.8), one invocation per operation.

The controller never imports this module. It sends its source over the stdin of one exec
(`python3 -c BOOT N verb ...`: BOOT reads N bytes of source from stdin and runs them; the rest of
stdin is the verb's input), so a whole operation costs one `pct exec`, whatever the number of files.

Verbs (each prints one JSON document on stdout; exit 0 when "ok" is true):
  hashes   ROOT [--follow=JSON] PATH...  sha256/size/mode of each path (null when missing)
  sync     ROOT STORE DEPLOY_ID    plan + apply in one exec: stdin header line (pinned files, "follow")
                                   -> stdout line (what it has, what it needs) -> stdin "apply" + tar
  apply    ROOT STORE DEPLOY_ID    stdin: a tar of manifest.json + file bodies. Every file is written
                                   to a temporary name beside its destination and verified; the old
                                   and new versions are kept in STORE/objects (content-addressed, with
                                   the file's mode); only when all of that succeeded is each file renamed
                                   into place (atomic per file) and read back. A failure before the
                                   renames leaves every destination untouched; one during them puts the
                                   renamed files back from the store ("partial" names what could not be).
                                   No temporary file remains. Paths are walked without following
                                   symlinks (code "symlink"), except under the "follow" prefixes.
  storelist JSON-ARGS              the store's objects (bytes, mode) and its deploy records
  storeprune JSON-ARGS             delete the named objects (ctl store prune decides which)
  probe    JSON-ARGS               launch preflight facts in one round trip (files, tmux, log, disk,
                                   GPUs, logs of the run series)
  launch   JSON-ARGS               write the run record beside the log (never over one) and start the
                                   detached tmux session
  runstate JSON-ARGS               exit status / liveness / log size of runs
  stop     JSON-ARGS               SIGINT the run's process group, escalate, end its session
  tailinfo JSON-ARGS               log size and last N lines
  logread  JSON-ARGS               a JSON header line, then raw log bytes from an offset (+ file hashes)
  poll     JSON-ARGS               runstate + logread of every run of the container in one call: a JSON
                                   header line, then the runs' log bytes back to back
  cachestat JSON-ARGS              compile cache size, entries (fxgraph/aotautograd/triton), marker; saved caches
  cachemark JSON-ARGS              write the cache's ctl-cache.json marker (torch build that filled it)
  cachesave JSON-ARGS              tar.gz of the cache + sidecar JSON (sha256, torch build); never overwrites
  cacherestore JSON-ARGS           verify sha256, unpack beside, move the current cache aside (kept), swap in
  envfacts JSON-ARGS               venv symlink/dir, where uv is, which paths are taken (ctl env sync)
  writefile JSON-ARGS              stdin -> a new file (refuses to replace one)
  ckptscan JSON-ARGS               newest complete checkpoint (manifest present, sha256s match) under given dirs
  packdir  JSON-ARGS               a checkpoint directory as a tar stream in base64 lines (between JSON lines)
  unpackdir JSON-ARGS              stdin (a tar stream) -> a new checkpoint directory, verified by its manifest
  hello    JSON-ARGS               who answers: pid, python, whether a staying agent (`ctl ping`)
  serve                            stay: answer requests for the verbs above, one at a time, until stdin ends
                                   (started by ctl's host relay, controller/remote/hostrelay.py; see serve())
"""

import io
import marshal
import os
import stat
import struct
import sys
import time


class _Lazy:
    """A module imported on its first use. An agent start that only says hello or polls (`ctl ping`, `ctl status`)
    needs none of these, and they were half of its start: hashlib alone loads OpenSSL (~9 ms), subprocess,
    shutil, tarfile and traceback another ~12 ms; a cold `ctl ping` of 40 containers starts 40 agents."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        module = __import__(self._name)
        globals()[self._name] = module
        return getattr(module, attr)


hashlib = _Lazy("hashlib")
re = _Lazy("re")
glob = _Lazy("glob")
shutil = _Lazy("shutil")
subprocess = _Lazy("subprocess")
tarfile = _Lazy("tarfile")
traceback = _Lazy("traceback")


try:  # the interpreter's own sha256, for a few KiB: hashlib would load OpenSSL for them (see _Lazy)
    from _sha256 import sha256 as _small_sha256
except ImportError:
    try:
        from _sha2 import sha256 as _small_sha256  # Python 3.12+
    except ImportError:
        _small_sha256 = None


class _Json:
    """json's loads/dumps/load/dump. The json module imports re and enum (~5 ms of CPU of every agent start, a
    third of what the agent adds to Python's own start); the plain calls go straight to the C accelerator json
    itself uses (_json: the same scanner and encoder, so the same results), and everything else (indent,
    sort_keys, default, a document json refuses, an interpreter without _json) to the json module, imported
    then. What dumps cannot encode is refused here, in json's words."""

    def __init__(self):
        self.strict, self.object_hook, self.object_pairs_hook = True, None, None  # what _json's scanner reads
        self.parse_float, self.parse_int = float, int
        self.parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__
        try:
            import _json

            self._scan = _json.make_scanner(self)
            self._make_encoder, self._encode_str = _json.make_encoder, _json.encode_basestring_ascii
            self._fast = True
        except (ImportError, AttributeError, TypeError):
            self._fast = False

    @staticmethod
    def _module():
        import json

        return json

    def loads(self, s):
        if not self._fast or not isinstance(s, str):
            return self._module().loads(s)
        idx = len(s) - len(s.lstrip(" \t\n\r"))
        try:
            obj, end = self._scan(s, idx)
        except Exception:  # json says what is wrong (the scanner raises its own errors through json.decoder)
            return self._module().loads(s)
        if s[end:].strip(" \t\n\r"):
            return self._module().loads(s)  # extra data: json's error
        return obj

    def dumps(self, obj, **kw):
        if not self._fast or kw:
            return self._module().dumps(obj, **kw)
        if isinstance(obj, str):
            return self._encode_str(obj)

        def default(o):
            raise TypeError("Object of type %s is not JSON serializable" % o.__class__.__name__)

        # a new encoder (and dict of containers seen) per call, as json.dumps makes: an error mid-way leaves none
        encode = self._make_encoder({}, default, self._encode_str, None, ": ", ", ", False, False, True)
        return "".join(encode(obj, 0))

    def load(self, f):
        return self.loads(f.read())

    def dump(self, obj, f, **kw):
        f.write(self.dumps(obj, **kw))


json = _Json()

_BLOCK = 1 << 20
COMPILED_KEEP = 4  # compiled agents kept in /run/ctl (one per ctl version met), newest first


def keep_compiled(entry):
    """Keep the code BOOT just compiled (entry: (path, code), set by BOOT only when it compiled), so that the
    next start of this agent reads it instead of compiling the source again. Best effort, never in the way:
    only in a directory of our own that nobody else may enter, written under a temporary name then renamed;
    the oldest beyond COMPILED_KEEP go."""
    if not entry:
        return
    path, code = entry
    d = os.path.dirname(path)
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
        entries = [e for e in os.scandir(d) if e.name.startswith("agent-")]
        kept = sorted((e for e in entries if not e.name.endswith(".tmp")),
                      key=lambda e: e.stat(follow_symlinks=False).st_mtime, reverse=True)
        # a temporary name left by an agent killed while it wrote goes once it is surely nobody's
        stale = [e for e in entries if e.name.endswith(".tmp")
                 and time.time() - e.stat(follow_symlinks=False).st_mtime > 600]
        for e in kept[COMPILED_KEEP:] + stale:
            os.unlink(e.path)
    except (OSError, ValueError):
        pass


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


def _store_dirs(root, store):
    """(objects, deploys) directory descriptors of the store, made 0700 (versions of 0600 files live there)."""
    fd = _opendir(root, _container_path(root, store), (), [], 0o700)
    out = []
    try:
        os.fchmod(fd, 0o700)
        for sub in ("objects", "deploys"):
            out.append(_opendir_at(fd, sub))
            os.fchmod(out[-1], 0o700)
        return out
    except BaseException:
        _close_all(out)  # a staying agent (serve) would keep them request after request
        raise
    finally:
        os.close(fd)


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


def probe(args):
    """Everything a launch preflight needs, in one round trip."""
    root = args.get("root", "/")
    out = {"ok": True}
    out["files"] = hashes(root, args.get("files", []), args.get("follow", ()))["files"]
    session = args.get("session")
    if session or args.get("sessions"):
        tmux = _which("tmux")
        if tmux is None:
            out["tmux"] = {"error": "tmux not found in the container"}
        elif session:
            out["tmux"] = {"exists": _tmux_has(session, tmux)}
        else:  # the run's name is not known yet: every session, so the caller can check the one it picks
            r = subprocess.run([tmux, "list-sessions", "-F", "#{session_name}"], capture_output=True, text=True)
            out["tmux"] = {"sessions": r.stdout.split() if r.returncode == 0 else []}
    log = args.get("log")
    if log:
        p = _under(root, log)
        out["log"] = {"exists": os.path.lexists(p)}
        d = os.path.dirname(p)
        while d and not os.path.isdir(d):
            d = os.path.dirname(d)
        try:
            st = os.statvfs(d or "/")
            out["disk"] = {"path": d, "free": st.f_bavail * st.f_frsize}
        except OSError as e:
            out["disk"] = {"error": _describe(e)}
    if args.get("run_dir"):
        out["run_dir"] = {"exists": os.path.lexists(_under(root, args["run_dir"]))}
    pattern = args.get("series_glob")
    if pattern:
        out["series_logs"] = sorted(
            os.path.basename(p) for p in glob.glob(_under(root, pattern)))
    if args.get("gpus"):
        out["gpus"] = _gpus()
    if args.get("rdzv"):
        out["rdzv"] = _rdzv_check(args["rdzv"])
    if args.get("env_probe"):
        out["env_probe"] = _env_probe(args["env_probe"], sys.stdin.buffer)
    return out


def _env_probe(spec, stream):
    """The environment probe (probe_env.py, the first spec["n"] bytes after the agent's source on stdin) run as
    `python3 - ARGS` would be, so a launch learns its environment in the preflight's round trip. Its output goes
    back as text: the controller parses and bounds it exactly as when it runs the probe on its own."""
    src = stream.read(int(spec["n"]))
    try:
        r = subprocess.run([sys.executable, "-"] + [str(a) for a in spec.get("argv", [])], input=src,
                           capture_output=True, timeout=float(spec.get("timeout", 110)))
    except subprocess.TimeoutExpired:
        return {"rc": 124, "stdout": "", "stderr": "env probe: no answer within %ss" % spec.get("timeout", 110)}
    return {"rc": r.returncode, "stdout": r.stdout.decode("utf-8", "replace"),
            "stderr": r.stderr.decode("utf-8", "replace")[-4000:]}


def _rdzv_check(spec):
    """A run across several containers, before anything starts: the rendezvous node listens on the rendezvous
    port (as torchrun's TCPStore will: every address), each other node connects to ADDRESS:PORT from here and
    reads the nonce ctl gave the listener, so reaching something else at that address does not count. Both ends
    give up at the deadline; the connecting side closes first, so the listener's port is not left in TIME_WAIT."""
    import socket
    timed_out = socket.timeout  # TimeoutError only from Python 3.10; the agent runs on 3.8
    deadline = time.time() + float(spec.get("timeout", 10))
    nonce = str(spec["nonce"]).encode()
    if "listen" in spec:
        port = int(spec["listen"])
        srv = None
        try:
            try:
                srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                srv.bind(("::", port))
            except OSError as e:
                if srv is not None:
                    srv.close()
                if e.errno == 98:  # EADDRINUSE: no need to try IPv4
                    raise
                srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                srv.bind(("0.0.0.0", port))
            srv.listen(64)
        except OSError as e:
            if srv is not None:
                srv.close()
            return {"listen": port, "bound": False, "error": e.strerror or str(e), "in_use": e.errno == 98}
        peers = 0
        want = int(spec.get("expect", 0))
        try:
            while peers < want and time.time() < deadline:
                srv.settimeout(max(0.05, deadline - time.time()))
                try:
                    conn, _addr = srv.accept()
                except OSError:  # a timeout too
                    continue
                try:
                    conn.settimeout(max(0.05, deadline - time.time()))
                    conn.sendall(nonce + b"\n")
                    if conn.recv(16).startswith(b"ok"):
                        peers += 1
                    while conn.recv(16):  # until the peer closes (it closes first)
                        pass
                except OSError:
                    pass
                finally:
                    conn.close()
        finally:
            srv.close()
        return {"listen": port, "bound": True, "peers": peers}
    host, port = spec["connect"][0], int(spec["connect"][1])
    t0 = time.time()
    last = "no attempt"
    while time.time() < deadline:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.05, deadline - time.time()))
        except timed_out:
            last = "timed out"
            break
        except socket.gaierror as e:
            last = "cannot resolve %s: %s" % (host, e.strerror or e)
            break
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(0.1)  # refused: the listener may not be up yet
            continue
        try:
            conn.settimeout(max(0.05, deadline - time.time()))
            got = b""
            while not got.endswith(b"\n") and len(got) < 256:
                chunk = conn.recv(256)
                if not chunk:
                    break
                got += chunk
            if not got:
                last = "the connection was closed without an answer"
                continue
            if got.strip() == nonce:
                conn.sendall(b"ok\n")
                return {"connect": "%s:%d" % (host, port), "ok": True, "seconds": round(time.time() - t0, 3)}
            return {"connect": "%s:%d" % (host, port), "ok": False,
                    "error": "something else answers there (not the rendezvous node's check)"}
        except OSError as e:
            last = e.strerror or str(e)
        finally:
            conn.close()
    return {"connect": "%s:%d" % (host, port), "ok": False, "error": last, "seconds": round(time.time() - t0, 3)}


def _gpus():
    smi = _which("nvidia-smi")
    if smi is None:
        return {"error": "nvidia-smi not found in the container"}
    q = subprocess.run([smi, "--query-gpu=index,uuid,memory.used,memory.total",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True)
    if q.returncode != 0:
        return {"error": (q.stdout + q.stderr).strip().splitlines()[0] if (q.stdout + q.stderr).strip()
                else "nvidia-smi exited %d" % q.returncode}
    gpus = []
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"index": int(parts[0]), "uuid": parts[1], "used_mib": float(parts[2]),
                         "total_mib": float(parts[3]), "procs": []})
    a = subprocess.run([smi, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True)
    by_uuid = {g["uuid"]: g for g in gpus}
    for line in a.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0] in by_uuid:
            by_uuid[parts[0]]["procs"].append({"pid": parts[1], "name": parts[2], "used_mib": parts[3]})
    return {"gpus": gpus}


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


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


def _status_of(argv):
    """argv's exit status (None when it was killed), its input and output /dev/null: os.posix_spawn, without
    importing subprocess."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=[
            (os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)])
    finally:
        os.close(null)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else None


def _tmux_has(session, tmux=None):
    """Whether tmux has the session (None without tmux)."""
    tmux = tmux or _which("tmux")
    if tmux is None:
        return None
    return _status_of([tmux, "has-session", "-t", "=" + session]) == 0


def _tmux_pane_alive(session):
    """Whether a pane of the session still runs its command (the launcher): with tmux's remain-on-exit a
    session outlives it, and nothing is left to write an exit status."""
    r = subprocess.run(["tmux", "list-panes", "-s", "-t", "=" + session, "-F", "#{pane_dead}"],
                       capture_output=True, text=True)
    return r.returncode == 0 and "0" in r.stdout.split()


def _proc_start(pid):
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None when gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _proc_env(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    env = {}
    for item in data.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return env


def _proc_cmd(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return " ".join(a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a)[:120]
    except OSError:
        return "?"


def _not_the_run(pid, run, log):
    """None when live pid is run's training (its environment's CTL_RUN is the run's name and its start time
    the one the launcher recorded beside the pid, LOG.pid.start); else why not. LOG.pid is writable in the
    container: ctl never signals what it names without this check."""
    want = _read_int(log + ".pid.start")
    start = _proc_start(pid)
    if want is not None and start is not None and start != want:
        return "it started at tick %d, the run's training at tick %d (the pid was reused)" % (start, want)
    env = _proc_env(pid)
    if env is None:
        return "its environment cannot be read"
    if env.get("CTL_RUN") != run:
        return "its CTL_RUN is %s" % ("unset" if "CTL_RUN" not in env else repr(env["CTL_RUN"]))
    return None


def runstate(args):
    """State of runs: exit status if written, whether the training's process group lives, log size. A pid
    that is alive but not the run's training (see _not_the_run) is not the run being alive: "alive" is false
    and "impostor" says what it is. With "record", the run record beside the log (LOG.ctl.json) too.
    "session" (whether tmux has the run's session; null without tmux) only for a run asked with "record" or
    one neither alive nor ended with a status."""
    root = args.get("root", "/")
    out = []
    for r in args["runs"]:
        log = _under(root, r["log"])
        pid = _read_int(log + ".pid")
        alive = _pid_alive(pid) if pid else False
        st = {"name": r["name"], "exit": _read_int(log + ".exit"), "pid": pid, "alive": alive}
        if alive:
            why = _not_the_run(pid, r["name"], log)
            if why is not None and not _pid_alive(pid):  # it ended while we looked (a zombie's environ is empty)
                why = None
                st["alive"] = False
            if why is not None:
                st["alive"] = False
                st["impostor"] = "pid %d (%s): %s" % (pid, _proc_cmd(pid), why)
        # tmux is asked (a process started, ~3 ms of CPU) only where its answer is read: a starting run's
        # reconciling, and a training gone without an exit status (is its launcher still there to write it?).
        # A poll of live runs, what `ctl status` and every tick of `ctl supervise` send, starts none.
        if r.get("record") or (not st["alive"] and st["exit"] is None):
            st["session"] = _tmux_has(r["session"])
        try:
            s = os.stat(log)
            st["log_size"] = s.st_size
            st["log_mtime"] = s.st_mtime
        except OSError:
            st["log_size"] = None
        if st["exit"] is not None:
            try:
                st["exit_mtime"] = os.stat(log + ".exit").st_mtime  # when it ended: which node went first
            except OSError:
                pass
        if r.get("record"):
            st["record"] = _read_json(log + ".ctl.json")
        out.append(st)
    _await_exit_status(root, args["runs"], out)
    return {"ok": True, "runs": out, "now": time.time()}


EXIT_GRACE_S = 3.0  # the launcher writes LOG.exit right after the training ends; a loaded box may take a while


def _await_exit_status(root, runs, states):
    """A training that has just ended, seen before its launcher wrote LOG.exit, would read as lost for good. The
    launcher writes LOG.exit before it ends: so whether it still runs is asked first, then LOG.exit is read
    again; while it runs, its exit status is waited for, all such runs together, under one deadline."""
    pending = []
    for r, st in zip(runs, states):
        if not (st["pid"] and not st["alive"] and not st.get("impostor") and st["exit"] is None):
            continue
        log = _under(root, r["log"])
        launcher = st["session"] and _tmux_pane_alive(r["session"])
        if not _take_exit(log, st) and launcher:
            pending.append((log, st))
    deadline = time.time() + EXIT_GRACE_S
    while pending and time.time() < deadline:
        time.sleep(0.05)
        pending = [(log, st) for log, st in pending if not _take_exit(log, st)]


def _take_exit(log, st):
    """LOG.exit into the run's state; whether it was there."""
    code = _read_int(log + ".exit")
    if code is None:
        return False
    st["exit"] = code
    try:
        st["exit_mtime"] = os.stat(log + ".exit").st_mtime
    except OSError:
        pass
    return True


def launch(args):
    """Start a run in a detached tmux session; refuse to touch an existing log, record or session."""
    root = args.get("root", "/")
    log = _under(root, args["log"])
    session = args["session"]
    tmux = _which("tmux")
    if tmux is None:
        return {"ok": False, "error": "tmux not found in the container", "code": "tmux"}
    # The log's directory is made and held without following symlinks (a container user's symlink must not
    # send root's record elsewhere); the record is private (0600): it holds the run's variables.
    parent, name = args["log"].rsplit("/", 1)
    try:
        dfd = _opendir(root, parent, args.get("follow", ()), [])
    except Refused as e:
        return {"ok": False, "error": "log %s: %s" % (args["log"], e), "code": "symlink"}
    try:
        if os.path.lexists(log) or _lexists_at(dfd, name):
            return {"ok": False, "error": "log %s already exists; a log is never overwritten" % args["log"],
                    "code": "clobber"}
        if _tmux_has(session):
            return {"ok": False, "error": "tmux session %r already exists" % session, "code": "busy"}
        try:
            fd = os.open(name + ".ctl.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=dfd)
        except FileExistsError:
            return {"ok": False, "error": "run record %s.ctl.json already exists" % args["log"], "code": "clobber"}
        with os.fdopen(fd, "w") as f:
            json.dump(args["record"], f, indent=2, sort_keys=True, default=str)
    finally:
        os.close(dfd)
    env = dict(os.environ)
    env.update(args.get("env", {}))
    for _attempt in range(3):
        r = subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "200", "-y", "50",
                            "bash", "-c", args["script"]], capture_output=True, text=True, env=env)
        # The tmux server was exiting (its last session had just ended) as we asked: nothing started, ask again.
        if r.returncode == 0 or "server exited unexpectedly" not in r.stderr:
            break
        time.sleep(0.1)
    if r.returncode != 0:
        return {"ok": False, "error": "tmux new-session failed: " + (r.stderr.strip() or str(r.returncode)),
                "code": "busy" if "duplicate session" in r.stderr else "tmux"}
    deadline = time.time() + 5
    pid = None
    while time.time() < deadline:
        pid = _read_int(log + ".pid")
        if pid:
            break
        time.sleep(0.02)
    return {"ok": True, "pid": pid, "pid_start": _proc_start(pid) if pid else None, "started": time.time()}


def stop(args):
    """SIGINT to the run's process group, wait, then SIGTERM, SIGKILL; then end its tmux session."""
    import signal
    root = args.get("root", "/")
    log = _under(root, args["log"])
    pid = _read_int(log + ".pid")
    steps = []
    if pid and _pid_alive(pid) and args.get("run"):
        why = _not_the_run(pid, args["run"], log)
        if why is not None:
            return {"ok": False, "code": "identity", "pid": pid,
                    "error": "%s.pid names pid %d (%s), which is not run %s's training: %s; refusing to signal it"
                    % (args["log"], pid, _proc_cmd(pid), args["run"], why)}
    if pid and _pid_alive(pid):
        escalation = [(signal.SIGINT, args.get("grace", 30)), (signal.SIGTERM, 10), (signal.SIGKILL, 5)]
        if args.get("term_first"):  # a node whose peer died: no step can finish, SIGINT would only wait
            escalation = [(signal.SIGTERM, args.get("grace", 10)), (signal.SIGKILL, 5)]
        for sig, wait in escalation:
            try:
                os.killpg(pid, sig)
                if sig != signal.SIGKILL:  # a stopped (stalled) group acts on it only once continued
                    os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                break
            steps.append(sig.name)
            deadline = time.time() + wait
            while time.time() < deadline and _pid_alive(pid):
                time.sleep(0.1)
            if not _pid_alive(pid):
                break
    # Let the launcher write the exit status before its session goes.
    deadline = time.time() + 5
    while time.time() < deadline and _read_int(log + ".exit") is None and _tmux_has(args["session"]):
        time.sleep(0.1)
    if _tmux_has(args["session"]):
        subprocess.run(["tmux", "kill-session", "-t", "=" + args["session"]], capture_output=True)
        steps.append("kill-session")
    swept = _sweep(args["run"], log) if args.get("run") else []
    if swept:
        steps.append("swept %d straggler(s)" % len(swept))
    return {"ok": True, "signals": steps, "exit": _read_int(log + ".exit"), "swept": swept,
            "alive": _pid_alive(pid) if pid else False}


def _sweep(run, log):
    """Processes of this run still alive outside the training's process group (torchrun starts each worker in a
    session of its own, so a killed torchrun leaves them running, waiting on a collective): every process whose
    environment names this run and this log (CTL_RUN, CTL_LOG) gets SIGTERM, then SIGKILL."""
    import signal
    me = os.getpid()

    def ours():
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != me:
                env = _proc_env(int(entry))
                if env and env.get("CTL_RUN") == run and env.get("CTL_LOG") == log and _pid_alive(int(entry)):
                    found.append(int(entry))
        return found

    pids = ours()
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 2)):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)
        if not any(_pid_alive(p) for p in pids):
            break
    return pids


# A log's tail as `ctl tail` shows it: at most TAIL_WINDOW bytes are read from the end, lines end at \n, \r\n
# or \r (tqdm redraws with \r), each is cut to LINE_CAP bytes. The same rules as controller/core/loglines.py
# (this file is stdlib only and imports nothing of ctl).
TAIL_WINDOW = 1 << 20
TAIL_CHUNK = 1 << 16  # read back from the end this much at a time, until the last N lines are in
LINE_CAP = 4096


def _tail_lines(data, partial_first, ends=None):
    """Lines of `data` (no separators), the unfinished last one included, each cut to LINE_CAP bytes; an
    empty line ended by a bare \r (a progress bar's redraw) is left out. With `partial_first`, the first
    line started before `data` did: only its last LINE_CAP bytes are kept, marked. `ends`, when given, gets
    each line's end offset in `data`."""
    out = []
    pos = 0
    seps = [*re.finditer(b"\r\n|\r|\n", data), None]
    for m in seps:
        seg = data[pos:m.start()] if m is not None else data[pos:]
        if m is None and not seg:
            break
        if seg or m is None or m.group() != b"\r":
            if pos == 0 and partial_first:
                seg = b"[cut: started before the last %d bytes] ... " % len(data) + seg[-LINE_CAP:]
            elif len(seg) > LINE_CAP:
                seg = seg[:LINE_CAP] + b" ... [cut: %d bytes]" % (len(seg) - LINE_CAP)
            out.append(seg)
            if ends is not None:
                ends.append(m.end() if m is not None else len(data))
        if m is not None:
            pos = m.end()
    return out


def tailinfo(args):
    """Size of the log and its last N lines, from at most its last TAIL_WINDOW bytes (never the whole file:
    a log whose last line is a long run of progress updates is read once, and answers a bounded reply)."""
    path = _under(args.get("root", "/"), args["log"])
    n = int(args.get("lines", 20))
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start, data, at_line = _tail_read(f, size, n)
    except OSError as e:
        return {"ok": False, "error": _describe(e)}
    ends = []
    partial = start > 0 and not at_line and not data.startswith((b"\n", b"\r"))
    lines = _tail_lines(data, partial, ends) if n > 0 else []
    if start > 0 and len(lines) > n:
        lines, ends = lines[1:], ends[1:]  # the partial first line is only shown when fewer than N lines follow it
    lines, ends = (lines[-n:], ends[-n:]) if n > 0 else ([], [])
    text = b"".join(line + b"\n" for line in lines)
    out = {"ok": True, "size": size, "text": text.decode("utf-8", "replace")}
    if args.get("times"):
        out["times"] = _line_times(path, [start + e for e in ends])
    return out


def _tail_read(f, size, n):
    """(start, data, at_line) of the last TAIL_WINDOW bytes of f that hold its last n lines: read back from the
    end TAIL_CHUNK at a time, and cut just after a \n once n more \n follow it (a \n always ends a line that
    _tail_lines keeps, and the lines after it are split the same whatever precedes it); the whole window when
    fewer lines are in it (at_line False: its first line may have begun before it). A 1 GiB log's last 20
    lines cost one small read, not the split of 1 MiB."""
    limit = max(0, size - TAIL_WINDOW)
    if n <= 0:
        return size, b"", True
    pos, data = size, b""
    while pos > limit:
        step = min(TAIL_CHUNK, pos - limit)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
        if data.count(b"\n") > n:
            cut = data.index(b"\n") + 1
            return pos + cut, data[cut:], True
    return pos, data, False


def _line_times(log, ends):
    """When each line (by its end offset) reached the log, from LOG.times, the launcher's samples of the log's
    size (one line "SIZE EPOCH" whenever it grew, every half second): the first sample at or past a line's end.
    Only the samples from the end back to the first line are read. None where there are no samples."""
    if not ends:
        return []
    samples = []
    try:
        if not stat.S_ISREG(os.lstat(log + ".times").st_mode):  # the container's file: no FIFO, device, symlink
            return [None] * len(ends)
        with open(log + ".times", "rb") as f:
            pos = f.seek(0, 2)
            tail = b""
            while pos > 0 and len(tail) < 4 * TAIL_WINDOW:  # the container's file: read a bounded part
                step = min(pos, 1 << 16)
                pos -= step
                f.seek(pos)
                tail = f.read(step) + tail
                rows = tail.split(b"\n", 2)
                if pos > 0 and len(rows) > 2:  # rows[0] may be cut; rows[1] is whole: before the first line?
                    try:
                        if int(rows[1].split()[0]) < ends[0]:
                            break
                    except (IndexError, ValueError):
                        pass
            for row in tail.splitlines()[1 if pos > 0 else 0:]:
                parts = row.split()
                if len(parts) == 2:
                    try:
                        samples.append((int(parts[0]), float(parts[1].replace(b",", b"."))))  # locale radix
                    except ValueError:
                        pass
    except OSError:
        return [None] * len(ends)
    try:
        mtime = os.stat(log).st_mtime
    except OSError:
        mtime = None
    out = []
    i = 0
    for end in ends:
        while i < len(samples) and samples[i][0] < end:
            i += 1
        out.append(samples[i][1] if i < len(samples) else mtime)  # written since the last sample
    return out


_HEAD = 4096  # bytes of the log's start that identify it (with the inode) across pulls


def _head_sha(f, n):
    f.seek(0)
    data = f.read(n)  # at most _HEAD bytes: no file's worth of hashing, so not worth OpenSSL's load
    return (_small_sha256(data) if _small_sha256 is not None else hashlib.sha256(data)).hexdigest()[:16]


def _wild(name, pat):
    """fnmatch.fnmatchcase(name, pat) for a pattern of literal characters, `*` and `?` (no `[...]`)."""
    n = p = 0
    star, mark = -1, 0
    while n < len(name):
        if p < len(pat) and pat[p] == "*":
            star, mark = p, n
            p += 1
        elif p < len(pat) and (pat[p] == "?" or pat[p] == name[n]):
            n += 1
            p += 1
        elif star >= 0:  # let the last `*` take one more character
            p, mark = star + 1, mark + 1
            n = mark
        else:
            return False
    while p < len(pat) and pat[p] == "*":
        p += 1
    return p == len(pat)


def _names(d, dirs_only):
    """glob's listing of d: the names in it (only directories, symlinks followed, with dirs_only); none on error."""
    out = []
    try:
        with os.scandir(d) as it:
            for e in it:
                try:
                    if not dirs_only or e.is_dir():
                        out.append(e.name)
                except OSError:
                    pass
    except OSError:
        pass
    return out


def _below(d, dirs_only):
    """glob's `**` under d: every name below it, at any depth, hidden ones neither listed nor entered."""
    for x in _names(d, dirs_only):
        if x[0] != ".":
            yield x
            for y in _below(os.path.join(d, x), dirs_only):
                yield os.path.join(x, y)


def _glob(base, pattern):
    """The paths of glob.glob(os.path.join(glob.escape(base), pattern), recursive=True), in any order, without
    importing glob (re, fnmatch, enum...: ~8 ms of every agent start that scans a run's checkpoints) when the
    pattern is made of names, `**`, `*` and `?`; any other pattern goes to glob itself."""
    parts = pattern.split("/")
    if "[" in pattern or any(part in ("", ".", "..") for part in parts):
        return glob.glob(os.path.join(glob.escape(base), pattern), recursive=True)
    found = [base]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        reached = []
        for d in found:
            if part == "**":
                reached.append(os.path.join(d, ""))  # none at all: d/, as glob says it (no file matches it)
                reached.extend(os.path.join(d, x) for x in _below(d, not last))
            elif "*" in part or "?" in part:
                hidden = part[0] == "."  # a name starting with a dot matches only a pattern that does
                reached.extend(os.path.join(d, x) for x in _names(d, not last)
                               if (hidden or x[0] != ".") and _wild(x, part))
            elif not last or os.path.lexists(os.path.join(d, part)):
                reached.append(os.path.join(d, part))
        found = reached
    return found


def _hash_known(path, known):
    """sha256/size/mtime_ns of a file, reusing `known` [size, mtime_ns, sha] when size and mtime match."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    same = known and known[0] == st.st_size and known[1] == st.st_mtime_ns and known[2]
    sha = known[2] if same else _sha(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}


def _logread(args):
    """(header, bytes) of `logread`: the header says where the bytes start ("offset": 0 again, with "reset"
    saying why, when the log was truncated or replaced since `ident`), the log's size, mtime and new ident
    (inode + hash of its first bytes), the agent's clock, and optionally the hashes of files and of
    checkpoints (a hash is only recomputed when a file's size or mtime differs from what the caller already
    knows). At most "max_bytes" log bytes."""
    root = args.get("root", "/")
    path = _under(root, args["log"])
    offset = int(args.get("offset", 0))
    out = {"ok": True, "now": time.time()}
    data = b""
    try:
        f = open(path, "rb")
    except OSError as e:
        out = {"ok": False, "error": _describe(e), "code": "missing" if isinstance(e, FileNotFoundError) else "io"}
        f = None
    if f is not None:
        with f:
            st = os.fstat(f.fileno())
            reset = None
            old = (args.get("ident") or "").split(":")
            if len(old) == 3 and old[0] != str(st.st_ino):
                reset = "replaced (new inode)"
            elif st.st_size < offset:
                reset = "truncated (size %d < offset %d)" % (st.st_size, offset)
            elif len(old) == 3 and (st.st_size < int(old[1]) or _head_sha(f, int(old[1])) != old[2]):
                reset = "rewritten (its first bytes changed)"
            if reset is not None:
                offset = 0
            n = min(st.st_size, _HEAD)
            out.update({"size": st.st_size, "mtime": st.st_mtime, "offset": offset, "reset": reset,
                        "ident": "%d:%d:%s" % (st.st_ino, n, _head_sha(f, n))})
            f.seek(offset)
            data = f.read(max(0, min(int(args.get("max_bytes", 8 << 20)), st.st_size - offset)))
    known = args.get("known", {})
    if args.get("files"):
        out["files"] = {p: _hash_known(_under(root, p), known.get(p)) for p in args["files"]}
    ck = args.get("checkpoints")
    if ck:
        base = _under(root, ck["dir"])
        found = {}
        for p in sorted(_glob(base, ck["glob"])):
            rel = os.path.relpath(p, base)
            h = _hash_known(p, known.get(rel))
            if h is not None:
                found[rel] = h
        out["checkpoints"] = found
    out["length"] = len(data)
    return out, data


def logread(args):
    """Bytes of a log from an offset: one JSON header line (see _logread), then exactly `length` raw bytes."""
    out, data = _logread(args)
    sys.stdout.buffer.write(json.dumps(out).encode() + b"\n" + data)
    sys.stdout.flush()
    return 0 if out.get("ok") else 1


def poll(args):
    """Every run of one container in one call (`ctl status`, `ctl supervise`): for each run, its state (as
    runstate) when "state" is set, then its log's new bytes (as logread) when "read" holds logread's
    arguments. States are read first, so a run seen ended has all its output in the bytes that follow.

    One JSON header line {"ok", "now", "runs": [{"state": {...} | null, "read": header | null}], "length"},
    then every read's bytes back to back, in the order of "runs" (each read header's "length" says how many
    are its own). All reads together return at most "max_bytes": once it is spent, a run gets an empty read
    whose offset and size tell the caller that more is waiting."""
    root = args.get("root", "/")
    left = max(0, int(args.get("max_bytes", 8 << 20)))
    runs = args["runs"]
    asked = [r for r in runs if r.get("state")]
    states = iter(runstate({"root": root, "runs": asked})["runs"]) if asked else iter(())
    out, data = [], []
    for r in runs:
        entry = {"state": next(states) if r.get("state") else None, "read": None}
        if r.get("read") is not None:
            read = dict(r["read"], root=root, log=r["log"])
            read["max_bytes"] = min(int(read.get("max_bytes", left)), left)
            head, chunk = _logread(read)
            left -= len(chunk)
            entry["read"] = head
            data.append(chunk)
        out.append(entry)
    blob = b"".join(data)
    doc = {"ok": True, "now": time.time(), "runs": out, "length": len(blob)}
    sys.stdout.buffer.write(json.dumps(doc).encode() + b"\n" + blob)
    sys.stdout.flush()
    return 0


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


def _store_open(args):
    """(objects, deploys) descriptors of an existing store, or None when there is none yet."""
    root = args["root"]
    try:
        fd = _opendir(root, _container_path(root, args["store"]))
    except FileNotFoundError:
        return None
    out = []
    try:
        for sub in ("objects", "deploys"):
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


def storelist(args):
    """Every object of the store (bytes, mode, mtime; stray temporary copies apart) and every deploy record."""
    fds = _store_open(args)
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
    fds = _store_open(args)
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


# --- compile caches and venv facts (ctl cache, ctl env sync) --------------------------------------

_CACHE_SUBS = ("fxgraph", "aotautograd", "triton")
_CACHE_MARKER = "ctl-cache.json"


def _tree_size(path):
    """(bytes, files) under path, without following symlinks."""
    total, files = 0, 0
    for top, _dirs, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(top, n))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
                files += 1
    return total, files


def _read_json(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _write_json_new(path, doc):
    """Write doc to path only if path does not exist yet (link(2) refuses to replace)."""
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def _cache_facts(d):
    out = {"exists": os.path.isdir(d)}
    if out["exists"]:
        out["bytes"], out["files"] = _tree_size(d)
        entries = {}
        for sub in _CACHE_SUBS:
            p = os.path.join(d, sub)
            entries[sub] = len(os.listdir(p)) if os.path.isdir(p) else 0
        out["entries"] = entries
        out["marker"] = _read_json(os.path.join(d, _CACHE_MARKER))
    return out


def _saved_caches(store):
    out = []
    try:
        names = sorted(os.listdir(store))
    except OSError:
        return out
    for n in names:
        if n.endswith(".tar.gz") and not n.startswith("."):
            base = n[: -len(".tar.gz")]
            try:
                size = os.stat(os.path.join(store, n)).st_size
            except OSError:
                continue
            out.append({"name": base, "bytes": size, "sidecar": _read_json(os.path.join(store, base + ".json"))})
    return out


def cachestat(args):
    """The compile cache (size, entries per kind, ctl-cache.json marker) and the saved caches of the store."""
    root = args["root"]
    return {"ok": True, "cache": _cache_facts(_under(root, args["dir"])),
            "saved": _saved_caches(_under(root, args["store"]))}


def cachemark(args):
    """Write the ctl-cache.json marker (which torch build filled the cache); replaces an older marker."""
    d = _under(args["root"], args["dir"])
    if not os.path.isdir(d):
        return {"ok": False, "code": "missing", "error": "no compile cache at %s" % args["dir"]}
    path = os.path.join(d, _CACHE_MARKER)
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "w") as f:
        json.dump(args["marker"], f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return {"ok": True, "marker": args["marker"]}


def cachesave(args):
    """Tar the cache into STORE/NAME.tar.gz with a NAME.json sidecar (sha256, torch build); never overwrites."""
    root = args["root"]
    d = _under(root, args["dir"])
    store = _under(root, args["store"])
    name = args["name"]
    tgz, side = os.path.join(store, name + ".tar.gz"), os.path.join(store, name + ".json")
    if os.path.lexists(tgz) or os.path.lexists(side):
        return {"ok": False, "code": "clobber",
                "error": "a saved cache named %r already exists in %s (never overwritten; pick another name)"
                % (name, args["store"])}
    if not os.path.isdir(d):
        return {"ok": False, "code": "missing", "error": "no compile cache at %s: nothing to save" % args["dir"]}
    marker = _read_json(os.path.join(d, _CACHE_MARKER))
    if marker is None and args.get("marker"):
        marker = args["marker"]  # a cache ctl never warmed: the live torch build is the best guess
        _write_json_new(os.path.join(d, _CACHE_MARKER), marker)
    facts = _cache_facts(d)
    os.makedirs(store, exist_ok=True)
    tmp = os.path.join(store, ".%s.tar.gz.tmp%d" % (name, os.getpid()))
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=3) as tar:
            tar.add(d, arcname=".")
        sha = _sha(tmp)
        size = os.stat(tmp).st_size
        doc = {"format": "ctl-cache 1", "name": name, "sha256": sha, "bytes": size, "source_dir": args["dir"],
               "cache_bytes": facts.get("bytes"), "files": facts.get("files"), "entries": facts.get("entries"),
               "created": args.get("created"), "marker": marker,
               "torch_build": (marker or {}).get("torch_build")}
        if not _write_json_new(side, doc):
            return {"ok": False, "code": "clobber", "error": "%s appeared meanwhile: not overwritten" % side}
        try:
            os.link(tmp, tgz)
        except FileExistsError:
            os.unlink(side)
            return {"ok": False, "code": "clobber", "error": "%s appeared meanwhile: not overwritten" % tgz}
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return {"ok": True, "sidecar": doc}


def _safe_members(tar):
    out = []
    for m in tar.getmembers():
        parts = [p for p in m.name.split("/") if p not in ("", ".")]
        if m.name.startswith("/") or ".." in parts:
            raise ValueError("unsafe path in archive: %r" % m.name)
        if not parts:
            continue
        if m.issym() or m.islnk():
            if m.linkname.startswith("/") or ".." in m.linkname.split("/"):
                raise ValueError("link leaving the cache in archive: %r -> %r" % (m.name, m.linkname))
        elif not (m.isfile() or m.isdir()):
            raise ValueError("unexpected member type in archive: %r" % m.name)
        out.append(m)
    return out


def cacherestore(args):
    """Verify STORE/NAME.tar.gz against its sha256, unpack it beside the cache, move the current cache aside
    (kept under a timestamped name, never deleted) and put the restored one in its place."""
    root = args["root"]
    d = _under(root, args["dir"]).rstrip("/")
    store = _under(root, args["store"])
    name = args["name"]
    tgz, side = os.path.join(store, name + ".tar.gz"), os.path.join(store, name + ".json")
    sidecar = _read_json(side)
    if not os.path.isfile(tgz) or sidecar is None:
        return {"ok": False, "code": "missing",
                "error": "no saved cache %r in %s (`ctl cache status` lists them)" % (name, args["store"])}
    want = args.get("torch_build")
    have = sidecar.get("torch_build")
    if want and not args.get("force") and have != want:
        return {"ok": False, "code": "torch", "saved": have, "live": want,
                "error": "saved cache %r was made by torch %s, the container runs torch %s" % (name, have, want)}
    sha = _sha(tgz)
    if sha != sidecar.get("sha256"):
        return {"ok": False, "code": "verify",
                "error": "%s: sha256 %s does not match its sidecar (%s): refusing a damaged cache"
                % (tgz, sha[:12], str(sidecar.get("sha256"))[:12])}
    os.makedirs(os.path.dirname(d) or "/", exist_ok=True)
    staging = "%s.ctl-restore-%d" % (d, os.getpid())
    try:
        with tarfile.open(tgz, "r:gz") as tar:
            members = _safe_members(tar)
            if hasattr(tarfile, "tar_filter"):
                tar.extractall(staging, members=members, filter="tar")
            else:
                tar.extractall(staging, members=members)
    except (ValueError, OSError, tarfile.TarError) as e:
        shutil.rmtree(staging, ignore_errors=True)  # only the half-unpacked copy; the archive stays
        return {"ok": False, "code": "verify", "error": "cannot unpack %s: %s" % (tgz, _describe(e))}
    aside = None
    if os.path.lexists(d):
        if os.path.isdir(d) and not os.path.islink(d) and not os.listdir(d):
            os.rmdir(d)  # an empty directory holds nothing to keep
        else:
            aside = "%s.ctl-aside-%s" % (args["dir"].rstrip("/"), args["stamp"])
            n = 1
            while os.path.lexists(_under(root, aside)):
                n += 1
                aside = "%s.ctl-aside-%s-%d" % (args["dir"].rstrip("/"), args["stamp"], n)
            os.rename(d, _under(root, aside))
    try:
        os.rename(staging, d)
    except OSError as e:
        if aside is not None:
            os.rename(_under(root, aside), d)
        shutil.rmtree(staging, ignore_errors=True)
        return {"ok": False, "code": "failed", "error": "cannot put the restored cache in place: %s" % _describe(e)}
    facts = _cache_facts(d)
    return {"ok": True, "aside": aside, "sha256": sha, "cache": facts, "sidecar": sidecar}


def envfacts(args):
    """Facts `ctl env sync` needs in one round trip: the venv (symlink or directory), where uv is."""
    root = args["root"]
    venv = _under(root, args["venv"])
    uv = None
    for cand in args.get("uv", []):
        if cand.startswith("/"):
            p = _under(root, cand)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                uv = cand
                break
        else:
            found = _which(cand)
            if found:
                uv = found
                break
    return {"ok": True, "venv_exists": os.path.lexists(venv), "venv_is_symlink": os.path.islink(venv),
            "venv_target": os.readlink(venv) if os.path.islink(venv) else None, "uv": uv,
            "taken": [p for p in args.get("paths", []) if os.path.lexists(_under(root, p))]}


def writefile(args, stream):
    """Write stdin to PATH through a temporary name; refuse to replace an existing file."""
    path = _under(args["root"], args["path"])
    if os.path.lexists(path):
        return {"ok": False, "code": "clobber", "error": "%s already exists (never overwritten)" % args["path"]}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "wb") as f:
        shutil.copyfileobj(stream, f)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return {"ok": False, "code": "clobber", "error": "%s already exists (never overwritten)" % args["path"]}
    finally:
        os.unlink(tmp)
    return {"ok": True, "path": args["path"], "sha256": _sha(path)}


_PACK_LINE = 48 << 10  # raw bytes per base64 line of packdir (64 KiB a line): ctl reads lines, bounded


def packdir(args):
    """A checkpoint directory's regular files as a tar stream, base64 in lines of 64 KiB on stdout, after a JSON
    header line; the last line is the JSON answer (main writes it). Symlinks are not followed or carried. How ctl
    carries a checkpoint from the node that wrote it to the other nodes of a run, through the controller."""
    import base64
    d = _under(args.get("root", "/"), args["dir"])
    names = []
    for dirpath, dirnames, filenames in os.walk(d):
        dirnames[:] = sorted(n for n in dirnames if not os.path.islink(os.path.join(dirpath, n)))
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            if not os.path.islink(path) and os.path.isfile(path):
                names.append(os.path.relpath(path, d))
    if not names:
        return {"ok": False, "code": "missing", "error": "%s: no files (not a checkpoint directory)" % args["dir"]}
    out = sys.stdout.buffer
    out.write((json.dumps({"ok": True, "files": len(names)}) + "\n").encode())
    sent = [0]

    class Lines:
        buf = b""

        def write(self, data):
            self.buf += data
            while len(self.buf) >= _PACK_LINE:
                out.write(base64.b64encode(self.buf[:_PACK_LINE]) + b"\n")
                self.buf = self.buf[_PACK_LINE:]
            sent[0] += len(data)
            return len(data)

        def flush(self):
            if self.buf:
                out.write(base64.b64encode(self.buf) + b"\n")
                self.buf = b""

    lines = Lines()
    with tarfile.open(fileobj=lines, mode="w|") as tar:
        for n in names:
            tar.add(os.path.join(d, n), arcname=n, recursive=False)
    lines.flush()
    out.flush()
    return {"ok": True, "files": len(names), "bytes": sent[0]}


def unpackdir(args, stream):
    """A tar stream on stdin (packdir's, decoded by ctl) into a new checkpoint directory: unpacked beside it,
    checked against its manifest.json's sha256s, then renamed into place. An existing directory is never
    replaced; the parent is walked without following symlinks."""
    root = args.get("root", "/")
    parent, name = args["dir"].rstrip("/").rsplit("/", 1)
    try:
        dfd = _opendir(root, parent or "/", args.get("follow", ()), [])
    except Refused as e:
        return {"ok": False, "code": "symlink", "error": "%s: %s" % (args["dir"], e)}
    except OSError as e:
        return {"ok": False, "error": _describe(e)}
    os.close(dfd)
    dest = _under(root, args["dir"])
    if os.path.lexists(dest):
        return {"ok": False, "code": "clobber", "error": "%s already exists (never replaced)" % args["dir"]}
    tmp = os.path.join(os.path.dirname(dest), ".%s.ctl-%d" % (name, os.getpid()))
    os.mkdir(tmp, 0o700)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                parts = [p for p in m.name.split("/") if p not in ("", ".")]
                if m.name.startswith("/") or ".." in parts or not m.isfile():
                    raise ValueError("unexpected member in the checkpoint stream: %r" % m.name)
                target = os.path.join(tmp, *parts)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tar.extractfile(m)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as f:
                    shutil.copyfileobj(src, f)
        why = _ckpt_problem(tmp)
        if why is not None:
            raise ValueError("the copy does not match its manifest: %s" % why)
        os.chmod(tmp, 0o755)
        if os.path.lexists(dest):
            raise FileExistsError(dest)
        os.rename(tmp, dest)
    except (OSError, ValueError, tarfile.TarError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return {"ok": False, "code": "verify" if isinstance(e, ValueError) else _code(e), "error": _describe(e)}
    return {"ok": True, "dir": args["dir"]}


def ckptscan(args):
    """The newest complete checkpoint under the given directories, tried in order (a failed run's own, then its
    ancestors'): a step_N/ directory whose manifest.json is there and whose files match its sha256s. A
    directory without its manifest (half-written when the run died) or with a wrong hash is skipped, and
    the reply says why."""
    import re
    root = args.get("root", "/")
    skipped = []
    for item in args.get("dirs", []):
        base = _under(root, item["dir"])
        try:
            names = os.listdir(base)
        except OSError:
            continue
        steps = sorted(((int(m.group(1)), n) for n in names if (m := re.match(r"^step_(\d+)$", n))), reverse=True)
        for step, name in steps:
            d = os.path.join(base, name)
            why = _ckpt_problem(d)
            if why is None:
                return {"ok": True, "found": {"run": item.get("run"), "dir": item["dir"] + "/" + name,
                                              "step": step}, "skipped": skipped}
            skipped.append({"dir": item["dir"] + "/" + name, "why": why})
    return {"ok": True, "found": None, "skipped": skipped}


def _ckpt_problem(d):
    try:
        with open(os.path.join(d, "manifest.json")) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest.json (written last: the checkpoint is incomplete)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return "unreadable manifest.json (%s)" % type(e).__name__
    for name, meta in files.items():
        path = os.path.join(d, name)
        if os.path.islink(path) or not os.path.isfile(path):
            return "%s is missing" % name
        if _sha(path) != meta.get("sha256"):
            return "%s does not match its sha256 in the manifest" % name
    return None


# The frames between the host relay and a staying agent: kind (1 byte), 0 (2 bytes), length (4 bytes), big-endian,
# then the data (the relay's own header, controller/remote/hostrelay.py).
_FRAME = struct.Struct(">cHI")
SERVE_MAX_REQUEST = 64 << 20  # the relay sends only small requests to a staying agent (hostrelay.RESIDENT_MAX_INPUT)


def _read_exact(fd, n):
    parts, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve():
    """Stay and answer requests over stdin/stdout instead of one process per verb (a `pct exec`, a python3 start
    and a compile of this source each).

    The relay sends nothing after the source until this hello (H, JSON), so no request byte is left in
    sys.stdin's buffer. The protocol then moves to private copies of fds 0 and 1, and fds 0, 1 and 2 become
    /dev/null: a child of a verb (tmux, nvidia-smi) that writes to its stdout or reads its stdin can never
    touch a frame. A request is R: a JSON argv line, then the verb's whole input. Its answer is O (what
    the verb wrote on stdout), E (stderr, with the traceback of an exception) and X (its exit status,
    ASCII), exactly what one `python3 -c BOOT N VERB ...` exec would have given. End of stdin: exit."""
    _STAYING.append(0)
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    hello = json.dumps({"agent": "serve", "pid": os.getpid(), "python": sys.version.split()[0]}).encode()
    _write_all(wfd, _FRAME.pack(b"H", 0, len(hello)) + hello)
    keep_compiled(globals().pop("__ctl_compiled__", None))  # after the hello: the relay is not kept waiting
    while True:
        head = _read_exact(rfd, _FRAME.size)
        if head is None:
            return 0
        kind, _sid, n = _FRAME.unpack(head)
        if kind != b"R" or n > SERVE_MAX_REQUEST:
            return 2  # not the relay speaking: stop rather than guess
        body = _read_exact(rfd, n)
        if body is None:
            return 0
        line, _, data = body.partition(b"\n")
        _STAYING[0] += 1
        out, err, rc = _serve_one(json.loads(line.decode()), data)
        # One write: the relay, woken once, reads the whole answer (three writes could wake it three times).
        _write_all(wfd, b"".join(_FRAME.pack(k, 0, len(chunk)) + chunk
                                 for k, chunk in ((b"O", out), (b"E", err), (b"X", str(rc).encode()))))


_STAYING = []  # in a staying agent (serve): [requests it took, this one included]


def hello(args):
    """Who answers. A staying agent also says how many requests it took: more than this one means it was up
    before (`ctl ping` counts this answer as one of its round trips)."""
    out = {"ok": True, "pid": os.getpid(), "python": sys.version.split()[0], "staying": bool(_STAYING)}
    if _STAYING:
        out["served"] = _STAYING[0]
    return out


def _serve_one(argv, data):
    """One request: main(argv) with stdin, stdout and stderr of its own; (stdout bytes, stderr bytes, status)."""
    if not argv or argv[0] == "serve":
        return b"", b"ctl agent: not a verb for a staying agent\n", 2
    saved = sys.stdin, sys.stdout, sys.stderr
    out, err = io.BytesIO(), io.BytesIO()
    sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace", write_through=True)
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # as one exec would: the traceback on stderr, status 1
        try:
            traceback.print_exc()  # imported on first use: may itself fail (a MemoryError, a python upgraded)
        except BaseException:
            sys.stderr.write("%s: %s\n" % (type(e).__name__, e))
        rc = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            f.flush()
        got = out.getvalue(), err.getvalue()
        sys.stdin, sys.stdout, sys.stderr = saved
    return got[0], got[1], rc


def main(argv):
    verb = argv[0]
    if verb != "serve":
        keep_compiled(globals().pop("__ctl_compiled__", None))
    if verb == "hashes":  # hashes ROOT [--follow=JSON] PATH...
        paths, follow = argv[2:], []
        if paths and paths[0].startswith("--follow="):
            follow, paths = json.loads(paths[0][len("--follow="):]), paths[1:]
        out = hashes(argv[1], paths, follow)
    elif verb == "sync":
        out = sync(argv[1], argv[2], argv[3], sys.stdin.buffer)
    elif verb == "apply":
        out = apply(argv[1], argv[2], argv[3], sys.stdin.buffer)
    elif verb == "logread":
        return logread(json.loads(argv[1]))
    elif verb == "poll":
        return poll(json.loads(argv[1]))
    elif verb in ("cachestat", "cachemark", "cachesave", "cacherestore", "envfacts"):
        out = {"cachestat": cachestat, "cachemark": cachemark, "cachesave": cachesave,
               "cacherestore": cacherestore, "envfacts": envfacts}[verb](json.loads(argv[1]))
    elif verb == "ckptscan":
        out = ckptscan(json.loads(argv[1]))
    elif verb == "packdir":
        out = packdir(json.loads(argv[1]))
    elif verb == "unpackdir":
        out = unpackdir(json.loads(argv[1]), sys.stdin.buffer)
    elif verb == "writefile":
        out = writefile(json.loads(argv[1]), sys.stdin.buffer)
    elif verb in ("storelist", "storeprune"):
        out = {"storelist": storelist, "storeprune": storeprune}[verb](json.loads(argv[1]))
    elif verb == "serve" and len(argv) == 1:
        return serve()
    elif verb in ("probe", "runstate", "launch", "stop", "tailinfo", "hello"):
        out = {"probe": probe, "runstate": runstate, "launch": launch, "stop": stop,
               "tailinfo": tailinfo, "hello": hello}[verb](json.loads(argv[1]))
    else:
        out = {"ok": False, "error": "unknown verb %r" % verb}
    sys.stdout.write(json.dumps(out))
    sys.stdout.flush()
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    # Under BOOT (python3 -c BOOT N verb ...) argv is ["-c", N, verb, ...]; as a file, [path, verb, ...].
    sys.exit(main(sys.argv[2:] if sys.argv[0] == "-c" else sys.argv[1:]))
