"""The command tree completion walks (compspec.py), generated from the typer app: run
`python -m controller.launch.specgen --write` after changing a command (tests/test_completion.py checks it).

Apart from complete.py because it imports typer and every cli module: a TAB never does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from controller.cli.names import KINDS


def build_spec() -> dict[str, Any]:
    """The command tree of the typer app, as `candidates` walks it (imports typer and every cli module)."""
    import typer.main

    from controller.launch.main import load_app

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
    text = ('"""The command tree `ctl` completes against (launch/complete.py). Generated: do not edit; after\n'
            'changing a command, run `python -m controller.launch.specgen --write`\n'
            '(tests/test_completion.py checks it)."""\n\n'
            "from __future__ import annotations\n\n"
            "TYPE_CHECKING = False  # typing is not imported to answer a TAB\n"
            "if TYPE_CHECKING:\n    from typing import Any\n\n"
            f"SPEC: dict[str, Any] = {pprint.pformat(build_spec(), width=116, sort_dicts=True)}\n")
    path.write_text(text)
    return path


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        from controller.launch import specgen  # this file as a module, not as __main__

        sys.stdout.write(f"wrote {specgen.write_spec()}\n")
    else:
        sys.stderr.write("usage: python -m controller.launch.specgen --write\n")
        sys.exit(2)
