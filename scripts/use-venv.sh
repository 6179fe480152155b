# Sourced (not run) by quickstart.sh and test.sh from the repository root: runs setup.sh, which installs into
# the project venv (.venv, or CTL_VENV) and prints the venv's python on its last line, and sets
#   PY       that python (ctl, ruff, mypy and pytest all run from it, never from the system interpreter)
#   PATH     the venv's bin first, as an absolute path. Why: the `local` target runs the rendered
#            start_training.sh with `python3` from PATH (inventory.yaml: containers.local.vars.python), after a
#            `cd` into the run directory, and `ctl env probe` runs `python3 -` from PATH too; that python3
#            must be the venv's, which has torch (Debian's /usr/bin/python3 has none, and PEP 668 keeps pip off it).
PY=$(bash scripts/setup.sh | tail -n 1)
VENV_BIN=$(cd "$(dirname "$PY")" && pwd)
PY="$VENV_BIN/$(basename "$PY")"
export PATH="$VENV_BIN:$PATH"
