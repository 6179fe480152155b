"""Where each key of a YAML document is: so that an error in the inventory or a runbook names its line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import yaml

Path_ = tuple[Any, ...]


class DuplicateKey(ValueError):
    def __init__(self, line: int, path: Path_) -> None:
        super().__init__(f"duplicate key {dotted(path)}")
        self.line, self.path = line, path


def line_index(node: yaml.Node, *, unique: bool = False) -> dict[Path_, int]:
    """Every key path of the document -> the 1-based line where it appears (a key's own line for mappings).
    With `unique`, a key given twice in one mapping raises DuplicateKey (YAML keeps the last silently)."""
    import yaml  # here, not at import: a command whose inventory parse is cached never loads PyYAML

    out: dict[Path_, int] = {}

    def walk(n: yaml.Node, path: Path_) -> None:
        out.setdefault(path, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            seen: set[Any] = set()
            for k, v in n.value:
                if unique and k.value in seen:
                    raise DuplicateKey(k.start_mark.line + 1, (*path, k.value))
                seen.add(k.value)
                out.setdefault((*path, k.value), k.start_mark.line + 1)
                walk(v, (*path, k.value))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, (*path, i))

    walk(node, ())
    return out


def nearest_line(lines: dict[Path_, int], loc: Path_) -> int | None:
    """The line of `loc`, or of its closest ancestor that has one (a missing key's parent)."""
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return None


def dotted(loc: Path_) -> str:
    """('containers', 'ct200', 'gpus', 0) -> 'containers.ct200.gpus[0]'; a key with a control character (a
    newline) shown as Python writes it, so the message stays one line."""
    out = ""
    for part in loc:
        text = str(part) if str(part).isprintable() else repr(str(part))
        out += f"[{part}]" if isinstance(part, int) else (f".{text}" if out else text)
    return out
