"""Shell completion: typer's protocol (`ctl --install-completion`, `--show-completion`), answered fast.

Typer answers a TAB by building the whole command tree: importing typer, pydantic (typer coerces values with
it) and every cli module, about half a second. ctl's entry point (cli/main.py) hands a completion request here
before importing any of that. The tree comes from `compspec.py`: the commands, options and arguments typer
would build, and which arguments take container, group, run or host names, generated from the app by
`python -m controller.cli.complete --write` (tests/test_completion.py checks it matches the app). Names come
from the inventory (one YAML read, no validation) and the registry (one read-only SQLite query): no network,
no paramiko, no jinja2, no pydantic.

The same name functions are the typer arguments' `autocompletion=` callbacks, which is how the generator knows
which argument takes which names.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

TYPE_CHECKING = False  # the answer to a TAB does not pay for importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")

VAR = "_CTL_COMPLETE"
# Flags `ctl` accepts anywhere on the line (cli/main.py moves them before the verb).
ANYWHERE = ("--json", "--text", "--debug")


# --- names ----------------------------------------------------------------------------------------


def _inventory(path: str | None = None) -> dict[str, Any]:
    """The inventory as plain YAML (no validation: a name is all completion needs); {} when unreadable."""
    try:
        import yaml

        from controller import settings

        text = settings.inventory_path(path).read_text(encoding="utf-8")
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        doc = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except Exception:  # a missing or broken inventory completes nothing; the command itself will say why
        return {}
    return doc if isinstance(doc, dict) else {}


def _keys(doc: dict[str, Any], key: str) -> list[str]:
    v = doc.get(key)
    return [str(k) for k in v] if isinstance(v, dict) else []


def read_registry(query: Callable[[Any], T], default: T) -> T:
    """query(db) on a read-only connection to the registry (controller/registry.py's tables): nothing created or
    migrated; `default` without a registry or one that cannot be read now (being migrated, locked). Not through
    Registry: importing it (dataclasses, the JSON codecs) would cost more than the answer."""
    import sqlite3

    from controller import settings

    try:
        path = settings.state_dir() / "registry.sqlite3"
        if not path.is_file():
            return default
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=0.2)
        try:
            return query(db)
        finally:
            db.close()
    except (sqlite3.Error, OSError):
        return default


def _run_names(limit: int = 1000) -> list[tuple[str, str]]:
    """(ct, name) of the newest runs, [] without a registry."""
    none: list[tuple[str, str]] = []
    rows = read_registry(lambda db: db.execute("SELECT ct, name FROM runs ORDER BY created DESC LIMIT ?",
                                               (limit,)).fetchall(), none)
    return [(str(ct), str(name)) for ct, name in rows]


def names(kind: str, incomplete: str, inventory: str | None = None) -> list[str]:
    """The names an argument of `kind` takes that start with `incomplete`, from the inventory at `inventory`
    (-i; else CTL_INVENTORY, the config file, ./inventory.yaml) and the registry."""
    if kind in ("runs", "run_or_container") or (kind == "container_or_run" and "/" in incomplete):
        pairs = _run_names()
        refs = [f"{ct}/{name}" if "/" in incomplete else name for ct, name in pairs]
    else:
        refs = []
    if kind != "runs" and not (kind == "container_or_run" and "/" in incomplete):
        doc = _inventory(inventory)
        if kind == "hosts":
            refs += _keys(doc, "hosts")
        else:
            refs += _keys(doc, "containers") + (_keys(doc, "groups") if kind == "targets" else [])
    return [r for r in dict.fromkeys(refs) if r.startswith(incomplete)]


# The arguments' `autocompletion=` callbacks (typer calls them with the word being completed).

def containers(incomplete: str) -> list[str]:
    """Container names of the inventory."""
    return names("containers", incomplete)


def targets(incomplete: str) -> list[str]:
    """Container and group names of the inventory."""
    return names("targets", incomplete)


def hosts(incomplete: str) -> list[str]:
    """Host names of the inventory."""
    return names("hosts", incomplete)


def runs(incomplete: str) -> list[str]:
    """Run names of the registry, newest first: NAME, or CT/NAME once a `/` is typed."""
    return names("runs", incomplete)


def container_or_run(incomplete: str) -> list[str]:
    """A container, or one of its runs as CT/NAME once a `/` is typed (ctl tail)."""
    return names("container_or_run", incomplete)


def run_or_container(incomplete: str) -> list[str]:
    """A run or a container (ctl env diff)."""
    return names("run_or_container", incomplete)


KINDS = {"containers": containers, "targets": targets, "hosts": hosts, "runs": runs,
         "container_or_run": container_or_run, "run_or_container": run_or_container}


# --- the protocol ---------------------------------------------------------------------------------


def _split(line: str) -> list[str]:
    """Words as the shell would give them to ctl (an unclosed quote: the rest is one word)."""
    lex = shlex.shlex(line, posix=True)
    lex.whitespace_split = True
    lex.commenters = ""
    out: list[str] = []
    try:
        out.extend(lex)
    except ValueError:
        out.append(lex.token)
    return out


def _words(shell: str, env: dict[str, str]) -> tuple[list[str], str]:
    """(the words after `ctl` before the cursor, the word being completed), as typer's shell classes read them."""
    if shell == "bash":
        words = _split(env.get("COMP_WORDS", ""))
        cword = int(env.get("COMP_CWORD", "0") or 0)
        return words[1:cword], (words[cword] if cword < len(words) else "")
    line = env.get("_TYPER_COMPLETE_ARGS", "")
    words = _split(line)[1:]
    if shell in ("powershell", "pwsh"):
        incomplete = env.get("_TYPER_COMPLETE_WORD_TO_COMPLETE", "")
        return (words[:-1] if incomplete else words), incomplete
    if words and not line.endswith(" "):
        return words[:-1], words[-1]
    return words, ""


class Line:
    """`ctl ARGS...` as the command tree reads it, without typer: the command (`path`, its `node` in the tree),
    its positional words, the options given (name -> value, "" for a flag) and the -i/--inventory value."""

    def __init__(self, args: list[str], spec: dict[str, Any] | None = None) -> None:
        if spec is None:
            from controller.cli.compspec import SPEC

            spec = SPEC
        self.root = spec
        self.node = spec
        self.path: list[str] = []
        self.words: list[str] = []
        self.options: dict[str, str] = {}
        self.inventory: str | None = None
        i = 0
        while i < len(args):
            a = args[i]
            if a.startswith("-") and len(a) > 1:
                name, eq, value = a.partition("=")
                takes = self.opts().get(name, None)
                if takes is not None and not eq:
                    value = args[i + 1] if i + 1 < len(args) else ""
                    i += 1
                if name in ("-i", "--inventory") and takes is not None:
                    self.inventory = value
                self.options[name] = value
                i += 1
                continue
            if self.node.get("commands") and not self.words and a in self.node["commands"]:
                self.node = self.node["commands"][a]
                self.path.append(a)
            else:
                self.words.append(a)
            i += 1

    def opts(self) -> dict[str, str | None]:
        """The options the command takes (with the global ones): name -> the kind of its value, None for a flag."""
        node, root = self.node, self.root
        return {**root["opts"], **node["opts"]} if node is not root else node["opts"]

    def kinds(self) -> list[str]:
        """The kind of name each positional word is ("targets", "containers", "runs", ...; "" for none)."""
        out: list[str] = []
        for k, nargs in self.node.get("args", []):
            out += [k] * (len(self.words) - len(out) if nargs == -1 else nargs)
        return (out + [""] * len(self.words))[:len(self.words)]


def candidates(args: list[str], incomplete: str, spec: dict[str, Any] | None = None) -> list[str]:
    """What may follow `ctl ARGS...`, starting with `incomplete`: a command, an option, or a name."""
    line = Line(args, spec)
    root, node, pos, inventory = line.root, line.node, len(line.words), line.inventory
    opts = line.opts()
    if args:
        prev = args[-1]
        takes = opts.get(prev) if prev.startswith("-") and "=" not in prev else None
        if takes is not None:  # an option's value: names, or nothing (the shell completes file names)
            return names(takes, incomplete, inventory) if takes in KINDS else []
    if incomplete.startswith("-"):
        flags = list(node["opts"]) + ([] if node is root else list(ANYWHERE))
        return [f for f in dict.fromkeys(flags) if f.startswith(incomplete)]
    if node.get("commands") and pos == 0:
        return [c for c in node["commands"] if c.startswith(incomplete)]
    kinds = node.get("args", [])
    kind = ""
    taken = pos
    for k, nargs in kinds:
        if nargs == -1 or taken < nargs:
            kind = k
            break
        taken -= nargs
    return names(kind, incomplete, inventory) if kind in KINDS else []


def _zsh_quote(s: str) -> str:
    return s.replace('"', '""').replace("'", "''").replace("$", "\\$").replace("`", "\\`").replace(":", r"\\:")


def answer(env: dict[str, str] | None = None, out: Any = None) -> int:
    """Answer the completion request in env[_CTL_COMPLETE] (`complete_bash` ...) as typer's scripts expect;
    the exit status."""
    env = dict(os.environ) if env is None else env
    out = out or sys.stdout
    shell = env.get(VAR, "").removeprefix("complete_")
    if shell not in ("bash", "zsh", "fish", "powershell", "pwsh"):
        sys.stderr.write(f"ctl: unsupported completion instruction {env.get(VAR)!r}\n")
        return 1
    args, incomplete = _words(shell, env)
    found = candidates(args, incomplete)
    if shell == "bash":
        text = "\n".join(found)
    elif shell == "zsh":
        text = ("_arguments '*: :((" + "\n".join(f'"{_zsh_quote(v)}"' for v in found) + "))'") if found else "_files"
    elif shell == "fish":
        if env.get("_TYPER_COMPLETE_FISH_ACTION") == "is-args":
            return 0 if found else 1
        text = "\n".join(found)
    else:
        text = "\n".join(f"{v}::: " for v in found)
    if text:
        out.write(text)
    out.flush()
    return 0


# --- the spec, from the typer app -----------------------------------------------------------------


def build_spec() -> dict[str, Any]:
    """The command tree of the typer app, as `candidates` walks it (imports typer and every cli module)."""
    import typer.main

    from controller.cli.main import load_app

    names = {fn: kind for kind, fn in KINDS.items()}

    def kind_of(param: Any) -> str:
        info = getattr(getattr(param, "type_descriptor", None), "parameter_info", None)
        fn = getattr(info, "autocompletion", None)
        return names.get(fn, "") if fn is not None else ""

    def node(cmd: Any) -> dict[str, Any]:
        opts: dict[str, str | None] = {}
        args: list[list[Any]] = []
        for p in cmd.params:
            if p.param_type_name == "argument":
                args.append([kind_of(p), p.nargs])
            elif not getattr(p, "hidden", False):
                takes = None if (p.is_flag or p.count) else kind_of(p)
                for o in [*p.opts, *p.secondary_opts]:
                    opts[o] = takes
        out: dict[str, Any] = {"opts": opts, "args": args}
        subs = getattr(cmd, "commands", None)
        if subs:
            out["commands"] = {n: node(c) for n, c in sorted(subs.items()) if not getattr(c, "hidden", False)}
        return out

    return node(typer.main.get_command(load_app()))


def write_spec(path: Path | None = None) -> Path:
    import pprint

    path = path or Path(__file__).with_name("compspec.py")
    text = ('"""The command tree `ctl` completes against (cli/complete.py). Generated: do not edit; after changing a\n'
            'command, run `python -m controller.cli.complete --write` (tests/test_completion.py checks it)."""\n\n'
            "from __future__ import annotations\n\n"
            "TYPE_CHECKING = False  # typing is not imported to answer a TAB\n"
            "if TYPE_CHECKING:\n    from typing import Any\n\n"
            f"SPEC: dict[str, Any] = {pprint.pformat(build_spec(), width=116, sort_dicts=True)}\n")
    path.write_text(text)
    return path


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        from controller.cli import complete  # this file as the cli modules import it, not as __main__

        sys.stdout.write(f"wrote {complete.write_spec()}\n")
    else:
        sys.stderr.write("usage: python -m controller.cli.complete --write\n")
        sys.exit(2)
