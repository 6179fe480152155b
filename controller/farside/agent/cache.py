"""Compile caches (cachestat, cachemark, cachesave, cacherestore) and venv facts (envfacts, writefile)."""

import os
import stat

from .base import json, shutil, tarfile
from .fs import _code, _describe, _read_json, _sha, _under, _unmapped_owner, _which

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
    try:
        return _cachesave(args)
    except OSError as e:  # a cache or store directory container root may not write (unprivileged): one line
        return {"ok": False, "code": _code(e),
                "error": "cannot save the cache: %s%s" % (_describe(e), _unmapped_owner(e.filename or ""))}


def _cachesave(args):
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
