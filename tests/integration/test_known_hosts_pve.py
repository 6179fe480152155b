"""Marker lines of known_hosts (`@revoked`, `@cert-authority`) against the test host's real sshd host keys:
never a traceback; a revoked key refused (exit 6); host certificates refused with the file and line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from controller.errors import ExitCode
from tests.integration.conftest import PveEnv

pytestmark = pytest.mark.pvehost


def _with_known_hosts(env: PveEnv, lines: list[str]) -> Path:
    kh = env.dir / "known_hosts"
    kh.write_text("\n".join(lines) + "\n")
    env.write(hosts={n: {"known_hosts": str(kh)} for n in ("pve1", "pve2")})
    return kh


def _pve1_line(env: PveEnv) -> tuple[str, str, str]:
    """(host label, key type, base64 key) of pve1's line in the test host's known_hosts."""
    label = f"[{env.host.hosts['pve1'][0]}]:{env.host.port}"
    for line in env.host.known_hosts.read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == label:
            return label, fields[1], fields[2]
    raise AssertionError(f"no line for {label} in {env.host.known_hosts}")


def _other_key(tmp: Path) -> tuple[str, str]:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "other")], check=True)
    kind, blob = (tmp / "other.pub").read_text().split()[:2]
    return kind, blob


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    """ping's one result line (one container asked): the refusal, no traceback."""
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1, out
    return lines[0]


def test_marker_lines_for_other_hosts_are_no_crash(pve_env: PveEnv) -> None:
    kind, blob = _other_key(pve_env.dir)
    _with_known_hosts(pve_env, [
        "# a CA for another domain, a revoked key of some other machine, a damaged line",
        f"@cert-authority *.corp.example {kind} {blob}",
        f"@revoked * {kind} {blob}",
        "@bogus-marker foo ssh-ed25519 AAAA",
        "[broken]:22 ssh-ed25519 !!!not-base64!!!",
        *pve_env.host.known_hosts.read_text().splitlines(),
    ])
    r = pve_env.ctl("ping", "ct200", "ct300")
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_revoked_host_key_is_refused_even_when_also_listed(pve_env: PveEnv) -> None:
    label, kind, blob = _pve1_line(pve_env)
    kh = _with_known_hosts(pve_env, [*pve_env.host.known_hosts.read_text().splitlines(),
                                     f"@revoked {label} {kind} {blob}"])
    n = len(kh.read_text().splitlines())
    r = pve_env.ctl("ping", "ct200")
    assert r.returncode == ExitCode.HOST_KEY, r.stdout + r.stderr
    line = _one_line(r)
    assert "REVOKED" in line and f"{kh}:{n} @revoked" in line and label in line, line
    # Also with a wildcard host pattern, and without the plain line.
    kh = _with_known_hosts(pve_env, [f"@revoked * {kind} {blob}"])
    r = pve_env.ctl("ping", "ct200")
    assert r.returncode == ExitCode.HOST_KEY, r.stdout + r.stderr
    assert f"{kh}:1 @revoked" in _one_line(r)
    # pve2's key is not revoked: ct300 still answers.
    _with_known_hosts(pve_env, [*pve_env.host.known_hosts.read_text().splitlines(), f"@revoked * {kind} {blob}"])
    assert pve_env.ctl("ping", "ct300").returncode == 0


def test_a_host_trusted_only_through_a_cert_authority_is_refused_with_file_and_line(pve_env: PveEnv) -> None:
    label, kind, blob = _pve1_line(pve_env)
    ca_kind, ca_blob = _other_key(pve_env.dir)
    others = [x for x in pve_env.host.known_hosts.read_text().splitlines() if not x.startswith(label + " ")]
    kh = _with_known_hosts(pve_env, [*others, f"@cert-authority {pve_env.host.hosts['pve1'][0]},*.example "
                                              f"{ca_kind} {ca_blob}"])
    n = len(others) + 1
    r = pve_env.ctl("ping", "ct200")
    assert r.returncode == ExitCode.HOST_KEY, r.stdout + r.stderr
    line = _one_line(r)
    assert "host certificates are not supported" in line and f"{kh}:{n} (@cert-authority)" in line, line
    # The plain key beside the CA line: connects as before.
    _with_known_hosts(pve_env, [*others, f"@cert-authority * {ca_kind} {ca_blob}", f"{label} {kind} {blob}"])
    r = pve_env.ctl("ping", "ct200")
    assert r.returncode == 0, r.stdout + r.stderr
