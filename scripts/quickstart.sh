#!/usr/bin/env bash
# The main job on the embedded default: the `local` target of inventory.yaml (this machine, a
# directory standing for the container) and the tiny CPU model: deploy, launch and follow a short
# DFlash drafter training run to its end, then show the run table.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
export CTL_INVENTORY=inventory.yaml
# --allow-dirty: the quickstart deploys straight from this checkout, edited or not (the record says which).
"$PY" -m controller deploy local --allow-dirty
"$PY" -m controller launch local --follow
"$PY" -m controller runs local
