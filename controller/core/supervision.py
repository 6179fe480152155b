"""What `ctl supervise` decides, without I/O: restart policies, verdict changes as events, and the bytes a
notification sink receives (JSON signed with HMAC-SHA256, a Slack-style text).

An event says what someone woken at 3 a.m. needs: the run, its container and host, the verdict before and
after, the exit status or crash signature, throughput against the baseline, the log path, the last log
lines (sanitised before they reach a terminal or a chat), the command to look further, and what the
supervisor did about it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from controller.errors import InputError

# Verdicts as `ctl status` names them, plus the two only a supervisor gives.
UNREACHABLE = "unreachable"  # the host or container did not answer in time: never a crash, never restarted
STOPPED = "stopped"  # ended by `ctl stop`: never restarted
FAILURES = frozenset({"crashed", "stalled"})


@dataclass(frozen=True)
class Policy:
    """`--restart no | on-failure[:N] | always[:N]`: what to relaunch, and at most how many times per lineage."""

    mode: str = "no"
    max_restarts: int = 3

    @classmethod
    def parse(cls, text: str, default_max: int = 3) -> Policy:
        m = re.fullmatch(r"(no|on-failure|always)(?::(\d{1,4}))?", text.strip())
        if m is None:
            raise InputError(f"--restart {text!r}: use no, on-failure[:N] or always[:N] (N: restarts per lineage)")
        return cls(m.group(1), int(m.group(2)) if m.group(2) else default_max)

    def wants(self, verdict: str) -> bool:
        """Relaunch after this verdict? A crash or a stall with on-failure; a finished run too with always."""
        if self.mode == "no" or verdict in (UNREACHABLE, STOPPED):
            return False
        return verdict in FAILURES or (self.mode == "always" and verdict == "finished")

    def describe(self) -> str:
        return "no restarts" if self.mode == "no" else f"{self.mode}, at most {self.max_restarts} per lineage"


def backoff_s(base_s: float, restarts_so_far: int) -> float:
    """Seconds to wait before the next relaunch of a lineage: doubling, capped at an hour."""
    return float(min(base_s * (2 ** max(restarts_so_far, 0)), 3600.0))


@dataclass(frozen=True)
class Event:
    """One verdict change (or a supervisor action) of one run."""

    kind: str  # verdict | restart | gave_up | refused | notify_failed | supervisor
    run: str  # CT/NAME
    ct: str
    host: str | None
    before: str | None
    after: str | None
    summary: str
    action: str
    time: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)  # exit, crash, tok/s vs baseline, log, last lines...
    # one per event, the same in the registry and in every sink: a receiver drops a delivery it has seen
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def doc(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "run": self.run, "ct": self.ct, "host": self.host,
                "from": self.before, "to": self.after, "summary": self.summary, "action": self.action,
                "time": self.time,
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time)), **self.detail}


def summary_line(ev_run: str, before: str | None, after: str, reason: str) -> str:
    arrow = f"{before.upper()} -> " if before else ""
    return f"{ev_run}: {arrow}{after.upper()}: {reason}"


def body(doc: dict[str, Any]) -> bytes:
    """The exact bytes a webhook receives (and signs): canonical JSON."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign(secret: bytes, timestamp: str, payload: bytes) -> str:
    """`sha256=<hex>` of HMAC-SHA256 over `<timestamp>.<body>`: a receiver recomputes it and compares in
    constant time, and refuses an old timestamp (replays)."""
    mac = hmac.new(secret, timestamp.encode() + b"." + payload, hashlib.sha256).hexdigest()
    return f"sha256={mac}"


def verify(secret: bytes, timestamp: str, payload: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(secret, timestamp, payload), signature)


def slack_text(doc: dict[str, Any]) -> dict[str, Any]:
    """A Slack-compatible message: the summary, what was done, and where to look."""
    lines = [f"*{doc.get('summary')}*", f"action: {doc.get('action')}"]
    if doc.get("log"):
        lines.append(f"log: `{doc['log']}` on {doc.get('ct')} ({doc.get('host') or 'local'})")
    if doc.get("look"):
        lines.append(f"look: `{doc['look']}`")
    tail = doc.get("last_lines") or []
    if tail:
        lines.append("```\n" + "\n".join(str(x) for x in tail[-20:]) + "\n```")
    return {"text": "\n".join(lines)}


@dataclass(frozen=True)
class Sink:
    kind: str  # webhook | slack | cmd
    target: str  # URL, or the program's command line

    @classmethod
    def parse(cls, text: str) -> Sink:
        if text.startswith("slack:"):
            url = text[len("slack:"):]
            _check_url(url, text)
            return cls("slack", url)
        if text.startswith("cmd:"):
            prog = text[len("cmd:"):].strip()
            if not prog:
                raise InputError(f"--notify {text!r}: cmd: needs a program (cmd:PROGRAM [ARGS])")
            return cls("cmd", prog)
        _check_url(text, text)
        return cls("webhook", text)

    def label(self) -> str:
        return f"{self.kind}:{self.target}" if self.kind != "webhook" else self.target


def _check_url(url: str, given: str) -> None:
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
        raise InputError(f"--notify {given!r}: use https://..., slack:https://... or cmd:PROGRAM")
