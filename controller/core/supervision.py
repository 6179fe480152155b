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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from controller.core.terminal import clean_line
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

    kind: str  # verdict | restart | gave_up | refused | checkpoint_skipped | notify_failed | supervisor
    run: str  # CT/NAME
    ct: str
    host: str | None
    before: str | None
    after: str | None
    summary: str
    action: str
    time: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)  # exit, crash, tok/s vs baseline, log, last lines...
    # unique per event, the same in every retry of its delivery: a receiver drops what it has seen
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def doc(self) -> dict[str, Any]:
        return {"event_id": self.event_id, "kind": self.kind, "run": self.run, "ct": self.ct, "host": self.host,
                "from": self.before, "to": self.after, "summary": self.summary, "action": self.action,
                "time": self.time, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time)),
                **self.detail}


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


MAX_AGE_S = 300  # a signed event older (or this far in the future) is refused: a replay


def verify(secret: bytes, timestamp: str, payload: bytes, signature: str, *, now: float | None = None,
           max_age_s: float = MAX_AGE_S) -> bool:
    """The receiver's check: the signature matches AND the timestamp is within max_age_s of now (a captured
    request replayed later fails). De-duplicate retried deliveries by the body's `event_id`."""
    try:
        age = (time.time() if now is None else now) - int(timestamp)
    except ValueError:
        return False
    return abs(age) <= max_age_s and hmac.compare_digest(sign(secret, timestamp, payload), signature)


def slack_escape(value: object) -> str:
    """One inserted string for Slack's mrkdwn: terminal escapes and control characters made visible (a log line
    is untrusted), `&`, `<`, `>` as entities (no `<!channel>` ping, no `<url|disguised>` link), and backticks
    replaced by a look-alike so no line can close the code block or start one."""
    text = clean_line(str(value))
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("`", "\u02cb")


def slack_text(doc: dict[str, Any]) -> dict[str, Any]:
    """A Slack-compatible message: the summary, what was done, and where to look; every inserted string, the
    last log lines first, through slack_escape."""
    e = slack_escape
    lines = [f"*{e(doc.get('summary'))}*", f"action: {e(doc.get('action'))}"]
    if doc.get("log"):
        lines.append(f"log: `{e(doc['log'])}` on {e(doc.get('ct'))} ({e(doc.get('host') or 'local')})")
    if doc.get("look"):
        lines.append(f"look: `{e(doc['look'])}`")
    tail = doc.get("last_lines") or []
    if tail:
        lines.append("```\n" + "\n".join(e(x) for x in tail[-20:]) + "\n```")
    return {"text": "\n".join(lines)}


@dataclass(frozen=True)
class Sink:
    kind: str  # webhook | slack | cmd
    target: str  # URL, or the program's command line
    # where the text came from when it was not given literally (`env:NAME`): shown instead of the URL
    source: str | None = None

    @classmethod
    def parse(cls, text: str, *, allow_http_loopback: bool = False,
              lookup: Callable[[str], str | None] | None = None) -> Sink:
        """`https://...`, `slack:https://...`, `cmd:PROGRAM [ARGS]`, or `env:NAME` / `slack:env:NAME`: the URL
        (or the whole sink) read from the variable NAME by `lookup` (the environment, then supervise.env), so a
        secret URL never sits in a command line. http:// only to a loopback address, with allow_http_loopback."""
        kind, rest = ("slack", text[len("slack:"):]) if text.startswith("slack:") else ("webhook", text)
        source = None
        m = re.fullmatch(r"env:([A-Za-z_][A-Za-z0-9_]*)", rest)
        if m is not None:
            got = lookup(m[1]) if lookup is not None else None
            if not got:
                raise InputError(f"--notify {text!r}: variable {m[1]} is not set (in the environment or "
                                 "supervise.env)")
            source, rest = f"${m[1]}", got.strip()
            if kind == "webhook" and rest.startswith(("slack:", "cmd:")):
                inner = cls.parse(rest, allow_http_loopback=allow_http_loopback)
                return cls(inner.kind, inner.target, source)
        if kind == "webhook" and rest.startswith("cmd:"):
            prog = rest[len("cmd:"):].strip()
            if not prog:
                raise InputError(f"--notify {text!r}: cmd: needs a program (cmd:PROGRAM [ARGS])")
            return cls("cmd", prog, source)
        _check_url(rest, text if source is None else f"{text} (from {source})", allow_http_loopback)
        return cls(kind, rest, source)

    def label(self) -> str:
        """What events, errors and the console show: the URL's scheme and host only (its path is the
        secret of a Slack webhook), or the variable it came from."""
        if self.kind == "cmd":
            return f"cmd:{self.target}"
        shown = self.source or redact_url(self.target)
        return f"slack:{shown}" if self.kind == "slack" else shown


def redact_url(url: str) -> str:
    """`https://hooks.slack.com/<redacted>`: scheme and host kept, path, query and user info hidden."""
    m = re.fullmatch(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?:[^/@\s]*@)?(?P<host>[^/?#\s]*)(?P<rest>.*)", url,
                     re.DOTALL)
    if m is None:
        return "<redacted>"
    return m["scheme"] + m["host"] + ("/<redacted>" if m["rest"] not in ("", "/") else m["rest"])


def redact_sink(text: str) -> str:
    """A sink as given (`slack:https://hooks.slack.com/services/...`), for display: URL paths hidden."""
    if text.startswith("slack:"):
        return "slack:" + redact_sink(text[len("slack:"):])
    return redact_url(text) if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text) else text


_LOOPBACK = re.compile(r"(?:127(?:\.\d{1,3}){3}|\[::1\]|localhost)(?::\d{1,5})?")


def _check_url(url: str, given: str, allow_http_loopback: bool = False) -> None:
    m = re.fullmatch(r"(https?)://([^\s/?#]+)([/?]\S*)?", url)
    if m is None:
        raise InputError(f"--notify {given!r}: use https://..., slack:https://..., env:NAME or cmd:PROGRAM")
    if m[1] == "http" and not (allow_http_loopback and _LOOPBACK.fullmatch(m[2])):
        raise InputError(f"--notify {given!r}: events go over https only (signatures and Slack URLs must not "
                         "cross a network in clear); --allow-http-loopback permits http:// to 127.0.0.1 or ::1")
