"""Option values converted without pydantic.

typer (0.20+) converts every parameter's value through a pydantic TypeAdapter that it builds on each run: for a
plain `ctl deploy ct200` that is the pydantic import and three adapters, about 0.13 s of a command that otherwise
costs one round trip. ctl's parameters are all plain (str, int, float, bool, Path and lists of them, a few with
`min`), so `install` gives each of those a converter of its own before click parses the line; anything else, or a
typer whose internals moved, keeps typer's own conversion (slower, not wrong). tests/test_cli_startup.py checks
that a command imports no pydantic, and the messages below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controller.schema import BOOL_WORDS


def _int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"{value!r} is not an integer") from None


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None
    if not math.isfinite(out):  # a wait of `inf` seconds, or a ratio of `nan`, is never what was meant
        raise ValueError(f"{value!r} is not a finite number")
    return out


def _str(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    out = BOOL_WORDS.get(str(value).strip().lower())
    if out is None:
        raise ValueError(f"{value!r} is not true or false")
    return out


def _path(value: Any) -> Path:
    return value if isinstance(value, Path) else Path(str(value))


LEAVES: dict[Any, Callable[[Any], Any]] = {int: _int, float: _float, str: _str, bool: _bool, Path: _path}


def converter(annotation: Any, info: Any) -> Callable[[Any], Any] | None:
    """The converter of a parameter typer describes by `annotation` and its ParameterInfo `info`, or None when it
    is not one of the plain kinds (typer then converts it itself)."""
    plain = (info.parser is None and getattr(info, "click_type", None) is None and not info.clamp
             and not info.exists and not info.resolve_path and info.path_type is None and info.file_okay
             and info.dir_okay and not info.writable and info.readable and not info.allow_dash)
    if not plain:
        return None
    origin = getattr(annotation, "__origin__", None)
    if origin is list:
        (item,) = annotation.__args__
        one = converter(item, info)
        return None if one is None else lambda v: [one(x) for x in (v if isinstance(v, list | tuple) else [v])]
    leaf = LEAVES.get(annotation)
    if leaf is None or (annotation not in (int, float) and (info.min is not None or info.max is not None)):
        return None
    lo, hi = info.min, info.max
    if lo is None and hi is None:
        return leaf

    def ranged(value: Any) -> Any:
        out = leaf(value)
        if lo is not None and out < lo:
            raise ValueError(f"must be >= {lo}, not {value}")
        if hi is not None and out > hi:
            raise ValueError(f"must be <= {hi}, not {value}")
        return out

    return ranged


def install(command: Any) -> int:
    """Give every plain parameter of `command` and its subcommands a converter that needs no pydantic; returns
    how many it gave one (0 when this typer's internals are not the ones known here)."""
    try:
        from typer._click import Context
        from typer._click.exceptions import BadParameter
        from typer._coercion import RuntimeParam
    except ImportError:
        return 0
    if not hasattr(RuntimeParam, "_coerce_value"):
        return 0

    class Plain(RuntimeParam):
        def __init__(self, info: Any, annotation: Any, convert: Callable[[Any], Any]) -> None:
            super().__init__(parameter_info=info, annotation=annotation)
            object.__setattr__(self, "convert", convert)

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            try:
                return self.convert(value)  # type: ignore[attr-defined]
            except ValueError as e:
                raise BadParameter(str(e), ctx=ctx, param=param) from None

    done = 0
    todo = [command]
    while todo:
        cmd = todo.pop()
        todo.extend(getattr(cmd, "commands", {}).values())
        params = list(cmd.params)
        help_of = getattr(cmd, "get_help_option", None)
        if help_of is not None:  # --help is made on first use, outside cmd.params: made now, converted here too
            params.append(help_of(Context(cmd, **(cmd.context_settings or {}))))
        for p in params:
            if p is None:
                continue
            desc = getattr(p, "type_descriptor", None)
            if desc is None or getattr(p, "_runtime_param", False) is not None or desc.file_annotation is not None:
                continue
            convert = converter(desc.annotation, desc.parameter_info)
            if convert is not None:
                p._runtime_param = Plain(desc.parameter_info, desc.annotation, convert)
                done += 1
    return done
