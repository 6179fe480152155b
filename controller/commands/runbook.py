"""Runbooks' step actions: each calls, in-process, the command a `ctl` verb calls (deploy_all, env check,
launch with its environment probe, the watch loop, stop, mark-good, cache restore), over one connection
pool for the whole runbook; and `run`, which executes a runbook and records it in the registry.

Parsing, checking and sequencing live in controller/core/runbook.py; this module binds the step kinds to
what they do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from controller.commands import cache, deploy, environment, launcher, monitor, reconcile
from controller.commands.fanout import worst
from controller.commands.monitor import RunStatus
from controller.core.metrics import format_rate, parse_duration
from controller.core.runbook import Done, Result, Runbook, StepResult, execute
from controller.errors import ExitCode
from controller.inventory import Inventory
from controller.registry import Registry, RunRecord
from controller.transport.pool import Pool


class Actions:
    """The step kinds bound to the commands the CLI verbs call, sharing one pool, inventory and registry.

    `watching(text)` (from the caller) gives a callback that shows a watch step's progress, or None."""

    def __init__(self, inv: Inventory, reg: Registry, pool: Pool,
                 watching: Callable[[str], AbstractContextManager[Callable[[str], None] | None]] | None = None
                 ) -> None:
        self.inv, self.reg, self.pool, self.watching = inv, reg, pool, watching
        self.launched: dict[str, int] = {}  # run name -> registry id, so `{{ run }}` is never ambiguous

    def table(self) -> dict[str, Any]:
        return {"deploy": self.deploy, "env-check": self.env_check, "launch": self.launch, "watch": self.watch,
                "stop": self.stop, "mark-good": self.mark_good, "cache-restore": self.cache_restore}

    def _ct(self, name: str) -> tuple[Any, Any]:
        ct = self.inv.one(name)
        return ct, self.pool.container(ct)

    def _run(self, ref: str) -> RunRecord:
        return self.reg.find_run(f"#{self.launched[ref]}" if ref in self.launched else ref)

    def deploy(self, a: Mapping[str, Any], dry: bool) -> Any:
        cts = self.inv.select(a["containers"])
        results = deploy.deploy_all(self.inv, self.pool, cts, self.reg, dry_run=dry, allow_dirty=a["allow_dirty"])
        lines: list[str] = []
        for r in results:
            if dry and r.value is not None:
                lines += [f"{r.ct}: {p.action:<7} {p.dest}  {p.want[:12]}" for p in r.value.plan]
                lines += [f"{r.ct}: {c}" for c in r.value.commands]
        detail = "; ".join(f"{r.ct}: {r.value.summary()}" if r.value is not None else f"{r.ct}: FAILED {r.error}"
                           for r in results)
        return Done(detail, exit_code=worst(results), lines=tuple(lines))

    def env_check(self, a: Mapping[str, Any], dry: bool) -> Any:
        ct, t = self._ct(a["ct"])
        if dry:
            lock = a["lock"] or (f"{ct.spec.lock}" if ct.spec.lock else "its lock (none configured)")
            return Done(f"would compare {ct.name}'s environment with {lock}")
        res = environment.check(self.inv, ct, t, a["lock"])
        if res.ok:
            return Done(f"matches {res.lock_path} (fingerprint {res.fingerprint[:16]})")
        return Done(f"{len(res.findings)} difference(s) from {res.lock_path}: {res.findings[0].message}",
                    exit_code=int(ExitCode.ENV_MISMATCH), lines=tuple(f.message for f in res.findings))

    def launch(self, a: Mapping[str, Any], dry: bool) -> Any:
        if a["ct"] in self.inv.model.jobs:
            return self._launch_job(a, dry)
        ct, t = self._ct(a["ct"])
        if dry:
            name = a["run"] or launcher.next_name(self.inv, ct, t, self.reg)
            return Done(f"would launch {name} on {ct.name} (after its preflight)", sets={"run": name})
        got = launcher.launch(self.inv, ct, t, self.reg, a["run"], allow_drift=a["allow_drift"], force=a["force"],
                              allow_env_mismatch=a["allow_env_mismatch"])
        rec, checks = got.run, got.checks
        self.launched[rec.name] = rec.id
        forced = [c.name for c in checks if c.forced]
        return Done(f"{rec.name}: tmux session {rec.session}, log {rec.log_path}"
                    + (f" (forced: {', '.join(forced)})" if forced else ""), sets={"run": rec.name})

    def _launch_job(self, a: Mapping[str, Any], dry: bool) -> Any:
        """`launch: {ct: JOB}`: the run across the job's nodes, started together (or on none), as `ctl launch JOB`."""
        job = self.inv.job(a["ct"])
        if dry:
            name = a["run"] or launcher.next_job_name(self.inv, self.pool, self.reg, job.name)
            return Done(f"would launch {name} on the {job.nnodes} nodes of {job.name} (after their preflight)",
                        sets={"run": name})
        got = launcher.launch_job(self.inv, self.pool, self.reg, job.name, a["run"], allow_drift=a["allow_drift"],
                                  force=a["force"], allow_env_mismatch=a["allow_env_mismatch"])
        self.launched[got.run.name] = got.run.id
        forced = sorted({f"{node} {c.name}" for node, cs in got.checks.items() for c in cs if c.forced})
        return Done(f"{got.run.name}: {len(got.nodes)} nodes of {job.name} ({', '.join(m.ct for m in got.nodes)}), "
                    f"tmux session {got.run.session}, log {got.run.log_path} on each"
                    + (f" (forced: {', '.join(forced)})" if forced else ""), sets={"run": got.run.name})

    def watch(self, a: Mapping[str, Any], dry: bool) -> Any:
        until = " or ".join(x for x in (f"step {a['until_step']}" if a["until_step"] is not None else "",
                                        a["for"] or "") if x)
        if dry:
            return Done(f"would watch {a['run']} until {until} (slow below {a['slow_ratio']:.2f}x the baseline)")
        rec = self._run(a["run"])
        head = f"watching {rec.ct}/{rec.name} until {until}"

        def seconds(text: str) -> float:
            return parse_duration(text) or 0.0  # checked by the runbook's validators already

        with self.watching(head) if self.watching is not None else nullcontext() as show:
            def tick(st: RunStatus) -> None:
                if show is not None:
                    v = st.verdict
                    show(f"{head}: step {v.step if v.step is not None else '-'} "
                         f"{format_rate(st.last.tok_s if st.last else None)} tok/s {v.state.name}")

            st, why = monitor.watch(
                self.inv, self.reg, self.pool, rec, until_step=a["until_step"],
                limit_s=seconds(a["for"]) if a["for"] else None, for_text=a["for"], every_s=seconds(a["every"]),
                slow_ratio=a["slow_ratio"], stall_s=seconds(a["stall_after"]), checkpoints=a["checkpoints"],
                tick=tick)
        v = st.verdict
        return Done(f"{why}: {v.reason}", state=v.state.name, exit_code=int(v.exit_code))

    def stop(self, a: Mapping[str, Any], dry: bool) -> Any:
        if dry:
            return Done(f"would stop {a['run']} (SIGINT, {a['grace']:.0f}s grace, escalate)")
        rec = self._run(a["run"])
        if rec.multi:  # a run across a job's nodes: every node stopped, as `ctl stop` does
            rec = reconcile.refresh_all(self.inv, self.reg, self.pool, [rec]).runs[0]
            rec, _nodes = launcher.stop_job(self.inv, self.pool, self.reg, rec, grace=a["grace"], by_operator=True)
            return Done(f"{rec.ct}/{rec.name}: {rec.state} ({rec.note})")
        ct, t = self._ct(rec.ct)
        rec = reconcile.refresh(self.inv, ct, t, self.reg, [rec])[0]
        rec = reconcile.stop(self.inv, ct, t, self.reg, rec, grace=a["grace"], by_operator=True)
        return Done(f"{rec.ct}/{rec.name}: {rec.state} ({rec.note})")

    def mark_good(self, a: Mapping[str, Any], dry: bool) -> Any:
        if dry:
            return Done(f"would mark {a['run']} good (the baseline of later runs)")
        res = monitor.mark_good(self.inv, self.reg, self.pool, self._run(a["run"]))
        return Done(f"{res.run.ct}/{res.run.name}: marked good (baseline; {res.why})")

    def cache_restore(self, a: Mapping[str, Any], dry: bool) -> Any:
        ct, t = self._ct(a["ct"])
        if dry:
            return Done(f"would restore the compile cache {a['name']} into {ct.name} (verified; current kept aside)")
        res = cache.restore(self.inv, ct, t, a["name"], force=a["force"])
        return Done(f"restored {a['name']} into {res.dir} (sha256 {res.sha256[:12]} verified)"
                    + (f", previous kept at {res.aside}" if res.aside else ""))


def run(book: Runbook, variables: dict[str, Any], inv: Inventory, reg: Registry, pool: Pool, *, dry_run: bool,
        emit: Callable[[StepResult], None],
        watching: Callable[[str], AbstractContextManager[Callable[[str], None] | None]] | None = None
        ) -> tuple[Result, int | None]:
    """Execute the runbook; a real run is recorded (`ctl runbook history`), also when interrupted.
    Returns the result and the record's id (None for a dry run)."""
    record_id = None if dry_run else reg.start_runbook(book.name, str(book.path), book.sha256, variables)
    steps: list[StepResult] = []

    def seen(r: StepResult) -> None:
        steps.append(r)
        emit(r)

    try:
        res = execute(book, variables, Actions(inv, reg, pool, watching).table(), dry_run=dry_run, emit=seen)
    except BaseException as e:
        if record_id is not None:
            code = 130 if isinstance(e, KeyboardInterrupt) else int(getattr(e, "exit_code", 1))
            reg.finish_runbook(record_id, "interrupted", code, f"{type(e).__name__}: {e}",
                               [s.to_json() for s in steps])
        raise
    if record_id is not None:
        reg.finish_runbook(record_id, "ok" if res.ok else "failed", res.exit_code, res.message,
                           [s.to_json() for s in res.steps])
    return res, record_id
