"""Runs: the launch preflight (probe), their state (runstate, poll), their start (launch) and their end
(stop)."""

import os
import sys
import time

from ..common import _pid_alive
from .base import glob, json, subprocess
from .fs import (
    _NOFOLLOW,
    Refused,
    _code,
    _describe,
    _lexists_at,
    _opendir,
    _read_json,
    _under,
    _unmapped_owner,
    _which,
    hashes,
)
from .logs import _logread


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



def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
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
    except OSError as e:  # nothing started: say so in one line, and ctl releases the name
        why = e.strerror + _unmapped_owner(_under(root, parent))
        return {"ok": False, "error": "log directory %s: %s" % (parent, why), "code": _code(e)}
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
        except OSError as e:
            why = e.strerror + _unmapped_owner(_under(root, parent))
            return {"ok": False, "error": "run record %s.ctl.json: %s" % (args["log"], why), "code": _code(e)}
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
