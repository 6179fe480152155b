"""A Proxmox-VE-like REST API for the local test host: HTTPS, API-token auth, UPID tasks.

Runs as its own process (`python -m tests.pvehost.api --base D`), started by `PveHost.up()` and killed by
`down()`; it serves every node of the test host (as any node of a PVE cluster does) on 127.0.0.2, port
8006 or the next free one. Writes and starts/stops run the node's simulated `pct` in a background
thread, so the API and the CLI share one implementation; reads parse the node's config files with the
functions of pct.py. Shapes and messages follow shared/pve-facts.md:

- envelope `{"data": ...}`; parameter errors: 400 `Parameter verification failed.` with `errors`;
  other errors: 500 whose reason phrase is the message's first line; unknown paths: 501.
- `GET /cluster/status` (a `cluster` entry, then `node` entries with `ip`) and `GET /cluster/resources
  [?type=vm|node|storage|sdn]` (type=vm: `lxc/VMID` entries with node, status, name, template; no addresses),
  read from every node's config directory: moving a `<vmid>.conf` to another node's directory migrates it.
- bad or missing token: 401 after a deliberate delay (default 3 s; `<D>/api/auth_delay` overrides it
  at run time, see `PveHost.set_api_auth_delay`).
- POST start/stop/shutdown/snapshot/rollback and DELETE snapshot answer a UPID at once; a failure
  inside the task (`snapshot name 'X' already used`) only shows in `GET /nodes/N/tasks/UPID/status`.

Files under <D>/api/: ca.pem (the per-run CA that clients trust), server.pem/server.key (cert for
127.0.0.2 signed by it), api.json (url, port, token id and secret, ca path; written once listening),
api.pid, api.log, auth_delay.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.pvehost import pct as pctmod

API_ADDRESS = "127.0.0.2"
API_PORT = 8006
TOKEN_ID = "root@pam!ctl"
DEFAULT_AUTH_DELAY = 3.0
PVE_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"
VMID_RE = re.compile(r"^[1-9]\d*$")
BOOL_RE = re.compile(r"^(1|0|true|false|yes|no|on|off)$", re.IGNORECASE)


# --- certificates --------------------------------------------------------------------------------


def make_certs(d: Path, addresses: tuple[str, ...] = (API_ADDRESS,)) -> None:
    """A fresh CA (ca.pem) and a server certificate for `addresses` (IP SANs) signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ctl-pvehost test CA"),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "PVE Cluster Manager CA (simulated)")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, addresses[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    d.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    (d / "ca.pem").write_bytes(ca.public_bytes(pem))
    (d / "server.pem").write_bytes(cert.public_bytes(pem) + ca.public_bytes(pem))
    keyfile = d / "server.key"
    keyfile.touch(mode=0o600)
    keyfile.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


# --- errors --------------------------------------------------------------------------------------


class HttpError(Exception):
    def __init__(self, code: int, message: str, errors: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.errors = errors


def param_error(errors: dict[str, str]) -> HttpError:
    return HttpError(400, "Parameter verification failed.", errors)


# --- tasks ---------------------------------------------------------------------------------------


@dataclass
class Task:
    upid: str
    node: str
    pid: int
    pstart: int
    starttime: int
    type: str
    id: str
    user: str
    status: str = "running"
    exitstatus: str | None = None
    log: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"upid": self.upid, "node": self.node, "pid": self.pid, "pstart": self.pstart,
                               "starttime": self.starttime, "type": self.type, "id": self.id,
                               "user": self.user.split("!")[0], "status": self.status}
        if "!" in self.user:
            doc["tokenid"] = self.user.split("!", 1)[1]
        if self.exitstatus is not None:
            doc["exitstatus"] = self.exitstatus
        return doc


def _pstart(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


# --- the API -------------------------------------------------------------------------------------


@dataclass
class NodeInfo:
    name: str
    pct: Path
    etc_pve: Path
    lxcpath: Path
    address: str = ""  # the node's cluster address (`ip` in /cluster/status)

    def conf_rel(self, vmid: int) -> str:
        return f"nodes/{self.name}/lxc/{vmid}.conf"

    def conf_path(self, vmid: int) -> Path:
        return self.etc_pve / self.conf_rel(vmid)


class PveApi:
    """Routing, parameter checks and task bookkeeping; the HTTP handler only moves bytes."""

    def __init__(self, base: Path, token_id: str, secret: str, auth_delay_file: Path) -> None:
        self.base = base
        self.token_id = token_id
        self.secret = secret
        self.auth_delay_file = auth_delay_file
        self.tasks: dict[str, Task] = {}
        self.lock = threading.Lock()
        self.nodes: dict[str, NodeInfo] = {}
        for nj in sorted(base.glob("*/node.json")):
            info = json.loads(nj.read_text())
            self.nodes[info["node"]] = NodeInfo(info["node"], nj.parent / "bin" / "pct", Path(info["etc_pve"]),
                                                Path(info["lxcpath"]), info.get("address", ""))

    # --- auth

    def auth_delay(self) -> float:
        try:
            return float(self.auth_delay_file.read_text().strip())
        except (OSError, ValueError):
            return DEFAULT_AUTH_DELAY

    def check_auth(self, header: str | None) -> str:
        """-> the authenticated token id; raises 401 (after the delay) otherwise."""
        why = self._auth_failure(header)
        if why is None:
            return self.token_id
        time.sleep(self.auth_delay())
        raise HttpError(401, why)

    def _auth_failure(self, header: str | None) -> str | None:
        if not header:
            return "No ticket"
        prefix = "PVEAPIToken="
        if not header.startswith(prefix):
            return "authentication failure"
        token, sep, secret = header[len(prefix):].partition("=")
        if not sep or "!" not in token or "@" not in token:
            return "authentication failure"
        if token != self.token_id:
            user, _, name = token.partition("!")
            return f"no such token '{name}' for user '{user}'"
        if not hmac.compare_digest(secret.encode(), self.secret.encode()):
            return "invalid token value!"
        return None

    # --- routing

    def handle(self, method: str, path: str, params: dict[str, str], user: str) -> Any:
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] != ["api2", "json"]:
            raise HttpError(501, f"Method '{method} {path}' not implemented")
        p = parts[2:]
        if p == ["version"] and method == "GET":
            return {"version": "8.2.4", "release": "8.2", "repoid": "faa83925c9641325"}
        if p == ["nodes"] and method == "GET":
            return [{"node": n, "status": "online", "type": "node", "id": f"node/{n}"} for n in self.nodes]
        if p == ["cluster", "status"] and method == "GET":
            self._allow(params, set())
            return self._cluster_status()
        if p == ["cluster", "resources"] and method == "GET":
            self._allow(params, {"type"})
            return self._cluster_resources(params.get("type"))
        if len(p) >= 2 and p[0] == "nodes":
            node = self._node(p[1])
            rest = p[2:]
            if rest == ["lxc"] and method == "GET":
                self._allow(params, set())
                return [self._status(node, vmid) for vmid in self._vmids(node)]
            if len(rest) >= 2 and rest[0] == "tasks":
                return self._tasks(node, method, rest[1], rest[2:], params)
            if len(rest) >= 3 and rest[0] == "lxc":
                return self._lxc(node, method, rest[1], rest[2:], params, user)
        raise HttpError(501, f"Method '{method} /{'/'.join(p)}' not implemented")

    def _cluster_status(self) -> list[dict[str, Any]]:
        """As PVE: a `cluster` entry (only when the nodes form a cluster), then one `node` entry per member with
        its `ip` (the address corosync uses); /cluster/resources carries no addresses."""
        out: list[dict[str, Any]] = []
        if len(self.nodes) > 1:
            out.append({"type": "cluster", "id": "cluster", "name": "ctl-test", "nodes": len(self.nodes),
                        "quorate": 1, "version": len(self.nodes)})
        for i, n in enumerate(self.nodes.values()):
            out.append({"type": "node", "id": f"node/{n.name}", "name": n.name, "ip": n.address,
                        "online": 1, "local": 1 if i == 0 else 0, "nodeid": i + 1, "level": ""})
        return out

    def _cluster_resources(self, kind: str | None) -> list[dict[str, Any]]:
        """GET /cluster/resources[?type=vm|node|storage|sdn]: type=vm gives guests only (qemu and lxc), each
        with `id` (`lxc/200`), `node`, `status`, `name`, `template`; type=node the nodes; none: everything."""
        if kind is not None and kind not in ("vm", "node", "storage", "sdn"):
            raise param_error({"type": f"value '{kind}' does not have a value in the enumeration "
                                       "'vm, storage, node, sdn'"})
        out: list[dict[str, Any]] = []
        if kind in (None, "node"):
            for n in self.nodes.values():
                out.append({"id": f"node/{n.name}", "type": "node", "node": n.name, "status": "online",
                            "level": "", "cgroup-mode": 2, "maxcpu": 16, "cpu": 0.01,
                            "maxmem": 128 * 1024**3, "mem": 4 * 1024**3, "maxdisk": 100 * 1024**3,
                            "disk": 10 * 1024**3, "uptime": 3600})
        if kind in (None, "vm"):
            for n in self.nodes.values():
                for vmid in self._vmids(n):
                    st = self._status(n, vmid)
                    current, _, _, _ = self._conf(n, vmid)
                    entry = {"id": f"lxc/{vmid}", "type": "lxc", "vmid": vmid, "node": n.name,
                             "status": st["status"], "name": st["name"], "maxcpu": st["cpus"],
                             "maxmem": st["maxmem"], "maxdisk": st["maxdisk"], "mem": st["mem"],
                             "disk": st["disk"], "uptime": st["uptime"], "netin": 0, "netout": 0,
                             "diskread": 0, "diskwrite": 0, "cpu": 0,
                             "template": 1 if current.get("template") == "1" else 0}
                    if "tags" in current:
                        entry["tags"] = current["tags"]
                    if "lock" in current:
                        entry["lock"] = current["lock"]
                    out.append(entry)
                out.extend(self._qemu_resources(n))
        return out

    def _qemu_resources(self, node: NodeInfo) -> list[dict[str, Any]]:
        """The node's QEMU VMs as type=vm lists them beside the containers (`qemu/VMID`, type `qemu`), from their
        configs in nodes/NODE/qemu-server/VMID.conf. The test host runs no VM: each is stopped. None unless a test
        wrote such a config (discovery must leave VMs and templates out)."""
        out: list[dict[str, Any]] = []
        d = node.etc_pve / "nodes" / node.name / "qemu-server"
        for f in sorted(d.glob("*.conf")) if d.is_dir() else []:
            m = re.fullmatch(r"(\d+)\.conf", f.name)
            if m is None:
                continue
            vmid = int(m.group(1))
            current, _, _ = pctmod.parse_conf(f.read_text())
            out.append({"id": f"qemu/{vmid}", "type": "qemu", "vmid": vmid, "node": node.name, "status": "stopped",
                        "name": current.get("name", f"VM {vmid}"),
                        "maxcpu": int(current.get("cores", "1")) * int(current.get("sockets", "1")),
                        "maxmem": int(current.get("memory", "2048")) * 1024 * 1024, "maxdisk": 32 * 1024**3,
                        "mem": 0, "disk": 0, "uptime": 0, "netin": 0, "netout": 0, "diskread": 0, "diskwrite": 0,
                        "cpu": 0, "template": 1 if current.get("template") == "1" else 0})
        return out

    def _node(self, name: str) -> NodeInfo:
        node = self.nodes.get(name)
        if node is None:
            raise HttpError(500, f"hostname lookup '{name}' failed - failed to get address info for: {name}: "
                                 "Name or service not known")
        return node

    def _vmids(self, node: NodeInfo) -> list[int]:
        d = node.etc_pve / "nodes" / node.name / "lxc"
        return sorted(int(m.group(1)) for f in d.glob("*.conf") if (m := re.fullmatch(r"(\d+)\.conf", f.name)))

    @staticmethod
    def _allow(params: dict[str, str], allowed: set[str], required: frozenset[str] = frozenset()) -> None:
        errors = {k: "property is not defined in schema and the schema does not allow additional properties"
                  for k in params if k not in allowed}
        errors.update({k: "property is missing and it is not optional" for k in required if k not in params})
        if errors:
            raise param_error(errors)

    @staticmethod
    def _bool(params: dict[str, str], name: str) -> bool | None:
        if name not in params:
            return None
        if not BOOL_RE.match(params[name]):
            raise param_error({name: f"type check ('boolean') failed - got '{params[name]}'"})
        return params[name].lower() in ("1", "true", "yes", "on")

    def _vmid(self, node: NodeInfo, value: str) -> int:
        if not VMID_RE.match(value):
            raise param_error({"vmid": "invalid format - value does not look like a valid VM ID"})
        vmid = int(value)
        if vmid < 100:
            raise param_error({"vmid": "value must have a minimum value of 100"})
        if vmid > 999999999:
            raise param_error({"vmid": "value must have a maximum value of 999999999"})
        if not node.conf_path(vmid).exists():
            raise HttpError(500, f"Configuration file '{node.conf_rel(vmid)}' does not exist")
        return vmid

    @staticmethod
    def _snapname(value: str) -> str:
        if not pctmod.SNAP_NAME.match(value):
            raise param_error({"snapname": f"invalid format - invalid configuration ID '{value}'"})
        if len(value) > 40:
            raise param_error({"snapname": "value may only be 40 characters long"})
        return value

    def _conf(self, node: NodeInfo, vmid: int) -> tuple[dict[str, str], list[tuple[str, str]],
                                                       dict[str, dict[str, str]], str]:
        text = node.conf_path(vmid).read_text()
        current, raw, snaps = pctmod.parse_conf(text)
        return current, raw, snaps, hashlib.sha1(text.encode()).hexdigest()

    def _running(self, node: NodeInfo, vmid: int) -> bool:
        r = subprocess.run(["lxc-info", "-P", str(node.lxcpath), "-n", str(vmid), "-s", "-H"],
                           capture_output=True, text=True)
        return r.returncode == 0 and r.stdout.strip() == "RUNNING"

    def _status(self, node: NodeInfo, vmid: int) -> dict[str, Any]:
        current, _, _, _ = self._conf(node, vmid)
        running = self._running(node, vmid)
        st: dict[str, Any] = {
            "vmid": vmid, "name": current.get("hostname", f"CT{vmid}"), "type": "lxc",
            "status": "running" if running else "stopped", "cpus": int(current.get("cores", "1")),
            "maxmem": int(current.get("memory", "512")) * 1024 * 1024,
            "maxswap": int(current.get("swap", "512")) * 1024 * 1024, "maxdisk": 8 * 1024**3,
            "mem": 8 * 1024 * 1024 if running else 0, "swap": 0, "disk": 0, "netin": 0, "netout": 0,
            "diskread": 0, "diskwrite": 0, "uptime": 0,
        }
        if "lock" in current:
            st["lock"] = current["lock"]
        return st

    def _lxc(self, node: NodeInfo, method: str, vmid_s: str, rest: list[str], params: dict[str, str],
             user: str) -> Any:
        vmid = self._vmid(node, vmid_s)
        if rest == ["status", "current"] and method == "GET":
            self._allow(params, set())
            return self._status(node, vmid)
        if len(rest) == 2 and rest[0] == "status" and method == "POST" and rest[1] in ("start", "stop", "shutdown"):
            action = rest[1]
            allowed = {"start": {"skiplock", "debug"}, "stop": {"skiplock", "overrule-shutdown", "timeout"},
                       "shutdown": {"forceStop", "timeout"}}[action]
            self._allow(params, allowed)
            args = []
            for k in sorted(allowed & set(params)):
                if k == "timeout":
                    if not params[k].isdigit():
                        raise param_error({k: f"type check ('integer') failed - got '{params[k]}'"})
                    args += [f"--{k}", params[k]]
                else:
                    args += [f"--{k}", "1" if self._bool(params, k) else "0"]
            return self._task(node, f"vz{action}", vmid, user, [action, str(vmid), *args])
        if rest == ["config"] and method == "GET":
            self._allow(params, {"current", "snapshot"})
            current, raw, snaps, digest = self._conf(node, vmid)
            keys = current
            if "snapshot" in params:
                if params["snapshot"] not in snaps:
                    raise HttpError(500, f"snapshot '{params['snapshot']}' does not exist")
                keys, raw = snaps[params["snapshot"]], []
            doc: dict[str, Any] = {k: (int(v) if v.isdigit() else v) for k, v in keys.items()}
            doc["digest"] = digest
            if raw:
                doc["lxc"] = [[k, v] for k, v in raw]
            return doc
        if rest == ["snapshot"] and method == "GET":
            self._allow(params, set())
            current, _, snaps, _ = self._conf(node, vmid)
            out: list[dict[str, Any]] = []
            for name, keys in snaps.items():
                entry: dict[str, Any] = {"name": name, "description": keys.get("description", "")}
                if "snaptime" in keys:
                    entry["snaptime"] = int(keys["snaptime"])
                if "parent" in keys:
                    entry["parent"] = keys["parent"]
                out.append(entry)
            here: dict[str, Any] = {"name": "current", "description": "You are here!",
                                    "running": 1 if self._running(node, vmid) else 0}
            if "parent" in current:
                here["parent"] = current["parent"]
            return [*out, here]
        if rest == ["snapshot"] and method == "POST":
            self._allow(params, {"snapname", "description"}, frozenset({"snapname"}))
            name = self._snapname(params["snapname"])
            args = ["--description", params["description"]] if "description" in params else []
            return self._task(node, "vzsnapshot", vmid, user, ["snapshot", str(vmid), name, *args])
        if len(rest) >= 2 and rest[0] == "snapshot":
            name = self._snapname(rest[1])
            if len(rest) == 2 and method == "DELETE":
                self._allow(params, {"force"})
                args = ["--force", "1"] if self._bool(params, "force") else []
                return self._task(node, "vzdelsnapshot", vmid, user, ["delsnapshot", str(vmid), name, *args])
            if rest[2:] == ["rollback"] and method == "POST":
                self._allow(params, {"start"})
                args = ["--start", "1"] if self._bool(params, "start") else []
                return self._task(node, "vzrollback", vmid, user, ["rollback", str(vmid), name, *args])
            if rest[2:] == ["config"] and method == "GET":
                _, _, snaps, _ = self._conf(node, vmid)
                if name not in snaps:
                    raise HttpError(500, f"snapshot '{name}' does not exist")
                return snaps[name]
        raise HttpError(501, f"Method '{method} /nodes/{node.name}/lxc/{vmid}/{'/'.join(rest)}' not implemented")

    # --- tasks

    def _task(self, node: NodeInfo, kind: str, vmid: int, user: str, argv: list[str]) -> str:
        """Start pct in the background and answer its UPID at once (as PVE's fork_worker does)."""
        env = {"PATH": PVE_PATH, "PVE_NODE": node.name, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([str(node.pct), *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
        start = int(time.time())
        upid = f"UPID:{node.name}:{proc.pid:08X}:{_pstart(proc.pid):08X}:{start:08X}:{kind}:{vmid}:{user}:"
        task = Task(upid, node.name, proc.pid, _pstart(proc.pid), start, kind, str(vmid), user)
        with self.lock:
            self.tasks[upid] = task

        def finish() -> None:
            out, err = proc.communicate()
            lines = [ln for ln in (out + err).decode(errors="replace").splitlines() if ln.strip()]
            if proc.returncode == 0:
                status = "OK"
            else:
                # PVE: chomp, newlines to spaces; the task log ends in `TASK ERROR: <that>`
                text = " ".join(ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip())
                status = text or f"command '{' '.join(['pct', *argv])}' failed: exit code {proc.returncode}"
            with self.lock:
                task.log = [*lines, "TASK OK" if status == "OK" else f"TASK ERROR: {status}"]
                task.exitstatus = status
                task.status = "stopped"

        threading.Thread(target=finish, name=f"task-{kind}-{vmid}", daemon=True).start()
        return upid

    def _tasks(self, node: NodeInfo, method: str, upid: str, rest: list[str], params: dict[str, str]) -> Any:
        if not re.fullmatch(r"UPID:[^:]+:[0-9A-F]{8}:[0-9A-F]{8,9}:[0-9A-F]{8}:[^:]*:[^:]*:[^:]+:", upid):
            raise HttpError(500, f"unable to parse worker upid '{upid}'")
        with self.lock:
            task = self.tasks.get(upid)
            if task is None or task.node != node.name:
                raise HttpError(500, f"no such task '{upid}'")
            if rest == ["status"] and method == "GET":
                return task.to_json()
            if rest == ["log"] and method == "GET":
                return [{"n": i + 1, "t": line} for i, line in enumerate(task.log)]
        raise HttpError(501, f"Method '{method} /nodes/{node.name}/tasks/{upid}/{'/'.join(rest)}' not implemented")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "pve-api-daemon/3.0"
    api: PveApi  # set on the class by serve()

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write("%s %s\n" % (self.address_string(), format % args))  # noqa: UP031

    def _params(self) -> dict[str, str]:
        url = urllib.parse.urlsplit(self.path)
        params = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            body = self.rfile.read(length).decode()
            if (self.headers.get("Content-Type") or "").startswith("application/json"):
                params.update({k: str(int(v) if isinstance(v, bool) else v) for k, v in json.loads(body).items()})
            else:
                params.update(dict(urllib.parse.parse_qsl(body, keep_blank_values=True)))
        return params

    def _answer(self, code: int, reason: str | None, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code, reason)
        self.send_header("Content-Type", "application/json;charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=0")
        self.end_headers()
        self.wfile.write(body)

    def _dispatch(self, method: str) -> None:
        try:
            params = self._params()
            user = self.api.check_auth(self.headers.get("Authorization"))
            data = self.api.handle(method, urllib.parse.urlsplit(self.path).path, params, user)
            self._answer(200, None, {"data": data})
        except HttpError as e:
            reason = e.message.splitlines()[0] if e.message else "error"
            doc: dict[str, Any] = {"data": None}
            if e.errors:
                doc["errors"] = e.errors
            elif e.code >= 500:
                doc["message"] = e.message if e.message.endswith("\n") else e.message + "\n"
            self._answer(e.code, reason.encode("latin-1", "replace").decode("latin-1"), doc)
        except Exception as e:  # a bug here must still answer (and show in api.log)
            traceback.print_exc()
            self._answer(500, f"internal error: {type(e).__name__}", {"data": None})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")


class TlsServer(ThreadingHTTPServer):
    """TLS handshakes happen in the request thread, so a client that hangs up mid-handshake (one that does
    not trust our CA) never blocks accept()."""

    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, addr: tuple[str, int], context: ssl.SSLContext) -> None:
        self.context = context
        super().__init__(addr, Handler)

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        return self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ssl.SSLError, ConnectionError, TimeoutError)):
            sys.stderr.write(f"{client_address[0]} connection ended: {exc}\n")
            return
        super().handle_error(request, client_address)


def serve(base: Path, address: str, first_port: int) -> None:
    d = base / "api"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(d / "server.pem", d / "server.key")
    token = json.loads((d / "token.json").read_text())
    Handler.api = PveApi(base, token["id"], token["secret"], d / "auth_delay")
    server = None
    for port in range(first_port, first_port + 200):
        try:
            server = TlsServer((address, port), ctx)
            break
        except OSError:
            continue
    if server is None:
        raise SystemExit(f"no free port from {first_port} on {address}")
    port = server.server_address[1]
    info = {"url": f"https://{address}:{port}", "address": address, "port": port, "ca": str(d / "ca.pem"),
            "token_id": token["id"], "token_secret": token["secret"], "pid": os.getpid()}
    tmp = d / "api.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, d / "api.json")
    server.serve_forever(poll_interval=0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.pvehost.api", description="serve the test host's PVE API")
    ap.add_argument("--base", required=True)
    ap.add_argument("--address", default=API_ADDRESS)
    ap.add_argument("--port", type=int, default=API_PORT)
    args = ap.parse_args(argv)
    socket.setdefaulttimeout(60)  # a client that never finishes its handshake frees its thread eventually
    serve(Path(args.base).resolve(), args.address, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
