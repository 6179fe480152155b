"""The dashboard's cookie reaches no other server of 127.0.0.1 (issue 40): cookies ignore ports, so the page is
served under a secret path prefix and the cookie's Path is that prefix. A real server on loopback."""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from controller.web.server import Dashboard


class _Empty:
    """A board with no runs: what the server shows is not the point here."""

    def snapshot(self) -> dict[str, Any]:
        return {"version": 1, "runs": []}

    def run_detail(self, run_id: int) -> dict[str, Any] | None:
        return None

    def wait(self, version: int, timeout: float) -> int:
        return version


@pytest.fixture
def dash() -> Iterator[Dashboard]:
    d = Dashboard(_Empty(), "127.0.0.1", 0)
    th = threading.Thread(target=d.serve_forever, daemon=True)
    th.start()
    try:
        yield d
    finally:
        d.close()
        th.join(10)


def _get(d: Dashboard, path: str, cookie: str | None = None) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
    headers = {"Host": f"127.0.0.1:{d.port}"}
    if cookie:
        headers["Cookie"] = cookie
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def test_the_cookie_is_scoped_to_a_secret_prefix(dash: Dashboard) -> None:
    m = re.fullmatch(rf"http://127\.0\.0\.1:{dash.port}(/[A-Za-z0-9_-]{{22,}}/)\?token=(.+)", dash.url)
    assert m is not None, dash.url
    prefix, token = m[1], m[2]
    status, headers = _get(dash, f"{prefix}?token={token}")
    assert status == 303 and headers["location"] == prefix
    cookie = headers["set-cookie"]
    assert cookie.endswith(f"; Path={prefix}") and "Path=/;" not in cookie + ";", cookie
    jar = cookie.split(";")[0]
    assert _get(dash, f"{prefix}api/snapshot", jar)[0] == 200
    assert _get(dash, f"{prefix}static/dashboard.js", jar)[0] == 200
    for outside in ("/", "/api/snapshot", f"/?token={token}", prefix.rstrip("/"), "/x" + prefix):
        assert _get(dash, outside, jar)[0] == 404, outside  # nothing, not even the token exchange, outside it


def test_each_dashboard_has_its_own_prefix() -> None:
    a, b = Dashboard(_Empty(), "127.0.0.1", 0), Dashboard(_Empty(), "127.0.0.1", 0)
    try:
        assert a.access.prefix != b.access.prefix and len(a.access.prefix) >= 20
    finally:
        a.close()
        b.close()
