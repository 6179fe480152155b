"""Probe a training environment inside a container and print ONE JSON document (stdlib only, Python >= 3.8).

Why: the seeds' training venv was polluted (SGLang, flashinfer), torch was swapped between 2.11.0+cu128 and
+cu130 and the torch.compile cache was deleted, and nobody could say what had changed. This probe records
what matters so that the controller can pin it (envlock.Lock), check it and diff two states.

It must work in a bare container: no torch, no nvidia-smi, no venv, no pip. Every section that fails
becomes {"error": "..."}; the probe itself never crashes and always exits 0 with valid JSON.
torch is never imported (slow, and it may be the broken part): torch/version.py is read as text.

Usage: python3 probe_env.py [--venv PATH] [--cache-dir PATH] [--disk PATH ...]

Top-level keys: schema, python, venv, torch, nvidia_smi, kernel, compile_cache, disk, hostname, time,
fingerprint. `fingerprint` is sha256 over a canonical JSON of: the venv's python version, its packages
and versions, torch version and CUDA build tag, driver version and GPU names. Times, disk free and cache
size are left out on purpose: they change without the environment changing.
"""

import argparse
import ast
import getpass
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SCHEMA = 1
_TIMEOUT = 20.0
_NVSMI_QUERY = "--query-gpu=index,name,uuid,memory.total,driver_version"

# Runs on the venv's own interpreter: the same sys.path as training, no pip needed. The first
# distribution of a name on sys.path is the one import uses; later ones are reported as shadowed.
_SNIPPET = r"""
import json, os, re, sys
try:
    from importlib import metadata
except ImportError:
    import importlib_metadata as metadata
seen = {}
shadowed = []
for d in metadata.distributions():
    try:
        name = d.metadata["Name"]
    except Exception:
        name = None
    if not name:
        continue
    def text(f):
        try:
            return d.read_text(f)
        except Exception:
            return None
    loc = None
    try:
        loc = str(d.locate_file(""))
    except Exception:
        pass
    entry = {"name": name, "version": d.version, "installer": text("INSTALLER"),
             "direct_url": text("direct_url.json"), "location": loc}
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        shadowed.append(entry)
    else:
        seen[key] = entry
torch_version_py = None
for p in sys.path:
    cand = os.path.join(p or ".", "torch", "version.py")
    if os.path.isfile(cand):
        torch_version_py = cand
        break
json.dump({"version": ".".join(str(n) for n in sys.version_info[:3]), "implementation": sys.implementation.name,
           "prefix": sys.prefix, "base_prefix": getattr(sys, "base_prefix", sys.prefix),
           "dists": list(seen.values()), "shadowed": shadowed, "torch_version_py": torch_version_py},
          sys.stdout)
"""


def normalize(name):
    """PEP 503 name, so that `Flash_Attn` and `flash-attn` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _err(exc):
    return {"error": f"{type(exc).__name__}: {exc}"}


def _section(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # a probe must never crash: the error becomes the section
        return _err(exc)


def probe_python():
    return {
        "version": ".".join(str(n) for n in sys.version_info[:3]),
        "executable": sys.executable,
        "implementation": platform.python_implementation(),
    }


def _venv_python(venv):
    for rel in ("bin/python", "bin/python3", "Scripts/python.exe"):
        cand = os.path.join(venv, rel)
        if os.path.exists(cand):
            return cand
    return None


def _start_venv(venv):
    """Start the venv's interpreter early (in parallel with nvidia-smi); returns (popen, error)."""
    if not venv:
        return None, "no venv given (--venv PATH) and VIRTUAL_ENV is not set"
    if not os.path.isdir(venv):
        return None, f"venv {venv} does not exist or is not a directory"
    py = _venv_python(venv)
    if py is None:
        return None, f"venv {venv} has no bin/python"
    # -I: no cwd, PYTHONPATH or user site: the venv alone
    return _spawn([py, "-I", "-c", _SNIPPET], py, cwd="/")


def _spawn(argv, what, cwd=None):
    """Start argv with its output captured; returns (popen, None) or (None, why it could not start)."""
    try:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
    except OSError as exc:
        return None, f"cannot run {what}: {exc}"
    return proc, None


def _provenance(d):
    out = {}
    if d.get("installer"):
        out["installer"] = d["installer"].strip()
    raw = d.get("direct_url")
    if raw:
        try:
            info = json.loads(raw)
            out["url"] = info.get("url")
            if info.get("dir_info", {}).get("editable"):
                out["editable"] = True
            vcs = info.get("vcs_info")
            if vcs:
                out["vcs"] = {"vcs": vcs.get("vcs"), "commit_id": vcs.get("commit_id")}
        except (ValueError, AttributeError) as exc:
            out["direct_url_error"] = str(exc)
    return out


def _finish_venv(venv, proc):
    try:
        out, err = proc.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"path": venv, "error": f"venv python timed out after {_TIMEOUT}s"}, None
    if proc.returncode != 0:
        tail = " | ".join(err.decode("utf-8", "replace").strip().splitlines()[-3:])
        return {"path": venv, "error": f"venv python exited {proc.returncode}: {tail}"}, None
    data = json.loads(out.decode("utf-8"))
    packages, provenance, shadowed = {}, {}, {}
    for d in sorted(data["dists"], key=lambda e: normalize(e["name"])):
        key = normalize(d["name"])
        packages[key] = d["version"]
        prov = _provenance(d)
        if prov:
            provenance[key] = prov
    for d in data["shadowed"]:
        shadowed.setdefault(normalize(d["name"]), []).append({"version": d["version"], "location": d["location"]})
    section = {
        "path": venv,
        "realpath": os.path.realpath(venv),
        "is_symlink": os.path.islink(venv.rstrip("/") or "/"),
        "python_version": data["version"],
        "implementation": data["implementation"],
        "is_venv": data["prefix"] != data["base_prefix"],
        "packages": packages,
        "provenance": provenance,
        "shadowed": shadowed,
    }
    return section, data.get("torch_version_py")


def _local_tag(version):
    return version.split("+", 1)[1] if "+" in version else None


def probe_torch(version_py, packages):
    """torch version and CUDA build from torch/version.py read as text (never `import torch`)."""
    if not version_py:
        if packages is not None and "torch" in packages:
            return {"error": "torch is in the metadata ({}) but torch/version.py is missing".format(packages["torch"])}
        return {"error": "torch is not installed in the venv"}
    with open(version_py, encoding="utf-8") as f:
        tree = ast.parse(f.read(), version_py)
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            target, value = node.target.id, node.value
        else:
            continue
        try:
            values[target] = ast.literal_eval(value)
        except ValueError:
            continue
    version = values.get("__version__")
    cuda = values.get("cuda")
    hip = values.get("hip")
    tag = _local_tag(version) if isinstance(version, str) else None
    if tag is None:
        if cuda:
            tag = "cu" + str(cuda).replace(".", "")
        elif hip:
            tag = "rocm" + ".".join(str(hip).split(".")[:2])
        elif version:
            tag = "cpu"
    out = {
        "version": version,
        "cuda_tag": tag,
        "cuda": cuda,
        "hip": hip,
        "git_version": values.get("git_version"),
        "version_py": version_py,
    }
    meta = packages.get("torch") if packages else None
    if meta is not None and meta != version:
        # a half-finished swap (cu128 <-> cu130) leaves metadata and files disagreeing
        out["metadata_version"] = meta
        out["warning"] = f"torch metadata says {meta} but torch/version.py says {version}"
    return out


def _start_nvsmi():
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found on PATH"
    return _spawn([exe, _NVSMI_QUERY, "--format=csv,noheader,nounits"], "nvidia-smi")


def _finish_nvsmi(proc):
    try:
        out, err = proc.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"nvidia-smi timed out after {_TIMEOUT}s"}
    if proc.returncode != 0:
        text = (err or out).decode("utf-8", "replace").strip().splitlines()
        return {"error": "nvidia-smi exited {}: {}".format(proc.returncode, " | ".join(text[-3:]))}
    gpus = []
    for line in out.decode("utf-8", "replace").splitlines():
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 5:
            return {"error": f"unexpected nvidia-smi line: {line!r}"}
        idx, name, uuid, mem, driver = cols
        try:
            mem_mib = int(float(mem))
        except ValueError:
            mem_mib = None
        gpus.append(
            {"index": int(idx), "name": name, "uuid": uuid, "memory_total_mib": mem_mib, "driver_version": driver}
        )
    drivers = sorted({g["driver_version"] for g in gpus})
    return {"driver_version": drivers[0] if len(drivers) == 1 else (drivers or None), "gpus": gpus}


def _read(path, mode="r"):
    with open(path, mode) as f:
        return f.read()


def probe_kernel():
    u = platform.uname()
    container, evidence = None, None
    try:
        value = _read("/run/systemd/container").strip()
        if value:
            container, evidence = value, "/run/systemd/container"
    except OSError:
        pass
    if container is None:
        try:
            for item in _read("/proc/1/environ", "rb").split(b"\0"):
                if item.startswith(b"container="):
                    container, evidence = item[10:].decode("utf-8", "replace"), "/proc/1/environ"
        except OSError:
            pass
    if container is None:
        try:
            cg = _read("/proc/1/cgroup")
            for word in ("lxc", "docker", "kubepods", "containerd"):
                if word in cg:
                    container, evidence = word, "/proc/1/cgroup"
                    break
        except OSError:
            pass
    return {"release": u.release, "machine": u.machine, "container": container, "container_evidence": evidence}


def _user():
    try:
        return getpass.getuser()
    except Exception:  # no USER and no passwd entry in a bare container
        return str(os.getuid())


def _count(path):
    """(bytes, files) under path, without following symlinks."""
    total, files = 0, 0
    stack = [path]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
                        files += 1
                except OSError:
                    continue
    return total, files


def probe_cache(cache_dir):
    """The inductor cache: TORCHINDUCTOR_CACHE_DIR, else torch's default <tmp>/torchinductor_<user>."""
    if cache_dir:
        source = "flag"
    elif os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        cache_dir, source = os.environ["TORCHINDUCTOR_CACHE_DIR"], "env"
    else:
        user = re.sub(r'[\\/:*?"<>|]', "_", _user())
        cache_dir, source = os.path.join(tempfile.gettempdir(), "torchinductor_" + user), "default"
    out = {"path": cache_dir, "source": source, "exists": os.path.isdir(cache_dir)}
    if not out["exists"]:
        return out
    out["bytes"], out["files"] = _count(cache_dir)
    entries = {}
    for sub in ("fxgraph", "aotautograd", "triton"):
        p = os.path.join(cache_dir, sub)
        try:
            entries[sub] = len(os.listdir(p))
        except OSError:
            entries[sub] = None
    out["entries"] = entries
    return out


def probe_disk(paths):
    out = {}
    for p in paths:
        try:
            u = shutil.disk_usage(p)
            out[p] = {"total": u.total, "used": u.used, "free": u.free}
        except OSError as exc:
            out[p] = _err(exc)
    return out


def fingerprint_parts(doc):
    """What defines the environment; envlock.fingerprint() recomputes the same from a parsed probe."""
    venv, torch, smi = doc.get("venv") or {}, doc.get("torch") or {}, doc.get("nvidia_smi") or {}
    gpus = smi.get("gpus")
    return {
        "python": venv.get("python_version"),
        "packages": venv.get("packages"),
        "torch": {"version": torch.get("version"), "cuda_tag": torch.get("cuda_tag")},
        "driver": smi.get("driver_version"),
        "gpus": [g.get("name") for g in gpus] if isinstance(gpus, list) else None,
    }


def fingerprint(doc):
    canon = json.dumps(fingerprint_parts(doc), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def probe(venv=None, cache_dir=None, disks=()):
    venv = venv or os.environ.get("VIRTUAL_ENV") or None
    try:
        venv_proc, venv_err = _start_venv(venv)
    except Exception as exc:
        venv_proc, venv_err = None, f"{type(exc).__name__}: {exc}"
    smi_proc, smi_err = _start_nvsmi()
    doc = {"schema": SCHEMA, "python": _section(probe_python)}
    version_py = None
    if venv_proc is None:
        doc["venv"] = {"path": venv, "error": venv_err}
    else:
        res = _section(_finish_venv, venv, venv_proc)
        if isinstance(res, tuple):
            doc["venv"], version_py = res
        else:
            doc["venv"] = dict(res, path=venv)
    packages = doc["venv"].get("packages")
    if "error" in doc["venv"]:
        doc["torch"] = {"error": "no venv to look in: {}".format(doc["venv"]["error"])}
    else:
        doc["torch"] = _section(probe_torch, version_py, packages)
    doc["nvidia_smi"] = {"error": smi_err} if smi_proc is None else _section(_finish_nvsmi, smi_proc)
    doc["kernel"] = _section(probe_kernel)
    doc["compile_cache"] = _section(probe_cache, cache_dir)
    doc["disk"] = _section(probe_disk, list(disks))
    doc["hostname"] = _section(socket.gethostname)
    now = time.time()
    doc["time"] = {"epoch": now, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}
    doc["fingerprint"] = _section(fingerprint, doc)
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(description="Probe a training environment; prints one JSON document.")
    ap.add_argument("--venv", help="virtual environment to inspect (default: $VIRTUAL_ENV)")
    ap.add_argument("--cache-dir", help="torch.compile cache (default: $TORCHINDUCTOR_CACHE_DIR or torch's default)")
    ap.add_argument("--disk", action="append", default=[], metavar="PATH", help="report free space (repeatable)")
    args = ap.parse_args(argv)
    try:
        doc = probe(args.venv, args.cache_dir, args.disk)
    except Exception as exc:  # last resort: still one JSON document
        doc = {"schema": SCHEMA, "error": f"probe failed: {type(exc).__name__}: {exc}"}
    json.dump(doc, sys.stdout, sort_keys=True, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
