"""controller/schema.py: the inventory's records built from parsed YAML, each bad value refused with one message
and the path of keys to it (test_inventory.py checks the same through `load`, with file lines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest

from controller.schema import SchemaError, build, dump, spec


def _even(v: int) -> int:
    if v % 2:
        raise ValueError("must be even")
    return v


@dataclass(frozen=True)
class Inner:
    name: str
    size: int = spec(1, ge=1, le=8)

    def _check(self) -> None:
        if self.name == "bad":
            raise ValueError("'bad' is not a name")


@dataclass(frozen=True)
class Outer:
    items: dict[str, Inner]
    kind: Literal["a", "b"] = "a"
    count: int | Literal["auto"] = spec("auto")
    ratio: float = spec(0.5, gt=0, le=1)
    flag: bool = False
    even: int = spec(0, check=_even)
    inner: Inner | None = None
    tags: list[str] = spec(factory=list, min_items=0)
    nodes: list[int] = spec(factory=lambda: [1], min_items=1)
    extra: dict[str, Any] = spec(factory=dict)


def err(data: Any) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(SchemaError) as e:
        build(Outer, data)
    return e.value.loc, e.value.message


def test_a_good_mapping_builds_frozen_records_with_defaults_and_converted_values() -> None:
    o = build(Outer, {"items": {"x": {"name": "n", "size": "3"}}, "count": "4", "ratio": 1, "flag": "yes",
                      "inner": {"name": "i"}, "extra": {"k": [1, {"a": None}]}})
    assert o == Outer(items={"x": Inner("n", 3)}, count=4, ratio=1.0, flag=True, inner=Inner("i"),
                      extra={"k": [1, {"a": None}]})
    assert (o.kind, o.tags, o.nodes) == ("a", [], [1])
    assert build(Outer, {"items": {}}).count == "auto"
    assert dump(o)["items"] == {"x": {"name": "n", "size": 3}}
    with pytest.raises(AttributeError):
        o.kind = "b"  # type: ignore[misc]


@pytest.mark.parametrize(("data", "loc", "message"), [
    ({}, ("items",), "required key is missing"),
    ({"items": {}, "colour": 1}, ("colour",), "unknown key"),
    ({"items": []}, ("items",), "must be a mapping"),
    ({"items": {"x": {"name": "n", "sise": 2}}}, ("items", "x", "sise"), "unknown key"),
    ({"items": {"x": {"size": 2}}}, ("items", "x", "name"), "required key is missing"),
    ({"items": {"x": {"name": "n", "size": 9}}}, ("items", "x", "size"), "must be <= 8, not 9"),
    ({"items": {"x": {"name": "n", "size": 2.5}}}, ("items", "x", "size"), "must be an integer, not 2.5"),
    ({"items": {"x": {"name": "n", "size": True}}}, ("items", "x", "size"), "must be an integer, not True"),
    ({"items": {"x": {"name": 5}}}, ("items", "x", "name"), "must be a string, not 5"),
    ({"items": {"x": {"name": "bad"}}}, ("items", "x"), "'bad' is not a name"),
    ({"items": {}, "inner": {"name": "bad"}}, ("inner",), "'bad' is not a name"),  # not "must be a mapping"
    ({"items": {}, "inner": {"size": 0, "name": "n"}}, ("inner", "size"), "must be >= 1, not 0"),
    ({"items": {}, "inner": "n"}, ("inner",), "must be a mapping, not 'n'"),
    ({"items": {}, "inner": {"name": 5}}, ("inner", "name"), "must be a string, not 5"),  # not "inner: must be..."
    ({"items": {}, "ratio": 10**400}, ("ratio",), "must be a finite number, not a 401-digit integer"),
    ({"items": {}, "kind": "c"}, ("kind",), "must be 'a' or 'b', not 'c'"),
    ({"items": {}, "count": "many"}, ("count",), "must be an integer or 'auto', not 'many'"),
    ({"items": {}, "ratio": 0}, ("ratio",), "must be > 0, not 0.0"),
    ({"items": {}, "ratio": ".nan"}, ("ratio",), "must be a number, not '.nan'"),
    ({"items": {}, "ratio": float("inf")}, ("ratio",), "must be a finite number, not inf"),
    ({"items": {}, "flag": "maybe"}, ("flag",), "must be true or false, not 'maybe'"),
    ({"items": {}, "even": 3}, ("even",), "must be even"),
    ({"items": {}, "tags": "a,b"}, ("tags",), "must be a list"),
    ({"items": {}, "tags": ["a", 2]}, ("tags", 1), "must be a string, not 2"),
    ({"items": {}, "nodes": []}, ("nodes",), "must have at least 1 item(s)"),
    ({"items": {}, "extra": {1: "x"}}, ("extra", 1), "the key 1 must be a string (quote it)"),
    (["items"], (), "must be a mapping of items, kind, count, ratio, flag, even, inner, tags, nodes, extra"),
])
def test_each_bad_value_is_named_by_its_path_with_one_message(data: Any, loc: tuple[Any, ...], message: str) -> None:
    assert err(data) == (loc, message)
