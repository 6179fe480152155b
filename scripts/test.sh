#!/usr/bin/env bash
# The whole test suite, as CI runs it: setup, lint and types, then pytest (unit + payload on CPU + the
# installed-wheel test + integration tests against the local Proxmox test host, which needs root, LXC and sshd).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/use-venv.sh
source scripts/use-venv.sh   # setup.sh, then PY = .venv's python and .venv/bin first on PATH (it says why)
"$PY" -m ruff check controller tests remote_payload bench
"$PY" -m mypy controller
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
