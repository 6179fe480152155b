"""Write the generated pages of the documentation site: the command reference, from the click command tree that
typer builds of ctl's app, and the inventory reference, from the inventory's records (controller/inventory.py,
checked by controller/schema.py). Run after changing a command, an option, its help or an inventory key
(tests/test_docs.py fails until the committed pages equal what this writes):

    python scripts/gen_docs.py          # write docs/reference/commands.md and docs/reference/inventory.md
    python scripts/gen_docs.py --check  # exit 1 naming the pages that differ
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COMMANDS_MD = REPO / "docs" / "reference" / "commands.md"
INVENTORY_MD = REPO / "docs" / "reference" / "inventory.md"


def load_app() -> Any:
    """ctl's typer app with every verb registered: the one place this script (and tests/test_docs.py) finds it."""
    from controller.launch.main import load_app as load

    return load()


def click_command() -> Any:
    """The click command tree typer makes of the app, as `ctl` runs it."""
    import typer.main

    return typer.main.get_command(load_app())


# --- Markdown helpers ------------------------------------------------------------------------------------------

_CODE = re.compile(r"(`[^`]*`)")


def md_text(text: str) -> str:
    """Plain help text as Markdown: code spans kept, characters Markdown would interpret escaped outside them."""
    out = []
    for part in _CODE.split(text):
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part)
        else:
            out.append(part.replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;").replace("_", "\\_")
                       .replace("[", "\\["))
    return "".join(out)


def cell(text: str) -> str:
    """Text for a table cell: one line, pipes escaped (inside code spans too: tables split on them first)."""
    return md_text(" ".join(text.split())).replace("|", "\\|")


def code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`" if "`" not in text else "``" + text + "``"


# --- the command reference -------------------------------------------------------------------------------------


def _paragraphs(help_text: str) -> tuple[list[str], list[str]]:
    """A command's help as prose paragraphs and preformatted blocks (click's `\\b` paragraphs, kept as typed)."""
    prose: list[str] = []
    blocks: list[str] = []
    for para in re.split(r"\n\s*\n", help_text.strip()):
        if para.lstrip().startswith("\b"):
            blocks.append("\n".join(line.strip() for line in para.lstrip()[1:].strip("\n").splitlines()))
        elif para.strip():
            prose.append(" ".join(para.split()))
    return prose, blocks


def _context(cmd: Any, path: list[str]) -> Any:
    """A click context for the command at `path` (its parents' contexts above it), as `--help` renders it."""
    ctx = None
    for i, name in enumerate(path):
        ctx = cmd.context_class(cmd if i == len(path) - 1 else _command_at(path[: i + 1]), info_name=name,
                                parent=ctx)
    return ctx


_ROOT: list[Any] = []


def _command_at(path: list[str]) -> Any:
    cmd = _ROOT[0]
    for name in path[1:]:
        cmd = cmd.commands[name]
    return cmd


def _options_table(cmd: Any, ctx: Any) -> list[str]:
    """The arguments and options as `--help` shows them (typer's rendering: names, type, help, default)."""
    rows = []
    for p in cmd.params:
        if getattr(p, "hidden", False):
            continue
        record = p.get_help_record(ctx)
        if record is None:
            continue
        names, what = record
        if p.param_type_name == "argument" and p.required:
            what = (what + "  [required]").strip()
        rows.append(f"| {code(names)} | {cell(what)} |")
    if not rows:
        return []
    return ["| argument or option | what |", "|---|---|", *rows, ""]


def _walk(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    """Every command of the tree under `cmd`, depth first, in the order `--help` lists them."""
    if not _ROOT:
        _ROOT.append(cmd)
    yield path, cmd
    if hasattr(cmd, "commands"):
        ctx = _context(cmd, path)
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, [*path, name])


def commands_page() -> str:
    root = click_command()
    _ROOT[:] = [root]
    out = ["# Command reference", "",
           "<!-- Written by scripts/gen_docs.py from ctl's command line; tests/test_docs.py fails when it differs. -->",
           "",
           "Every command, its arguments and options, as `ctl COMMAND --help` prints them. Global options go before "
           "the command; `--json`, `--text` and `--debug` are also taken anywhere on the line. Exit codes: "
           "[exit codes](exit-codes.md).", ""]
    for path, cmd in _walk(root, ["ctl"]):
        depth = len(path)
        ctx = _context(cmd, path)
        title = "Global options" if depth == 1 else " ".join(path)
        out += [f"{'#' * min(depth + 1, 4)} {title}", ""]
        prose, blocks = _paragraphs(cmd.help or "")
        out += [md_text(p) + "\n" for p in prose]
        out += ["```text", "Usage: " + " ".join([*path, *cmd.collect_usage_pieces(ctx)]), "```", ""]
        out += _options_table(cmd, ctx)
        for block in blocks:
            out += ["```text", block, "```", ""]
        if hasattr(cmd, "commands") and depth > 1:
            subs = [n for n in cmd.list_commands(ctx) if not cmd.get_command(ctx, n).hidden]
            out += ["Commands: " + ", ".join(f"[{n}](#{'-'.join([*path, n])})" for n in subs) + ".", ""]
        epilog = (cmd.epilog or "").strip()
        if epilog:
            lines = [ln.strip() for ln in epilog.replace("\b", "").splitlines() if ln.strip()]
            head = lines[0] if not lines[0].startswith("ctl ") else "Examples:"
            examples = [ln for ln in lines if ln.startswith("ctl ")]
            out += [f"**{head.rstrip(':')}**", "", "```bash", *examples, "```", ""]
    return "\n".join(out).rstrip() + "\n"


# --- the inventory reference -----------------------------------------------------------------------------------

# What each key of the inventory means, and an example value (YAML, as it would be written after the key).
# Every field of the records must be here, and nothing else: the generator refuses a gap or a stale entry.
KEYS: dict[str, tuple[str, str]] = {
    "InventoryModel.hosts": ("The Proxmox hosts, by name.", "{kpro6: {address: 10.1.2.6}}"),
    "InventoryModel.containers": ("The containers runs live in, by name. The only required key.",
                                  "{ct200: {host: kpro6, vmid: 200}}"),
    "InventoryModel.groups": ("Named lists of containers, usable wherever a container name is.",
                              "{train: [ct200, ct300]}"),
    "InventoryModel.jobs": ("Runs across several containers, by name (torchrun with a c10d rendezvous).",
                            "{pair: {nodes: [ct200, ct300]}}"),
    "InventoryModel.payload": ("The pinned files and templates every deploy puts into the containers.",
                               "[{src: remote_payload/dflash_model.py, dest: /root/dflash_model.py}]"),
    "InventoryModel.runs": ("How runs are named, which tmux session holds them, where their files go.",
                            "{series: fresh, session: dflash}"),
    "InventoryModel.vars": ("Template variables for every container (a container's own `vars` win).",
                            "{python: python3}"),
    "HostSpec.address": ("Where ctl connects over SSH: an IP or a host name (one from ~/.ssh/config works).",
                         "10.1.2.6"),
    "HostSpec.port": ("The SSH port.", "22"),
    "HostSpec.user": ("The SSH user; `pct` needs root.", "root"),
    "HostSpec.identity_file": ("The private key to log in with (else your ssh agent's keys).", "~/.ssh/id_ed25519"),
    "HostSpec.known_hosts": ("The known_hosts file host keys are verified against; unknown or changed keys are "
                             "refused.", "~/.ssh/known_hosts"),
    "HostSpec.pct": ("The pct command on the host. Proxmox's own is started without pct where it can be; a "
                     "wrapper of your own always runs as given.", "/usr/local/bin/pct-wrapper"),
    "HostSpec.stage_dir": ("Where single-file uploads are staged on the host, in a private directory.", "/tmp"),
    "HostSpec.persist": ("Idle seconds of this host's persistent session (0: none; unset: 60). `CTL_PERSIST` and "
                         "the config file win.", "300"),
    "HostSpec.keepalive": ("SSH keepalives: see `hosts.NAME.keepalive`.", "{interval: 15, count: 3}"),
    "HostSpec.connect_timeout": ("Seconds for TCP connect, SSH banner, authentication and channel open "
                                 "(`CTL_CONNECT_TIMEOUT` wins).", "10"),
    "HostSpec.timeout": ("Deadline in seconds of every request that is not a follow, 0: none (`CTL_TIMEOUT` "
                         "wins).", "60"),
    "HostSpec.api": ("The host's Proxmox API, for snapshots and discovery: see `hosts.NAME.api`.",
                     "{url: \"https://10.1.2.6:8006\", node: kpro6, token_id: \"root@pam!ctl\"}"),
    "KeepaliveSpec.interval": ("Seconds between SSH keepalives that want an answer, 0: none "
                               "(`CTL_KEEPALIVE_INTERVAL` wins).", "15"),
    "KeepaliveSpec.count": ("Unanswered keepalives in a row after which the connection is dropped (exit 5; "
                            "`CTL_KEEPALIVE_COUNT` wins).", "3"),
    "ApiSpec.url": ("The API's address (https only).", "\"https://10.1.2.6:8006\""),
    "ApiSpec.node": ("The Proxmox node name of this host.", "kpro6"),
    "ApiSpec.token_id": ("The API token, as USER@REALM!TOKENID.", "\"root@pam!ctl\""),
    "ApiSpec.token_secret_env": ("The environment variable holding the token's secret (never in the file).",
                                 "PVE_TOKEN"),
    "ApiSpec.ca_file": ("The CA that signs the API's certificate (your cluster's `/etc/pve/pve-root-ca.pem`).",
                        "~/.config/ctl/pve-ca.pem"),
    "ApiSpec.verify": ("Verify TLS; `false` works but warns every time.", "true"),
    "ApiSpec.timeout": ("Seconds each API request may take.", "30"),
    "ContainerSpec.host": ("The host it lives on (`pct` transport).", "kpro6"),
    "ContainerSpec.vmid": ("Its Proxmox VMID (`pct` transport).", "200"),
    "ContainerSpec.transport": ("How ctl reaches it: `pct` (SSH to the host, `pct exec VMID -- argv`, argv quoted "
                                "once at the edge), `ssh` (an sshd in the container) or `local` (this machine).",
                                "pct"),
    "ContainerSpec.address": ("`ssh` transport: where ctl connects. A job's node: where the other nodes reach it "
                              "(its own IP).", "10.1.2.60"),
    "ContainerSpec.port": ("`ssh` transport: the SSH port.", "22"),
    "ContainerSpec.user": ("`ssh` transport: the SSH user.", "root"),
    "ContainerSpec.identity_file": ("`ssh` transport: the private key.", "~/.ssh/id_ed25519"),
    "ContainerSpec.known_hosts": ("`ssh` transport: the known_hosts file.", "~/.ssh/known_hosts"),
    "ContainerSpec.root": ("`local` transport: the directory that stands for the container's `/`.", ".ctl/local"),
    "ContainerSpec.gpus": ("Which GPU indices hold the target and which the drafter: see `containers.NAME.gpus`.",
                           "{target: [0, 1, 2, 3, 4], drafter: [5, 6, 7]}"),
    "ContainerSpec.gpus_seen": ("The GPUs the container's config passes through, as `ctl inventory discover` "
                                "saw them (it writes this key; the split under `gpus` stays yours).", "[0, 1]"),
    "ContainerSpec.vars": ("Template variables of this container, over the inventory's `vars` (see below).",
                           "{venv: /root/venv}"),
    "ContainerSpec.lock": ("The environment lock `ctl env check` and `ctl launch` compare the venv with.",
                           "env/ct200.lock"),
    "ContainerSpec.baseline": ("The run this container's runs are judged against (else the newest marked good).",
                               "fresh5"),
    "ContainerSpec.allowed_paths": ("Container paths a payload `dest` may be under.", "[/root, /workspace]"),
    "ContainerSpec.follow_symlinks": ("Container path prefixes under which the agent may follow a symlink while "
                                      "resolving a destination (default: none).", "[/workspace/data]"),
    "ContainerSpec.store_keep": ("Versions per destination `ctl store prune` keeps.", "5"),
    "ContainerSpec.nccl": ("NCCL/gloo network variables for the start script; they win over the job's.",
                           "{socket_ifname: eth0}"),
    "GpuSplit.target": ("GPU indices of the frozen target model(s).", "[0, 1, 2, 3, 4]"),
    "GpuSplit.drafter": ("GPU indices of the drafter(s) being trained.", "[5, 6, 7]"),
    "NcclSpec.socket_ifname": ("`NCCL_SOCKET_IFNAME` and `GLOO_SOCKET_IFNAME`: the interface on the network "
                               "between the hosts (`=eth0` exact, `^lo,docker` to exclude).", "eth0"),
    "NcclSpec.ib_disable": ("`NCCL_IB_DISABLE`: no InfiniBand/RoCE device in the container (the usual LXC case).",
                            "true"),
    "NcclSpec.p2p_disable": ("`NCCL_P2P_DISABLE`: the container's GPUs cannot reach each other directly.", "true"),
    "JobSpec.nodes": ("The containers of the job, in order: the first hosts the rendezvous.", "[ct200, ct300]"),
    "JobSpec.rdzv_port": ("The c10d rendezvous port on the first node's `address`.", "29400"),
    "JobSpec.nproc_per_node": ("Processes per node: `auto` (each node's GPU split, targets + drafters) or a "
                               "number.", "auto"),
    "JobSpec.preflight_timeout": ("Seconds the launch preflight waits for every node to reach the rendezvous.",
                                  "10"),
    "JobSpec.nccl": ("NCCL/gloo network variables for every node (a container's own `nccl` keys win).",
                     "{ib_disable: true}"),
    "PayloadEntry.src": ("A file copied as it is (give `src` or `template`, not both).",
                         "remote_payload/dflash_model.py"),
    "PayloadEntry.template": ("A Jinja2 template rendered for the container (StrictUndefined).",
                              "templates/start_training.sh.j2"),
    "PayloadEntry.dest": ("Its path in the container, under one of `allowed_paths`.", "/root/start_training.sh"),
    "PayloadEntry.mode": ("Its octal mode; without it, the source file's own permission bits (never more readable "
                          "than the source). A start script that carries secrets: \"0700\".", "\"0755\""),
    "RunsSpec.series": ("Run names are this plus a number: fresh1, fresh2, ...", "fresh"),
    "RunsSpec.session": ("The tmux session name prefix runs live in.", "dflash"),
    "RunsSpec.log": ("A run's log in the container; must contain `{run}`.", "\"/workspace/train_stdout_{run}.log\""),
    "RunsSpec.dir": ("A run's directory in the container; must contain `{run}`.", "\"/workspace/runs/{run}\""),
    "RunsSpec.checkpoints": ("Where a run's full checkpoints are (`step_N/` with `manifest.json`).",
                             "\"{dir}/checkpoints\""),
    "RunsSpec.supervise": ("The defaults of `ctl supervise`: see `runs.supervise`.", "{restart: on-failure:3}"),
    "SuperviseSpec.interval": ("How often every live run is polled.", "30s"),
    "SuperviseSpec.restart": ("`no`, `on-failure[:N]` or `always[:N]`.", "on-failure:3"),
    "SuperviseSpec.max_restarts": ("Restarts of one lineage when `restart` gives no `:N`.", "3"),
    "SuperviseSpec.backoff": ("The wait before a relaunch; doubles with each restart of the lineage.", "30s"),
    "SuperviseSpec.stall_after": ("A run with no new step for this long is STALLED.", "10m"),
    "SuperviseSpec.slow_ratio": ("Below this fraction of the baseline's tok/s a run is SLOW.", "0.8"),
    "SuperviseSpec.notify": ("Where events go: `https://...`, `slack:https://...`, `cmd:PROGRAM ARGS`.",
                             "[\"https://ops.example/hooks/ctl\"]"),
    "SuperviseSpec.notify_secret_env": ("The variable holding the webhooks' HMAC key.", "CTL_NOTIFY_SECRET"),
}

# Template variables ctl gives every template a default for (controller/core/render.py); `vars` may set others.
VARS: dict[str, str] = {
    "python": "The interpreter that runs the training (a name or a path).",
    "venv": "The training venv to activate (`ctl env` probes and syncs it).",
    "payload_dir": "Where the payload's files are in the container.",
    "compile_cache_dir": "`TORCHINDUCTOR_CACHE_DIR`: the torch.compile cache, on a persistent path.",
    "data_cache_dir": "The payload's `--cache-dir`: tokenised data and taught tiny targets, kept across runs.",
    "env": "Environment variables for the training; keys must be shell identifiers.",
    "train_args": "The training's options, `key: value` as `--key value` (`true`: the bare flag); keys must be "
                  "option names.",
}

INVENTORY_INTRO = """\
# Inventory reference

<!-- Written by scripts/gen_docs.py from the inventory's records; tests/test_docs.py fails when it differs. -->

The inventory (`./inventory.yaml`, or `-i FILE`, `CTL_INVENTORY`, the config file's `inventory`) says where
training runs live and what gets deployed there. Relative paths in it (payload sources, templates, `local`
roots) are relative to the file. A bad inventory is one line naming the file, the line and the key (exit 3);
an unknown key is refused. Precedence: defaults < inventory < user config file < `CTL_*` variables < flags.

The repository's `inventory.yaml` is a full example: the seeds' host and CT 200, and the `local` target of the
quickstart.
"""

INVENTORY_OUTRO = """\
## Discovering it from Proxmox

```bash
ctl inventory discover --api https://pve1:8006 --token-id 'root@pam!ctl' --ca pve-root-ca.pem
ctl inventory discover --host kpro6 --diff
ctl inventory discover --host kpro6 --write
```

The secret is read from `$PVE_TOKEN` (or `--token-env VAR`); `--host NAME` uses the `api:` of a host already in
the inventory. Discovery reads the cluster in N + 2 requests for N containers: `GET /cluster/status` (nodes and
their addresses), `GET /cluster/resources?type=vm` (every container of every node, with node and status), then
each container's config, eight at a time. It records the GPUs a config passes through as `gpus_seen: [0, 1]`
(`devN: /dev/nvidiaN` keys and `lxc.mount.entry: /dev/nvidiaN ...` lines; the cgroup rule alone names no GPU);
the target/drafter split under `gpus:` stays yours.

Without options it prints the inventory it would write; `--diff` lists what differs (added, removed, moved to
another node, GPUs changed; `--json` for all of it); `--write` merges into the file with a YAML round trip:
comments, order, flow style and hand-written keys are kept, only `host` of a moved container, `gpus_seen`, new
hosts and new containers (`ctN`) change, and the result is validated before it atomically replaces the file. A
container gone from the cluster is dropped, unless it has runs in the registry: then only `--prune` drops it.
"""


def _records() -> dict[str, type]:
    from controller import inventory

    return {name: obj for name, obj in vars(inventory).items()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and name.endswith(("Spec", "Split", "Entry",
                                                                                          "Model"))}


def _nested(tp: Any) -> tuple[str, type] | None:
    """The record a field holds, and how its key path continues: ('', R), ('.NAME', R) or ('[]', R)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return "", tp
    if origin in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            found = _nested(a)
            if found:
                return found
    if origin is dict:
        found = _nested(typing.get_args(tp)[1])
        return (".NAME", found[1]) if found else None
    if origin is list:
        found = _nested(typing.get_args(tp)[0])
        return ("[]", found[1]) if found else None
    return None


_TITLES: dict[type, str] = {}  # record -> its key path, the text of a link to its section


def _typename(tp: Any, anchors: dict[type, str]) -> str:
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return f"[{_TITLES[tp]}](#{anchors[tp]})" if tp in anchors else "mapping"
    if origin is typing.Literal:
        return " \\| ".join(code(str(a)) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_typename(a, anchors) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return "list of " + _typename(typing.get_args(tp)[0], anchors)
    if origin is dict:
        return "mapping of name to " + _typename(typing.get_args(tp)[1], anchors)
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(tp, getattr(tp, "__name__", str(tp)))


def _bounds(f: dataclasses.Field[Any]) -> str:
    m = f.metadata
    parts = [f"{w} {int(m[k]) if float(m[k]).is_integer() else m[k]}" for k, w in (("ge", "≥"), ("gt", ">"),
                                                                             ("le", "≤")) if m.get(k) is not None]
    if m.get("min_items") is not None:
        parts.append(f"at least {m['min_items']} item(s)")
    return ", ".join(parts)


def _field_default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(its keys' defaults)"
    else:
        return "**required**"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return code("true" if value else "false")
    if isinstance(value, list):
        return code("[" + ", ".join(str(v) for v in value) + "]")
    if isinstance(value, dict):
        return code("{}")
    return code(str(value) if not isinstance(value, float) else f"{value:g}")


def inventory_sections() -> list[tuple[str, type]]:
    """(key path, record) of every record the inventory holds, in the order a reader meets them."""
    from controller.inventory import InventoryModel

    out: list[tuple[str, type]] = []

    def visit(path: str, cls: type) -> None:  # depth first: a record's own parts follow it
        if any(cls is seen for _, seen in out):
            return
        out.append((path, cls))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            found = _nested(hints[f.name])
            if found:
                visit((f"{path}.{f.name}" if path else f.name) + found[0], found[1])

    visit("", InventoryModel)
    return out


def _anchor(path: str) -> str:
    return (path or "top-level").replace(".NAME", "-name").replace("[]", "").replace(".", "-").lower()


def check_keys() -> list[str]:
    """What is wrong with KEYS: a field of the records without an entry, or an entry that names no field."""
    fields = {f"{cls.__name__}.{f.name}" for _, cls in inventory_sections() for f in dataclasses.fields(cls)}
    return ([f"{k}: no description in scripts/gen_docs.py KEYS" for k in sorted(fields - KEYS.keys())]
            + [f"{k}: in scripts/gen_docs.py KEYS but no such inventory key" for k in sorted(KEYS.keys() - fields)])


def inventory_page() -> str:
    from controller.core.render import _BUILTIN_DEFAULTS

    problems = check_keys()
    if problems:
        raise SystemExit("gen_docs: " + "; ".join(problems))
    sections = inventory_sections()
    anchors = {cls: _anchor(path) for path, cls in sections}
    _TITLES.update({cls: path or "top level" for path, cls in sections})
    out = [INVENTORY_INTRO]
    for path, cls in sections:
        title = path or "Top level"
        out += [f"## {title} {{ #{anchors[cls]} }}", ""]
        doc = " ".join((cls.__doc__ or "").split())
        if doc and not doc.startswith(cls.__name__ + "("):
            out += [md_text(doc), ""]
        out += ["| key | type | default | what | example |", "|---|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            what, example = KEYS[f"{cls.__name__}.{f.name}"]
            kind = _typename(hints[f.name], anchors)
            bounds = _bounds(f)
            if bounds:
                kind += f" ({bounds})"
            out.append(f"| `{f.name}` | {kind} | {_field_default(f)} | {cell(what)} | {code(f'{f.name}: {example}')} |")
        out.append("")
    missing = sorted(set(_BUILTIN_DEFAULTS) - VARS.keys()) + sorted(VARS.keys() - set(_BUILTIN_DEFAULTS))
    if missing:
        raise SystemExit(f"gen_docs: template variables out of step with scripts/gen_docs.py VARS: {missing}")
    out += ["## Template variables { #template-variables }", "",
            "Templates see the inventory's `vars`, then the container's `vars` over them, then what ctl computes "
            "(the GPU split, `CUDA_VISIBLE_DEVICES`, per-rank GPUs, run paths, the job). These have defaults:", "",
            "| variable | default | what |", "|---|---|---|"]
    for name, default in _BUILTIN_DEFAULTS.items():
        shown = "unset" if default is None else code(str(default) if default != {} else "{}")
        out.append(f"| `{name}` | {shown} | {cell(VARS[name])} |")
    out += ["", INVENTORY_OUTRO]
    return "\n".join(out).rstrip() + "\n"


def pages() -> dict[Path, str]:
    return {COMMANDS_MD: commands_page(), INVENTORY_MD: inventory_page()}


if __name__ == "__main__":
    check = "--check" in sys.argv[1:]
    stale = []
    for path, text in pages().items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(REPO)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    if stale:
        sys.exit(f"out of date: {', '.join(stale)} (run: python scripts/gen_docs.py)")
