#!/usr/bin/env bash
# Install what ctl and its tests need on a fresh Debian machine (idempotent; run as root for apt).
#   system: openssh (the test host's sshd and `ssh -t` for attach), lxc (the test host's containers), tmux,
#           nftables (a test drops the test host's loopback traffic; skipped without nft or iptables),
#           chromium (the headless browser the dashboard's tests drive; skipped without it),
#           debootstrap (scripts/test.sh builds with it the rootfs of the test host's unprivileged CT 202),
#           python3-venv where the interpreter cannot make a venv (stock Debian), python3 at /usr/bin (the
#           containers' interpreter), util-linux's setsid (the local agent's tests)
#   CI (CTL_NO_SKIP=1, set by .ci/run, where any skipped test fails the run) needs all of it: setup then fails, naming
#   why, where it is not root or a package cannot be installed. Elsewhere a missing one is a warning, and the tests
#   that need it skip, saying why.
#   python: a project venv at .venv (CTL_VENV overrides) holding ctl (editable) with its dev tools and the
#           payload's torch/transformers (and z-lab's `dflash` reference, for a test). Nothing is installed into the system interpreter: Debian 12 refuses
#           that (PEP 668, externally managed), and a project venv keeps the checkout's tools apart.
# Prints the venv's python on its last line, for the scripts that call it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${CTL_VENV:-.venv}

need_apt=()
ci=
[ -n "${CTL_NO_SKIP:-}" ] && [ "${CTL_NO_SKIP}" != 0 ] && ci=1
if [ -n "$ci" ] && [ "$(id -u)" -ne 0 ]; then
  echo "setup: CTL_NO_SKIP is set (CI: a skipped test fails the run) but this is not root: the Proxmox test host's" \
       "tests need root (LXC containers, sshd, nftables); run as root" >&2
  exit 1
fi
for bin in sshd:openssh-server ssh:openssh-client lxc-start:lxc tmux:tmux git:git ps:procps chromium:chromium \
           setsid:util-linux debootstrap:debootstrap; do
  command -v "${bin%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${bin%%:*}" ] || need_apt+=("${bin##*:}")
done
[ -x /usr/bin/python3 ] || need_apt+=(python3)
# the test host's sshd sees a Proxmox host's / through an overlay (tests/integration/test_pvehost_pct.py skips
# without): the module may just not be loaded yet
if [ -n "$ci" ] && ! grep -qw overlay /proc/filesystems && ! modprobe overlay; then
  echo "setup: CTL_NO_SKIP is set (CI) but this kernel has no overlayfs (modprobe overlay failed)" >&2
  exit 1
fi
if ! command -v nft >/dev/null 2>&1 && ! command -v iptables >/dev/null 2>&1 && [ ! -x /usr/sbin/nft ]; then
  need_apt+=(nftables)
fi
if [ ! -x "$VENV/bin/python" ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need_apt+=(python3-venv)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing ${need_apt[*]}; install them as root (apt-get install ${need_apt[*]})" >&2
  else
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >&2
VENV_PY="$VENV/bin/python"
# torch first and pinned: 2.13.0 is the CPU wheel this machine kind carries; an unpinned torch would
# pull a multi-GB CUDA build. The payload itself runs on torch 2.11 (the GPU boxes) through 2.13+.
"$VENV_PY" -m pip install -q --disable-pip-version-check "torch==2.13.0" >&2
# Editable as a path (compat): setuptools' default editable install adds an import hook that every python start of
# the venv pays (~16 ms here: pathlib, importlib.util, urllib), every ctl command and session process included.
# setuptools calls compat mode transitional: where a later one refuses it, the default editable install is used.
"$VENV_PY" -m pip install -q --disable-pip-version-check -e '.[dev,payload]' --config-settings editable_mode=compat >&2 ||
  "$VENV_PY" -m pip install -q --disable-pip-version-check -e '.[dev,payload]' >&2
# z-lab's DFlash reference implementation, for tests/payload/test_export_reference.py (it loads what `ctl export`
# writes and decodes with it). Pinned, and WITHOUT its dependencies: its own pins would bring datasets, requests
# and tqdm and replace this venv's torch and transformers, while dflash.model needs only those two.
"$VENV_PY" -m pip install -q --disable-pip-version-check --no-deps "dflash==0.1.0" >&2
echo "$VENV_PY"
