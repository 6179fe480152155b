"""The host relay's direct start of a staying agent (hostrelay.attach_argv, _start_resident): only Proxmox's own
`pct exec VMID -- ...`, run as root, is turned into the lxc-attach that pct would run, with the environment pct
would give it; an attach that is refused falls back to pct, one that hangs does not wait again. Against real
LXC: tests/integration/test_mux_pve.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller import farside

hostrelay = farside.load("relay")
PVE_PATH, StartFailed, attach_argv = hostrelay.PVE_PATH, hostrelay.StartFailed, hostrelay.attach_argv

AGENT = ["python3", "-I", "-S", "-c", "BOOT", "123", "serve"]


@pytest.fixture
def proxmox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A PATH on which `pct` is "Proxmox's own" (PVE_PCTS pointed at it), the relay running as root."""
    d = tmp_path / "sbin"
    d.mkdir()
    pct = d / "pct"
    pct.write_text("#!/bin/sh\nexit 0\n")
    pct.chmod(0o755)
    monkeypatch.setattr(hostrelay, "PVE_PCTS", (str(pct),))
    monkeypatch.setattr(hostrelay, "_pct_found", {})
    monkeypatch.setattr(hostrelay.os, "geteuid", lambda: 0)
    return f"{tmp_path / 'empty'}:{d}:/usr/bin"


def test_pct_exec_becomes_the_lxc_attach_pct_runs_with_its_environment(proxmox: str) -> None:
    env = {"PATH": proxmox, "HOME": "/root", "SSL_CERT_FILE": "/x.pem", "SSL_CERT_DIR": "/c", "LC_CTYPE": "C.UTF-8"}
    for pct in ("pct", *hostrelay.PVE_PCTS):  # on PATH, and by its path
        got = attach_argv([pct, "exec", "200", "--", *AGENT], env)
        assert got is not None
        argv, child = got
        assert argv == ["lxc-attach", "-n", "200", "--keep-env", "--", *AGENT]
        assert child == {"PATH": PVE_PATH, "HOME": "/root", "LC_CTYPE": "C.UTF-8"}  # the session's locale, kept
    assert env["PATH"] == proxmox and "SSL_CERT_FILE" in env  # the relay's own: untouched


def test_keep_env_0_clears(proxmox: str) -> None:
    got = attach_argv(["pct", "exec", "301", "--keep-env", "0", "--", "true"], {"PATH": proxmox, "A": "1"})
    assert got == (["lxc-attach", "-n", "301", "--clear-env", "--", "true"], {"A": "1", "PATH": PVE_PATH})
    got = attach_argv(["pct", "exec", "301", "--keep-env", "1", "--", "true"], {"PATH": proxmox})
    assert got is not None and got[0][3] == "--keep-env"


def test_any_other_line_is_run_as_given(proxmox: str) -> None:
    for argv in (
        ["/opt/site/pct-wrapper", "exec", "200", "--", *AGENT],  # an inventory's `pct:` of its own
        ["sudo", "pct", "exec", "200", "--", *AGENT],
        ["pct", "push", "200", "/a", "/b"],
        ["pct", "exec", "200", *AGENT],  # no `--`
        ["pct", "exec", "200", "--"],  # no command
        ["pct", "exec", "20", "--", "true"],  # not a vmid pct accepts
        ["pct", "exec", "0200", "--", "true"],
        ["pct", "exec", "2a0", "--", "true"],
        ["pct", "exec", "٢٠٠", "--", "true"],  # digits, but not ASCII ones
        ["pct", "exec", "200", "--keep-env", "2", "--", "true"],
        ["pct", "exec", "200", "--debug", "--", "true"],
    ):
        assert attach_argv(argv, {"PATH": proxmox}) is None, argv


def test_a_pct_that_path_finds_elsewhere_or_a_relay_not_root_is_run_as_given(
        proxmox: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = tmp_path / "local" / "pct"  # a site's audit or sudo wrapper ahead of Proxmox's on PATH
    wrapper.parent.mkdir()
    wrapper.write_text("#!/bin/sh\nexec /usr/sbin/pct \"$@\"\n")
    wrapper.chmod(0o755)
    line = ["pct", "exec", "200", "--", *AGENT]
    assert attach_argv(line, {"PATH": proxmox}) is not None
    assert attach_argv(line, {"PATH": f"{wrapper.parent}:{proxmox}"}) is None
    assert attach_argv(line, {"PATH": "/nonexistent"}) is None
    monkeypatch.setattr(hostrelay.os, "geteuid", lambda: 1000)  # lxc-attach would look for the user's containers
    assert attach_argv(line, {"PATH": proxmox}) is None
    assert attach_argv([hostrelay.PVE_PCTS[0], *line[1:]], {"PATH": proxmox}) is None


# --- _start_resident: which start wins -----------------------------------------------------------------------

HELLO = b'{"agent": "serve"}'
# An agent as far as the relay can tell: it says hello, then reads until its stdin ends.
FAKE_AGENT = (f"import sys, struct; sys.stdout.buffer.write(struct.pack('>cHI', b'H', 0, {len(HELLO)}) + {HELLO!r}); "
              "sys.stdout.flush(); sys.stdin.buffer.read()")
PCT_LINE = [sys.executable, "-c", FAKE_AGENT]  # stands for `pct exec VMID -- python3 ... serve`


def _direct(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    monkeypatch.setattr(hostrelay, "attach_argv", lambda line, environ: (argv, dict(environ)))
    monkeypatch.setattr(hostrelay, "_no_lxc_attach", [])


def _end(r: hostrelay.Resident) -> None:
    r.end()
    r.proc.wait(timeout=10)


def test_an_attach_that_says_hello_is_the_staying_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    _direct(monkeypatch, [sys.executable, "-c", FAKE_AGENT])
    r = hostrelay._start_resident(("k",), ["/not/run/pct"], b"src", lambda: False)
    assert r.via == sys.executable and r.alive()
    _end(r)


def test_an_attach_refused_falls_back_to_pct(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped container: lxc-attach exits at once without a hello; pct then says why, in its own words."""
    _direct(monkeypatch, ["sh", "-c", "echo 'Failed to get init pid' >&2; exit 1"])
    r = hostrelay._start_resident(("k",), PCT_LINE, b"src", lambda: False)
    assert r.via == sys.executable and r.alive()
    assert hostrelay._no_lxc_attach == []  # tried again for the next container
    _end(r)


def test_an_attach_that_closes_its_output_before_it_exits_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its stdout ends a moment before the process does (a loaded host): still a refusal, so pct says why; not
    read as a hang, which would skip pct."""
    _direct(monkeypatch, ["sh", "-c", "exec >&-; echo 'Failed to get init pid' >&2; sleep 0.3; exit 1"])
    r = hostrelay._start_resident(("k",), PCT_LINE, b"src", lambda: False)
    assert r.via == sys.executable and r.alive()
    _end(r)


def test_no_lxc_attach_on_the_host_falls_back_to_pct_and_is_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    _direct(monkeypatch, ["/nonexistent/lxc-attach", "-n", "200"])
    r = hostrelay._start_resident(("k",), PCT_LINE, b"src", lambda: False)
    assert r.via == sys.executable and hostrelay._no_lxc_attach == [True]
    _end(r)
    monkeypatch.setattr(hostrelay, "attach_argv", lambda line, environ: pytest.fail("tried again"))
    _end(hostrelay._start_resident(("k",), PCT_LINE, b"src", lambda: False))


def test_an_attach_that_hangs_is_given_up_once_not_followed_by_pct(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """A frozen container: the attach never says hello. Trying pct after it would wait as long again (and run
    past the request's own deadline); the request runs as its exec instead (the caller's fallback)."""
    _direct(monkeypatch, ["sleep", "30"])
    monkeypatch.setattr(hostrelay, "RESIDENT_HELLO_S", 1.0)
    marker = tmp_path / "pct-ran"
    t0 = time.monotonic()
    with pytest.raises(StartFailed) as e:
        hostrelay._start_resident(("k",), ["sh", "-c", f"touch {marker}"], b"src", lambda: False)
    assert not e.value.ended and time.monotonic() - t0 < 5
    assert not marker.exists()


def test_a_start_abandoned_while_the_attach_fails_is_not_retried_through_pct(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    _direct(monkeypatch, ["sh", "-c", "exit 1"])
    marker = tmp_path / "pct-ran"
    with pytest.raises(StartFailed):
        hostrelay._start_resident(("k",), ["sh", "-c", f"touch {marker}"], b"src", lambda: True)
    assert not marker.exists()


def test_the_relay_passes_on_the_session_s_lc_ctype_not_its_own_coercion(tmp_path: Path) -> None:
    """Python coerces a C locale (PEP 538) by setting LC_CTYPE in its own environment; the relay's children (pct,
    lxc-attach, the agents and what they launch) get the session's LC_CTYPE as it was, whichever start wins."""
    (tmp_path / "relay.py").write_bytes(farside.source("relay"))  # the relay as it ships
    probe = ("import os; g = {'__name__': 'relay'}; "
             f"exec(compile(open({str(tmp_path / 'relay.py')!r}).read(), 'relay', 'exec'), g); "
             "g['_uncoerce_locale'](); print(repr(os.environ.get('LC_CTYPE')))")
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for env, want in (({"LC_ALL": "", "LANG": ""}, None),  # C locale: coerced inside, nothing to pass on
                      ({"LC_CTYPE": "C.UTF-8"}, "C.UTF-8"),  # the session's own
                      ({"LC_CTYPE": "C"}, "C")):  # coerced to C.UTF-8 inside; the session said C
        r = subprocess.run([sys.executable, "-I", "-S", "-c", probe], env={**base, **env}, capture_output=True,
                           text=True, check=True)
        assert r.stdout.strip() == repr(want), (env, r.stdout, r.stderr)
