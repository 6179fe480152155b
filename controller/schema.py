"""Frozen dataclasses built from parsed YAML, checked field by field: the inventory's models without pydantic.

pydantic cost every ctl command about 0.2 s before it did anything (its import and the building of the models'
validators); these records need a small part of it: the types below, bounds, a check per field or per record,
and one message naming the key. `build(Cls, data)` returns a `Cls` or raises `SchemaError(loc, message)`, where
loc is the path of keys and indices to the offending value (yamlpos.py turns it into a line).

Supported field types: str, int, float, bool, Any, Literal[...], X | None, unions of these, list[X], dict[str, X]
and nested records. Conversions are those YAML users expect: an int field takes 22 or "22" (not 22.5, not true),
a float field an int, a bool field true/false (or yes/no, on/off, 1/0 written as strings).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["BOOL_WORDS", "SchemaError", "build", "dump", "spec"]

_MISSING = dataclasses.MISSING
BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False,
               "0": False}


class SchemaError(Exception):
    def __init__(self, loc: tuple[Any, ...], message: str, *, mismatch: bool = False) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message
        self.mismatch = mismatch  # the value is not of the type at all (a union then tries its next member)


def spec(default: Any = _MISSING, *, factory: Callable[[], Any] | None = None, ge: float | None = None,
         gt: float | None = None, le: float | None = None, min_items: int | None = None,
         check: Callable[[Any], Any] | None = None) -> Any:
    """A record field with bounds and a check: `check(value)` returns the value to keep (it may normalise it)
    or raises ValueError with the message to show."""
    meta = {"ge": ge, "gt": gt, "le": le, "min_items": min_items, "check": check}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


_hints: dict[type, dict[str, Any]] = {}


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = _hints.get(cls)
    if hints is None:
        hints = _hints[cls] = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def build(cls: type, data: Any, loc: tuple[Any, ...] = ()) -> Any:
    """`data` (a mapping) as a `cls` record; its `_check()` method, when it has one, runs last."""
    if not isinstance(data, dict):
        raise SchemaError(loc, "must be a mapping of " + ", ".join(f.name for f in dataclasses.fields(cls)),
                          mismatch=True)
    known = {f.name: (f, tp) for f, tp in _fields(cls)}
    for key in data:
        if key not in known:
            raise SchemaError((*loc, key), "unknown key")
    values: dict[str, Any] = {}
    for name, (f, tp) in known.items():
        if name not in data:
            if f.default is _MISSING and f.default_factory is _MISSING:
                raise SchemaError((*loc, name), "required key is missing")
            continue
        values[name] = _field(f, tp, data[name], (*loc, name))
    obj = cls(**values)
    check = getattr(obj, "_check", None)
    if check is not None:
        try:
            check()
        except ValueError as e:
            raise SchemaError(loc, str(e)) from None
    return obj


def _field(f: dataclasses.Field[Any], tp: Any, value: Any, loc: tuple[Any, ...]) -> Any:
    out = convert(tp, value, loc)
    meta = f.metadata
    if out is None:
        return out
    if isinstance(out, int | float):
        ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
        for limit, word, broken in ((ge, ">=", ge is not None and out < ge), (gt, ">", gt is not None and out <= gt),
                                    (le, "<=", le is not None and out > le)):
            if broken:
                raise SchemaError(loc, f"must be {word} {limit}, not {out}")
    if meta.get("min_items") is not None and len(out) < meta["min_items"]:
        raise SchemaError(loc, f"must have at least {meta['min_items']} item(s)")
    if meta.get("check") is not None:
        try:
            out = meta["check"](out)
        except ValueError as e:
            raise SchemaError(loc, str(e)) from None
    return out


def describe(tp: Any) -> str:
    """What a value of type `tp` is, for a message: "an integer", "'pct', 'ssh' or 'local'"."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        words = [repr(a) for a in typing.get_args(tp)]
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, "a mapping")


def convert(tp: Any, value: Any, loc: tuple[Any, ...]) -> Any:
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(tp)
        if value is None and type(None) in members:
            return None
        for m in members:
            if m is type(None):
                continue
            try:
                return convert(m, value, loc)
            except SchemaError as e:
                if not e.mismatch or e.loc != loc:  # right shape, wrong inside or out of bounds: that is the message
                    raise
        raise SchemaError(loc, f"must be {describe(tp)}, not {_shown(value)}", mismatch=True)
    if origin is typing.Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise SchemaError(loc, f"must be {describe(tp)}, not {value!r}", mismatch=True)
    if origin is list:
        if not isinstance(value, list):
            raise SchemaError(loc, "must be a list", mismatch=True)
        (item,) = typing.get_args(tp)
        return [convert(item, v, (*loc, i)) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(loc, "must be a mapping", mismatch=True)
        key_tp, value_tp = typing.get_args(tp)
        mapping: dict[Any, Any] = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise SchemaError((*loc, k), f"the key {k!r} must be a string (quote it)")
            mapping[k] = convert(value_tp, v, (*loc, k))
        return mapping
    if dataclasses.is_dataclass(tp):
        return build(tp, value, loc)  # type: ignore[arg-type]
    if tp is str:
        if isinstance(value, str):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int | str) and str(value).strip().lower() in BOOL_WORDS:
            return BOOL_WORDS[str(value).strip().lower()]
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                out = float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise SchemaError(loc, f"must be a finite number, not a {len(str(abs(value)))}-digit integer",
                                  mismatch=True) from None
            if not math.isfinite(out):
                raise SchemaError(loc, f"must be a finite number, not {value!r}", mismatch=True)
            return out
        if isinstance(value, str):
            try:
                parsed = float(value.strip())
            except ValueError:
                pass
            else:
                if math.isfinite(parsed):
                    return parsed
    else:
        raise TypeError(f"no conversion to {tp!r}")
    raise SchemaError(loc, f"must be {describe(tp)}, not {_shown(value)}", mismatch=True)


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def dump(obj: Any) -> Any:
    """A record as plain data (mappings, lists, scalars), as it could be written back to YAML or JSON."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else obj
