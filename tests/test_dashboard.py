"""`ctl dashboard` against real runs (the local target, real tmux, the fake payload) in a real browser (Debian's
headless Chromium over the DevTools protocol): the runs' rows and verdicts update live, a run's chart and its log
lines show, a log line of HTML renders as text, the token is needed by every request, a foreign Host header is
refused, and a host that never answers reads UNREACHABLE while the page and the other runs carry on."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.lifecycle import Lifecycle
from controller.registry import Registry
from tests.browser import Browser, chromium
from tests.conftest import REPO, LocalEnv
from tests.helpers import wait_for

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
needs_chromium = pytest.mark.skipif(chromium() is None, reason="chromium is not installed (scripts/setup.sh "
                                                                 "installs it: apt-get install chromium)")

# The start script prints the run's banner file (if any) before the fake payload's metric lines: a log line
# that is HTML, and one with terminal escape sequences.
START = """\
#!/usr/bin/env bash
set -euo pipefail
if [ -f {{ root }}/root/banner/$CTL_RUN ]; then cat {{ root }}/root/banner/$CTL_RUN; fi
exec python3 {{ root }}{{ payload["emit_metrics.py"] }} --no-preamble $(cat {{ root }}/root/args/$CTL_RUN)
"""
SCRIPT = '<script>window.__pwned = "script"</script>'
IMG = "<img src=x onerror=\"window.__pwned = 'img'\">"
ANSI = "\x1b]0;pwned title\x07\x1b[31mred text\x1b[0m"


class Dash:
    """`ctl dashboard` in a process of its own: its URL, and plain HTTP requests to it."""

    def __init__(self, env: LocalEnv, *args: str, inventory: Path | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "controller", "-i", str(inventory or env.inventory), "dashboard", "--port",
                "0", "--interval", "1s", *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=env.dir,
                                     env={**env.env, **(extra_env or {})})
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline().decode() if ready else ""
        m = re.search(r"http://127\.0\.0\.1:(\d+)(/[A-Za-z0-9_-]{16,}/)\?token=([A-Za-z0-9_-]+)", line)
        if m is None:
            self.close()
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise AssertionError(f"no URL printed: {line!r} {err}")
        self.url, self.port, self.prefix, self.token = m.group(0), int(m.group(1)), m.group(2), m.group(3)
        self.cookie = f"ctl_dashboard_{self.port}={self.token}"

    def request(self, path: str, *, method: str = "GET", cookie: bool = True, host: str | None = None,
                timeout: float = 5) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Host": host or f"127.0.0.1:{self.port}"}
        if cookie:
            headers["Cookie"] = self.cookie
        try:  # every path is served under the dashboard's secret prefix
            conn.request(method, self.prefix + path[1:] if path.startswith("/") else path, headers=headers)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def snapshot(self, timeout: float = 5) -> dict[str, Any]:
        status, _, body = self.request("/api/snapshot", timeout=timeout)
        assert status == 200, body
        return dict(json.loads(body))

    def close(self) -> int:
        """SIGTERM, as a service manager stops it: it must end promptly even with a poll still waiting."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("ctl dashboard did not end within 15 s of SIGTERM") from None


@contextlib.contextmanager
def dashboard(env: LocalEnv, *args: str, **kw: Any) -> Iterator[Dash]:
    d = Dash(env, *args, **kw)
    try:
        yield d
    finally:
        d.close()


def row(snap: dict[str, Any], ref: str) -> dict[str, Any] | None:
    return next((r for r in snap["runs"] if f"{r['ct']}/{r['run']}" == ref), None)


@pytest.fixture
def runs(env: LocalEnv) -> LocalEnv:
    """fresh1 finished at 12.8K tok/s and marked good; fresh2 running at 4.6K, its log opening with HTML and
    escape sequences; one poll of `ctl supervise` has recorded events."""
    (env.dir / "start_training.sh.j2").write_text(START)
    env.ok("deploy", "--allow-dirty")
    env.launch("fresh1", "--tok-s 12800 --steps 30 --interval 0.02 --jitter 0")
    wait_for("fresh1's end", lambda: (env.root / "workspace" / "train_stdout_fresh1.log.exit").exists(), 30, 0.3)
    env.ok("mark-good", "fresh1")
    (env.root / "root" / "banner").mkdir(parents=True)
    (env.root / "root" / "banner" / "fresh2").write_text(f"{SCRIPT}\n{IMG}\n{ANSI}\n")
    env.launch("fresh2", "--tok-s 4600 --steps 100000 --interval 0.1 --jitter 0")
    r = env.ctl("supervise", "--once", "--interval", "1s")  # events, as `ctl events` lists them
    assert r.returncode == 0, r.stderr
    return env


@pytest.mark.slow  # about a minute: two runs, a supervisor poll, a browser
@needs_tmux
@needs_chromium
def test_the_page_shows_live_runs_their_verdicts_and_log_lines_as_text(runs: LocalEnv, tmp_path: Path) -> None:
    with dashboard(runs, "--log-lines", "5000") as d, Browser() as b:
        b.goto(d.url)
        # The token went into an HttpOnly cookie and out of the address bar.
        assert b.evaluate("location.pathname + location.search") == d.prefix
        assert b.evaluate("document.cookie") == ""
        assert b.responses()[:2] == [(d.url, 303), (f"http://127.0.0.1:{d.port}{d.prefix}", 200)], b.responses()
        sel = "document.querySelector('#runs tr[data-run=\"loc/fresh2\"]')"
        b.wait(f"{sel} && {sel}.dataset.verdict === 'slow'", timeout=60, what="fresh2 judged SLOW on the page")
        reason = b.evaluate(f"{sel}.querySelector('td.why').textContent")
        assert "0.36x the baseline 12.8K (loc/fresh1)" in reason
        assert b.evaluate(f"{sel}.querySelector('.verdict').textContent") == "SLOW"
        # The sparkline: the newest 20 points once the run has logged that many (a loaded box may show the
        # verdict before, from fewer).
        b.wait(f"{sel}.querySelector('svg.spark polyline').dataset.count === '20'", timeout=30,
               what="fresh2's sparkline to hold its 20 newest points")
        # Live: the step moves on without a reload (the page only hears of it through its event stream).
        step = int(b.evaluate(f"{sel}.querySelector('td.step').textContent"))
        version = int(b.evaluate("document.body.dataset.version"))
        b.wait(f"Number({sel}.querySelector('td.step').textContent) >= {step + 5}", timeout=30,
               what="the step to advance live")
        assert int(b.evaluate("document.body.dataset.version")) > version
        assert b.evaluate("performance.getEntriesByType('navigation').length") == 1  # no reload happened
        # The finished baseline run is in the registry's list, and what the supervisor saw in the events.
        b.wait("!!document.querySelector('#recent tr[data-run=\"loc/fresh1\"]')")
        events = json.loads(runs.ok("--json", "events"))
        assert events
        shown = b.evaluate("[...document.querySelectorAll('#events li')].map((li) => li.textContent)")
        assert len(shown) == len(events) and all(e["summary"] in "\n".join(shown) for e in events)

        # The run's page: its chart against the baseline, its last log lines, its provenance.
        b.evaluate(f"{sel}.click()")
        b.wait("!document.getElementById('detail').hidden && "
               "Number(document.querySelector('#chart-tok polyline.series')?.dataset.count) >= 5",
               what="the tok/s chart to draw points")
        assert b.evaluate("document.querySelectorAll('#chart-tok line.baseline').length") == 1
        assert "loc/fresh1" in b.evaluate("document.getElementById('chart-tok').textContent")
        assert int(b.evaluate("document.querySelector('#chart-loss polyline.series').dataset.count")) >= 5
        log = b.wait("document.getElementById('log').textContent.includes('step=') && "
                     "document.getElementById('log').textContent", what="the run's log lines")
        # HTML from the container is shown as the text it is, and nothing of it ran or became an element.
        assert SCRIPT in log and IMG in log
        assert b.evaluate("window.__pwned === undefined")
        assert b.evaluate("document.querySelectorAll('#log *').length") == 0
        assert b.evaluate("document.querySelectorAll('img, #log script').length") == 0
        # Escape sequences are removed, the text between them kept.
        assert "red text" in log and "\x1b" not in log and "pwned title" not in log
        assert "fresh1" in b.evaluate("document.getElementById('diff-title').textContent")
        assert "loc/fresh2" in b.evaluate("document.getElementById('run-events').textContent")
        assert b.evaluate("(() => { const l = document.getElementById('log'); "
                          "return l.scrollTop + l.clientHeight >= l.scrollHeight - 4; })()")  # follows the end
        assert b.evaluate("document.getElementById('provenance').textContent").count("/root/emit_metrics.py") == 1
        shot = b.screenshot(tmp_path / "dashboard.png")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        if os.environ.get("CTL_DASHBOARD_SCREENSHOT"):  # how docs/dashboard.png is made
            shutil.copy(shot, os.environ["CTL_DASHBOARD_SCREENSHOT"])

        # Without the cookie the same browser gets nothing but a 401.
        b.call("Network.clearBrowserCookies", session=True)
        b.goto(f"http://127.0.0.1:{d.port}{d.prefix}")
        assert b.responses() == [(f"http://127.0.0.1:{d.port}{d.prefix}", 401)]
        assert b.evaluate("document.body.innerText").startswith("token required")
    assert d.proc.returncode == 0


def test_every_request_needs_the_token_and_the_host_it_was_served_on(env_noruns: LocalEnv) -> None:
    with dashboard(env_noruns) as d:
        p = d.port
        for path in ("/", "/api/snapshot", "/api/stream", "/static/dashboard.js", "/api/run/1", "/nothing"):
            status, _, body = d.request(path, cookie=False)
            assert (status, body) == (401, b"token required: open the URL ctl dashboard printed\n"), path
        assert d.request(f"/api/snapshot?token={d.token[:-1]}x", cookie=False)[0] == 401
        status, headers, _ = d.request(f"/api/snapshot?token={d.token}", cookie=False)
        assert status == 303 and headers["location"] == f"{d.prefix}api/snapshot"
        assert headers["set-cookie"] == f"{d.cookie}; HttpOnly; SameSite=Strict; Path={d.prefix}"
        status, headers, body = d.request("/api/snapshot")
        assert status == 200 and json.loads(body)["runs"] == []
        assert "script-src 'self'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-store"
        # DNS rebinding: a page of another site whose name resolves to 127.0.0.1 sends its own Host.
        for host in (f"evil.example:{p}", f"127.0.0.1.nip.io:{p}", "127.0.0.1", f"127.0.0.1:{p + 1}"):
            assert d.request("/api/snapshot", host=host)[0] == 403, host
        assert d.request("/api/snapshot", host=f"localhost:{p}")[0] == 200
        for method in ("POST", "PUT", "DELETE"):
            assert d.request("/api/snapshot", method=method)[0] == 405
        assert d.request("/api/run/999")[0] == 404
        status, headers, body = d.request("/")
        assert status == 200 and headers["content-type"].startswith("text/html") and b"<script" in body
        assert re.findall(rb"<script[^>]*>", body) == [b'<script src="static/dashboard.js" defer>']
    assert d.proc.returncode == 0


def test_the_page_puts_no_text_into_the_dom_as_markup() -> None:
    """The script builds the page from textContent and attributes only; no sink that parses HTML is used."""
    js = (REPO / "controller" / "web" / "static" / "dashboard.js").read_text()
    code = "\n".join(line for line in js.splitlines() if not line.lstrip().startswith("//"))
    assert "textContent" in code
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "setAttribute(\"on", "srcdoc"):
        assert sink not in code, sink


@needs_tmux
def test_a_silent_host_reads_unreachable_and_never_holds_up_the_page(env: LocalEnv, tmp_path: Path) -> None:
    # A "host" that accepts TCP connections and never says a word: the SSH banner never comes.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    (tmp_path / "known_hosts").write_text("")
    doc = yaml.safe_load(env.inventory.read_text())
    doc["hosts"] = {"quiet": {"address": "127.0.0.1", "port": silent.getsockname()[1], "user": "root",
                              "known_hosts": str(tmp_path / "known_hosts")}}
    doc["containers"]["ct900"] = {"host": "quiet", "vmid": 900, "transport": "pct"}
    inv = tmp_path / "with-silent.yaml"
    inv.write_text(yaml.safe_dump(doc))
    reg = Registry(Path(env.env["CTL_STATE_DIR"]) / "registry.sqlite3")
    rec = reg.claim_run("fresh1", "ct900", log_path="/workspace/train_stdout_fresh1.log", session="mt-fresh1")
    reg.update_run(rec.id, state=Lifecycle.RUNNING, started=time.time())
    env.launch("fresh1", "--tok-s 12800 --steps 100000 --interval 0.1 --jitter 0")
    try:
        # The transport would wait 60 s for the banner; the dashboard's own deadline is 5 s.
        with dashboard(env, "--deadline", "5s", inventory=inv, extra_env={"CTL_CONNECT_TIMEOUT": "60"}) as d:
            t0 = time.monotonic()
            seen: list[dict[str, Any]] = []

            def judged() -> bool:
                t = time.monotonic()
                snap = d.snapshot(timeout=3)  # every answer comes at once, whatever the hosts do
                assert time.monotonic() - t < 3
                seen.append(snap)
                quiet, local = row(snap, "ct900/fresh1"), row(snap, "loc/fresh1")
                return (quiet is not None and quiet["verdict"] == "unreachable" and local is not None
                        and local["verdict"] not in ("unreachable", "pending"))

            wait_for("ct900/fresh1 UNREACHABLE beside loc/fresh1 judged", judged, 40, 0.3)
            assert time.monotonic() - t0 < 40  # the dashboard's deadline, not the transport's 60 s
            snap = seen[-1]
            quiet, first = row(snap, "ct900/fresh1"), row(snap, "loc/fresh1")
            assert quiet is not None and first is not None
            assert "no answer from host quiet" in quiet["reason"] and "recorded state running kept" in quiet["reason"]
            assert {h["name"]: h["state"] for h in snap["hosts"]}["host quiet"] == "unreachable"
            # Meanwhile the local run goes on being polled and judged.
            wait_for("the local run to move on",
                     lambda: (r := row(d.snapshot(timeout=3), "loc/fresh1")) is not None
                     and (r["step"] or 0) > (first["step"] or 0) + 5, 30, 0.3)
            quiet_now = row(d.snapshot(timeout=3), "ct900/fresh1")
            assert quiet_now is not None and quiet_now["verdict"] == "unreachable"
            assert reg.run_by_id(rec.id).state == Lifecycle.RUNNING  # silence is never taken for a crash
        assert d.proc.returncode == 0
    finally:
        silent.close()


def test_bind_refuses_what_is_not_one_loopback_address_without_the_flag(env_noruns: LocalEnv) -> None:
    def refused(*args: str) -> str:
        r = env_noruns.ctl("dashboard", *args, timeout=30)
        assert r.returncode == 4, r.stdout + r.stderr
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
        return r.stderr

    assert "not a loopback address" in refused("--bind", "192.0.2.10") and "--allow-remote" in refused(
        "--bind", "192.0.2.10")
    assert "not every address" in refused("--bind", "0.0.0.0", "--allow-remote")
    assert "give an IP address" in refused("--bind", "example.com")
    assert "--port 70000" in refused("--port", "70000")
    assert "--deadline" in refused("--deadline", "soon")
    assert "--log-lines" in refused("--log-lines", "-1")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        r = env_noruns.ctl("dashboard", "--port", str(taken.getsockname()[1]), timeout=30)
        assert r.returncode == 9 and "cannot listen on 127.0.0.1 port" in r.stderr, r.stderr
    finally:
        taken.close()


@pytest.fixture
def env_noruns(tmp_path: Path) -> LocalEnv:
    """An inventory of one local container and an empty registry: nothing to deploy, no tmux."""
    root = tmp_path / "root"
    root.mkdir()
    e = LocalEnv(tmp_path, root, tmp_path / "inventory.yaml",
            dict(os.environ, CTL_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=str(REPO)))
    e.inventory.write_text(yaml.safe_dump({"containers": {"loc": {"transport": "local", "root": str(root)}}}))
    return e


@pytest.mark.parametrize("served", [False, True])
def test_closing_never_waits_for_a_loop_that_is_not_running_elsewhere(served: bool) -> None:
    """`ctl dashboard` serves in its main thread: a Ctrl-C before the loop started, or one that ended it, closes
    at once (shutdown() would wait for a loop that never runs); a loop in another thread is stopped and waited for."""
    import threading

    from controller.web.server import Dashboard

    d = Dashboard(object(), "127.0.0.1", 0)  # type: ignore[arg-type]  # a source is only read by requests
    port = d.port
    loop = threading.Thread(target=d.serve_forever, daemon=True) if served else None
    if loop is not None:
        loop.start()
        deadline = time.time() + 10
        while d._serving is None and time.time() < deadline:
            time.sleep(0.01)
    closer = threading.Thread(target=d.close, daemon=True)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive(), "close() waited for a serve loop"
    if loop is not None:
        loop.join(timeout=10)
        assert not loop.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
