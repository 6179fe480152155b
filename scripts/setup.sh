#!/usr/bin/env bash
# Install what ctl and its tests need on a fresh Debian machine (idempotent; run as root for apt).
#   system: openssh (the test host's sshd and `ssh -t` for attach), lxc (the test host's containers), tmux
#   python: ctl itself (editable) with its dev tools, and the payload's torch/transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

need_apt=()
for bin in sshd:openssh-server ssh:openssh-client lxc-start:lxc tmux:tmux git:git ps:procps; do
  command -v "${bin%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${bin%%:*}" ] || need_apt+=("${bin##*:}")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing ${need_apt[*]}; install them as root (apt-get install ${need_apt[*]})" >&2
  else
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq openssh-server openssh-client lxc tmux git procps >/dev/null
  fi
fi

# torch first and pinned: 2.13.0 is the CPU wheel this machine kind carries; an unpinned torch would
# pull a multi-GB CUDA build. The payload itself runs on torch 2.11 (the GPU boxes) through 2.13+.
"$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install -q --disable-pip-version-check -e '.[dev,payload]'
