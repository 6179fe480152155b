#!/usr/bin/env bash
# The whole test suite, as CI runs it: setup, lint and types, the docs build (mkdocs --strict), then pytest (unit +
# payload on CPU + the installed-wheel test + integration tests against the local Proxmox test host, which needs
# root, LXC and sshd).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/use-venv.sh
source scripts/use-venv.sh   # setup.sh, then PY = .venv's python and .venv/bin first on PATH (it says why)
# The unprivileged test container's rootfs (tests/integration/test_unpriv_pve.py: Debian bullseye, an older
# python3), once per machine: debootstrap from the Debian mirror into /var/cache/ctl-tests under a lock, with
# root:100000:65536 in /etc/subuid and /etc/subgid as on Proxmox (tests/pvehost/rootfs.py); nothing after. Here,
# not in setup.sh: the quickstart has no use for it. As root only; in CI (CTL_NO_SKIP) a failure fails the run.
if [ "$(id -u)" -eq 0 ] && ! "$PY" tests/pvehost/rootfs.py >/dev/null; then
  if [ -n "${CTL_NO_SKIP:-}" ] && [ "${CTL_NO_SKIP}" != 0 ]; then
    echo "test.sh: CTL_NO_SKIP is set (CI) but the unprivileged test container's rootfs could not be built (above)" >&2
    exit 1
  fi
  echo "test.sh: warning: no rootfs for the unprivileged test container; tests/integration/test_unpriv_pve.py skips" >&2
fi
"$PY" -m ruff check controller tests remote_payload bench
"$PY" -m mypy controller
# The documentation site (mkdocs.yml, docs/): warnings are errors, so a page left out of the nav, a broken link or
# a missing anchor fails here; tests/test_docs.py checks the generated references and every `ctl` line in it.
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet --site-dir site
# Three workers (pytest-xdist), a test file per worker at a time, on CI's 2 cores: most integration tests wait on
# sshd, LXC, tmux and deadlines rather than compute, so a third file beside two fills the waits (a whole run used
# 1.2 of the 2 cores so, and took 9:45 on a quiet machine; the two-worker figure, 20:44, was taken beside other
# work, so the two are not a ratio: bench/RESULTS.md). Each worker
# brings up its own Proxmox test host (tests/conftest.py gives each its own port range). CTL_TEST_WORKERS=0 runs
# everything in one process.
exec "$PY" -m pytest -q -p no:cacheprovider -n "${CTL_TEST_WORKERS:-3}" --dist loadfile "$@"
