"""What a container's GPU setup looks like from inside it; prints ONE JSON document (stdlib only, Python >= 3.8).

Run by `ctl doctor` as `python3 - SPEC [ENV PROBE ARGS...]` with this source on stdin, and by `ctl launch` in the
slot of its preflight that runs the environment probe (agent.py `probe`, "env_probe"): either way one exec. It
only reads: each device node is opened and closed at once (the errno says why one cannot be used: EPERM the
cgroup, ENOENT no bind mount, ENXIO no driver behind the major), nothing is written anywhere.

SPEC (JSON): {"nodes": [paths], "caps": bool (also every /dev/nvidia-caps/* there is), "smi": bool, "net": bool,
"env": bool (run the environment probe, whose source ctl puts into ENV_PROBE_SOURCE, with the other arguments)}.

Answer: {"gpu": {"nodes": {path: {...}}, "driver_file", "libs", "smi", "shm", "memlock", "addresses", "ifaces"},
"env": {"rc", "stdout", "stderr"} or null} - "env" in the shape agent.py's `probe` gives the environment probe's
output, so the controller reads it the same way.
"""

import errno
import json
import os
import resource
import socket
import stat
import subprocess
import sys

from .procs import _finish, _start

ENV_PROBE_SOURCE = None  # ctl puts probe_env.py's source here when it ships this file (controller/remote/client.py)

_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
             "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/lib/x86_64-linux-gnu", "/lib64")
_LIBS = ("libnvidia-ml.so.1", "libcuda.so.1")
_SMI_QUERY = ["--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"]
_SMI_TIMEOUT = 20


def node(path):
    """Whether the node exists, what it is, and whether it opens (the errno's name when not)."""
    out = {"exists": False}
    try:
        st = os.stat(path)
    except OSError as e:
        out["errno"] = errno.errorcode.get(e.errno, str(e.errno))
        out["error"] = e.strerror
        return out
    out.update(exists=True, char=stat.S_ISCHR(st.st_mode), mode="%04o" % stat.S_IMODE(st.st_mode),
               uid=st.st_uid, gid=st.st_gid)
    if stat.S_ISCHR(st.st_mode):
        out["rdev"] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        out["errno"] = errno.errorcode.get(e.errno, str(e.errno))
        out["error"] = e.strerror
    else:
        os.close(fd)
        out["opens"] = True
    return out


def _ld_dirs():
    """The library directories the dynamic linker searches: /etc/ld.so.conf and its includes, then the defaults."""
    dirs = []

    def read(path, depth=0):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("include ") and depth < 4:
                import glob
                for inc in sorted(glob.glob(line.split(None, 1)[1].strip())):
                    read(inc, depth + 1)
            elif line.startswith("/"):
                dirs.append(line)

    read("/etc/ld.so.conf")
    for d in _LIB_DIRS:
        if d not in dirs:
            dirs.append(d)
    return dirs


def libs():
    """Where the linker would find libnvidia-ml.so.1 and libcuda.so.1, and the file each links to (its name
    carries the driver version it belongs to)."""
    out = {}
    dirs = _ld_dirs()
    for name in _LIBS:
        found = None
        for d in dirs:
            p = os.path.join(d, name)
            if os.path.lexists(p):
                found = {"path": p, "real": os.path.realpath(p), "exists": os.path.exists(p)}
                break
        out[name] = found
    return out


def _which(name):
    for d in [*os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(":"), "/usr/bin", "/usr/sbin"]:
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def start_smi():
    """The container's nvidia-smi, started now (it runs while the nodes are looked at)."""
    exe = _which("nvidia-smi")
    if exe is None:
        return {"rc": 127, "out": "", "err": "nvidia-smi: not found"}
    return _start([exe, *_SMI_QUERY])


def shm():
    try:
        st = os.statvfs("/dev/shm")
    except OSError as e:
        return {"error": "/dev/shm: %s" % e.strerror}
    return {"size": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}


def memlock():
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return -1 if soft == resource.RLIM_INFINITY else soft


def addresses():
    """The container's own IPv4 addresses (the LOCAL entries of /proc/net/fib_trie) and IPv6 ones
    (/proc/net/if_inet6): what a job node's `address:` must be one of."""
    found = []
    try:
        with open("/proc/net/fib_trie", encoding="ascii", errors="replace") as f:
            last = None
            for line in f:
                s = line.strip()
                if s.startswith("|--"):
                    last = s[3:].strip()
                elif "/32 host LOCAL" in s and last and last not in found:
                    found.append(last)
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6", encoding="ascii", errors="replace") as f:
            for line in f:
                h = line.split()[0]
                addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(h))
                if addr not in found:
                    found.append(addr)
    except (OSError, ValueError, IndexError):
        pass
    return found


def ifaces():
    try:
        return sorted(name for _i, name in socket.if_nameindex())
    except OSError:
        return []


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return None


def gpu(spec):
    smi = start_smi() if spec.get("smi") else None
    paths = [str(p) for p in spec.get("nodes", [])]
    if spec.get("caps"):
        try:
            paths += sorted("/dev/nvidia-caps/" + n for n in os.listdir("/dev/nvidia-caps"))
        except OSError:
            pass
    out = {"nodes": {p: node(p) for p in paths}, "driver_file": _read("/proc/driver/nvidia/version"),
           "libs": libs(), "uid_map": _read("/proc/self/uid_map")}
    if smi is not None:
        out["smi"] = _finish(smi, _SMI_TIMEOUT, "nvidia-smi: no answer within %ss" % _SMI_TIMEOUT, 8000)
    if spec.get("net"):
        out.update(shm=shm(), memlock=memlock(), addresses=addresses(), ifaces=ifaces())
    return out


def start_env_probe(argv):
    """probe_env.py (ENV_PROBE_SOURCE) as `python3 - ARGS`, started now: it runs while the nodes are looked at."""
    if not ENV_PROBE_SOURCE:
        return {"rc": 2, "stdout": "", "stderr": "probe_gpu: shipped without the environment probe"}
    try:
        proc = subprocess.Popen([sys.executable, "-", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    except OSError as e:
        return {"rc": 127, "stdout": "", "stderr": "env probe: %s" % e.strerror}
    try:
        proc.stdin.write(ENV_PROBE_SOURCE)  # ~20 KB: within a pipe's buffer, so this does not wait for the reader
        proc.stdin.close()
    except OSError:
        pass
    proc.stdin = None  # written and closed: communicate() must not flush it again
    return proc


def finish_env_probe(proc):
    """Its output as agent.py's `probe` gives it back."""
    if isinstance(proc, dict):
        return proc
    try:
        out, err = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"rc": 124, "stdout": "", "stderr": "env probe: no answer within 100s"}
    return {"rc": proc.returncode, "stdout": out.decode("utf-8", "replace"),
            "stderr": err.decode("utf-8", "replace")[-4000:]}


def main(argv):
    try:
        spec = json.loads(argv[0]) if argv else {}
    except ValueError:
        spec = {}
    env = start_env_probe(argv[1:]) if spec.get("env") else None
    doc = {"gpu": gpu(spec), "env": finish_env_probe(env) if env is not None else None}
    sys.stdout.write(json.dumps(doc) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
