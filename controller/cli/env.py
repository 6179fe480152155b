"""Environment and compile-cache commands (`ctl env ...`, `ctl cache ...`), registered on the main app.

Each converts options, calls controller.commands.environment / controller.commands.cache, and renders the result.
Exit codes: `env check` 11 (ENV_MISMATCH) when the container differs from its lock; `env diff` 1 when the two
environments differ; refusals to overwrite are 10 (CLOBBER); a cache of another torch build is 11.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer

from controller.cli import app as _cli
from controller.cli import names as _c
from controller.cli.app import container_argument
from controller.errors import BusyError, CtlError, ExitCode

app: typer.Typer = _cli.app
OPTS = _cli.OPTS
_console, _inv, _out, _registry, _table = _cli._console, _cli._inv, _cli._out, _cli._registry, _cli._table
_esc = _cli._esc

env_app = typer.Typer(help="The training venv against its lock: probe, check, lock, diff, sync.", no_args_is_help=True)
cache_app = typer.Typer(help="The torch.compile cache: status, save, restore, warm (nothing deletes a cache).",
                        no_args_is_help=True)
app.add_typer(env_app, name="env")
app.add_typer(cache_app, name="cache")


@contextmanager
def _container(name: str | None) -> Iterator[tuple[Any, Any, Any]]:
    with _cli._session(name) as (inv, ct, pool):
        yield inv, ct, pool.container(ct)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


# --- env -----------------------------------------------------------------------------------------


@env_app.command("probe")
def probe_cmd(container: str | None = container_argument("The container to probe.")) -> None:
    """Probe the container's venv, torch build, driver, GPUs and compile cache (one exec)."""
    from controller.commands import envprobe
    from controller.core.envlock import Probe

    with _container(container) as (inv, ct, t):
        doc = envprobe.probe_doc(inv, ct, t)
    if OPTS.json:
        _out(doc)
        return
    import json

    p = Probe.from_json(json.dumps(doc), ct.name)
    con = _console()
    gpus = ", ".join(f"{g.index}:{g.name}" for g in p.gpus) or "none"
    cache = p.cache
    cache_text = (f"{_mb(cache.bytes)} in {cache.files} files "
                  + " ".join(f"{k}={v}" for k, v in cache.entries.items())) if cache.exists else "missing"
    rows = [
        ("container", ct.label),
        ("venv", (p.venv_path or "-") + (f" -> {p.venv_realpath}" if p.venv_is_symlink else "")),
        ("python", p.python_version or "-"),
        ("torch", f"{p.torch.version} (CUDA tag {p.torch.cuda_tag}, CUDA {p.torch.cuda})" if p.torch.version
         else (p.torch.error or "not installed")),
        ("packages", str(len(p.packages))),
        ("driver", p.driver_version or "-"),
        ("gpus", f"{len(p.gpus)}: {gpus}" if p.gpus else "none"),
        ("compile cache", f"{cache.path}: {cache_text}"),
        ("fingerprint", p.fingerprint),
    ]
    for k, v in rows:
        con.print(f"{k:<14} {v}", markup=False)
    for section, err in sorted(p.errors.items()):
        con.print(f"[yellow]{_esc(section)}: {_esc(err)}[/yellow]")


@env_app.command("check")
def check_cmd(
    container: str | None = container_argument("The container to check."),
    lock: str | None = typer.Option(None, "--lock", help="Lock file (default: the container's `lock:`)."),
) -> None:
    """Compare the container's venv with its lock; exit 11 with one line per difference."""
    from controller.commands import environment

    with _container(container) as (inv, ct, t):
        res = environment.check(inv, ct, t, lock)
    if OPTS.json:
        _out(res.to_json())
    else:
        con = _console()
        if res.ok:
            con.print(f"{ct.name}: matches {res.lock_path} (fingerprint {res.fingerprint[:16]})")
        else:
            con.print(f"{ct.name}: [red]{len(res.findings)} difference(s)[/red] from {res.lock_path}:")
            for f in res.findings:
                con.print(f"  {f.kind:<9} {f.message}", markup=False)
            con.print(f"`ctl env sync {ct.name}` rebuilds the venv from the lock (the old one is kept)")
    raise typer.Exit(0 if res.ok else int(ExitCode.ENV_MISMATCH))


@env_app.command("lock")
def lock_cmd(
    container: str | None = container_argument("The container whose venv to pin."),
    output: str = typer.Option(..., "-o", "--output", help="Lock file to write, e.g. env/ct200.lock."),
    force: bool = typer.Option(False, "--force", help="Replace an existing lock file."),
) -> None:
    """Write the container's current package set as a lock (never over an existing file without --force)."""
    from controller.commands import environment

    with _container(container) as (inv, ct, t):
        res = environment.write_lock(inv, ct, t, output, force=force)
    if OPTS.json:
        _out(res.__dict__)
        return
    verb = "replaced" if res.replaced else "wrote"
    _console().print(f"{verb} {res.path}: {res.pins} pins from {ct.name} (fingerprint {res.fingerprint[:16]})")
    if not ct.spec.lock:
        _console().print(f"add `lock: {res.path}` (relative to the inventory) to {ct.name} so launches check it")


@env_app.command("diff")
def diff_cmd(
    a: str = typer.Argument(..., autocompletion=_c.run_or_container,
                            help="A container (live probe) or a run (NAME, CT/NAME, #ID)."),
    b: str = typer.Argument(..., autocompletion=_c.run_or_container, help="A container (live probe) or a run."),
) -> None:
    """What changed between two environments: a run's recorded probe and another run's, or a live container."""
    from controller.commands import environment, envprobe

    inv = _inv()
    reg = _registry()
    with _cli.session(inv) as pool:
        d = environment.diff(inv, reg, a, b, lambda ct: envprobe.probe(inv, ct, pool.container(ct)))
    if OPTS.json:
        _out(d.to_json())
    else:
        con = _console()
        fa, fb = d.fingerprints
        if d.same:
            con.print(f"{d.a} and {d.b}: same environment (fingerprint {str(fa)[:16]})", markup=False)
        else:
            con.print(f"{d.a} -> {d.b}: fingerprint {str(fa)[:16]} -> {str(fb)[:16]}", markup=False)
            for c in d.changes:
                con.print(f"  {c.message}", markup=False)
    raise typer.Exit(0 if d.same else 1)


@env_app.command("sync")
def sync_cmd(
    container: str | None = container_argument("The container whose venv to rebuild from its lock."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands; change nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before building and switching."),
    python: str | None = typer.Option(None, "--python", help="Python version or interpreter (default: the lock's)."),
    uv: str | None = typer.Option(None, "--uv", help="uv inside the container (default: PATH, ~/.local/bin/uv)."),
    lock: str | None = typer.Option(None, "--lock", help="Lock file (default: the container's `lock:`)."),
    force: bool = typer.Option(False, "--force", help="Switch although a run is live on the container."),
) -> None:
    """Build a NEW venv beside the old one from the lock (uv), verify it, then switch the venv symlink to it."""
    from controller.commands import environment, reconcile

    with _container(container) as (inv, ct, t):
        if not dry_run and not force:
            busy = reconcile.live(inv, ct, t, _registry())
            if busy:
                names = ", ".join(r.name for r in busy)
                raise BusyError(f"{ct.name}: run {names} is live; switching its venv under it would mix two "
                                f"environments in one run (stop it first: ctl stop {ct.name}/{busy[0].name}; "
                                "or --force)")
        plan = environment.sync(inv, ct, t, dry_run=True, python=python, uv=uv, lock_override=lock)
        con = _console()
        if not OPTS.json:
            con.print(plan.snapshot_hint)
            con.print(f"{ct.name}: build {plan.new_venv} from {plan.lock_path}, verify, then point {plan.venv} at it"
                      + (f" (the old {plan.old_target} is kept)" if plan.old_target else ""), markup=False)
            if plan.kept_as:
                con.print(f"  {plan.venv} is a directory: it is kept as {plan.kept_as}", markup=False)
            for s in plan.steps:
                con.print(f"  {s.what:<7} {s.line}", markup=False)
            if plan.uv is None:
                con.print(f"[yellow]uv is not installed in {ct.name}: the build step cannot run there[/yellow]")
        if dry_run:
            if OPTS.json:
                _out(plan.to_json())
            return
        if not yes:
            if not sys.stdin.isatty():
                raise CtlError("env sync changes the container: pass --yes (or --dry-run to see the commands)")
            if not typer.confirm(f"build {plan.new_venv} and switch {plan.venv} to it?", default=False):
                raise typer.Exit(1)
        res = environment.sync(inv, ct, t, python=python, uv=uv, lock_override=lock)
    if OPTS.json:
        _out(res.to_json())
    else:
        con.print(f"{ct.name}: {res.venv} -> {res.new_venv} (verified against the lock); "
                  f"previous venv kept at {res.kept_as or res.old_target or '-'}", markup=False)


# --- cache ---------------------------------------------------------------------------------------


@cache_app.command("status")
def cache_status_cmd(container: str | None = container_argument()) -> None:
    """Where the compile cache is, its size and entries, which torch build filled it, and the saved caches."""
    from controller.commands import cache

    with _container(container) as (inv, ct, t):
        st = cache.status(inv, ct, t)
    if OPTS.json:
        _out(st.to_json())
        return
    con = _console()
    if st.exists:
        ents = " ".join(f"{k}={v}" for k, v in st.entries.items())
        con.print(f"{ct.name}: {st.dir}: {_mb(st.bytes)} in {st.files} files ({ents})", markup=False)
    else:
        con.print(f"{ct.name}: {st.dir}: [yellow]no cache[/yellow] (`ctl cache warm` or `ctl cache restore`)")
    m = st.marker
    if m:
        con.print(f"  built by torch {m.torch_build or '?'} ({m.by}, {m.time_utc})", markup=False)
    elif st.exists:
        con.print("  no ctl-cache.json marker: which torch build filled it is unknown")
    if st.saved:
        _table(f"saved in {st.store}", ["name", "size", "torch", "created", "sha256"],
               [[s.name, _mb(s.bytes), s.torch_build or "?", s.created or "-", (s.sha256 or "?")[:12]]
                for s in st.saved])


@cache_app.command("save")
def cache_save_cmd(
    container: str = typer.Argument(..., autocompletion=_c.containers, help="The container."),
    name: str = typer.Argument(..., help="Name of the saved cache (never overwritten)."),
    local: str | None = typer.Option(None, "--local", help="Also pull the tarball into this local directory."),
) -> None:
    """Save the compile cache as STORE/NAME.tar.gz with a sidecar (sha256, torch build)."""
    from controller.commands import cache

    with _container(container) as (inv, ct, t):
        res = cache.save(inv, ct, t, name, local_dir=local)
    if OPTS.json:
        _out(res.to_json())
        return
    _console().print(f"{ct.name}: saved {res.path} ({_mb(res.bytes)}, {res.files} files, torch "
                     f"{res.torch_build or '?'}, sha256 {res.sha256[:12]})"
                     + (f"; copy at {res.local_path}" if res.local_path else ""), markup=False)


@cache_app.command("restore")
def cache_restore_cmd(
    container: str = typer.Argument(..., autocompletion=_c.containers, help="The container."),
    name: str = typer.Argument(..., help="A saved cache (see `ctl cache status`)."),
    force: bool = typer.Option(False, "--force", help="Restore a cache made by another torch build."),
) -> None:
    """Verify NAME's sha256 and put it in place; the current cache is moved aside (kept), never deleted."""
    from controller.commands import cache

    with _container(container) as (inv, ct, t):
        res = cache.restore(inv, ct, t, name, force=force)
    if OPTS.json:
        _out(res.to_json())
        return
    con = _console()
    con.print(f"{ct.name}: restored {name} into {res.dir} ({res.files} files, sha256 {res.sha256[:12]} verified)",
              markup=False)
    if res.aside:
        con.print(f"  the previous cache is kept at {res.aside}", markup=False)
    if res.forced and res.torch_build != res.live_torch_build:
        con.print(f"[yellow]  forced: saved by torch {_esc(res.torch_build)}, container runs "
                  f"{_esc(res.live_torch_build)}[/yellow]")


@cache_app.command("warm")
def cache_warm_cmd(
    container: str | None = container_argument(),
    gpu: list[int] = typer.Option(None, "--gpu", help="GPU to warm on (repeatable; default: the drafter GPUs)."),
) -> None:
    """Fill the compile cache with remote_payload/warmup_compile.py, ONE GPU at a time, never concurrently."""
    from controller.commands import cache

    con = _console()

    def emit(i: int, n: int, g: int | None, line: str) -> None:
        if not OPTS.json:
            con.print(f"[{i}/{n} {'GPU ' + str(g) if g is not None else 'cpu'}] {line}", markup=False)

    with _container(container) as (inv, ct, t):
        t0 = time.monotonic()
        res = cache.warm(inv, ct, t, gpus=gpu or None, emit=emit)
    if OPTS.json:
        _out(res.to_json())
        return
    con.print(f"{ct.name}: warmed {res.dir} on {len(res.steps)} GPU(s) one at a time in "
              f"{time.monotonic() - t0:.0f}s: {_mb(res.before)} -> {_mb(res.after)}, torch "
              f"{res.marker.get('torch_build')}", markup=False)
