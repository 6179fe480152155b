"""Delivering events to notification sinks: each sink has its own queue and worker thread, so a slow or
failing sink never delays polling or the other sinks. Delivery retries with backoff; a delivery that
still fails is reported back (the supervisor records it as an event of its own).

    https://...        POST the event as JSON; headers X-Ctl-Timestamp and X-Ctl-Signature
                       (sha256=HMAC-SHA256 over "<timestamp>.<body>", key from the variable the inventory names);
                       the body's event_id is the same in every retry. http:// only to loopback, with a flag
    slack:https://...  POST a Slack-compatible {"text": ...}
    env:NAME           either of those read from the variable NAME (environment or supervise.env): a Slack
                       URL is a secret, kept out of command lines
    cmd:PROGRAM ARGS   run PROGRAM (no shell, a minimal environment) with the event's JSON on stdin
A redirect is a failed delivery (never followed).
"""

from __future__ import annotations

import os
import queue
import shlex
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from controller.core.supervision import Sink, body, sign, slack_text
from controller.settings import notify_retries

TIMEOUT_S = 10.0  # one delivery attempt


class Deliverer:
    """One worker per sink. `send(doc)` returns at once."""

    def __init__(self, sinks: list[Sink], secret: bytes | None, on_failure: Callable[[Sink, dict[str, Any], str], None],
                 *, retries: tuple[float, ...] | None = None) -> None:
        self.sinks, self.secret, self.on_failure = sinks, secret, on_failure
        self.retries = retries if retries is not None else notify_retries()
        self._queues: list[queue.Queue[dict[str, Any] | None]] = []
        self._threads: list[threading.Thread] = []
        for s in sinks:
            q: queue.Queue[dict[str, Any] | None] = queue.Queue()
            th = threading.Thread(target=self._work, args=(s, q), name=f"notify-{s.kind}", daemon=True)
            th.start()
            self._queues.append(q)
            self._threads.append(th)

    def send(self, doc: dict[str, Any]) -> None:
        for q in self._queues:
            q.put(doc)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop after what is queued, waiting at most wait_s in all: Ctrl-C must not hang on a dead sink (what is
        still queued then is lost, and the supervisor says so by its exit)."""
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + wait_s
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))

    def _work(self, sink: Sink, q: queue.Queue[dict[str, Any] | None]) -> None:
        while True:
            doc = q.get()
            if doc is None:
                return
            error = None
            for attempt, wait in enumerate((0.0, *self.retries)):
                if wait:
                    time.sleep(wait)
                try:
                    deliver(sink, doc, self.secret)
                    error = None
                    break
                except Exception as e:
                    error = f"attempt {attempt + 1}: {type(e).__name__}: {e}"
            if error is not None:
                self.on_failure(sink, doc, error)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is a failed delivery: following it would send the signed event (and its headers) to wherever the
    answer points, and count that answer as delivered."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None  # urllib then raises HTTPError(code)


def _opener() -> urllib.request.OpenerDirector:
    # built per delivery, not at import: its proxy handler reads the whole environment (getproxies), and the
    # command server preloads this module while it records which variables its imports read
    return urllib.request.build_opener(_NoRedirects)


# What a cmd: sink's program gets of the supervisor's environment (which holds PVE tokens and the webhook key):
# enough to find programs, write files and print text, nothing else.
CMD_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")


def cmd_env() -> dict[str, str]:
    return {k: v for k in CMD_ENV if (v := os.environ.get(k)) is not None}


def deliver(sink: Sink, doc: dict[str, Any], secret: bytes | None) -> None:
    """One attempt; raises on any failure (HTTP status >= 300 including any redirect, timeout, non-zero exit).
    Error texts name the sink by its label, never its URL."""
    try:
        _deliver(sink, doc, secret)
    except Exception as e:
        text = str(e)
        if sink.kind != "cmd" and sink.target in text:
            raise RuntimeError(text.replace(sink.target, sink.label())) from None
        raise


def _deliver(sink: Sink, doc: dict[str, Any], secret: bytes | None) -> None:
    if sink.kind == "cmd":
        argv = shlex.split(sink.target)
        r = subprocess.run(argv, input=body(doc), capture_output=True, timeout=TIMEOUT_S, check=False,
                           env=cmd_env())
        if r.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {r.returncode}: {r.stderr.decode(errors='replace')[-200:]}")
        return
    if sink.kind == "slack":
        payload = body(slack_text(doc))
        headers = {"Content-Type": "application/json"}
    else:
        payload = body(doc)
        ts = str(int(time.time()))
        headers = {"Content-Type": "application/json", "X-Ctl-Timestamp": ts, "User-Agent": "ctl-supervise"}
        if secret is not None:
            headers["X-Ctl-Signature"] = sign(secret, ts, payload)
    req = urllib.request.Request(sink.target, data=payload, headers=headers, method="POST")  # noqa: S310 - http(s) only
    with _opener().open(req, timeout=TIMEOUT_S) as resp:
        if resp.status >= 300:
            raise urllib.error.HTTPError(sink.label(), resp.status, resp.reason, resp.headers, None)
