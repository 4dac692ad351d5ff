#!/usr/bin/env bash
# engramd installed editable from this tree (`pip install --no-deps -e .`: its entry points
# registered for the engines' plugin loaders), skipped where it already is, so that set-ups run side
# by side (gpu_session.sh's PHASE+PHASE) never rewrite the install under each other's daemons.
#
#   bash benchmarks/common/install_editable.sh LOG      (PYTHON: the interpreter, default python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
if "$python" -m pip show engramd-daemon 2>/dev/null | grep -qxF "Editable project location: $PWD"; then
    exit 0
fi
"$python" -m pip install -q --no-deps --no-build-isolation -e . >"$1" 2>&1 || { tail -20 "$1"; exit 1; }
