"""The host relay's direct start of a staying agent (hostrelay.attach_argv): only Proxmox's own `pct exec VMID
-- ...` is turned into the lxc-attach that pct would run, with the environment pct would give it. Against real
LXC: tests/integration/test_mux_pve.py."""

from __future__ import annotations

from controller.remote.hostrelay import PVE_PATH, attach_argv

AGENT = ["python3", "-I", "-S", "-c", "BOOT", "123", "serve"]


def test_pct_exec_becomes_the_lxc_attach_pct_runs_with_its_environment() -> None:
    env = {"PATH": "/root/.pyenv/shims:/usr/bin", "HOME": "/root", "SSL_CERT_FILE": "/x.pem", "SSL_CERT_DIR": "/c",
           "LANG": "en_US.UTF-8", "LC_CTYPE": "C.UTF-8"}
    for pct in ("pct", "/usr/sbin/pct"):
        got = attach_argv([pct, "exec", "200", "--", *AGENT], env)
        assert got is not None
        argv, child = got
        assert argv == ["lxc-attach", "-n", "200", "--keep-env", "--", *AGENT]
        assert child == {"PATH": PVE_PATH, "HOME": "/root", "LANG": "en_US.UTF-8", "LC_CTYPE": "C.UTF-8"}
    assert env["PATH"] == "/root/.pyenv/shims:/usr/bin" and "SSL_CERT_FILE" in env  # the relay's own: untouched


def test_keep_env_0_clears_and_the_relays_own_locale_coercion_is_not_passed_on() -> None:
    got = attach_argv(["pct", "exec", "301", "--keep-env", "0", "--", "true"], {"LC_CTYPE": "C.UTF-8", "A": "1"})
    assert got == (["lxc-attach", "-n", "301", "--clear-env", "--", "true"], {"A": "1", "PATH": PVE_PATH})
    got = attach_argv(["pct", "exec", "301", "--keep-env", "1", "--", "true"], {})
    assert got is not None and got[0][3] == "--keep-env"


def test_any_other_line_is_run_as_given() -> None:
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
        assert attach_argv(argv, {"PATH": "/bin"}) is None, argv
