"""Deploy: pin -> plan -> push -> verify -> record, for one container.

Pin: every payload entry of the inventory (plain files and rendered templates) with its sha256,
size and mode, plus the git commit and dirty flag of the sources. Plan: one agent call asks the
container for the hashes of every destination; only changed files travel. Apply: one agent call
receives a tar of the changed files over the exec's stdin, writes each beside its destination,
verifies it, keeps old and new versions in the container's content-addressed store, and only then
renames them into place (see controller/remote/agent.py). Plan and apply are one `sync` conversation over
one exec, whatever the file count; with a staying agent (a warm host session) they are one request, and a
second one only when something changed (a transfer over 1 MiB keeps its exec, with its progress bar).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.commands.fanout import Outcome, fanout
from controller.core.render import context, render
from controller.errors import ClobberError, CtlError, DriftError, InputError
from controller.inventory import Container, Inventory
from controller.names import check_container_path
from controller.registry import DeployRecord, Registry
from controller.remote.client import STAYING_MAX_INPUT, Agent, AgentReplyError, agent_source
from controller.settings import cache_get, cache_put, file_stamps, private_dir, private_file, state_dir
from controller.transport.base import Duplex, Transport
from controller.transport.pool import Pool

STORE = "/var/lib/ctl"  # inside the container: objects/<sha256>, deploys/<id>.json


@dataclass(frozen=True)
class PinnedFile:
    """One payload file as this deploy sends it: its bytes (rendered, for a template), hash, mode and source."""

    dest: str
    sha256: str
    size: int
    mode: str
    source: str
    kind: str  # file | template
    content: bytes = field(repr=False)


@dataclass(frozen=True)
class Manifest:
    """What a container is to hold after the deploy: its pinned files, and the commit they came from."""

    ct: str
    files: tuple[PinnedFile, ...]
    commit: str | None
    dirty: bool
    dirty_paths: tuple[str, ...]
    vars: dict[str, Any]

    def hashes(self) -> dict[str, str]:
        return {f.dest: f.sha256 for f in self.files}

    def rendered(self) -> dict[str, str]:
        return {f.dest: f.content.decode("utf-8", "replace") for f in self.files if f.kind == "template"}


@dataclass(frozen=True)
class FilePlan:
    """One file's fate in a deploy: what the container has, what it will have, and the action between."""

    dest: str
    action: str  # create | update | mode | same
    want: str
    have: str | None
    size: int


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


# --- pin -----------------------------------------------------------------------------------------


def _git_state(paths: list[Path]) -> tuple[str | None, tuple[str, ...]]:
    """(HEAD commit, sources that differ from it). A source outside any git tree counts as dirty."""
    stamps = tuple((p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else (0, -1) for p in paths)
    return _git_state_cached(tuple(paths), stamps)


@functools.lru_cache(maxsize=8)
def _git_state_cached(
    paths: tuple[Path, ...], stamps: tuple[tuple[int, int], ...]
) -> tuple[str | None, tuple[str, ...]]:
    """Asked once for the containers of one deploy (same sources, same stamps); an edit changes the key."""
    del stamps  # part of the cache key only
    if not paths:
        return None, ()
    top_dir = paths[0].parent
    try:
        top = subprocess.run(["git", "-C", str(top_dir), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return None, tuple(str(p) for p in paths)
    if top.returncode != 0:
        return None, tuple(str(p) for p in paths)
    root_s, commit = top.stdout.split()[:2]
    root = Path(root_s)
    inside = [p for p in paths if p.resolve().is_relative_to(root)]
    outside = [str(p) for p in paths if not p.resolve().is_relative_to(root)]
    st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", *[str(p.resolve()) for p in inside]],
                        capture_output=True, text=True, check=False)
    dirty = [line[3:] for line in st.stdout.splitlines() if line.strip()]
    return commit, tuple(dirty + outside)


RENDER_CACHE_KEEP = 256  # renderings kept in STATE/render (a few KB each); the oldest go first


@functools.cache
def _renderer_id() -> bytes:
    """What a rendering depends on besides template and context: ctl's renderer (its source) and Jinja2."""
    from controller.core import render as module

    return hashlib.sha256(Path(module.__file__ or "").read_bytes()
                          + file_stamps(packages=("jinja2",))).digest()


def rendered(src: Path, ctx: dict[str, Any], name: str) -> bytes:
    """`render(src, ctx)`, kept in the state directory under the hash of everything it depends on (the template,
    the context in its own order and types, the renderer and Jinja2): a deploy or launch whose template and
    variables did not change neither imports nor runs Jinja2, a sixth of a command's start-up. Each entry holds
    the rendering's sha256 and is used only when it matches (a file cut short by a crash is rendered again).
    The cache is private (0700/0600): a rendering may hold the inventory's variables."""
    try:
        source = src.read_bytes()
    except OSError:
        return render(src, ctx, display_name=name)  # which says what is wrong with the template
    key = hashlib.sha256(b"\0".join([_renderer_id(), source, repr(ctx).encode()])).hexdigest()
    hit = cache_get("render", key)
    if hit is not None:
        return hit
    content = render(src, ctx, display_name=name)
    cache_put("render", key, content, RENDER_CACHE_KEEP)  # a read-only or full state directory: rendered again
    return content


def pin(inv: Inventory, ct: Container) -> Manifest:
    ctx = context(inv, ct)
    files: list[PinnedFile] = []
    sources: list[Path] = []
    for i, entry in enumerate(inv.model.payload):
        where = f"{inv.path}: payload[{i}]"
        try:
            dest = check_container_path(entry.dest, "dest", tuple(ct.spec.allowed_paths))
        except InputError as e:
            raise InputError(f"{where}: {e.message}") from None
        src = (inv.base_dir / entry.source)
        sources.append(src)
        if entry.template is not None:
            content = rendered(src, ctx, entry.source)
            kind = "template"
        else:
            try:
                content = src.read_bytes()
            except FileNotFoundError:
                raise InputError(f"{where}: source file {entry.source} not found (in {inv.base_dir})") from None
            except IsADirectoryError:
                raise InputError(f"{where}: source {entry.source} is a directory; list files one by one") from None
            kind = "file"
        files.append(PinnedFile(dest, hashlib.sha256(content).hexdigest(), len(content), entry.mode,
                                entry.source, kind, content))
    dests = [f.dest for f in files]
    dup = {d for d in dests if dests.count(d) > 1}
    if dup:
        raise InputError(f"{inv.path}: payload: destination {sorted(dup)[0]} is listed twice")
    commit, dirty = _git_state(sources)
    safe_vars = json.loads(json.dumps(ctx, default=str))
    return Manifest(ct.name, tuple(files), commit, bool(dirty), dirty, safe_vars)


# --- plan ----------------------------------------------------------------------------------------


def remote_hashes(t: Transport, dests: list[str], follow: list[str] | None = None
                  ) -> dict[str, dict[str, Any] | None]:
    """sha256/size/mode of each destination, walked without following symlinks except under `follow`."""
    agent = Agent(t)
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


class _Opening:
    """The way to the container's agent, opened on a thread of its own while pinning runs here: with a staying
    agent (Transport.keeps_agents) a `hello` request that starts it, else the exec of the `sync` conversation.
    session() waits for it (and raises what it raised): the Duplex, or None for the staying agent."""

    def __init__(self, t: Transport, agent: Agent, argv: list[str]) -> None:
        self._t, self._agent, self._argv = t, agent, argv
        self._value: Duplex | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"open-{t.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._t.keeps_agents():
                self._agent.call("hello", {})
            else:
                self._value = self._t.open(self._argv)
        except BaseException as e:  # handed to session()
            self._error = e

    def session(self) -> Duplex | None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def discard(self) -> None:
        """Pinning failed: end the exec if it opened (the agent reads no source and exits); never wait on a
        connection that is still being made (the pool closes it)."""
        if self._thread.is_alive() or self._value is None:
            return
        with contextlib.suppress(CtlError):
            self._value.finish(timeout=10)


class _Conversation:
    """`sync` over one exec: the header out, the plan back, then (or not) "apply" and the tar, in one exec."""

    def __init__(self, agent: Agent, session: Duplex) -> None:
        self.agent, self.session = agent, session

    def plan(self, header: bytes) -> dict[str, Any]:
        self.session.send(agent_source() + header)
        first = Agent.json_line(self.session.readline(timeout=120))
        if first is None:
            self.agent.fail("sync", self.session.finish(timeout=30))
        return first

    def end(self) -> None:
        self.session.finish(timeout=30)  # stdin closed: the agent applies nothing

    def apply(self, data: bytes, progress: Callable[[int], None]) -> dict[str, Any]:
        step = 1 << 20
        for pos in range(0, len(data), step):
            self.session.send(data[pos:pos + step])
            progress(min(pos + step, len(data)))
        return self.agent.parse("sync", self.session.finish(timeout=600))


def deploy(
    inv: Inventory, ct: Container, t: Transport, reg: Registry | None, *, dry_run: bool = False,
    allow_dirty: bool = False, progress: Progress | None = None,
) -> DeployResult:
    """One exec per container: the agent answers what it has, then receives only what changed. With a staying
    agent (a warm host session), one request instead, and a second one to apply what changed."""
    t0 = time.monotonic()
    deploy_id = _new_id()
    agent = Agent(t)
    args = (t.path(STORE), deploy_id)
    # The way to the agent does not depend on the pins: open it in the background, so that the SSH handshake and
    # the host's start of pct + agent overlap with pinning (templates, hashes, git state) here.
    opening = _Opening(t, agent, agent.argv("sync", args))
    try:
        manifest = pin(inv, ct)
        if manifest.dirty and not allow_dirty and not dry_run:
            shown = ", ".join(manifest.dirty_paths[:3]) + (" ..." if len(manifest.dirty_paths) > 3 else "")
            raise DriftError(
                f"{ct.name}: payload sources differ from git HEAD ({shown}); commit them, or pass --allow-dirty "
                "(the deploy record will say so)"
            )
    except BaseException:
        opening.discard()
        raise
    entries = [{"index": i, "dest": f.dest, "sha256": f.sha256, "mode": f.mode, "size": f.size}
               for i, f in enumerate(manifest.files)]
    session = opening.session()
    conv = None if session is None else _Conversation(agent, session)
    follow = list(ct.spec.follow_symlinks)
    header = json.dumps({"files": entries, "dry_run": dry_run, "follow": follow}).encode() + b"\n"
    first = agent.sync(args, header)[0] if conv is None else conv.plan(header)
    have = checked_hashes(agent.need(first, "have"), ct.name)
    try:
        fplan = [_file_plan(f, have.get(f.dest), ct.name) for f in manifest.files]
    except CtlError:
        if conv is not None:
            with contextlib.suppress(CtlError):
                conv.end()
        raise
    changed = [(e, f) for e, f, p in zip(entries, manifest.files, fplan, strict=True) if p.action != "same"]
    bodies = [f.content for _e, f in changed]
    tar = bundle([e for e, _f in changed], bodies, manifest=False) if changed else b""  # (tarfile: only then)
    if dry_run or not changed:
        if conv is not None:
            conv.end()
        commands: tuple[str, ...] = ()
        if dry_run and changed:
            # The exact exec, runnable by hand: its stdin (agent, pinned files, "apply", tar) is kept here.
            stdin_file = state_dir() / "dry-run" / f"{ct.name}-{deploy_id}.stdin"
            private_dir(stdin_file.parent.parent)
            private_dir(stdin_file.parent)
            header = json.dumps({"files": entries, "dry_run": False, "follow": follow}).encode() + b"\n"
            private_file(stdin_file).write_bytes(agent_source() + header + b"apply\n" + tar)  # rendered scripts: 0600
            commands = (f"{agent.shell_line('sync', *args)} < {shlex.quote(str(stdin_file))}",)
        return DeployResult(ct.name, tuple(fplan), None, time.monotonic() - t0, 0, commands=commands,
                            dry_run=dry_run)
    data = b"apply\n" + tar

    def sent(n: int) -> None:
        if progress is not None:
            progress(ct.name, n, len(data))

    again = first  # the plan the agent applies by: made again when plan and apply are two requests
    if conv is None and len(tar) > STAYING_MAX_INPUT:  # a large transfer: an exec of its own, with progress
        conv = _Conversation(agent, t.open(agent.argv("sync", args)))
        again = conv.plan(header)
    if conv is None:
        again, doc = agent.sync(args, header, tar, timeout=600)
        sent(len(data))
    else:
        doc = conv.apply(data, sent)
    need = again.get("need")
    want = {i for i, p in enumerate(fplan) if p.action != "same"}  # the indices of `changed`
    moved: list[int] = sorted({i for i in need if isinstance(i, int)} ^ want) if isinstance(need, list) else []
    prev_modes = {r["dest"]: r.get("previous_mode") for r in doc.get("files", [])}
    files = [{"dest": p.dest, "sha256": p.want, "mode": f.mode, "previous": p.have, "action": p.action,
              "previous_mode": prev_modes.get(p.dest)} for f, p in zip(manifest.files, fplan, strict=True)]
    ok = bool(doc.get("ok"))
    partial = not ok and bool(doc.get("partial"))
    if partial:  # what stays replaced, and only that: `ctl deploy --rollback` restores it
        replaced = set(doc.get("replaced") or [])
        files = [f for f in files if f["dest"] in replaced]
    if reg is not None:
        reg.add_deploy(DeployRecord(deploy_id, ct.name, "partial" if partial else "deploy", time.time(),
                                    manifest.commit, manifest.dirty, ok, files, doc.get("error")))
    if not ok and moved and not partial:
        shown = ", ".join(str(entries[i]["dest"]) for i in moved if 0 <= i < len(entries))
        raise DriftError(f"{ct.name}: files in the container changed while this deploy ran ({shown or '?'}); "
                         "nothing was replaced", hint="run the deploy again (`ctl deploy --check` shows drift)")
    if not ok:
        raise agent.error(doc, suffix=_failure_suffix(doc, deploy_id))
    return DeployResult(ct.name, tuple(fplan), deploy_id, time.monotonic() - t0, sum(len(b) for b in bodies))


def _failure_suffix(doc: dict[str, Any], deploy_id: str) -> str:
    """What a failed apply left: nothing replaced, or exactly the files that stay replaced (partial)."""
    if not doc.get("partial"):
        return "; nothing was replaced"
    names = ", ".join(str(d) for d in doc.get("replaced") or [])
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
    return FilePlan(f.dest, action, f.sha256, h["sha256"] if h else None, f.size)


def check(inv: Inventory, ct: Container, t: Transport, reg: Registry | None) -> list[FilePlan]:
    """Drift: container files against the last successful deploy (or the pins if none). Fixes nothing."""
    last = reg.deploys(ct.name, limit=1) if reg is not None else []
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
    history = [d for d in reg.deploys(ct.name, ok_only=False, limit=50) if d.ok or d.kind == "partial"][:1]
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
    have = remote_hashes(t, [f["dest"] for f in restore], follow)
    drifted = [f["dest"] for f in restore if (have.get(f["dest"]) or {}).get("sha256") != f["sha256"]]
    if drifted:
        raise DriftError(f"{ct.name}: {', '.join(drifted)} changed since deploy {last.id}; "
                         "refusing to roll back over it (see `ctl deploy --check`)")
    deploy_id = _new_id()
    entries = [{"index": i, "dest": f["dest"], "sha256": f["previous"], "mode": f.get("previous_mode") or f["mode"],
                "from": "store"} for i, f in enumerate(restore)]
    agent = Agent(t)
    doc = agent.call("apply", (t.path(STORE), deploy_id), payload=bundle(entries, [], follow=follow), check=False)
    prev_modes = {r["dest"]: r.get("previous_mode") for r in doc.get("files", [])}
    files = [{"dest": e["dest"], "sha256": e["sha256"], "mode": e["mode"], "previous": f["sha256"],
              "action": "update", "previous_mode": prev_modes.get(e["dest"]) or f["mode"]}
             for e, f in zip(entries, restore, strict=True)]
    ok = bool(doc.get("ok"))
    partial = not ok and bool(doc.get("partial"))
    if partial:
        files = [f for f in files if f["dest"] in set(doc.get("replaced") or [])]
    reg.add_deploy(DeployRecord(deploy_id, ct.name, "partial" if partial else "rollback", time.time(),
                                last.commit_sha, last.dirty, ok, files, doc.get("error")))
    if not ok:
        raise agent.error(doc, suffix=_failure_suffix(doc, deploy_id))
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
