"""Notification sinks after the second hardening pass (issue 40): Slack text takes no orders from a log, webhooks
are https only and never follow a redirect, sink URLs are secrets (from the environment or supervise.env, hidden
in labels, escaped in the systemd unit), signed events expire and carry an id, `cmd:` sinks get a minimal
environment. Real HTTP servers on loopback, real sink programs."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from controller.errors import InputError
from tests.helpers import wait_for

EVIL = ["```", "<!channel> wake up", "<https://evil.example|https://pve.internal/sso>", "a & b",
        "\x1b]52;c;cGF5bG9hZA==\x07clipboard", "```", "*bold* `tick`"]


class _Hook(http.server.BaseHTTPRequestHandler):
    got: ClassVar[list[tuple[str, dict[str, str], bytes]]] = []
    status = 204
    location = ""

    def _take(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        type(self).got.append((self.command, dict(self.headers), self.rfile.read(n)))
        self.send_response(self.status)
        if self.location:
            self.send_header("Location", self.location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET = _take

    def log_message(self, *args: Any) -> None:
        pass


def _serve(status: int = 204, location: str = "") -> tuple[http.server.ThreadingHTTPServer, type[_Hook]]:
    handler = type("H", (_Hook,), {"got": [], "status": status, "location": location})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, handler


def _slack_text(doc: dict[str, Any]) -> str:
    from controller.core.supervision import slack_text

    return str(slack_text(doc)["text"])


def test_slack_text_takes_no_orders_from_the_log() -> None:
    text = _slack_text({"summary": "ct200/fresh7: OK -> CRASHED: <!here>", "action": "none", "log": "/w/`x`.log",
                        "ct": "ct200", "host": "pve1", "look": "ctl tail ct200/fresh7", "last_lines": EVIL})
    lines = text.split("\n")
    assert [i for i, x in enumerate(lines) if "```" in x] == [len(lines) - 1 - len(EVIL) - 1, len(lines) - 1]
    assert lines[-1] == "```"  # the block closes where ctl closes it, and only there
    assert "<" not in text and ">" not in text  # no <!channel>, no <url|label> link, anywhere
    assert "&lt;!channel&gt; wake up" in text and "&lt;!here&gt;" in text and "a &amp; b" in text
    assert "\x1b" not in text and "\x07" not in text  # the terminal cleaner ran on every line
    assert text.replace("```", "").count("`") == 4  # ctl's inline code marks (log, look); none of the container's


def test_a_slack_sink_receives_the_escaped_text() -> None:
    from controller.commands.notify import Deliverer
    from controller.core.supervision import Sink

    srv, hook = _serve()
    failures: list[str] = []
    d = Deliverer([Sink.parse(f"slack:http://127.0.0.1:{srv.server_port}/services/T0/B0/x",
                              allow_http_loopback=True)], None, lambda s, doc, err: failures.append(err), retries=())
    try:
        d.send({"summary": "s", "action": "a", "last_lines": EVIL})
        wait_for("the slack message", lambda: hook.got, timeout=60)
    finally:
        d.close(wait_s=5)
        srv.shutdown()
    text = json.loads(hook.got[0][2])["text"]
    assert not failures and text.count("```") == 2 and "<!channel>" not in text and "&lt;!channel&gt;" in text


def test_a_redirect_is_a_failed_delivery_and_is_not_followed() -> None:
    from controller.commands.notify import Deliverer
    from controller.core.supervision import Sink

    target, target_h = _serve(200)
    hop, hop_h = _serve(302, f"http://127.0.0.1:{target.server_port}/elsewhere")
    failures: list[tuple[str, str]] = []
    d = Deliverer([Sink.parse(f"http://127.0.0.1:{hop.server_port}/hook/s3cr3tpath", allow_http_loopback=True)],
                  b"key", lambda s, doc, err: failures.append((s.label(), err)), retries=())
    try:
        d.send({"run": "ct200/fresh1", "summary": "one"})
        wait_for("the delivery's outcome", lambda: failures or target_h.got, timeout=60)
    finally:
        d.close(wait_s=5)
        hop.shutdown()
        target.shutdown()
    assert len(hop_h.got) == 1 and target_h.got == []  # the signed request went nowhere else
    assert len(failures) == 1 and "302" in failures[0][1], failures
    assert "s3cr3tpath" not in failures[0][0] + failures[0][1]


def test_sinks_are_https_unless_loopback_http_is_allowed() -> None:
    from controller.core.supervision import Sink

    for text in ("http://127.0.0.1:9/h", "slack:http://127.0.0.1/x", "http://10.0.0.1/h", "http://hooks.example/h"):
        with pytest.raises(InputError, match="https only"):
            Sink.parse(text)
    for text in ("http://10.0.0.1/h", "http://hooks.example/h", "http://127.0.0.1.evil.example/h"):
        with pytest.raises(InputError, match="https only"):
            Sink.parse(text, allow_http_loopback=True)
    assert Sink.parse("http://127.0.0.1:9/h", allow_http_loopback=True).target == "http://127.0.0.1:9/h"
    assert Sink.parse("http://[::1]:9/h", allow_http_loopback=True).kind == "webhook"
    assert Sink.parse("https://hooks.example/h").target == "https://hooks.example/h"
    with pytest.raises(InputError):
        Sink.parse("https://hooks.example/h\n")


def test_sink_labels_hide_url_paths() -> None:
    from controller.core.supervision import Sink

    slack = Sink.parse("slack:https://hooks.slack.com/services/T0/B0/SeCrEt")
    hook = Sink.parse("https://user:pw@hooks.example:8443/ctl/SeCrEt?sig=SeCrEt")
    assert slack.label() == "slack:https://hooks.slack.com/<redacted>"
    assert hook.label() == "https://hooks.example:8443/<redacted>"
    assert Sink.parse("cmd:notify-send x").label() == "cmd:notify-send x"


def test_sink_urls_come_from_the_environment_or_a_private_supervise_env(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from controller import settings
    from controller.core.supervision import Sink

    monkeypatch.setenv("CTL_CONFIG", str(tmp_path / "config.yaml"))
    monkeypatch.delenv("SLACK_HOOK", raising=False)
    with pytest.raises(InputError, match="SLACK_HOOK is not set"):
        Sink.parse("slack:env:SLACK_HOOK", lookup=settings.secret_lookup)
    env_file = tmp_path / "supervise.env"
    env_file.write_text("OTHER=1\nSLACK_HOOK='https://hooks.slack.com/services/T0/B0/FromFile'\n")
    env_file.chmod(0o600)
    got = Sink.parse("slack:env:SLACK_HOOK", lookup=settings.secret_lookup)
    assert (got.kind, got.target, got.label()) == ("slack", "https://hooks.slack.com/services/T0/B0/FromFile",
                                                   "slack:$SLACK_HOOK")
    whole = Sink.parse("env:SLACK_HOOK", lookup=lambda n: "slack:https://hooks.slack.com/services/x")
    assert (whole.kind, whole.label()) == ("slack", "slack:$SLACK_HOOK")
    monkeypatch.setenv("SLACK_HOOK", "https://hooks.slack.com/services/T0/B0/FromEnv")
    assert Sink.parse("slack:env:SLACK_HOOK", lookup=settings.secret_lookup).target.endswith("FromEnv")
    monkeypatch.delenv("SLACK_HOOK")
    env_file.chmod(0o644)  # readable by others: holds secrets, so it is not read
    with pytest.raises(InputError, match="0600"):
        Sink.parse("slack:env:SLACK_HOOK", lookup=settings.secret_lookup)


def _ctl(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True, timeout=60,
                          env=env, cwd=cwd)


def test_config_show_hides_slack_urls(tmp_path: Path) -> None:
    env = {**os.environ, "CTL_CONFIG": str(tmp_path / "config.yaml"), "CTL_STATE_DIR": str(tmp_path / "state"),
           "CTL_NOTIFY": "slack:https://hooks.slack.com/services/T0/B0/SeCrEt, cmd:notify-send"}
    for args in (("config", "show"), ("--json", "config", "show")):
        r = _ctl(*args, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "SeCrEt" not in r.stdout and "hooks.slack.com/<redacted>" in r.stdout, r.stdout
        assert "cmd:notify-send" in r.stdout


def test_the_systemd_unit_doubles_percent_and_dollar(tmp_path: Path) -> None:
    (tmp_path / "inventory.yaml").write_text("containers:\n  loc: {transport: local, root: /nonexistent}\n")
    env = {**os.environ, "CTL_CONFIG": str(tmp_path / "config.yaml"), "CTL_STATE_DIR": str(tmp_path / "st$ate%d")}
    r = _ctl("-i", str(tmp_path / "inventory.yaml"), "supervise", "--unit", "--notify", "cmd:/bin/echo 50%$HOME",
             env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    exec_line = next(x for x in r.stdout.splitlines() if x.startswith("ExecStart="))
    assert "50%%$$HOME" in exec_line, exec_line
    state_line = next(x for x in r.stdout.splitlines() if x.startswith("Environment="))
    assert "st$$ate%%d" in state_line, state_line
    assert "EnvironmentFile=-%h/.config/ctl/supervise.env" in r.stdout  # ctl's own specifier stays one


def test_signed_events_expire_and_carry_an_id() -> None:
    from controller.core.supervision import Event, body, sign, verify

    a, b = Event("verdict", "ct/r", "ct", None, None, "crashed", "s", "none"), \
        Event("verdict", "ct/r", "ct", None, None, "crashed", "s", "none")
    assert a.doc()["event_id"] and a.doc()["event_id"] != b.doc()["event_id"]
    assert a.doc()["event_id"] == a.doc()["event_id"]  # the same for every retry of one event
    payload = body(a.doc())
    now = int(time.time())
    fresh, old = str(now), str(now - 3600)
    assert verify(b"k", fresh, payload, sign(b"k", fresh, payload))
    assert not verify(b"k", old, payload, sign(b"k", old, payload))  # a replay an hour later
    assert not verify(b"k", str(now + 3600), payload, sign(b"k", str(now + 3600), payload))
    assert not verify(b"k", "soon", payload, sign(b"k", "soon", payload))


def test_a_cmd_sink_gets_a_minimal_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.commands.notify import Deliverer
    from controller.core.supervision import Sink

    out = tmp_path / "env.txt"
    prog = tmp_path / "dump.sh"
    prog.write_text(f"#!/bin/sh\ncat > /dev/null\nenv > {out}\n")
    prog.chmod(0o755)
    monkeypatch.setenv("PVE_TOKEN", "pve-SeCrEt")
    monkeypatch.setenv("CTL_WEBHOOK_SECRET", "hook-SeCrEt")
    failures: list[str] = []
    d = Deliverer([Sink.parse(f"cmd:{prog}")], b"hook-SeCrEt", lambda s, doc, err: failures.append(err), retries=())
    try:
        d.send({"run": "ct/r", "summary": "x"})
        wait_for("the sink program", lambda: out.exists() and out.read_text(), timeout=60)
    finally:
        d.close(wait_s=5)
    seen = dict(x.split("=", 1) for x in out.read_text().splitlines() if "=" in x)
    assert not failures and "SeCrEt" not in out.read_text(), seen
    assert seen.get("PATH") == os.environ["PATH"]  # still finds its programs
