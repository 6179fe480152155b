"""The inventory: hosts, containers, the pinned payload and run naming, validated.

A bad inventory ends in one line naming the file, the line and the key (`InventoryError`), never a
traceback. Precedence: defaults < inventory < CTL_* variables < flags (see `load`). The records are frozen
dataclasses that schema.py builds and checks (no pydantic: it cost every command 0.2 s to start).
"""

from __future__ import annotations

import hashlib
import marshal
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from controller import settings
from controller.errors import CtlError, InputError, InventoryError
from controller.names import check_container_path, check_name
from controller.schema import SchemaError, build, spec
from controller.yamlpos import dotted, line_index, nearest_line


def _https(v: str) -> str:
    if not v.startswith("https://"):
        raise ValueError("must start with https://")
    return v.rstrip("/")


def _token(v: str) -> str:
    if "@" not in v or "!" not in v:
        raise ValueError("must look like USER@REALM!TOKENID")
    return v


def _as_value_error(check: Any) -> Any:
    """A names.py check (InputError) as a field check (ValueError with the same message)."""
    def run(v: Any) -> Any:
        try:
            return check(v)
        except InputError as e:
            raise ValueError(e.message) from None
    return run


_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")  # a login name: never an option (`-oProxyCommand=...`)


def _user(v: str) -> str:
    if not isinstance(v, str) or not _USER.fullmatch(v):
        raise ValueError(f"{v!r} is not a user name (letters, digits, '_', '.', '-'; not starting with '-')")
    return v


def _host_address(v: str | None) -> str | None:
    """Where ssh connects: a host name or an IP address, whole (it reaches ssh's command line and templates)."""
    if v is not None and (not isinstance(v, str) or not _ADDRESS.fullmatch(v)):
        raise ValueError(f"{v!r} is not a host name or an IP address")
    return v


def _gpu_indices(v: list[int] | None) -> list[int] | None:
    if v is not None and any(i < 0 for i in v):
        raise ValueError("GPU indices must be >= 0")
    return v


@dataclass(frozen=True)
class ApiSpec:
    """A host's `api:` block: where its Proxmox API answers, as which token (its secret from the environment)."""

    url: str = spec(check=_https)
    node: str = spec()
    token_id: str = spec(check=_token)
    token_secret_env: str = "PVE_TOKEN"
    ca_file: str | None = None
    verify: bool = True
    timeout: float = 30.0


@dataclass(frozen=True)
class KeepaliveSpec:
    """SSH keepalives, like OpenSSH's ServerAliveInterval / ServerAliveCountMax: a probe every `interval`
    seconds (0: none); `count` unanswered in a row drop the connection (CTL_KEEPALIVE_* override)."""

    interval: float = spec(settings.DEFAULT_KEEPALIVE_INTERVAL, ge=0)
    count: int = spec(settings.DEFAULT_KEEPALIVE_COUNT, ge=1)


@dataclass(frozen=True)
class HostSpec:
    """One Proxmox host of `hosts:`: how ctl logs in over SSH and how long its session and requests may take."""

    address: str = spec(check=_host_address)
    port: int = spec(22, ge=1, le=65535)
    user: str = spec("root", check=_user)
    identity_file: str | None = None
    known_hosts: str | None = None
    pct: str = "pct"
    stage_dir: str = "/tmp"
    persist: int | None = spec(None, ge=0)  # idle seconds of the host's persistent session (0: off; unset:
    #                                         settings.DEFAULT_PERSIST); CTL_PERSIST and the config file override
    keepalive: KeepaliveSpec = spec(factory=KeepaliveSpec)
    connect_timeout: float = spec(settings.DEFAULT_CONNECT_TIMEOUT, gt=0)  # CTL_CONNECT_TIMEOUT overrides
    timeout: float = spec(settings.DEFAULT_TIMEOUT, ge=0)  # deadline of each request, 0: none; CTL_TIMEOUT overrides
    api: ApiSpec | None = None


@dataclass(frozen=True)
class GpuSplit:
    """A container's `gpus:`: which GPU indices hold the target model and which the drafter."""

    target: list[int] = spec(factory=list, check=_gpu_indices)
    drafter: list[int] = spec(factory=list, check=_gpu_indices)

    @property
    def all(self) -> list[int]:
        """Distinct GPUs in order of first use (targets first)."""
        seen: list[int] = []
        for i in [*self.target, *self.drafter]:
            if i not in seen:
                seen.append(i)
        return seen


def _mode(v: str | int) -> str:
    try:
        m = int(str(v), 8)
    except ValueError:
        raise ValueError(f"{v!r} is not an octal mode such as '0644'") from None
    if not 0 <= m <= 0o7777:
        raise ValueError(f"{v!r} is out of range")
    return f"{m:04o}"


@dataclass(frozen=True, kw_only=True)
class PayloadEntry:
    """One file of `payload:`: a source copied as is, or a template rendered, to `dest` in the container."""

    src: str | None = None
    template: str | None = None
    dest: str = spec(check=_as_value_error(lambda v: check_container_path(v, "dest")))
    mode: str | None = spec(None, check=_mode)  # None: the source's own permission bits

    def _check(self) -> None:
        if (self.src is None) == (self.template is None):
            raise ValueError("give exactly one of 'src' or 'template'")

    @property
    def source(self) -> str:
        return self.src if self.src is not None else str(self.template)


@dataclass(frozen=True)
class SuperviseSpec:
    """`runs.supervise:` the defaults of `ctl supervise` (its flags win)."""

    interval: str = "30s"
    restart: str = "no"  # no | on-failure[:N] | always[:N]
    max_restarts: int = spec(3, ge=0)  # of one lineage, when `restart` gives no :N
    backoff: str = "30s"  # before a relaunch; doubles with each restart of the lineage
    stall_after: str = "10m"
    slow_ratio: float = spec(0.8, gt=0, le=1)
    notify: list[str] = spec(factory=list)  # https://..., slack:https://..., cmd:PROGRAM
    notify_secret_env: str = "CTL_NOTIFY_SECRET"  # the variable holding the webhooks' HMAC key


def _has_run(v: str) -> str:
    if "{run}" not in v:
        raise ValueError("must contain {run} so that every run gets its own path")
    if any(ord(c) < 32 or c == "\x7f" for c in v):
        raise ValueError("must not contain control characters (newline, NUL, ...)")
    return v


@dataclass(frozen=True)
class RunsSpec:
    """`runs:`: how runs are named, which tmux session holds them, where their log and files go."""

    series: str = spec("run", check=_as_value_error(check_name))
    session: str = spec("ctl", check=_as_value_error(check_name))
    log: str = spec("/workspace/train_stdout_{run}.log", check=_has_run)
    dir: str = spec("/workspace/runs/{run}", check=_has_run)
    checkpoints: str = "{dir}/checkpoints"  # where a run's full checkpoints are (step_N/ with manifest.json)
    supervise: SuperviseSpec = spec(factory=SuperviseSpec)


_IFNAMES = re.compile(r"^\^?=?[A-Za-z0-9_.:@-]+(,\^?=?[A-Za-z0-9_.:@-]+)*$")  # NCCL's prefix list syntax
_ADDRESS = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|[0-9A-Fa-f:.]+)$")  # host name or IP


def _ifname(v: str | None) -> str | None:
    if v is not None and not _IFNAMES.fullmatch(v):
        raise ValueError(f"{v!r} is not an interface list such as 'eth0', '=eth0', '^docker,lo'")
    return v


@dataclass(frozen=True)
class NcclSpec:
    """`nccl:` on a container (or a job, for all its nodes): the variables NCCL and gloo need to pick the
    right network on a Proxmox node (docs/guides/multinode.md)."""

    socket_ifname: str | None = spec(None, check=_ifname)  # NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: eth0, =eth0
    ib_disable: bool | None = None  # NCCL_IB_DISABLE: no InfiniBand/RoCE in the container
    p2p_disable: bool | None = None  # NCCL_P2P_DISABLE: GPUs of the container cannot reach each other directly

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.socket_ifname is not None:
            out["NCCL_SOCKET_IFNAME"] = out["GLOO_SOCKET_IFNAME"] = self.socket_ifname
        if self.ib_disable is not None:
            out["NCCL_IB_DISABLE"] = "1" if self.ib_disable else "0"
        if self.p2p_disable is not None:
            out["NCCL_P2P_DISABLE"] = "1" if self.p2p_disable else "0"
        return out


def _nproc(v: int | str) -> int | str:
    if isinstance(v, int) and v < 1:
        raise ValueError("must be at least 1, or 'auto'")
    return v


@dataclass(frozen=True)
class JobSpec:
    """`jobs.NAME`: one run across several containers, started by torchrun on each with a c10d rendezvous at
    the first node's `address` and `rdzv_port`."""

    nodes: list[str] = spec(min_items=1)
    rdzv_port: int = spec(29400, ge=1, le=65535)
    nproc_per_node: int | Literal["auto"] = spec("auto", check=_nproc)  # auto: each node's GPU split
    # How long the launch preflight waits for every node to reach the rendezvous endpoint (a TCP connect)
    preflight_timeout: float = spec(10.0, gt=0, le=300)
    nccl: NcclSpec | None = None  # defaults for every node; a container's own `nccl:` keys win


def _prefixes(v: list[str]) -> list[str]:
    return [_as_value_error(lambda p: check_container_path(p, "follow_symlinks prefix"))(p) for p in v]


@dataclass(frozen=True)
class ContainerSpec:
    """One container of `containers:`: how it is reached (pct on a host, ssh or a local root), its GPUs, vars,
    env lock and baseline."""

    host: str | None = None
    vmid: int | None = spec(None, ge=100, le=999999999)
    transport: Literal["pct", "ssh", "local"] = "pct"
    # ssh transport: where ctl connects; a job's node: where the other nodes reach it
    address: str | None = spec(None, check=_host_address)
    port: int = spec(22, ge=1, le=65535)
    user: str = spec("root", check=_user)
    identity_file: str | None = None
    known_hosts: str | None = None
    root: str | None = None  # local transport: directory that stands for the container's /
    gpus: GpuSplit = spec(factory=GpuSplit)
    gpus_seen: list[int] | None = spec(None, check=_gpu_indices)  # GPUs the CT's config passes through, as
    #                                                               `ctl inventory discover` saw them
    vars: dict[str, Any] = spec(factory=dict)
    lock: str | None = None
    baseline: str | None = None
    allowed_paths: list[str] = spec(factory=lambda: ["/root", "/workspace", "/opt", "/srv"])
    # Container paths under which the agent may follow a symlink while resolving a destination (default: none)
    follow_symlinks: list[str] = spec(factory=list, check=_prefixes)
    store_keep: int = spec(5, ge=1)  # versions per destination `ctl store prune` keeps
    nccl: NcclSpec | None = None  # NCCL/gloo network variables for the start script

    def _check(self) -> None:
        if self.transport == "pct" and (self.host is None or self.vmid is None):
            raise ValueError("transport 'pct' needs 'host' and 'vmid'")
        if self.transport == "ssh" and self.address is None:
            raise ValueError("transport 'ssh' needs 'address'")
        if self.transport == "local" and self.root is None:
            raise ValueError("transport 'local' needs 'root' (a directory standing for the container's /)")


@dataclass(frozen=True, kw_only=True)
class InventoryModel:
    """An inventory file as read and checked, before names are resolved (`Inventory` answers questions)."""

    hosts: dict[str, HostSpec] = spec(factory=dict)
    containers: dict[str, ContainerSpec]
    groups: dict[str, list[str]] = spec(factory=dict)
    jobs: dict[str, JobSpec] = spec(factory=dict)
    payload: list[PayloadEntry] = spec(factory=list)
    runs: RunsSpec = spec(factory=RunsSpec)
    vars: dict[str, Any] = spec(factory=dict)


@dataclass(frozen=True)
class Container:
    """A container resolved against its host: everything a command needs to reach and describe it."""

    name: str
    spec: ContainerSpec
    host_name: str | None
    host: HostSpec | None
    root: Path | None  # local transport only, absolute

    @property
    def key(self) -> str:
        """Its identity in the registry, which is the user's and shared by every checkout: the name, and for a
        `local` target its root too, so each checkout's `local` is a container of its own with its own runs."""
        return f"{self.name}@{self.root}" if self.spec.transport == "local" else self.name

    @property
    def label(self) -> str:
        if self.spec.transport == "pct":
            return f"{self.name} ({self.host_name}/{self.spec.vmid})"
        return self.name


@dataclass(frozen=True)
class Job:
    """A job resolved against the inventory: its nodes in order (node 0 hosts the rendezvous)."""

    name: str
    spec: JobSpec
    nodes: tuple[Container, ...]

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def master_addr(self) -> str:
        """The first node's address: where torchrun's c10d rendezvous (its TCPStore) listens."""
        addr = self.nodes[0].spec.address
        assert addr is not None  # checked when the inventory loads
        return addr

    @property
    def rdzv_endpoint(self) -> str:
        host = self.master_addr
        return f"[{host}]:{self.spec.rdzv_port}" if ":" in host else f"{host}:{self.spec.rdzv_port}"

    def rank(self, ct: str) -> int:
        return [c.name for c in self.nodes].index(ct)


@dataclass(frozen=True)
class Inventory:
    """A checked inventory and the file it came from: containers, groups and jobs by name."""

    path: Path
    model: InventoryModel

    @property
    def base_dir(self) -> Path:
        """Relative sources (payload, templates, locks, local roots) are relative to the inventory file."""
        return self.path.parent

    def container(self, name: str) -> Container:
        spec = self.model.containers.get(name)
        if spec is None:
            known = ", ".join(sorted(self.model.containers)) or "none"
            raise InputError(f"unknown container {name!r} in {self.path} (known: {known})")
        host = self.model.hosts.get(spec.host) if spec.host else None
        root = None
        if spec.root is not None:
            root = (self.base_dir / os.path.expanduser(spec.root)).resolve()
        return Container(name=name, spec=spec, host_name=spec.host, host=host, root=root)

    def keys(self) -> dict[str, str]:
        """The registry keys that are more than a name (`local` targets'), by container name."""
        cts = (self.container(n) for n, c in self.model.containers.items() if c.transport == "local")
        return {ct.name: ct.key for ct in cts}

    def job(self, name: str) -> Job:
        spec = self.model.jobs.get(name)
        if spec is None:
            known = ", ".join(sorted(self.model.jobs)) or "none"
            raise InputError(f"unknown job {name!r} in {self.path} (jobs: {known})")
        return Job(name, spec, tuple(self.container(n) for n in spec.nodes))

    def job_of(self, ct: str) -> Job | None:
        """The job whose node this container is (a container is a node of at most one job), or None."""
        for name, job in self.model.jobs.items():
            if ct in job.nodes:
                return self.job(name)
        return None

    def select(self, names: list[str]) -> list[Container]:
        """Containers by name, group or job, in the order given, without repeats. Empty means all."""
        if not names:
            names = list(self.model.containers)
        out: list[str] = []
        for n in names:
            if n in self.model.containers:
                members = [n]
            elif n in self.model.jobs:
                members = list(self.model.jobs[n].nodes)
            else:
                members = self.model.groups.get(n, [n])
            for m in members:
                if m not in out:
                    out.append(m)
        return [self.container(n) for n in out]

    def targets(self, names: list[str] | None, *, all_: bool, purpose: str) -> list[Container]:
        """The containers a verb that changes them acts on: those named (or groups), or, with none named, the
        inventory's only container; several need an explicit --all, so a bare command never touches a fleet."""
        cts = self.select(names or [])
        if not names and len(cts) > 1 and not all_:
            shown = ", ".join(ct.name for ct in cts[:8]) + (" ..." if len(cts) > 8 else "")
            raise InputError(f"name the containers or groups {purpose} ({self.path} has {len(cts)}: {shown}), "
                             "or pass --all")
        return cts

    def one(self, name: str) -> Container:
        """The one container `name` stands for; a group of several is refused (a one-container verb)."""
        cts = self.select([name])
        if len(cts) != 1:
            raise CtlError(f"{name!r} names {len(cts)} containers; give one container")
        return cts[0]


# --- loading -------------------------------------------------------------------------------------


def resolve_path(explicit: str | None = None) -> Path:
    """Flag > CTL_INVENTORY > ./inventory.yaml."""
    return settings.inventory_path(explicit)


def _parse(text: str) -> tuple[dict[tuple[Any, ...], int] | None, Any]:
    """The line of every key (None for an empty document) and the data, from one parse by libyaml when PyYAML
    has it (the pure-Python parser, run twice, was a fifth of a command's start-up). Lines are indexed before
    the data is built: building flattens `<<` merge keys inside the node tree, which would move them."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        lines = line_index(node)
        return lines, loader.construct_document(node)
    finally:
        loader.dispose()


PARSE_CACHE_KEEP = 32  # parsed inventories kept in STATE/inventory (one per content seen); the oldest go first


def _parser_id() -> bytes:
    """What a parse depends on besides the text: this module and yamlpos (how lines are indexed), and PyYAML."""
    from controller import yamlpos

    return settings.file_stamps(__file__, yamlpos.__file__ or "", packages=("yaml",))


def _parsed(text: str, name: str) -> tuple[dict[tuple[Any, ...], int] | None, Any]:
    """_parse(text), kept in the state directory under the hash of the text and of the parser: a command whose
    inventory did not change neither imports PyYAML nor parses (a tenth of a warm command). An entry holds the
    sha256 of its marshalled (lines, data) and is used only when it matches; a document marshal cannot hold (a
    YAML timestamp) is parsed every time. Private (0700/0600): the inventory names hosts and variables."""
    key = hashlib.sha256(_parser_id() + b"\0" + text.encode()).hexdigest()
    blob = settings.cache_get("inventory", key)
    if blob is not None:
        try:
            # ctl's own file in its private state directory (0700/0600), checked against its hash; marshal holds
            # plain data here, and whatever it held is checked field by field by build() as a parse would be.
            items, data = marshal.loads(blob)  # noqa: S302
            return (None if items is None else dict(items)), data
        except (ValueError, EOFError, TypeError):
            pass
    import yaml

    try:
        lines, data = _parse(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else None
        raise InventoryError(name, f"YAML syntax error: {e.problem or e.context}", line=line) from None
    except yaml.YAMLError as e:
        raise InventoryError(name, f"YAML error: {e}") from None
    try:
        blob = marshal.dumps((None if lines is None else list(lines.items()), data))
    except ValueError:
        return lines, data  # not marshallable (a YAML timestamp): parsed again next time
    settings.cache_put("inventory", key, blob, PARSE_CACHE_KEEP)
    return lines, data


_LAST: dict[tuple[Path, str], Inventory] = {}  # the inventory this process built last, by its file and text


def load(path: str | Path | None = None) -> Inventory:
    """The inventory at `path` (default: resolve_path's), checked. A process that loads the same file with the
    same text again (a command's early session start, then the command) gets the Inventory it built: building
    and checking one of 40 containers is ~4-6 ms. Every load still reads the file."""
    p = resolve_path(str(path) if path is not None else None)
    name = str(p)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(name, "inventory file not found (give -i PATH or set CTL_INVENTORY)") from None
    except OSError as e:
        raise InventoryError(name, f"cannot read: {e.strerror}") from None
    key = (p.resolve(), text)
    built = _LAST.get(key)
    if built is None:
        built = _build(p, name, text)
        _LAST.clear()
        _LAST[key] = built
    return built


def _build(p: Path, name: str, text: str) -> Inventory:
    lines, data = _parsed(text, name)
    if lines is None or not isinstance(data, dict):
        raise InventoryError(name, "expected a mapping with 'hosts' and 'containers'", line=1)
    try:
        model = build(InventoryModel, data)
    except SchemaError as e:
        raise InventoryError(name, e.message, line=nearest_line(lines, e.loc), key=dotted(e.loc)) from None
    _check_references(name, model, lines)
    _check_jobs(name, model, lines)
    _check_shell_vars(name, model, lines)
    return Inventory(path=p.resolve(), model=model)


def _check_references(name: str, model: InventoryModel, lines: dict[tuple[Any, ...], int]) -> None:
    for cname in model.containers:
        try:
            check_name(cname, "container name")
        except InputError as e:
            raise InventoryError(name, e.message, line=lines.get(("containers", cname)),
                                 key=f"containers.{cname}") from None
    for hname in model.hosts:
        try:
            check_name(hname, "host name")
        except InputError as e:
            raise InventoryError(name, e.message, line=lines.get(("hosts", hname)), key=f"hosts.{hname}") from None
    seen: dict[tuple[str, int], str] = {}
    for cname, c in model.containers.items():
        if c.host is not None and c.host not in model.hosts:
            known = ", ".join(sorted(model.hosts)) or "none"
            raise InventoryError(
                name, f"unknown host {c.host!r} (hosts: {known})",
                line=lines.get(("containers", cname, "host")), key=f"containers.{cname}.host",
            )
        if c.transport == "pct" and c.host is not None and c.vmid is not None:
            other = seen.get((c.host, c.vmid))
            if other is not None:
                raise InventoryError(
                    name, f"vmid {c.vmid} on host {c.host!r} is already used by {other!r}",
                    line=lines.get(("containers", cname, "vmid")), key=f"containers.{cname}.vmid",
                )
            seen[(c.host, c.vmid)] = cname
    for gname, members in model.groups.items():
        for i, m in enumerate(members):
            if m not in model.containers:
                raise InventoryError(
                    name, f"unknown container {m!r} in group", line=lines.get(("groups", gname, i)),
                    key=f"groups.{gname}[{i}]",
                )
        if gname in model.containers:
            raise InventoryError(name, "a group may not share a container's name",
                                 line=lines.get(("groups", gname)), key=f"groups.{gname}")


def _check_jobs(name: str, model: InventoryModel, lines: dict[tuple[Any, ...], int]) -> None:
    """Each job: a valid name of its own, known containers each in one job only, an `address:` on every node
    (the first one's is the rendezvous endpoint), the same GPU split on every node (torchrun starts the same
    command with the same arguments everywhere)."""
    def refuse(loc: tuple[Any, ...], msg: str) -> NoReturn:
        raise InventoryError(name, msg, line=nearest_line(lines, loc), key=dotted(loc))

    owner: dict[str, str] = {}
    for jname, job in model.jobs.items():
        try:
            check_name(jname, "job name")
        except InputError as e:
            refuse(("jobs", jname), e.message)
        if jname in model.containers or jname in model.groups:
            refuse(("jobs", jname), "a job may not share a container's or a group's name")
        split: tuple[int, int] | None = None
        for i, node in enumerate(job.nodes):
            loc = ("jobs", jname, "nodes", i)
            spec = model.containers.get(node)
            if spec is None:
                refuse(loc, f"unknown container {node!r} (containers: {', '.join(sorted(model.containers))})")
            if node in owner:
                refuse(loc, f"{node} is already a node of job {owner[node]!r}; a container is a node of one "
                            "job (its start script is rendered for it)")
            owner[node] = jname
            if spec.address is None:
                refuse(("containers", node), f"{node} is a node of job {jname!r} and needs `address:`, where the "
                                             "other nodes reach it")
            elif not _ADDRESS.fullmatch(spec.address):
                refuse(("containers", node, "address"), f"{spec.address!r} is not a host name or an IP address")
            mine = (len(spec.gpus.target) or 1, len(spec.gpus.drafter) or 1)
            if split is None:
                split = mine
            elif mine != split:
                refuse(loc, f"{node} has {mine[0]} target(s) and {mine[1]} drafter(s), {job.nodes[0]} has "
                            f"{split[0]} and {split[1]}: every node of a job runs the same command, so give them "
                            "the same GPU split")


# What the rendered start_training.sh puts unquoted on a shell line: each must be a name, never shell text.
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # a shell identifier (`export KEY=...`)
_OPTION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # an option name (`--KEY value`)
_COMMAND = re.compile(r"^[A-Za-z0-9_./+][A-Za-z0-9_./+-]*$")  # an interpreter: a name or a path, no shell


def _check_shell_vars(name: str, model: InventoryModel, lines: dict[tuple[Any, ...], int]) -> None:
    """vars.env keys, vars.train_args keys and vars.python (globally and per container), refused at load with
    the line: the start script is shell, and these reach it as names, not quoted values."""
    scopes: list[tuple[tuple[Any, ...], dict[str, Any]]] = [(("vars",), model.vars)]
    scopes += [(("containers", c, "vars"), spec.vars) for c, spec in model.containers.items()]

    def refuse(loc: tuple[Any, ...], msg: str) -> None:
        raise InventoryError(name, msg, line=nearest_line(lines, loc), key=dotted(loc))

    for base, vs in scopes:
        for var, pattern, what in (("env", _ENV_KEY, "an environment variable name (a shell identifier: "
                                    "letters, digits, '_', not starting with a digit)"),
                                   ("train_args", _OPTION, "an option name (letters, digits, '_', '-', "
                                    "starting with a letter or digit)")):
            if var not in vs or vs[var] is None:
                continue
            if not isinstance(vs[var], dict):
                refuse((*base, var), "must be a mapping")
            for key in vs[var]:
                if not isinstance(key, str) or not pattern.fullmatch(key):
                    refuse((*base, var, key), f"{key!r} is not {what}")
        py = vs.get("python")
        if py is not None and (not isinstance(py, str) or not _COMMAND.fullmatch(py)):
            refuse((*base, "python"), f"{py!r} is not an interpreter name or path (letters, digits, "
                                      "'_', '.', '/', '+', '-'; no spaces or shell characters)")
