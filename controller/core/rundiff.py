"""`ctl diff RUN_A RUN_B`: the answer to "what changed since the last run that worked"."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any

from controller.registry import RunRecord


@dataclass(frozen=True)
class RunDiff:
    a: str
    b: str
    commit: tuple[str | None, str | None]
    files: list[tuple[str, str | None, str | None]] = field(default_factory=list)  # dest, sha a, sha b
    rendered: dict[str, str] = field(default_factory=dict)  # dest -> unified diff
    vars: list[tuple[str, Any, Any]] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    env_fingerprint: tuple[str | None, str | None] = (None, None)

    @property
    def same(self) -> bool:
        return not (self.files or self.rendered or self.vars or self.env
                    or self.env_fingerprint[0] != self.env_fingerprint[1])

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "same": self.same, "commit": list(self.commit),
            "files": [{"dest": d, "a": x, "b": y} for d, x, y in self.files],
            "rendered": self.rendered, "vars": [{"key": k, "a": x, "b": y} for k, x, y in self.vars],
            "env_fingerprint": list(self.env_fingerprint), "env": self.env,
        }

    def render(self) -> str:
        out = [f"diff {self.a} -> {self.b}"]
        if self.same:
            out.append("no difference in payload, rendered scripts, variables or environment")
        ca, cb = self.commit
        out.append(f"commit: {ca or '-'} -> {cb or '-'}" if ca != cb else f"commit: {ca or '-'} (same)")
        if self.files:
            out.append("payload files:")
            for d, x, y in self.files:
                out.append(f"  {d}: {(x or 'absent')[:12]} -> {(y or 'absent')[:12]}")
        for dest, text in self.rendered.items():
            out.append(f"rendered {dest}:")
            out.append(text.rstrip("\n"))
        if self.vars:
            out.append("template variables:")
            for k, x, y in self.vars:
                out.append(f"  {k}: {json.dumps(x)} -> {json.dumps(y)}")
        fa, fb = self.env_fingerprint
        if fa != fb:
            out.append(f"environment fingerprint: {fa or 'not recorded'} -> {fb or 'not recorded'}")
        for line in self.env:
            out.append(f"  {line}")
        return "\n".join(out)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def diff(a: RunRecord, b: RunRecord) -> RunDiff:
    """Records made before secrets were redacted at launch are redacted here: a diff never shows a secret."""
    from dataclasses import replace

    from controller.core.redact import redact_rendered, redact_vars, secret_values

    known = secret_values(a.vars) | secret_values(b.vars)
    a = replace(a, vars=redact_vars(a.vars), rendered=redact_rendered(a.rendered, known))
    b = replace(b, vars=redact_vars(b.vars), rendered=redact_rendered(b.rendered, known))
    files = [(d, a.files.get(d), b.files.get(d)) for d in sorted(set(a.files) | set(b.files))
             if a.files.get(d) != b.files.get(d)]
    rendered = {}
    for dest in sorted(set(a.rendered) | set(b.rendered)):
        x, y = a.rendered.get(dest, ""), b.rendered.get(dest, "")
        if x != y:
            rendered[dest] = "".join(difflib.unified_diff(
                x.splitlines(keepends=True), y.splitlines(keepends=True),
                fromfile=f"{a.ct}/{a.name}:{dest}", tofile=f"{b.ct}/{b.name}:{dest}"))
    va, vb = _flatten(a.vars), _flatten(b.vars)
    vars_ = [(k, va.get(k), vb.get(k)) for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)]
    env: list[str] = []
    if a.env and b.env:
        from controller.core import envlock

        pa = envlock.Probe.from_json(json.dumps(a.env), f"run {a.name}")
        pb = envlock.Probe.from_json(json.dumps(b.env), f"run {b.name}")
        env = [c.message for c in envlock.diff_probes(pa, pb)]
    return RunDiff(f"{a.ct}/{a.name}", f"{b.ct}/{b.name}", (a.commit_sha, b.commit_sha), files, rendered, vars_, env,
                   (a.env_fingerprint, b.env_fingerprint))


def diff_nodes(a: RunRecord, a_nodes: list[RunRecord], b: RunRecord, b_nodes: list[RunRecord]) -> RunDiff:
    """Runs across several containers (or one of each kind), node by node: node i of A against node i of B,
    each difference named `nodeI`; a run of one container counts as one node. Different node counts or
    containers show as variables (`nodes`, `nodeI.ct`)."""
    xs, ys = a_nodes or [a], b_nodes or [b]
    out = RunDiff(f"{a.ct}/{a.name}", f"{b.ct}/{b.name}", (a.commit_sha, b.commit_sha))
    if len(xs) != len(ys):
        out.vars.append(("nodes", len(xs), len(ys)))
    fps: tuple[list[str], list[str]] = ([], [])
    for i in range(max(len(xs), len(ys))):
        x, y = (xs[i] if i < len(xs) else None), (ys[i] if i < len(ys) else None)
        tag = f"node{i}"
        if x is None or y is None:
            out.vars.append((f"{tag}.ct", x.ct if x else None, y.ct if y else None))
            continue
        if x.ct != y.ct:
            out.vars.append((f"{tag}.ct", x.ct, y.ct))
        d = diff(x, y)
        out.files.extend((f"{tag}:{dest}", p, q) for dest, p, q in d.files)
        out.rendered.update({f"{tag}:{dest}": text for dest, text in d.rendered.items()})
        out.vars.extend((f"{tag}.{k}", p, q) for k, p, q in d.vars)
        out.env.extend(f"{tag}: {line}" for line in d.env)
        fps[0].append(x.env_fingerprint or "-")
        fps[1].append(y.env_fingerprint or "-")
    fa, fb = ",".join(fps[0]), ",".join(fps[1])
    return RunDiff(out.a, out.b, out.commit, out.files, out.rendered, out.vars, out.env,
                   (fa if fa.strip("-,") else None, fb if fb.strip("-,") else None))
