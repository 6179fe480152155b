"""The Proxmox VE REST API, through proxmoxer's https backend. The only module that imports proxmoxer.

Why a wrapper: proxmoxer hands back raw dicts, disables urllib3's TLS warnings globally, returns a UPID
for a task that may still fail, and lets requests/HTTP errors through as they are. Here:

- the token secret comes only from the environment variable the inventory names (`token_secret_env`),
  never from the inventory or argv, and never appears in a message;
- TLS is verified against `ca_file` (or the system CAs); `verify: false` works but warns on stderr every
  time an API client is made, because proxmoxer would otherwise stay silent about it;
- every POST/DELETE waits for its UPID task and raises `PveFailure` (an ApiError, exit 30) with the
  task's exitstatus unless it is `OK` or `WARNINGS: N`;
- each transport failure becomes one line: refused token (401), unreachable, untrusted certificate.

proxmoxer and requests are imported when the first request is made, so `ctl --help` stays fast.
"""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from controller.errors import ApiError, ConnectionFailed, InputError
from controller.inventory import ApiSpec, HostSpec

TASK_TIMEOUT = 600.0  # seconds a snapshot/rollback task may take before we stop waiting (it keeps running)
_OK = re.compile(r"^(OK|WARNINGS: \d+)$")


class PveFailure(ApiError):
    """PVE refused an operation or its task failed. `detail` is PVE's own text (task exitstatus, or the
    reason phrase of an HTTP 500), the same text `pct` prints for the same failure."""

    def __init__(self, message: str, *, detail: str, upid: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail
        self.upid = upid


@dataclass(frozen=True)
class Snapshot:
    name: str
    description: str = ""
    snaptime: int | None = None
    parent: str | None = None
    current: bool = False  # the running state derives from this snapshot ("You are here!" hangs below it)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TaskOutcome:
    """A finished task: its UPID (None through pct, which runs it in the foreground) and exitstatus."""

    upid: str | None
    exitstatus: str
    seconds: float


def snapshots_from_api(items: list[dict[str, Any]]) -> list[Snapshot]:
    here = next((i.get("parent") for i in items if i.get("name") == "current"), None)
    out = []
    for i in items:
        name = str(i.get("name", ""))
        if name == "current" or not name:
            continue
        snaptime = i.get("snaptime")
        out.append(Snapshot(name=name, description=str(i.get("description") or "").strip(),
                            snaptime=int(snaptime) if snaptime is not None else None,
                            parent=i.get("parent"), current=name == here))
    return sorted(out, key=lambda s: (s.snaptime or 0, s.name))


def task_ok(exitstatus: str | None) -> bool:
    return exitstatus is not None and bool(_OK.fullmatch(exitstatus))


class PveApi:
    """A client for one host's `api:` section. Requests go to `spec.node`; tasks are awaited."""

    via = "api"

    def __init__(
        self,
        host: HostSpec | ApiSpec,
        *,
        base_dir: Path | None = None,
        environ: Mapping[str, str] | None = None,
        task_timeout: float = TASK_TIMEOUT,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        spec = host.api if isinstance(host, HostSpec) else host
        if spec is None:
            raise InputError("this host has no `api:` section in the inventory")
        self.spec = spec
        self.url = spec.url
        self.node = spec.node
        self.task_timeout = task_timeout
        env = os.environ if environ is None else environ
        secret = env.get(spec.token_secret_env, "")
        if not secret:
            raise InputError(
                f"environment variable {spec.token_secret_env} is not set: it must hold the secret of API token "
                f"{spec.token_id} for {spec.url} (never put the secret in the inventory or on the command line)")
        self._secret = secret
        self.ca_file: str | None = None
        self._verify: bool | str = True
        if not spec.verify:
            self._verify = False
            (warn or _stderr)(f"ctl: warning: TLS certificate of {spec.url} is NOT verified (api.verify: false): "
                              f"anyone on the path can read the token {spec.token_id}")
        elif spec.ca_file:
            ca = Path(os.path.expanduser(spec.ca_file))
            if not ca.is_absolute() and base_dir is not None:
                ca = base_dir / ca
            if not ca.is_file():
                raise InputError(f"api.ca_file {ca} does not exist (the CA that signed {spec.url}'s certificate)")
            self.ca_file = str(ca)
            self._verify = str(ca)
        self._prox: Any = None

    def __repr__(self) -> str:  # never the secret
        return f"PveApi({self.url}, node={self.node}, token={self.spec.token_id})"

    # --- plumbing ---------------------------------------------------------------------------------

    def _api(self) -> Any:
        if self._prox is None:
            from proxmoxer import ProxmoxAPI

            u = urllib.parse.urlsplit(self.url)
            user, _, token_name = self.spec.token_id.partition("!")
            prefix = u.path.strip("/") or None
            self._prox = ProxmoxAPI(u.hostname, port=u.port or 8006, path_prefix=prefix, backend="https",
                                    user=user, token_name=token_name, token_value=self._secret,
                                    verify_ssl=self._verify, timeout=self.spec.timeout)
        return self._prox

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """One line per failure: the caller's `what` names the request."""
        import requests
        from proxmoxer import ResourceException

        try:
            yield
        except ResourceException as e:
            reason = str(e.content or e.status_message or "").strip()
            if e.status_code == 401:
                raise ConnectionFailed(
                    f"PVE API at {self.url} refused the token {self.spec.token_id} (401): "
                    f"check {self.spec.token_secret_env}") from None
            if e.status_code == 403:
                raise ApiError(f"PVE API at {self.url}: {what}: permission denied for token "
                               f"{self.spec.token_id} (403): {reason}") from None
            if e.status_code == 400:
                errs = e.errors if isinstance(e.errors, dict) else {}
                detail = "; ".join(f"{k}: {v}" for k, v in errs.items()) or reason
                raise PveFailure(f"PVE API at {self.url}: {what}: {reason} ({detail})", detail=detail) from None
            raise PveFailure(f"PVE API at {self.url}: {what}: {reason} ({e.status_code})", detail=reason) from None
        except requests.exceptions.SSLError as e:
            text = str(e)
            m = re.search(r"certificate verify failed: (.+?)\s*\(_ssl", text)
            if m or "CERTIFICATE_VERIFY_FAILED" in text:
                why = m.group(1) if m else "certificate verify failed"
                trust = self.ca_file or "the system CA store"
                raise ConnectionFailed(f"TLS certificate of {self.url} is not trusted by {trust} ({why})") from None
            raise ConnectionFailed(f"TLS with {self.url} failed: {_short(text)}") from None
        except requests.exceptions.ConnectTimeout:
            raise ConnectionFailed(f"cannot reach {self.url}: no answer within {self.spec.timeout:g}s "
                                   "(api.timeout)") from None
        except requests.exceptions.Timeout:
            raise ConnectionFailed(f"PVE API at {self.url}: {what}: no answer within {self.spec.timeout:g}s "
                                   "(api.timeout)") from None
        except requests.exceptions.ConnectionError as e:
            text = str(e)
            if "Connection refused" in text or "Errno 111" in text:
                why = "connection refused"
            elif "Name or service not known" in text or "Temporary failure in name resolution" in text:
                why = "host name not resolved"
            elif "No route to host" in text or "Network is unreachable" in text:
                why = "no route to host"
            elif "RemoteDisconnected" in text or "Connection aborted" in text or "reset by peer" in text:
                why = "connection closed by the server"
            else:
                why = _short(text)
            raise ConnectionFailed(f"cannot reach {self.url}: {why}") from None
        except requests.exceptions.RequestException as e:
            raise ConnectionFailed(f"PVE API at {self.url}: {what}: {_short(str(e))}") from None
        except ValueError as e:  # a body that is not PVE's JSON
            raise ApiError(f"PVE API at {self.url}: {what}: unexpected answer ({e})") from None

    def _lxc(self, vmid: int) -> Any:
        return self._api().nodes(self.node).lxc(vmid)

    def _wait(self, upid: Any, what: str) -> TaskOutcome:
        """Poll tasks/{upid}/status until stopped; PveFailure unless OK or WARNINGS."""
        if not isinstance(upid, str) or not upid.startswith("UPID:"):
            raise ApiError(f"PVE API at {self.url}: {what}: expected a task id (UPID), got {upid!r}")
        t0 = time.monotonic()
        delay = 0.05
        task = self._api().nodes(upid.split(":")[1]).tasks(upid).status
        while True:
            with self._errors(f"status of task {upid}"):
                st = task.get()
            if st.get("status") == "stopped":
                exitstatus = str(st.get("exitstatus") or "unknown")
                if not task_ok(exitstatus):
                    raise PveFailure(f"{what} on {self.node}: task failed: {exitstatus}", detail=exitstatus,
                                     upid=upid)
                return TaskOutcome(upid, exitstatus, time.monotonic() - t0)
            if time.monotonic() - t0 > self.task_timeout:
                raise ApiError(f"{what} on {self.node}: task {upid} still running after {self.task_timeout:g}s; "
                               "it goes on in the background (see the task log in the PVE web UI)")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    # --- operations -------------------------------------------------------------------------------

    def version(self) -> dict[str, Any]:
        with self._errors("GET /version"):
            result: dict[str, Any] = self._api().version.get()
        return result

    def cluster_status(self) -> list[dict[str, Any]]:
        """GET /cluster/status: the `cluster` entry (if clustered) and one `node` entry per member with `ip`."""
        with self._errors("GET /cluster/status"):
            items = self._api().cluster.status.get()
        return [dict(i) for i in items or []]

    def cluster_resources(self, kind: str | None = "vm") -> list[dict[str, Any]]:
        """GET /cluster/resources?type=KIND: every guest of every node in one request (type=vm)."""
        with self._errors(f"GET /cluster/resources?type={kind}"):
            items = self._api().cluster.resources.get(**({"type": kind} if kind else {}))
        return [dict(i) for i in items or []]

    def lxc_config(self, node: str, vmid: int) -> dict[str, Any]:
        """GET /nodes/NODE/lxc/VMID/config: keys as PVE stores them; raw `lxc.*` lines under `lxc` as
        [key, value] pairs."""
        with self._errors(f"config of CT {vmid} on {node}"):
            doc = self._api().nodes(node).lxc(vmid).config.get()
        return dict(doc or {})

    def status(self, vmid: int) -> str:
        """running | stopped."""
        with self._errors(f"status of CT {vmid}"):
            st = self._lxc(vmid).status.current.get()
        return str(st.get("status", "unknown"))

    def list_snapshots(self, vmid: int) -> list[Snapshot]:
        with self._errors(f"snapshots of CT {vmid}"):
            items = self._lxc(vmid).snapshot.get()
        return snapshots_from_api(list(items or []))

    def snapshot(self, vmid: int, name: str, description: str | None = None) -> TaskOutcome:
        what = f"snapshot {name!r} of CT {vmid}"
        data: dict[str, Any] = {"snapname": name}
        if description:
            data["description"] = description
        with self._errors(what):
            upid = self._lxc(vmid).snapshot.post(**data)
        return self._wait(upid, what)

    def rollback(self, vmid: int, name: str, start: bool = False) -> TaskOutcome:
        what = f"rollback of CT {vmid} to {name!r}"
        with self._errors(what):
            upid = self._lxc(vmid).snapshot(name).rollback.post(**({"start": 1} if start else {}))
        return self._wait(upid, what)

    def delete_snapshot(self, vmid: int, name: str) -> TaskOutcome:
        what = f"deleting snapshot {name!r} of CT {vmid}"
        with self._errors(what):
            upid = self._lxc(vmid).snapshot(name).delete()
        return self._wait(upid, what)

    def describe(self, action: str, vmid: int, name: str | None = None, **params: Any) -> str:
        """The request an action sends (for --dry-run); no secret in it."""
        base = f"{self.url}/api2/json/nodes/{self.node}/lxc/{vmid}"
        if action == "snapshot":
            extra = "".join(f" {k}={v!r}" for k, v in params.items() if v)
            return f"POST {base}/snapshot snapname={name}{extra}"
        if action == "rollback":
            return f"POST {base}/snapshot/{name}/rollback" + (" start=1" if params.get("start") else "")
        if action == "delete":
            return f"DELETE {base}/snapshot/{name}"
        return f"GET {base}/snapshot"


def _short(text: str) -> str:
    """The innermost reason of a requests/urllib3 error chain, on one line."""
    m = re.findall(r"\(([^()]*(?:\([^()]*\))?[^()]*)\)", text)
    line = (m[-1] if m else text).strip().splitlines()
    return line[0][:200] if line else "unknown error"


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
