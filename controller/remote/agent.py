"""ctl's agent: runs INSIDE a container (stdlib only, Python >= 3.8), one invocation per operation.

The controller never imports this module. It sends its source over the stdin of one exec
(`python3 -c BOOT N verb ...`: BOOT reads N bytes of source from stdin and runs them; the rest of
stdin is the verb's input), so a whole operation costs one `pct exec`, whatever the number of files.

Verbs (each prints one JSON document on stdout; exit 0 when "ok" is true):
  hashes   ROOT PATH...            sha256/size/mode of each path (null when missing)
  sync     ROOT STORE DEPLOY_ID    plan + apply in one exec: stdin header line (pinned files) -> stdout line
                                   (what it has, what it needs) -> stdin "apply" + tar of the needed files
  apply    ROOT STORE DEPLOY_ID    stdin: a tar of manifest.json + file bodies. Every file is written
                                   to a temporary name beside its destination and verified; the old
                                   and new versions are kept in STORE/objects (content-addressed);
                                   only when all of that succeeded is each file renamed into place
                                   (atomic per file) and read back. Any failure removes the temporary
                                   files and leaves every destination untouched.
  probe    JSON-ARGS               launch preflight facts in one round trip (files, tmux, log, disk,
                                   GPUs, logs of the run series)
  launch   JSON-ARGS               write the run record beside the log (never over one) and start the
                                   detached tmux session
  runstate JSON-ARGS               exit status / liveness / log size of runs
  stop     JSON-ARGS               SIGINT the run's process group, escalate, end its session
  tailinfo JSON-ARGS               log size and last N lines
  logread  JSON-ARGS               a JSON header line, then raw log bytes from an offset (+ file hashes)
  cachestat JSON-ARGS              compile cache size, entries (fxgraph/aotautograd/triton), marker; saved caches
  cachemark JSON-ARGS              write the cache's ctl-cache.json marker (torch build that filled it)
  cachesave JSON-ARGS              tar.gz of the cache + sidecar JSON (sha256, torch build); never overwrites
  cacherestore JSON-ARGS           verify sha256, unpack beside, move the current cache aside (kept), swap in
  envfacts JSON-ARGS               venv symlink/dir, where uv is, which paths are taken (ctl env sync)
  writefile JSON-ARGS              stdin -> a new file (refuses to replace one)
"""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time

BOOT = "import sys;n=int(sys.argv[1]);exec(compile(sys.stdin.buffer.read(n),'ctl-agent','exec'))"
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


def _stat(path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return {"error": "not a regular file"}
    return {"sha256": _sha(path), "size": st.st_size, "mode": "%04o" % stat.S_IMODE(st.st_mode)}


def hashes(root, paths):
    return {"ok": True, "files": {p: _stat(_under(root, p)) for p in paths}}


def _store_object(store, path, sha):
    obj = os.path.join(store, "objects", sha)
    if not os.path.exists(obj):
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        tmp = obj + ".tmp%d" % os.getpid()
        shutil.copyfile(path, tmp)
        os.replace(tmp, obj)
    return obj


def apply(root, store, deploy_id, stream, manifest=None):
    staged = []  # (tmp, dest, entry)
    created = []
    by_index = {}
    if manifest is not None:
        by_index = {e["index"]: e for e in manifest["files"] if e.get("from") == "tar"}
    try:
        tar = tarfile.open(fileobj=stream, mode="r|") if (manifest is None or by_index) else []
        for member in tar:
            data = tar.extractfile(member)
            if member.name == "manifest.json":
                manifest = json.loads(data.read().decode())
                by_index = {e["index"]: e for e in manifest["files"] if e.get("from") == "tar"}
                continue
            if manifest is None or not member.name.startswith("f"):
                raise ValueError("unexpected member %r in bundle" % member.name)
            entry = by_index[int(member.name[1:])]
            staged.append(_receive(root, entry, data, created, deploy_id))
        if manifest is None:
            raise ValueError("bundle has no manifest (connection dropped?)")
        for entry in manifest["files"]:
            if entry.get("from") == "store":
                obj = os.path.join(store, "objects", entry["sha256"])
                if not os.path.exists(obj):
                    raise ValueError("%s: version %s is not in the store" % (entry["dest"], entry["sha256"][:12]))
                with open(obj, "rb") as data:
                    staged.append(_receive(root, entry, data, created, deploy_id))
        if len(staged) != len(manifest["files"]):
            raise VerifyFailed("bundle incomplete: %d of %d files (connection dropped?)"
                             % (len(staged), len(manifest["files"])))
        # Keep old and new versions before anything is replaced.
        results = []
        for tmp, dest, entry in staged:
            previous = _stat(dest)
            prev_sha = previous.get("sha256") if previous else None
            if prev_sha:
                _store_object(store, dest, prev_sha)
            _store_object(store, tmp, entry["sha256"])
            results.append({"dest": entry["dest"], "sha256": entry["sha256"], "mode": entry["mode"],
                            "previous": prev_sha, "previous_mode": previous.get("mode") if previous else None})
    except BaseException as e:
        for tmp, _dest, _entry in staged:
            _unlink(tmp)
        return {"ok": False, "error": _describe(e), "code": _code(e), "stage": "receive"}
    # Commit: atomic rename per file, then read back.
    for (tmp, dest, entry), res in zip(staged, results):
        os.replace(tmp, dest)
        res["verified"] = _sha(dest) == entry["sha256"]
    record = {"id": deploy_id, "time": time.time(), "files": results}
    rec_dir = os.path.join(store, "deploys")
    os.makedirs(rec_dir, exist_ok=True)
    with open(os.path.join(rec_dir, deploy_id + ".json"), "w") as f:
        json.dump(record, f)
    ok = all(r["verified"] for r in results)
    out = {"ok": ok, "files": results, "dirs_created": created}
    if not ok:
        out["error"] = "read-back differs for " + ", ".join(r["dest"] for r in results if not r["verified"])
        out["code"] = "verify"
    return out


def _receive(root, entry, data, created, deploy_id):
    dest = _under(root, entry["dest"])
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        created.append(entry["dest"].rsplit("/", 1)[0])
    tmp = os.path.join(parent, ".%s.ctl-%s" % (os.path.basename(dest), deploy_id))
    h = hashlib.sha256()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            while True:
                b = data.read(_BLOCK)
                if not b:
                    break
                h.update(b)
                out.write(b)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, int(entry["mode"], 8))
    except BaseException:
        _unlink(tmp)
        raise
    if h.hexdigest() != entry["sha256"]:
        _unlink(tmp)
        raise VerifyFailed("%s: received content has sha256 %s, expected %s (truncated transfer?)"
                         % (entry["dest"], h.hexdigest()[:12], entry["sha256"][:12]))
    return tmp, dest, entry


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
    out["files"] = hashes(root, args.get("files", []))["files"]
    session = args.get("session")
    if session or args.get("sessions"):
        tmux = shutil.which("tmux")
        if tmux is None:
            out["tmux"] = {"error": "tmux not found in the container"}
        elif session:
            r = subprocess.run([tmux, "has-session", "-t", "=" + session], capture_output=True)
            out["tmux"] = {"exists": r.returncode == 0}
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
        import glob
        out["series_logs"] = sorted(
            os.path.basename(p) for p in glob.glob(_under(root, pattern)))
    if args.get("gpus"):
        out["gpus"] = _gpus()
    return out


def _gpus():
    smi = shutil.which("nvidia-smi")
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


def _tmux_has(session):
    tmux = shutil.which("tmux")
    if tmux is None:
        return None
    return subprocess.run([tmux, "has-session", "-t", "=" + session], capture_output=True).returncode == 0


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
    and "impostor" says what it is. With "record", the run record beside the log (LOG.ctl.json) too."""
    root = args.get("root", "/")
    out = []
    for r in args["runs"]:
        log = _under(root, r["log"])
        pid = _read_int(log + ".pid")
        alive = _pid_alive(pid) if pid else False
        st = {"name": r["name"], "exit": _read_int(log + ".exit"), "pid": pid, "alive": alive,
              "session": _tmux_has(r["session"])}
        if alive:
            why = _not_the_run(pid, r["name"], log)
            if why is not None:
                st["alive"] = False
                st["impostor"] = "pid %d (%s): %s" % (pid, _proc_cmd(pid), why)
        try:
            s = os.stat(log)
            st["log_size"] = s.st_size
            st["log_mtime"] = s.st_mtime
        except OSError:
            st["log_size"] = None
        if r.get("record"):
            st["record"] = _read_json(log + ".ctl.json")
        out.append(st)
    return {"ok": True, "runs": out, "now": time.time()}


def launch(args):
    """Start a run in a detached tmux session; refuse to touch an existing log, record or session."""
    root = args.get("root", "/")
    log = _under(root, args["log"])
    session = args["session"]
    tmux = shutil.which("tmux")
    if tmux is None:
        return {"ok": False, "error": "tmux not found in the container", "code": "tmux"}
    if os.path.lexists(log):
        return {"ok": False, "error": "log %s already exists; a log is never overwritten" % args["log"],
                "code": "clobber"}
    if _tmux_has(session):
        return {"ok": False, "error": "tmux session %r already exists" % session, "code": "busy"}
    os.makedirs(os.path.dirname(log), exist_ok=True)
    try:
        fd = os.open(log + ".ctl.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return {"ok": False, "error": "run record %s.ctl.json already exists" % args["log"], "code": "clobber"}
    with os.fdopen(fd, "w") as f:
        json.dump(args["record"], f, indent=2, sort_keys=True, default=str)
    env = dict(os.environ)
    env.update(args.get("env", {}))
    r = subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "200", "-y", "50",
                        "bash", "-c", args["script"]], capture_output=True, text=True, env=env)
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
        for sig, wait in ((signal.SIGINT, args.get("grace", 30)), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(pid, sig)
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
    return {"ok": True, "signals": steps, "exit": _read_int(log + ".exit"),
            "alive": _pid_alive(pid) if pid else False}


def tailinfo(args):
    """Size of the log and its last N lines (read from the end, not the whole file)."""
    path = _under(args.get("root", "/"), args["log"])
    n = int(args.get("lines", 20))
    try:
        size = os.path.getsize(path)
    except OSError as e:
        return {"ok": False, "error": _describe(e)}
    block = 1 << 16
    data = b""
    with open(path, "rb") as f:
        pos = size
        while pos > 0 and data.count(b"\n") <= n:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines = lines[:-1]
    text = b"\n".join(lines[-n:]) + (b"\n" if lines[-n:] else b"") if n > 0 else b""
    return {"ok": True, "size": size, "text": text.decode("utf-8", "replace")}


_HEAD = 4096  # bytes of the log's start that identify it (with the inode) across pulls


def _head_sha(f, n):
    f.seek(0)
    return hashlib.sha256(f.read(n)).hexdigest()[:16]


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


def logread(args):
    """Bytes of a log from an offset: one JSON header line, then exactly `length` raw bytes.

    The header says where the bytes start ("offset": 0 again, with "reset" saying why, when the log
    was truncated or replaced since `ident`), the log's size, mtime and new ident (inode + hash of its
    first bytes), the agent's clock, and optionally the hashes of files and of checkpoints (a hash is
    only recomputed when a file's size or mtime differs from what the caller already knows).
    """
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
        import glob
        base = _under(root, ck["dir"])
        found = {}
        for p in sorted(glob.glob(os.path.join(glob.escape(base), ck["glob"]), recursive=True)):
            rel = os.path.relpath(p, base)
            h = _hash_known(p, known.get(rel))
            if h is not None:
                found[rel] = h
        out["checkpoints"] = found
    out["length"] = len(data)
    sys.stdout.buffer.write(json.dumps(out).encode() + b"\n" + data)
    sys.stdout.flush()
    return 0 if out.get("ok") else 1


def sync(root, store, deploy_id, stream):
    """Plan and apply in ONE exec: a header line lists the pinned files; the agent answers with what it
    has and which it needs; the controller then sends a tar of just those (or closes stdin)."""
    header = json.loads(stream.readline().decode())
    files = header["files"]
    have = {e["dest"]: _stat(_under(root, e["dest"])) for e in files}
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
    out = apply(root, store, deploy_id, stream, manifest={"files": entries})
    out["applied"] = True
    return out


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
            found = shutil.which(cand)
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


def main(argv):
    verb = argv[0]
    if verb == "hashes":
        out = hashes(argv[1], argv[2:])
    elif verb == "sync":
        out = sync(argv[1], argv[2], argv[3], sys.stdin.buffer)
    elif verb == "apply":
        out = apply(argv[1], argv[2], argv[3], sys.stdin.buffer)
    elif verb == "logread":
        return logread(json.loads(argv[1]))
    elif verb in ("cachestat", "cachemark", "cachesave", "cacherestore", "envfacts"):
        out = {"cachestat": cachestat, "cachemark": cachemark, "cachesave": cachesave,
               "cacherestore": cacherestore, "envfacts": envfacts}[verb](json.loads(argv[1]))
    elif verb == "writefile":
        out = writefile(json.loads(argv[1]), sys.stdin.buffer)
    elif verb in ("probe", "runstate", "launch", "stop", "tailinfo"):
        out = {"probe": probe, "runstate": runstate, "launch": launch, "stop": stop,
               "tailinfo": tailinfo}[verb](json.loads(argv[1]))
    else:
        out = {"ok": False, "error": "unknown verb %r" % verb}
    sys.stdout.write(json.dumps(out))
    sys.stdout.flush()
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    # Under BOOT (python3 -c BOOT N verb ...) argv is ["-c", N, verb, ...]; as a file, [path, verb, ...].
    sys.exit(main(sys.argv[2:] if sys.argv[0] == "-c" else sys.argv[1:]))
