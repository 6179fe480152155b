"""Environment pinning: parse a probe, write and read a lock, check, diff, and plan a venv sync.

In the seeds the training venv was polluted (SGLang, flashinfer), torch was swapped between
2.11.0+cu128 and +cu130, the compile cache in /tmp was deleted, and nobody could say what changed.
`controller/farside/probe_env.py` records the environment as JSON; this module turns that into a lock,
says in one line per package what differs from it, diffs two probes, and plans a rebuild that
never touches the old venv. Pure logic: no I/O, no clock, no torch; the commands do the transport.

Lock format (a pip/uv requirements file, so `uv pip install -r LOCK` reads it as it is):

    # format: ctl-lock 1
    # python: 3.12.3                      header keys: `# key: value` before the first requirement;
    # source: ct200                       known keys: format, python, source, created, fingerprint;
    # created: 2026-05-20T10:00:00Z       other comments are free text
    # fingerprint: <sha256 of the probe the lock was made from>
    --index-url https://pypi.org/simple                      optional, at most one
    --extra-index-url https://download.pytorch.org/whl/cu130 derived from build tags (+cu130, +cpu, +rocm6.3)
    torch==2.11.0+cu130                   one exact pin per distribution, PEP 503 names, sorted
    mypkg @ https://host/mypkg-1.0-py3-none-any.whl  # version: 1.0    direct URL: version in the comment

Nothing else is accepted (no ranges, no -e, no -r): a lock pins exactly one version of everything.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from controller.errors import EnvMismatch, InputError
from controller.names import check_container_path

LOCK_FORMAT = "ctl-lock 1"
PYTORCH_INDEX = "https://download.pytorch.org/whl"

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.!_+-]*$")
_PY_VERSION = re.compile(r"^3\.\d+(?:\.\d+)?$")
_URL = re.compile(r"^(?:https?|git\+https?|git\+ssh|file)://[^\s]+$")
_INDEX_URL = re.compile(r"^https?://[^\s]+$")
# Local version tags of the PyTorch wheel index; each one is a directory of download.pytorch.org/whl.
_TORCH_TAG = re.compile(r"^(?:cu\d{3}|cpu|xpu|rocm\d+(?:\.\d+)*)$")
_HEADER = re.compile(r"^#\s*([a-z][a-z-]*)\s*:\s*(.*?)\s*$")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)$")
_DIRECT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*@\s*(\S+)$")
_HEADER_KEYS = ("format", "python", "source", "created", "fingerprint")


def normalize(name: str) -> str:
    """PEP 503 name: `Flash_Attn`, `flash.attn` and `flash-attn` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split_local(version: str) -> tuple[str, str | None]:
    """'2.11.0+cu130' -> ('2.11.0', 'cu130'): the build tag is what a cu128/cu130 swap changes."""
    base, sep, tag = version.partition("+")
    return base, (tag if sep else None)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# Probe


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_mib: int | None = None


@dataclass(frozen=True)
class TorchBuild:
    """torch as its files say (torch/version.py), which a half-finished swap can make differ from its metadata."""

    version: str | None = None
    cuda_tag: str | None = None
    cuda: str | None = None
    git_version: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class CompileCache:
    path: str | None = None
    exists: bool = False
    bytes: int | None = None
    files: int | None = None
    entries: dict[str, int | None] = field(default_factory=dict, hash=False)
    error: str | None = None


@dataclass(frozen=True)
class Provenance:
    """Where a distribution came from, as recorded in its dist-info (INSTALLER, direct_url.json)."""

    installer: str | None = None
    url: str | None = None
    editable: bool = False


@dataclass(frozen=True)
class Probe:
    """A parsed probe_env.py document. Sections the probe could not read carry their error in `errors`."""

    schema: int
    fingerprint: str
    hostname: str | None
    time_utc: str | None
    python_version: str | None  # the venv's interpreter (what training runs), else the probe's own
    venv_path: str | None
    venv_realpath: str | None
    venv_is_symlink: bool
    packages: dict[str, str] = field(hash=False)
    provenance: dict[str, Provenance] = field(hash=False)
    shadowed: dict[str, tuple[str, ...]] = field(hash=False)
    torch: TorchBuild
    driver_version: str | None
    gpus: tuple[Gpu, ...]
    cache: CompileCache
    kernel_release: str | None
    container: str | None
    errors: dict[str, str] = field(hash=False)
    raw: dict[str, Any] = field(hash=False, compare=False, repr=False)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "probe") -> Probe:
        """Parse probe output; `source` (a CT name, a file) names where a bad document came from."""
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise InputError(f"{source}: probe output is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise InputError(f"{source}: probe output is not a JSON object")
        if "error" in doc and "venv" not in doc:
            raise InputError(f"{source}: the probe failed: {doc['error']}")
        try:
            return cls._from_doc(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{source}: probe output has an unexpected shape: {exc!r}") from exc

    @classmethod
    def _from_doc(cls, doc: dict[str, Any]) -> Probe:
        errors: dict[str, str] = {}

        def section(key: str) -> dict[str, Any]:
            value = doc.get(key)
            if not isinstance(value, dict):
                errors[key] = "missing"
                return {}
            if "error" in value:
                errors[key] = str(value["error"])
            return value

        venv, torch, smi, cache, kernel, python = (
            section(k) for k in ("venv", "torch", "nvidia_smi", "compile_cache", "kernel", "python")
        )
        packages = {normalize(str(k)): str(v) for k, v in (venv.get("packages") or {}).items()}
        provenance = {
            normalize(str(k)): Provenance(
                installer=v.get("installer"), url=v.get("url"), editable=bool(v.get("editable", False))
            )
            for k, v in (venv.get("provenance") or {}).items()
        }
        shadowed = {
            normalize(str(k)): tuple(str(e.get("version")) for e in v) for k, v in (venv.get("shadowed") or {}).items()
        }
        driver = smi.get("driver_version")
        gpus = tuple(
            Gpu(int(g["index"]), str(g["name"]), str(g.get("uuid", "")), g.get("memory_total_mib"))
            for g in smi.get("gpus") or ()
        )
        fingerprint = doc.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise ValueError("no fingerprint")
        time = doc.get("time")
        return cls(
            schema=int(doc.get("schema", 0)),
            fingerprint=fingerprint,
            hostname=doc.get("hostname") if isinstance(doc.get("hostname"), str) else None,
            time_utc=time.get("utc") if isinstance(time, dict) else None,
            python_version=venv.get("python_version") or python.get("version"),
            venv_path=venv.get("path"),
            venv_realpath=venv.get("realpath"),
            venv_is_symlink=bool(venv.get("is_symlink", False)),
            packages=dict(sorted(packages.items())),
            provenance=provenance,
            shadowed=shadowed,
            torch=TorchBuild(
                version=torch.get("version"),
                cuda_tag=torch.get("cuda_tag"),
                cuda=torch.get("cuda"),
                git_version=torch.get("git_version"),
                error=torch.get("error"),
            ),
            driver_version=driver if isinstance(driver, str) else (", ".join(driver) if driver else None),
            gpus=gpus,
            cache=CompileCache(
                path=cache.get("path"),
                exists=bool(cache.get("exists", False)),
                bytes=cache.get("bytes"),
                files=cache.get("files"),
                entries=dict(cache.get("entries") or {}),
                error=cache.get("error"),
            ),
            kernel_release=kernel.get("release"),
            container=kernel.get("container"),
            errors=errors,
            raw=doc,
        )


def fingerprint(probe: Probe) -> str:
    """Recompute the probe's fingerprint (same canonical JSON as probe_env.fingerprint_parts)."""
    venv = probe.raw.get("venv") or {}
    torch = probe.raw.get("torch") or {}
    smi = probe.raw.get("nvidia_smi") or {}
    gpus = smi.get("gpus")
    parts = {
        "python": venv.get("python_version"),
        "packages": venv.get("packages"),
        "torch": {"version": torch.get("version"), "cuda_tag": torch.get("cuda_tag")},
        "driver": smi.get("driver_version"),
        "gpus": [g.get("name") for g in gpus] if isinstance(gpus, list) else None,
    }
    return _sha(json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=True))


# --------------------------------------------------------------------------------------------
# Lock


@dataclass(frozen=True)
class Pin:
    """One locked distribution; `url` only for direct references (`name @ url`)."""

    name: str
    version: str
    url: str | None = None
    line: int | None = field(default=None, compare=False)

    @property
    def build_tag(self) -> str | None:
        return split_local(self.version)[1]

    def render(self) -> str:
        if self.url:
            return f"{self.name} @ {self.url}  # version: {self.version}"
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Lock:
    """A pinned environment; `render()` and `parse()` round-trip."""

    pins: tuple[Pin, ...]
    python: str | None = None
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    source: str | None = None
    created: str | None = None
    fingerprint: str | None = None
    path: str | None = field(default=None, compare=False)

    def pin(self, name: str) -> Pin | None:
        key = normalize(name)
        return next((p for p in self.pins if p.name == key), None)

    @classmethod
    def from_probe(
        cls, probe: Probe, *, source: str | None = None, index_url: str | None = None, include_pip: bool = False
    ) -> Lock:
        """Pin everything the probed venv holds; the PyTorch index of each build tag becomes an extra index.

        pip/setuptools/wheel are left out unless `include_pip`: uv does not need them and a `--without-pip`
        venv would otherwise always show them as missing.
        """
        if "venv" in probe.errors:
            raise EnvMismatch(f"cannot lock {source or probe.hostname or 'the probe'}: venv: {probe.errors['venv']}")
        tooling = set() if include_pip else {"pip", "setuptools", "wheel"}
        pins: list[Pin] = []
        for name, version in sorted(probe.packages.items()):
            if name in tooling:
                continue
            prov = probe.provenance.get(name)
            url = prov.url if prov and prov.url and not prov.editable and not prov.url.startswith("file:") else None
            pins.append(Pin(name, version, url))
        if index_url is not None and not _INDEX_URL.fullmatch(index_url):
            raise InputError(f"index URL {index_url!r} must be an http(s) URL")
        return cls(
            pins=tuple(pins),
            python=probe.python_version,
            index_url=index_url,
            extra_index_urls=torch_indexes(pins),
            source=source or probe.hostname,
            created=probe.time_utc,
            fingerprint=probe.fingerprint,
        )

    @classmethod
    def parse(cls, text: str, path: str) -> Lock:
        """Read a lock; every error names `path:line`."""
        header: dict[str, str] = {}
        pins: dict[str, Pin] = {}
        index_url: str | None = None
        extras: list[str] = []
        body_started = False

        def fail(lineno: int, message: str) -> InputError:
            return InputError(f"{path}:{lineno}: {message}")

        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                m = _HEADER.match(line)
                if m and not body_started and m.group(1) in _HEADER_KEYS:
                    key, value = m.groups()
                    if key in header:
                        raise fail(lineno, f"header key {key!r} given twice")
                    header[key] = value
                continue
            body_started = True
            if line.startswith("-"):
                opt, _, value = line.partition(" ")
                value = value.strip()
                if opt not in ("--index-url", "--extra-index-url"):
                    raise fail(lineno, f"unsupported option {opt!r} (a lock allows --index-url, --extra-index-url)")
                if not _INDEX_URL.fullmatch(value):
                    raise fail(lineno, f"{opt} needs an http(s) URL, got {value!r}")
                if opt == "--index-url":
                    if index_url is not None:
                        raise fail(lineno, "--index-url given twice")
                    index_url = value
                elif value not in extras:
                    extras.append(value)
                continue
            pin = _parse_pin(line, lineno, fail)
            if pin.name in pins:
                raise fail(lineno, f"{pin.name} is pinned twice (first on line {pins[pin.name].line})")
            pins[pin.name] = pin
        fmt = header.get("format")
        if fmt is not None and fmt != LOCK_FORMAT:
            raise InputError(f"{path}: unsupported lock format {fmt!r} (this ctl reads {LOCK_FORMAT!r})")
        python = header.get("python")
        if python is not None and not _PY_VERSION.fullmatch(python):
            line_no = _line_of(text, "python")
            raise fail(line_no, f"python version {python!r} is not like 3.12 or 3.12.3")
        return cls(
            pins=tuple(sorted(pins.values(), key=lambda p: p.name)),
            python=python,
            index_url=index_url,
            extra_index_urls=tuple(extras),
            source=header.get("source"),
            created=header.get("created"),
            fingerprint=header.get("fingerprint"),
            path=path,
        )

    def render(self) -> str:
        lines = [f"# format: {LOCK_FORMAT}"]
        for key in ("python", "source", "created", "fingerprint"):
            value = getattr(self, key)
            if value:
                lines.append(f"# {key}: {value}")
        lines.append("# written by ctl (controller/core/envlock.py); `uv pip install --no-deps -r` installs it as is")
        if self.index_url:
            lines.append(f"--index-url {self.index_url}")
        lines.extend(f"--extra-index-url {u}" for u in self.extra_index_urls)
        lines.extend(p.render() for p in self.pins)
        return "\n".join(lines) + "\n"


def _line_of(text: str, key: str) -> int:
    for lineno, raw in enumerate(text.splitlines(), 1):
        m = _HEADER.match(raw.strip())
        if m and m.group(1) == key:
            return lineno
    return 0


def _parse_pin(line: str, lineno: int, fail: Callable[[int, str], InputError]) -> Pin:
    comment = ""
    if " #" in line:
        line, _, comment = line.partition(" #")
        line = line.strip()
    m = _PIN.fullmatch(line)
    if m:
        name, version = m.groups()
        if not _NAME.fullmatch(name) or not _VERSION.fullmatch(version):
            raise fail(lineno, f"invalid pin {line!r}")
        return Pin(normalize(name), version, None, lineno)
    m = _DIRECT.fullmatch(line)
    if m:
        name, url = m.groups()
        if not _URL.fullmatch(url):
            raise fail(lineno, f"{name}: direct reference {url!r} is not a URL")
        vm = re.search(r"version:\s*(\S+)", comment)
        if not vm or not _VERSION.fullmatch(vm.group(1)):
            raise fail(lineno, f"{name} @ URL needs its version in a comment: `# version: 1.2.3`")
        return Pin(normalize(name), vm.group(1), url, lineno)
    if re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*\s*(\[|[<>~!=])", line):
        raise fail(lineno, f"{line!r}: a lock pins exact versions: write name==version")
    raise fail(lineno, f"cannot read {line!r}: expected name==version, name @ URL, or --index-url/--extra-index-url")


def torch_indexes(pins: Iterable[Pin]) -> tuple[str, ...]:
    """PyTorch index of every build tag in the pins (torch==2.11.0+cu130 -> .../whl/cu130), sorted."""
    tags = {p.build_tag for p in pins if p.build_tag and _TORCH_TAG.fullmatch(p.build_tag) and not p.url}
    return tuple(f"{PYTORCH_INDEX}/{t}" for t in sorted(t for t in tags if t))


# --------------------------------------------------------------------------------------------
# Check

FindingKind = Literal["missing", "extra", "version", "build_tag", "python"]


@dataclass(frozen=True)
class Finding:
    """One way the environment differs from its lock, with the line a user reads."""

    kind: FindingKind
    name: str
    locked: str | None
    found: str | None
    message: str

    def __str__(self) -> str:
        return self.message


def _version_finding(name: str, locked: str, found: str, what: str = "found") -> Finding:
    lb, lt = split_local(locked)
    fb, ft = split_local(found)
    if lb == fb and lt != ft:
        msg = f"{name}: locked {locked}, {what} {found} (build tag {lt or 'none'} -> {ft or 'none'})"
        return Finding("build_tag", name, locked, found, msg)
    return Finding("version", name, locked, found, f"{name}: locked {locked}, {what} {found}")


def python_matches(locked: str, found: str) -> bool:
    """'3.12' accepts any 3.12.x; '3.12.3' only itself."""
    return found == locked or found.startswith(locked + ".")


def check(lock: Lock, probe: Probe) -> list[Finding]:
    """Every difference between lock and probe: python first, then by package name. Empty = matches."""
    if "venv" in probe.errors:
        raise EnvMismatch(f"cannot check {probe.hostname or 'the probe'}: venv: {probe.errors['venv']}")
    out: list[Finding] = []
    if lock.python and probe.python_version and not python_matches(lock.python, probe.python_version):
        out.append(
            Finding(
                "python",
                "python",
                lock.python,
                probe.python_version,
                f"python: locked {lock.python}, found {probe.python_version}",
            )
        )
    locked = {p.name: p for p in lock.pins}
    for name in sorted(set(locked) | set(probe.packages)):
        pin, found = locked.get(name), probe.packages.get(name)
        if pin is None and found is not None:
            if name in ("pip", "setuptools", "wheel"):
                continue  # installer tooling is not part of what a lock from a --without-pip venv pins
            out.append(Finding("extra", name, None, found, f"{name}: {found} installed, not in the lock"))
        elif pin is not None and found is None:
            out.append(Finding("missing", name, pin.version, None, f"{name}: locked {pin.version}, not installed"))
        elif pin is not None and found is not None and pin.version != found:
            out.append(_version_finding(name, pin.version, found))
    torch_pin = locked.get("torch")
    files = probe.torch.version
    if torch_pin and files and probe.packages.get("torch") == torch_pin.version and files != torch_pin.version:
        # metadata agrees but the files do not: a swap that did not finish
        out.append(_version_finding("torch", torch_pin.version, files, "torch/version.py says"))
    return out


def require_match(lock: Lock, probe: Probe, where: str) -> None:
    """Launch preflight: raise EnvMismatch listing the first findings, or return when the env matches."""
    findings = check(lock, probe)
    if findings:
        shown = "; ".join(f.message for f in findings[:5])
        more = f" (+{len(findings) - 5} more)" if len(findings) > 5 else ""
        raise EnvMismatch(
            f"{where}: environment differs from {lock.path or 'its lock'}: {shown}{more}",
            hint="`ctl env check` lists everything; `ctl env sync` rebuilds the venv from the lock",
        )


# --------------------------------------------------------------------------------------------
# Diff

ChangeKind = Literal["added", "removed", "changed", "python", "torch", "driver", "gpus", "cache"]


@dataclass(frozen=True)
class Change:
    """One difference between two probes (a before and an after)."""

    kind: ChangeKind
    subject: str
    before: str | None
    after: str | None
    message: str

    def __str__(self) -> str:
        return self.message


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def _cache_text(c: CompileCache) -> str:
    if c.error:
        return f"error ({c.error})"
    if not c.exists:
        return "missing"
    return f"{_mb(c.bytes)} in {c.files} files"


def diff_probes(a: Probe, b: Probe) -> list[Change]:
    """What changed from `a` to `b`: python, packages, torch build, driver, GPUs, compile cache."""
    out: list[Change] = []
    if a.python_version != b.python_version:
        out.append(
            Change(
                "python",
                "python",
                a.python_version,
                b.python_version,
                f"python: {a.python_version} -> {b.python_version}",
            )
        )
    for name in sorted(set(a.packages) | set(b.packages)):
        va, vb = a.packages.get(name), b.packages.get(name)
        if va == vb:
            continue
        if va is None:
            out.append(Change("added", name, None, vb, f"+ {name} {vb}"))
        elif vb is None:
            out.append(Change("removed", name, va, None, f"- {name} {va}"))
        else:
            ta, tb = split_local(va)[1], split_local(vb)[1]
            note = f" (build tag {ta or 'none'} -> {tb or 'none'})" if split_local(va)[0] == split_local(vb)[0] else ""
            out.append(Change("changed", name, va, vb, f"~ {name} {va} -> {vb}{note}"))
    ba = (a.torch.version, a.torch.cuda_tag)
    bb = (b.torch.version, b.torch.cuda_tag)
    if ba != bb:
        sa = f"{ba[0]} ({ba[1]})" if ba[0] else "none"
        sb = f"{bb[0]} ({bb[1]})" if bb[0] else "none"
        out.append(Change("torch", "torch build", sa, sb, f"torch build (torch/version.py): {sa} -> {sb}"))
    if a.driver_version != b.driver_version:
        out.append(
            Change(
                "driver", "driver", a.driver_version, b.driver_version,
                f"NVIDIA driver: {a.driver_version or 'none'} -> {b.driver_version or 'none'}",
            )
        )  # fmt: skip
    ga = [f"{g.index}:{g.name}:{g.uuid}" for g in a.gpus]
    gb = [f"{g.index}:{g.name}:{g.uuid}" for g in b.gpus]
    if ga != gb:
        sa, sb = _gpu_text(a.gpus), _gpu_text(b.gpus)
        out.append(Change("gpus", "gpus", sa, sb, f"GPUs: {sa} -> {sb}"))
    ca, cb = a.cache, b.cache
    if ca.path != cb.path:
        out.append(Change("cache", "cache dir", ca.path, cb.path, f"compile cache dir: {ca.path} -> {cb.path}"))
    if (ca.exists, ca.bytes, ca.files, ca.error) != (cb.exists, cb.bytes, cb.files, cb.error):
        sa, sb = _cache_text(ca), _cache_text(cb)
        out.append(Change("cache", "cache size", sa, sb, f"compile cache {cb.path}: {sa} -> {sb}"))
    return out


def _gpu_text(gpus: tuple[Gpu, ...]) -> str:
    if not gpus:
        return "none"
    names: dict[str, int] = {}
    for g in gpus:
        names[g.name] = names.get(g.name, 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in names.items()) + f" [{','.join(g.uuid[-8:] for g in gpus)}]"


# --------------------------------------------------------------------------------------------
# Sync

_UV = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class SyncPlan:
    """Argv lists, in order: `guard`, `build`; then the caller probes the new venv, and only when
    `check(lock, probe)` is empty runs `switch`. Nothing removes the old venv."""

    guard: tuple[tuple[str, ...], ...]
    build: tuple[tuple[str, ...], ...]
    switch: tuple[tuple[str, ...], ...]
    lock_path: str
    new_venv_dir: str


def switch_commands(link: str, target: str) -> list[list[str]]:
    """Point `link` at `target` atomically: a symlink under a temporary name, then rename(2) over `link`.

    `mv -T` refuses to replace a real directory, so a venv that is not yet a symlink is left untouched
    (the command fails) rather than replaced.
    """
    link = check_container_path(link, "venv link")
    target = check_container_path(target, "venv directory")
    tmp = posixpath.join(posixpath.dirname(link), f".{posixpath.basename(link)}.ctl-switch")
    return [["ln", "-sfn", target, tmp], ["mv", "-T", tmp, link]]


def sync_plan(
    lock: Lock,
    venv_dir: str,
    new_venv_dir: str,
    python: str | None = None,
    *,
    lock_path: str | None = None,
    uv: str = "uv",
) -> SyncPlan:
    """Build `new_venv_dir` from the lock with uv beside the old venv, verify it, then switch `venv_dir` to it.

    `venv_dir` is the path training uses (a symlink after the first sync); `lock_path` is where the caller
    has put `lock.render()` in the container (default: beside the new venv). `python` is a version
    (default: the lock's) or an absolute interpreter path.
    """
    link = check_container_path(venv_dir, "venv path")
    new = check_container_path(new_venv_dir, "new venv path")
    if link == "/" or new == "/":
        raise InputError("a venv cannot be /")
    if link == new or new.startswith(link + "/") or link.startswith(new + "/"):
        raise InputError(f"new venv {new} must be beside {link}, not the same path or inside it")
    lock_file = check_container_path(lock_path or f"{new}.lock", "lock path")
    if lock_file == new or lock_file.startswith(new + "/"):
        raise InputError(f"lock path {lock_file} must not be inside the new venv {new} (uv creates that directory)")
    interpreter = _check_python(python, lock)
    if not (_UV.fullmatch(uv) or uv.startswith("/")):
        raise InputError(f"uv {uv!r} must be a command name or an absolute path")
    if uv.startswith("/"):
        uv = check_container_path(uv, "uv path")
    if not lock.pins:
        raise InputError(f"lock {lock.path or '(unsaved)'} pins nothing: refusing to build an empty venv")

    new_python = posixpath.join(new, "bin", "python")
    install = [uv, "pip", "install", "--python", new_python, "--no-deps"]
    if lock.index_url:
        install += ["--index-url", lock.index_url]
    for url in lock.extra_index_urls:
        install += ["--extra-index-url", url]
    if lock.extra_index_urls:
        # uv's default takes a name from the first index that has it; download.pytorch.org also serves
        # numpy, jinja2, nvidia-* ... so an exact pin must be looked up in every index.
        install += ["--index-strategy", "unsafe-best-match"]
    install += ["-r", lock_file]
    return SyncPlan(
        guard=(("test", "!", "-e", new), ("test", "-f", lock_file)),
        build=(tuple([uv, "venv", "--python", interpreter, new]), tuple(install)),
        switch=tuple(tuple(c) for c in switch_commands(link, new)),
        lock_path=lock_file,
        new_venv_dir=new,
    )


def _check_python(python: str | None, lock: Lock) -> str:
    if python is None:
        if not lock.python:
            raise InputError("the lock names no python version: pass one (e.g. 3.12) or an interpreter path")
        return lock.python
    if python.startswith("/"):
        return check_container_path(python, "python interpreter")
    if not _PY_VERSION.fullmatch(python):
        raise InputError(f"python {python!r} must be a version like 3.12 / 3.12.3 or an absolute interpreter path")
    if lock.python and not (python_matches(python, lock.python) or python_matches(lock.python, python)):
        raise InputError(f"python {python} does not match the lock's python {lock.python}")
    return python
