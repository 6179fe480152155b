"""`ctl export RUN`: a run's drafter out of its container, in the reference DFlash layout (z-lab/dflash
`DFlashDraftModel`; SGLang and vLLM read the same), with what it came from written beside it.

One checkpoint scan (agent `ckptscan`: the newest complete step_N/, manifest present and every sha256 matching;
for a run across several containers, on every node: the node holding the newest is where rank 0 wrote them), then
the payload's own exporter (remote_payload/dflash_export.py, deployed with the payload) runs in that container in
the training venv: it verifies the checkpoint's manifest again, writes config.json + model.safetensors into a
fresh directory beside the run's checkpoints and answers one JSON line (each file's sha256 and size, the training
provenance, the loss and accept_len logged at that step). Both files come back over the transport's `get`, are
checked against those sha256s, and land with provenance.json in a temporary directory beside DIR that is renamed
to DIR only when all of it is there: DIR is whole or absent. The container's copy is removed afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.commands import envprobe
from controller.commands.fanout import fanout
from controller.errors import (
    ClobberError,
    CtlError,
    DiskError,
    ExitCode,
    InputError,
    RemoteCommandError,
    VerifyError,
)
from controller.files import file_sha256, replace_dir
from controller.inventory import Container, Inventory
from controller.registry import Registry, RunRecord
from controller.remote.client import Agent
from controller.settings import LONG_TIMEOUT
from controller.transport.base import Transport
from controller.transport.pool import Pool

EXPORT_SCRIPT = "dflash_export.py"
DTYPES = ("bfloat16", "float16", "float32")
FILES = ("config.json", "model.safetensors")
PROVENANCE = "provenance.json"
FORMAT = "ctl-export/1"
_SHA = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Exported:
    """One export: where it went and what it holds."""

    run: str  # CT/NAME
    run_id: int
    step: int
    node: str
    checkpoint: str
    dtype: str
    dir: str
    files: dict[str, dict[str, Any]]
    metrics: dict[str, Any] = field(default_factory=dict)
    replaced: bool = False

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def export_dest(inv: Inventory) -> str:
    """Where the payload puts dflash_export.py; a clear error when the payload has none."""
    for e in inv.model.payload:
        if posixpath.basename(e.dest) == EXPORT_SCRIPT:
            return e.dest
    raise InputError(f"{inv.path}: the payload does not deploy {EXPORT_SCRIPT}, so nothing can export the drafter: "
                     f"add `{{src: remote_payload/{EXPORT_SCRIPT}, dest: /root/{EXPORT_SCRIPT}}}` and `ctl deploy`")


def default_dir(rec: RunRecord, step: int) -> Path:
    return Path("exports") / f"{rec.name}-step{step}"


def checkpoints_dir(inv: Inventory, rec: RunRecord) -> str:
    if not rec.run_dir:
        raise InputError(f"run {rec.ct}/{rec.name} has no run directory recorded: it has no checkpoints to export")
    return inv.model.runs.checkpoints.replace("{dir}", rec.run_dir).replace("{run}", rec.name)


def nodes_of(inv: Inventory, reg: Registry, rec: RunRecord) -> list[Container]:
    return [inv.container(m.ct) for m in reg.members(rec.id)] if rec.multi else [inv.container(rec.ct)]


@dataclass(frozen=True)
class Found:
    node: str
    dir: str  # the step_N directory in that container
    step: int


def pick(rec: RunRecord, ckdir: str, scans: list[tuple[str, dict[str, Any]]], step: int | None) -> Found:
    """Which node's checkpoint to export, from each node's `ckptscan` answer: the newest complete one (rank 0 wrote
    it; other nodes hold copies at most), or step N. A run without one is one line saying what is there."""
    label = f"{rec.ct}/{rec.name}"
    best: tuple[str, dict[str, Any]] | None = None
    skipped: list[tuple[str, dict[str, Any]]] = []
    for node, doc in scans:
        found = doc.get("found")
        if isinstance(found, dict) and isinstance(found.get("step"), int) and isinstance(found.get("dir"), str) and (
                best is None or found["step"] > best[1]["step"]):
            best = (node, found)
        skipped += [(node, s) for s in doc.get("skipped") or [] if isinstance(s, dict)]
    if step is not None:
        want = f"{ckdir}/step_{step}"
        for node, s in skipped:
            if s.get("dir") == want:
                raise InputError(f"run {label}: checkpoint step {step} is not complete ({node}:{want}: "
                                 f"{s.get('why')}); `ctl export {label}` takes the newest complete one")
        if best is None:
            raise InputError(f"run {label} has no complete checkpoint in {ckdir}, so no step {step}")
        if step > best[1]["step"]:
            raise InputError(f"run {label}: no checkpoint step {step} (the newest complete one is step "
                             f"{best[1]['step']})")
        return Found(best[0], want, step)  # the exporter verifies it there (and says which steps exist if not)
    if best is None:
        if skipped:
            node, s = skipped[0]
            raise InputError(f"run {label} has no complete checkpoint in {ckdir}: {node}:{s.get('dir')}: "
                             f"{s.get('why')}")
        raise InputError(f"run {label} has no checkpoint in {ckdir} (the payload writes one every --ckpt-every "
                         "steps and at the end)")
    return Found(best[0], str(best[1]["dir"]), int(best[1]["step"]))


def exporter_argv(inv: Inventory, ct: Container, t: Transport, script: str, found: Found, ckdir: str, out: str,
                  dtype: str, metrics: str, step: int | None) -> list[str]:
    """The exporter's command line: the newest complete checkpoint by its path, or --step N of the checkpoints
    directory (the exporter then names the steps there when N is not one of them)."""
    env = envprobe.settings(inv, ct)
    python = f"{env.venv.rstrip('/')}/bin/python" if env.venv else env.python
    if python.startswith("/"):
        python = t.path(python)
    which = [t.path(found.dir)] if step is None else [t.path(ckdir), "--step", str(step)]
    return ["env", "PYTHONUNBUFFERED=1", python, t.path(script), which[0], t.path(out), *which[1:], "--dtype", dtype,
            "--metrics", t.path(metrics), "--json"]


def summary_of(ct: str, res_out: str) -> dict[str, Any]:
    """The exporter's JSON line, checked: everything later relies on its file list and sha256s."""
    lines = [x for x in res_out.strip().splitlines() if x.startswith("{")]
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("ok") is True and isinstance(doc.get("step"), int)
            and isinstance(files, dict) and sorted(files) == sorted(FILES)
            and all(isinstance(f, dict) and isinstance(f.get("sha256"), str) and _SHA.fullmatch(f["sha256"])
                    and isinstance(f.get("bytes"), int) for f in files.values())):
        raise CtlError(f"{ct}: {EXPORT_SCRIPT} answered no summary ctl can check (an older exporter? `ctl deploy`)")
    return doc


def export_run(inv: Inventory, pool: Pool, reg: Registry, rec: RunRecord, *, out: str | None = None,
               step: int | None = None, dtype: str = "bfloat16", force: bool = False) -> Exported:
    """Export `rec`'s newest complete checkpoint (or step `step`) to `out` (default ./exports/RUN-stepN)."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if step is not None and step < 0:
        raise InputError(f"--step {step}: a step is >= 0")
    label = f"{rec.ct}/{rec.name}"
    if out is not None:
        _check_dest(Path(out), force)  # before any remote work: a taken -o is known at once
    script = export_dest(inv)
    ckdir = checkpoints_dir(inv, rec)
    nodes = nodes_of(inv, reg, rec)
    scans = fanout(pool, nodes, lambda ct, t: Agent.of(t).call(
        "ckptscan", {"dirs": [{"run": rec.name, "dir": ckdir}]}, timeout=LONG_TIMEOUT))
    failed = [o for o in scans if not o.ok]
    if failed:  # a node not heard from may hold the newest checkpoint: never export an older one instead
        e = CtlError(f"run {label}: looking for its checkpoints: {failed[0].error}")
        e.exit_code = ExitCode(failed[0].exit_code) if failed[0].exit_code in ExitCode._value2member_map_ \
            else ExitCode.FAILURE
        raise e
    found = pick(rec, ckdir, [(o.ct, o.value or {}) for o in scans], step)
    dest = Path(out) if out is not None else default_dir(rec, found.step)
    _check_dest(dest, force)
    ct = inv.container(found.node)
    t = pool.container(ct)
    have = (Agent.of(t).call("hashes", [script]).get("files") or {}).get(script)
    if not isinstance(have, dict) or not isinstance(have.get("sha256"), str):
        raise InputError(f"{ct.name}: {script} is not in the container: run `ctl deploy {ct.name}` first")
    remote = f"{posixpath.dirname(ckdir.rstrip('/'))}/exports/.ctl-export-{os.urandom(8).hex()}"
    metrics = f"{rec.run_dir}/metrics.jsonl"
    argv = exporter_argv(inv, ct, t, script, found, ckdir, remote, dtype, metrics, step)
    try:
        res = t.run(argv, timeout=LONG_TIMEOUT, max_output=1 << 20)
        if res.returncode == 2 and res.err.strip().splitlines()[-1:] and \
                res.err.strip().splitlines()[-1].startswith("error: "):
            raise InputError(f"run {label}: {ct.name}: {res.err.strip().splitlines()[-1][len('error: '):]}")
        if res.returncode != 0:
            raise RemoteCommandError(t.name, argv, res.returncode, res.err, what=f"{EXPORT_SCRIPT}")
        doc = summary_of(ct.name, res.out)
        if step is not None and doc["step"] != step:
            raise VerifyError(f"{ct.name}: {EXPORT_SCRIPT} exported step {doc['step']}, not step {step}")
        provenance = {
            "format": FORMAT, "run": label, "run_id": rec.id, "step": doc["step"], "node": ct.name,
            "checkpoint": doc.get("checkpoint"), "checkpoint_sha256": doc.get("checkpoint_sha256"),
            "commit": rec.commit_sha, "dirty": rec.dirty, "payload": dict(rec.files),
            "exporter": {"path": script, "sha256": have["sha256"]},
            **{k: (doc.get("provenance") or {}).get(k) for k in ("target", "target_sha256", "tokenizer_sha256",
                                                                  "data_sha256")},
            "metrics": doc.get("metrics") or {}, "dtype": dtype, "drafter": doc.get("drafter") or {},
            "files": doc["files"], "exported": time.time(),
        }
        replaced = _land(t, remote, dest, doc["files"], provenance, force)
    finally:
        with contextlib.suppress(CtlError):  # the container's copy, whole or partial; never masks why it failed
            t.run(["rm", "-rf", "--", t.path(remote)], timeout=120)
    where = str(dest.resolve())
    reg.add_export(rec.id, step=doc["step"], dtype=dtype, node=ct.name, checkpoint=str(doc.get("checkpoint")),
                   path=where, files=doc["files"], provenance=provenance, when=provenance["exported"])
    return Exported(label, rec.id, doc["step"], ct.name, str(doc.get("checkpoint")), dtype, where, doc["files"],
                    dict(provenance["metrics"]), replaced)


def _check_dest(dest: Path, force: bool) -> None:
    if (dest.exists() or dest.is_symlink()) and not force:
        raise ClobberError(f"{dest} exists; refusing to overwrite it", hint="choose another -o or --force")
    if dest.exists() and not dest.is_dir():
        raise InputError(f"{dest} is a file, not an export directory")


def _land(t: Transport, remote: str, dest: Path, files: dict[str, dict[str, Any]], provenance: dict[str, Any],
          force: bool) -> bool:
    """Bring the files into a temporary directory beside `dest`, check them, add provenance.json, rename it to
    `dest`. Nothing of it is left when any step fails (a full disk included)."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".ctl-tmp", dir=dest.parent))
    except OSError as e:
        raise _local_error(dest, e) from None
    try:
        for name in FILES:
            t.get(f"{remote}/{name}", str(tmp / name))
            got = file_sha256(tmp / name)
            if got != files[name]["sha256"]:
                raise VerifyError(f"{t.name}: {name} arrived with sha256 {got[:16]}, the exporter wrote "
                                  f"{files[name]['sha256'][:16]}: nothing written to {dest}")
        with open(tmp / PROVENANCE, "w", encoding="utf-8") as f:
            f.write(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # noqa: S103 - an export is for serving: readable by others, as a checkout is
        if (dest.exists() or dest.is_symlink()) and not force:  # taken meanwhile (another ctl export)
            raise ClobberError(f"{dest} exists; refusing to overwrite it", hint="choose another -o or --force")
        return replace_dir(tmp, dest)
    except OSError as e:
        raise _local_error(dest, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _local_error(dest: Path, e: OSError) -> CtlError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskError(f"local disk full writing the export {dest}: nothing written there")
    return InputError(f"writing the export {dest}: {e.strerror or e}: nothing written there")
