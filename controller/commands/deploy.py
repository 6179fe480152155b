"""Deploy: pin -> plan -> push -> verify -> record, for one container.

Pin (pins.py): what the container is to hold. Plan: one agent call asks the
container for the hashes of every destination; only changed files travel. Apply: one agent call
receives a tar of the changed files over the exec's stdin, writes each beside its destination,
verifies it, keeps old and new versions in the container's content-addressed store, and only then
renames them into place (see controller/farside/agent/). Plan and apply are one `sync` conversation over
one exec, whatever the file count; with a staying agent (a warm host session) they are one request, and a
second one only when something changed (a transfer over 1 MiB keeps its exec, with its progress bar). The
agent's client holds that conversation (remote/client.py: Sync); this module decides what travels and records it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controller.commands.fanout import Outcome, fanout
from controller.commands.pins import STORE, PinnedFile, pin
from controller.errors import ClobberError, CtlError, DriftError, InputError
from controller.inventory import Container, Inventory
from controller.registry import DeployRecord, Registry
from controller.remote.client import Agent, AgentReplyError, ApplyReply
from controller.settings import private_dir, private_file, state_dir
from controller.transport.base import Transport
from controller.transport.pool import Pool


@dataclass(frozen=True)
class FilePlan:
    """One file's fate in a deploy: what the container has, what it will have, and the action between."""

    dest: str
    action: str  # create | update | mode | same
    want: str
    have: str | None
    size: int
    mode: str = ""  # the octal mode it will have ("" where the plan does not say: a rollback's)


@dataclass(frozen=True)
class DeployResult:
    """A deploy (or rollback) that succeeded; a failure is raised as a CtlError instead."""

    ct: str
    plan: tuple[FilePlan, ...]
    deploy_id: str | None = None
    seconds: float = 0.0
    bytes_sent: int = 0
    commands: tuple[str, ...] = ()
    dry_run: bool = False
    kind: str = "deploy"

    @property
    def changed(self) -> int:
        return sum(1 for p in self.plan if p.action != "same")

    def summary(self) -> str:
        if self.dry_run:
            return f"would change {self.changed} of {len(self.plan)} files"
        if self.kind == "rollback":
            return f"rolled back {self.changed} file(s) to their previous version, verified ({self.seconds:.2f}s)"
        if self.changed == 0:
            return f"up to date ({len(self.plan)} files verified, {self.seconds:.2f}s)"
        return f"deployed {self.changed} of {len(self.plan)} files, verified ({self.seconds:.2f}s)"

    def to_json(self) -> dict[str, Any]:
        return {
            "ct": self.ct, "ok": True, "deploy_id": self.deploy_id, "seconds": round(self.seconds, 3),
            "bytes_sent": self.bytes_sent, "error": None, "dry_run": self.dry_run,
            "files": [p.__dict__ for p in self.plan], "commands": list(self.commands),
        }


# --- plan ----------------------------------------------------------------------------------------


def remote_hashes(t: Transport | Agent, dests: list[str], follow: list[str] | None = None
                  ) -> dict[str, dict[str, Any] | None]:
    """sha256/size/mode of each destination, walked without following symlinks except under `follow`."""
    agent = t if isinstance(t, Agent) else Agent.of(t)
    args = [f"--follow={json.dumps(follow)}", *dests] if follow else dests
    files: dict[str, dict[str, Any] | None] = agent.need(agent.call("hashes", args), "files")
    return checked_hashes(files, t.name)


_SHA256 = re.compile(r"[0-9a-f]{64}")


def checked_hashes(files: Any, where: str) -> dict[str, Any]:
    """The container's answer about its files, refused unless every sha256 in it is 64 lowercase hex digits:
    the hashes are printed in plans and stored as deploy records, and a container is untrusted."""
    if not isinstance(files, dict):
        raise AgentReplyError(f"{where}: the agent's file list is not a mapping")
    for dest, h in files.items():
        sha = h.get("sha256") if isinstance(h, dict) else None
        if isinstance(h, dict) and "sha256" in h and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise AgentReplyError(f"{where}: the agent answered a malformed sha256 for {dest!r}: "
                                  f"{str(h['sha256'])[:80]!r}")
    return files


# --- apply ---------------------------------------------------------------------------------------


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    import tarfile  # only when something travels: a deploy that changes nothing does not pay for it

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def bundle(entries: list[dict[str, Any]], bodies: list[bytes], *, manifest: bool = True,
           follow: list[str] | None = None) -> bytes:
    """The tar stream `apply` reads: manifest.json first (unless the agent has it already from sync's header
    line), then f<index> bodies of the entries sent "from": "tar", in order. Entries "from": "store" travel as
    manifest lines only: the agent takes their bytes from its store."""
    sent = [e for e in entries if e.get("from", "tar") == "tar"]
    members = [("manifest.json", json.dumps({"files": entries, "follow": follow or []}).encode())] if manifest else []
    return _tar(members + [(f"f{e['index']}", b) for e, b in zip(sent, bodies, strict=True)])


def _new_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + os.urandom(3).hex()


Progress = Callable[[str, int, int], None]  # (container, bytes sent, bytes total)


def deploy(
    inv: Inventory, ct: Container, t: Transport, reg: Registry | None, *, dry_run: bool = False,
    allow_dirty: bool = False, progress: Progress | None = None,
) -> DeployResult:
    """One exec per container: the agent answers what it has, then receives only what changed. With a staying
    agent (a warm host session), one request instead, and a second one to apply what changed."""
    t0 = time.monotonic()
    deploy_id = _new_id()
    agent = Agent.of(t)
    # The way to the agent does not depend on the pins: it opens in the background (Sync), so that the SSH handshake
    # and the host's start of pct + agent overlap with pinning (templates, hashes, git state) here.
    sync = agent.begin_sync(t.path(STORE), deploy_id)
    try:
        manifest = pin(inv, ct)
        if manifest.dirty and not allow_dirty and not dry_run:
            shown = ", ".join(manifest.dirty_paths[:3]) + (" ..." if len(manifest.dirty_paths) > 3 else "")
            raise DriftError(
                f"{ct.name}: payload sources differ from git HEAD ({shown}); commit them, or pass --allow-dirty "
                "(the deploy record will say so)"
            )
    except BaseException:
        sync.discard()
        raise
    entries = [{"index": i, "dest": f.dest, "sha256": f.sha256, "mode": f.mode, "size": f.size}
               for i, f in enumerate(manifest.files)]
    follow = list(ct.spec.follow_symlinks)
    header = json.dumps({"files": entries, "dry_run": dry_run, "follow": follow}).encode() + b"\n"
    first = sync.plan(header)
    checked_hashes(first.have, ct.name)
    try:
        fplan = [_file_plan(f, first.have.get(f.dest), ct.name) for f in manifest.files]
    except CtlError:
        with contextlib.suppress(CtlError):
            sync.end()
        raise
    changed = [(e, f) for e, f, p in zip(entries, manifest.files, fplan, strict=True) if p.action != "same"]
    bodies = [f.content for _e, f in changed]
    tar = bundle([e for e, _f in changed], bodies, manifest=False) if changed else b""  # (tarfile: only then)
    if dry_run or not changed:
        sync.end()
        commands: tuple[str, ...] = ()
        if dry_run and changed:
            # The exact exec, runnable by hand: its stdin (agent, pinned files, "apply", tar) is kept here.
            stdin_file = state_dir() / "dry-run" / f"{ct.name}-{deploy_id}.stdin"
            private_dir(stdin_file.parent.parent)
            private_dir(stdin_file.parent)
            header = json.dumps({"files": entries, "dry_run": False, "follow": follow}).encode() + b"\n"
            line, stdin = sync.by_hand(header, tar)
            private_file(stdin_file).write_bytes(stdin)  # rendered scripts: 0600
            commands = (f"{line} < {shlex.quote(str(stdin_file))}",)
        return DeployResult(ct.name, tuple(fplan), None, time.monotonic() - t0, 0, commands=commands,
                            dry_run=dry_run)

    def sent(n: int, of: int) -> None:
        if progress is not None:
            progress(ct.name, n, of)

    again, reply = sync.apply(header, tar, sent)
    want = {i for i, p in enumerate(fplan) if p.action != "same"}  # the indices of `changed`
    moved: list[int] = sorted(set(again.need) ^ want) if again.need is not None else []
    files = [{"dest": p.dest, "sha256": p.want, "mode": f.mode, "previous": p.have, "action": p.action,
              "previous_mode": reply.previous_modes.get(p.dest)} for f, p in zip(manifest.files, fplan, strict=True)]
    if reply.partial:  # what stays replaced, and only that: `ctl deploy --rollback` restores it
        files = [f for f in files if f["dest"] in set(reply.replaced)]
    if reg is not None:
        reg.add_deploy(DeployRecord(deploy_id, ct.key, "partial" if reply.partial else "deploy", time.time(),
                                    manifest.commit, manifest.dirty, reply.ok, files, reply.error))
    if not reply.ok and moved and not reply.partial:
        shown = ", ".join(str(entries[i]["dest"]) for i in moved if 0 <= i < len(entries))
        raise DriftError(f"{ct.name}: files in the container changed while this deploy ran ({shown or '?'}); "
                         "nothing was replaced", hint="run the deploy again (`ctl deploy --check` shows drift)")
    if not reply.ok:
        raise reply.refusal(agent, _failure_suffix(reply, deploy_id))
    return DeployResult(ct.name, tuple(fplan), deploy_id, time.monotonic() - t0, sum(len(b) for b in bodies))


def _failure_suffix(reply: ApplyReply, deploy_id: str) -> str:
    """What a failed apply left: nothing replaced, or exactly the files that stay replaced (partial)."""
    if not reply.partial:
        return "; nothing was replaced"
    names = ", ".join(str(d) for d in reply.replaced)
    return (f"; PARTIAL: {names} stay replaced (recorded as deploy {deploy_id}; "
            "`ctl deploy --rollback` restores their previous versions)")


def _file_plan(f: PinnedFile, h: dict[str, Any] | None, ct: str = "") -> FilePlan:
    if h is not None and h.get("code") == "symlink":
        raise InputError(f"{ct + ': ' if ct else ''}{f.dest}: {h['error']}; refusing to deploy through it")
    if h is not None and "error" in h:
        raise InputError(f"{f.dest} exists in the container but is {h['error']}; refusing to replace it")
    if h is None:
        action = "create"
    elif h["sha256"] != f.sha256:
        action = "update"
    elif h["mode"] != f.mode:
        action = "mode"
    else:
        action = "same"
    return FilePlan(f.dest, action, f.sha256, h["sha256"] if h else None, f.size, f.mode)


def check(inv: Inventory, ct: Container, t: Transport, reg: Registry | None) -> list[FilePlan]:
    """Drift: container files against the last successful deploy (or the pins if none). Fixes nothing."""
    last = reg.deploys(ct.key, limit=1) if reg is not None else []
    if last:
        want = {f["dest"]: (f["sha256"], f["mode"]) for f in last[0].files}
    else:
        want = {f.dest: (f.sha256, f.mode) for f in pin(inv, ct).files}
    have = remote_hashes(t, list(want), list(ct.spec.follow_symlinks))
    out = []
    for dest, (sha, mode) in want.items():
        h = have.get(dest)
        if h is None:
            out.append(FilePlan(dest, "missing", sha, None, 0))
        elif h.get("sha256") != sha:
            out.append(FilePlan(dest, "changed", sha, h.get("sha256"), h.get("size", 0)))
        elif h.get("mode") != mode:
            out.append(FilePlan(dest, "mode", sha, sha, h.get("size", 0)))
        else:
            out.append(FilePlan(dest, "same", sha, sha, h.get("size", 0)))
    return out


def rollback(ct: Container, t: Transport, reg: Registry) -> DeployResult:
    """Restore every file the last deploy replaced to its previous version, from the container's store."""
    t0 = time.monotonic()
    # The last deploy that replaced files: a complete one, or a partial one (those it left replaced); a failed
    # deploy that put everything back replaced nothing. A rollback of a rollback re-applies what it undid.
    history = [d for d in reg.deploys(ct.key, ok_only=False, limit=50) if d.ok or d.kind == "partial"][:1]
    if not history:
        raise InputError(f"{ct.name}: no deploy recorded in {reg.path}; nothing to roll back")
    last = history[0]
    restore = [f for f in last.files if f["action"] in ("update", "mode") and f["previous"]]
    kept_new = [f["dest"] for f in last.files if f["action"] == "create"]
    if not restore:
        raise ClobberError(
            f"{ct.name}: deploy {last.id} only created files ({', '.join(kept_new) or 'none'}); "
            "rolling back would mean deleting them, which ctl never does"
        )
    follow = list(ct.spec.follow_symlinks)
    agent = Agent.of(t)  # one client for the rollback's two requests
    have = remote_hashes(agent, [f["dest"] for f in restore], follow)
    drifted = [f["dest"] for f in restore if (have.get(f["dest"]) or {}).get("sha256") != f["sha256"]]
    if drifted:
        raise DriftError(f"{ct.name}: {', '.join(drifted)} changed since deploy {last.id}; "
                         "refusing to roll back over it (see `ctl deploy --check`)")
    deploy_id = _new_id()
    entries = [{"index": i, "dest": f["dest"], "sha256": f["previous"], "mode": f.get("previous_mode") or f["mode"],
                "from": "store"} for i, f in enumerate(restore)]
    reply = agent.apply(t.path(STORE), deploy_id, bundle(entries, [], follow=follow))
    files = [{"dest": e["dest"], "sha256": e["sha256"], "mode": e["mode"], "previous": f["sha256"],
              "action": "update", "previous_mode": reply.previous_modes.get(e["dest"]) or f["mode"]}
             for e, f in zip(entries, restore, strict=True)]
    if reply.partial:
        files = [f for f in files if f["dest"] in set(reply.replaced)]
    reg.add_deploy(DeployRecord(deploy_id, ct.key, "partial" if reply.partial else "rollback", time.time(),
                                last.commit_sha, last.dirty, reply.ok, files, reply.error))
    if not reply.ok:
        raise reply.refusal(agent, _failure_suffix(reply, deploy_id))
    fplan = tuple(FilePlan(e["dest"], "update", e["sha256"], f["sha256"], 0)
                  for e, f in zip(entries, restore, strict=True))
    return DeployResult(ct.name, fplan, deploy_id, time.monotonic() - t0, 0, kind="rollback")


# --- several containers (one connection per host; one exec per host through the relay) ------------


def deploy_all(inv: Inventory, pool: Pool, cts: list[Container], reg: Registry | None, *, dry_run: bool = False,
               allow_dirty: bool = False, progress: Progress | None = None) -> list[Outcome[DeployResult]]:
    return fanout(pool, cts, lambda ct, t: deploy(inv, ct, t, reg, dry_run=dry_run, allow_dirty=allow_dirty,
                                                   progress=progress))


def check_all(inv: Inventory, pool: Pool, cts: list[Container], reg: Registry | None
              ) -> list[Outcome[list[FilePlan]]]:
    return fanout(pool, cts, lambda ct, t: check(inv, ct, t, reg))


def rollback_all(pool: Pool, cts: list[Container], reg: Registry) -> list[Outcome[DeployResult]]:
    return fanout(pool, cts, lambda ct, t: rollback(ct, t, reg))
