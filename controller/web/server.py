"""The dashboard's HTTP server (stdlib http.server): one page, its script and style, and a JSON API over a Board.

Security, since a browser is a program that runs what others send it:
- Loopback by default. Another address needs `allow_remote` (the CLI's --allow-remote), and must be one
  address (not 0.0.0.0 / ::): the Host header is checked against it.
- A random token (secrets.token_urlsafe) on every request. The URL printed once carries it as `?token=`; the
  server answers that with a cookie (HttpOnly, SameSite=Strict, named after the port so that two dashboards
  do not overwrite each other's) and a redirect to the same path without it. No token, no data: 401.
- Everything is served under a second random path prefix (`/<prefix>/`), and the cookie's Path is that
  prefix: cookies ignore ports, so a cookie for `/` would also go to every other server on 127.0.0.1
  (TensorBoard, Jupyter, another user's listener); this one goes only to paths nobody else knows. Any other
  path is 404.
- The Host header must name the address served (DNS rebinding: a page of another site whose name resolves to
  127.0.0.1 sends its own name): 403 otherwise.
- Read-only: GET and HEAD; anything else is 405. Nothing a request asks reaches a container.
- Everything from containers reaches the page as JSON strings that the script puts in the DOM as text
  (textContent, never innerHTML); the Content-Security-Policy forbids inline script and every other origin.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import secrets
import socket
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from controller.errors import BusyError, InputError

STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
          "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
}
STREAM_EVERY_S = 2.0  # a live page gets the snapshot at least this often (ages, the deadline crossing)


class Source(Protocol):
    """What the server shows (commands.dashboard.Board)."""

    def snapshot(self) -> dict[str, Any]: ...

    def run_detail(self, run_id: int) -> dict[str, Any] | None: ...

    def wait(self, version: int, timeout: float) -> int: ...


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_bind(address: str, *, allow_remote: bool) -> str:
    """The address to listen on, or one line saying why not."""
    if address == "localhost":
        address = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise InputError(f"--bind {address!r}: give an IP address (127.0.0.1 by default)") from None
    if ip.is_unspecified:
        raise InputError(f"--bind {address}: give the one address to serve on, not every address (the Host header "
                         "of each request is checked against it)")
    if not ip.is_loopback and not allow_remote:
        raise InputError(f"--bind {address} is not a loopback address: anyone who can reach it and holds the URL "
                         "sees your runs over plain HTTP; pass --allow-remote to serve it anyway")
    return str(ip)


@dataclass(frozen=True)
class Access:
    token: str
    cookie: str  # the cookie's name
    hosts: frozenset[str]  # Host header values accepted
    prefix: str = "/"  # every path served starts with it (`/<random>/`); the cookie's Path

    def allowed_host(self, value: str | None) -> bool:
        return value is not None and value.lower() in self.hosts

    def valid(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a page's open stream never holds up the exit
    allow_reuse_address = True
    access: Access
    source: Source
    pages: dict[str, bytes]
    closing: threading.Event


class _V6Server(_Server):
    address_family = socket.AF_INET6


class Dashboard:
    """A server bound to (address, port), not yet serving: `url` is what to open (with the token)."""

    def __init__(self, source: Source, address: str, port: int, *, allow_remote: bool = False,
                 token: str | None = None) -> None:
        address = check_bind(address, allow_remote=allow_remote)
        if not 0 <= port <= 65535:
            raise InputError(f"--port {port}: give a port from 1 to 65535 (0: any free one)")
        cls = _V6Server if ":" in address else _Server
        try:
            self.httpd = cls((address, port), _Handler)
        except OSError as e:
            raise BusyError(f"cannot listen on {address} port {port}: {e.strerror or e}") from None
        self.port = int(self.httpd.server_address[1])
        host = f"[{address}]" if ":" in address else address
        names = {f"{host}:{self.port}"}
        if is_loopback(address):
            names |= {f"localhost:{self.port}", f"127.0.0.1:{self.port}", f"[::1]:{self.port}"}
        self.remote = not is_loopback(address)
        prefix = f"/{secrets.token_urlsafe(16)}/"
        self.access = Access(token or secrets.token_urlsafe(32), f"ctl_dashboard_{self.port}", frozenset(names),
                             prefix)
        self.url = f"http://{host}:{self.port}{prefix}?token={self.access.token}"
        self.httpd.access = self.access
        self.httpd.source = source
        self.httpd.closing = threading.Event()
        self._serving: int | None = None  # the thread in serve_forever, while it runs
        pkg = resources.files("controller.web") / "static"
        self.httpd.pages = {path: (pkg / name).read_bytes() for path, (name, _type) in STATIC.items()}

    def serve_forever(self) -> None:
        self._serving = threading.get_ident()
        try:
            self.httpd.serve_forever(poll_interval=0.2)
        finally:
            self._serving = None

    def close(self) -> None:
        """Stop serving and close the socket. shutdown() is only for a serve_forever running in another thread:
        it waits for that loop to return, and so would wait forever for one that never started (Ctrl-C before it,
        `ctl dashboard` serves in its main thread) or that already returned in this thread."""
        self.httpd.closing.set()
        if self._serving is not None and self._serving != threading.get_ident():
            self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "ctl-dashboard"
    sys_version = ""
    timeout = 30  # a client that stops reading or writing frees its thread

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: a request line can carry the token."""

    # --- the gate ---------------------------------------------------------------------------------

    def _gate(self) -> tuple[str, dict[str, list[str]]] | None:
        """(path, query) of a request that may be answered; else it has been answered with an error."""
        access = self.server.access
        if not access.allowed_host(self.headers.get("Host")):
            self._plain(HTTPStatus.FORBIDDEN, "unexpected Host header: open the URL ctl dashboard printed\n")
            return None
        url = urlsplit(self.path)
        if not url.path.startswith(access.prefix):
            self._plain(HTTPStatus.NOT_FOUND, "not found: open the URL ctl dashboard printed\n")
            return None
        query = parse_qs(url.query)
        given = query.get("token", [None])[-1]
        if given is not None:
            if not access.valid(given):
                self._plain(HTTPStatus.UNAUTHORIZED, "wrong token: open the URL ctl dashboard printed\n")
                return None
            # Move the token into a cookie and out of the address bar (and of the page's history).
            self.send_response(HTTPStatus.SEE_OTHER)
            self.send_header("Location", url.path)
            self.send_header("Set-Cookie", f"{access.cookie}={access.token}; HttpOnly; SameSite=Strict; "
                                           f"Path={access.prefix}")
            self._common(0)
            self.end_headers()
            return None
        if not access.valid(self._cookie()):
            self._plain(HTTPStatus.UNAUTHORIZED, "token required: open the URL ctl dashboard printed\n")
            return None
        return "/" + url.path[len(access.prefix):], query

    def _cookie(self) -> str | None:
        raw = self.headers.get("Cookie")
        if not raw:
            return None
        try:
            jar = SimpleCookie(raw)
        except CookieError:
            return None
        morsel = jar.get(self.server.access.cookie)
        return morsel.value if morsel is not None else None

    # --- verbs ------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _refuse(self) -> None:
        self._plain(HTTPStatus.METHOD_NOT_ALLOWED, "read-only: GET and HEAD only\n", allow="GET, HEAD")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    def _answer(self, *, body: bool) -> None:
        gated = self._gate()
        if gated is None:
            return
        path, _query = gated
        src = self.server.source
        if path in STATIC:
            self._send(HTTPStatus.OK, STATIC[path][1], self.server.pages[path], body=body)
        elif path == "/api/snapshot":
            self._json(src.snapshot(), body=body)
        elif path.startswith("/api/run/") and path[len("/api/run/"):].isdigit():
            detail = src.run_detail(int(path[len("/api/run/"):]))
            if detail is None:
                self._plain(HTTPStatus.NOT_FOUND, "no such run\n")
            else:
                self._json(detail, body=body)
        elif path == "/api/stream":
            self._stream(body=body)
        else:
            self._plain(HTTPStatus.NOT_FOUND, "not found\n")

    def _stream(self, *, body: bool) -> None:
        """Server-sent events: the snapshot now, then whenever the board changes (at least every few seconds)."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self._common(None)
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if not body:
            return
        src, closing = self.server.source, self.server.closing
        version = -1
        try:
            while not closing.is_set():
                snap = src.snapshot()
                version = int(snap.get("version", version))
                self.wfile.write(b"event: snapshot\ndata: " + _dumps(snap) + b"\n\n")
                self.wfile.flush()
                src.wait(version, STREAM_EVERY_S)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
            return  # the page went away

    # --- responses --------------------------------------------------------------------------------

    def _common(self, length: int | None) -> None:
        for k, v in HEADERS.items():
            self.send_header(k, v)
        if length is not None:
            self.send_header("Content-Length", str(length))

    def _send(self, status: HTTPStatus, ctype: str, data: bytes, *, body: bool = True,
              allow: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        if allow:
            self.send_header("Allow", allow)
        self._common(len(data))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _json(self, doc: Any, *, body: bool) -> None:
        self._send(HTTPStatus.OK, "application/json", _dumps(doc), body=body)

    def _plain(self, status: HTTPStatus, text: str, *, allow: str | None = None) -> None:
        self._send(status, "text/plain; charset=utf-8", text.encode(), body=self.command != "HEAD", allow=allow)


def _dumps(doc: Any) -> bytes:
    """JSON for the page, on one line (an event-stream frame ends at a blank line). JSON has no NaN or
    infinity: a loss that became NaN is sent as the string "nan", shown as such, never hidden as missing."""
    return json.dumps(_finite(doc), default=str, allow_nan=False).encode()


def _finite(doc: Any) -> Any:
    if isinstance(doc, float) and not math.isfinite(doc):
        return str(doc)
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [_finite(v) for v in doc]
    return doc
