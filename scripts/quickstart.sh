#!/usr/bin/env bash
# The main job on the embedded default: the `local` target of inventory.yaml (this machine, a
# directory standing for the container) and the tiny CPU model: deploy, launch and follow a short
# DFlash drafter training run to its end, then show the run table.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/use-venv.sh
source scripts/use-venv.sh   # setup.sh, then PY = .venv's python and .venv/bin first on PATH (it says why)
export CTL_INVENTORY=inventory.yaml
# --allow-dirty: the quickstart deploys straight from this checkout, edited or not (the record says which).
ctl deploy local --allow-dirty
ctl launch local --follow
ctl runs local
