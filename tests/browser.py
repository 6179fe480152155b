"""A real browser for tests: Debian's headless Chromium, driven over the Chrome DevTools Protocol.

The protocol travels over a pipe (`--remote-debugging-pipe`: commands on the browser's fd 3, answers and events
on its fd 4, each message JSON ended by a NUL byte), so no port is opened and no websocket client is needed.
The browser resolves no name but loopback addresses (--host-resolver-rules) and keeps its background
networking off: a test never reaches beyond this machine.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-domain-reliability",
    "--no-pings", "--metrics-recording-only", "--mute-audio", "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
]


def chromium() -> str | None:
    if os.access("/usr/lib/chromium/chromium", os.X_OK):  # Debian's binary, without its shell wrapper
        return "/usr/lib/chromium/chromium"
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(AssertionError):
    pass


class Browser:
    """One headless Chromium with one page; `evaluate` runs JavaScript in it and returns the value."""

    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        exe = chromium()
        if exe is None:
            raise BrowserError("chromium is not installed (apt-get install chromium)")
        self.profile = Path(tempfile.mkdtemp(prefix="ctl-chromium-"))
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds() -> None:  # the browser reads commands on fd 3 and writes answers on fd 4
            # Copied out of the way first: a pipe end that is already fd 3 would stay close-on-exec after
            # dup2(3, 3), and one that is fd 4 would be replaced before it is copied.
            r, w = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.log = self.profile / "chromium.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [exe, *FLAGS, f"--user-data-dir={self.profile / 'profile'}", f"--window-size={width},{height}",
                 "--remote-debugging-pipe", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                close_fds=False, preexec_fn=fds)  # dup2 in the child; close_fds would close 3 and 4 after it
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    # --- the protocol --------------------------------------------------------------------------------

    def _read(self, timeout: float) -> dict[str, Any]:
        import select

        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise BrowserError(f"no answer from chromium in {timeout}s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium closed the pipe: {self.log.read_text(errors='replace')[-2000:]}")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return dict(json.loads(msg))

    def call(self, method: str, *, session: bool = False, timeout: float = 30, **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        while True:
            got = self._read(timeout)
            if got.get("id") == self._id:
                if "error" in got:
                    raise BrowserError(f"{method}: {got['error']}")
                return dict(got.get("result", {}))
            self.events.append(got)

    # --- what tests use ------------------------------------------------------------------------------

    def goto(self, url: str, timeout: float = 30) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait("document.readyState === 'complete' && location.href !== 'about:blank'", timeout=timeout)

    def evaluate(self, expression: str, timeout: float = 30) -> Any:
        res = self.call("Runtime.evaluate", session=True, timeout=timeout, expression=expression,
                        returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise BrowserError(f"{expression}: {res['exceptionDetails'].get('exception', {}).get('description')}")
        return res["result"].get("value")

    def wait(self, expression: str, timeout: float = 30, what: str | None = None) -> Any:
        """Until `expression` is truthy in the page: its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out after {timeout}s waiting for {what or expression}")
            time.sleep(0.2)

    def responses(self) -> list[tuple[str, int]]:
        """(url, status) of each HTTP response the page received since the last `goto`, redirects included,
        in order."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Network.requestWillBeSent" and p.get("redirectResponse"):
                out.append((p["redirectResponse"]["url"], p["redirectResponse"]["status"]))
            elif e.get("method") == "Network.responseReceived":
                out.append((p["response"]["url"], p["response"]["status"]))
        return out

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
