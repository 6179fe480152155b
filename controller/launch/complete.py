"""Shell completion: typer's protocol (`ctl --install-completion`, `--show-completion`), answered fast.

Typer answers a TAB by building the whole command tree: importing typer, pydantic (typer coerces values with
it) and every cli module, about half a second. ctl's entry point (launch/main.py) hands a completion request here
before importing any of that. The tree comes from `compspec.py`: the commands, options and arguments typer
would build, and which arguments take container, group, run or host names, generated from the app by
`python -m controller.launch.specgen --write` (tests/test_completion.py checks it matches the app). Names come
from cli/names.py (the inventory's names, one read-only registry query): no network, no paramiko, no jinja2,
no pydantic.
"""

from __future__ import annotations

import os
import shlex
import sys

from controller.cli.names import KINDS, names

TYPE_CHECKING = False  # the answer to a TAB does not pay for importing typing
if TYPE_CHECKING:
    from typing import Any

VAR = "_CTL_COMPLETE"
# Flags `ctl` accepts anywhere on the line (launch/main.py moves them before the verb).
ANYWHERE = ("--json", "--text", "--debug")


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
            from controller.launch.compspec import SPEC

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
