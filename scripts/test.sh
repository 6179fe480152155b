#!/usr/bin/env bash
# The whole test suite, as CI runs it: setup, lint and types, then pytest (unit + payload on CPU +
# integration tests against the local Proxmox test host, which needs root, LXC and sshd).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" -m ruff check controller tests remote_payload bench
"$PY" -m mypy controller
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
