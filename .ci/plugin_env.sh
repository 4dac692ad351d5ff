#!/usr/bin/env bash
# Build the environment an engine plugin's tests run in (tests/vllm_plugin, tests/sglang_plugin):
# a virtual environment layered over the environment of the `python` that runs this script (torch
# 2.13.0 CPU and engramd's dependencies are reused from there, never replaced), with the engine
# and what its Engram code imports pinned in .ci/ENGINE-requirements.txt, and engramd installed in
# it so that the engine's plugin entry point is visible there.
#   .ci/plugin_env.sh ENGINE [DIR]   (ENGINE: vllm or sglang; DIR default: .venv-ENGINE)
# .ci/vllm_env.sh and .ci/sglang_env.sh name the engine.
#
# Why not `venv --system-site-packages`: when `python` is itself a virtual environment (or a
# conda-style prefix), "system" means the base interpreter's packages, not the ones installed
# where `python` is, and torch would be missing. The new environment instead reads the running
# interpreter's site folders through a .pth file, after its own packages, so what it installs
# wins and everything else comes from the environment it was built over. Works the same from the
# system Python, from a venv and from a conda prefix.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
engine="${1:?usage: .ci/plugin_env.sh vllm|sglang [DIR]}"
venv="${2:-$repo/.venv-$engine}"
requirements="$repo/.ci/$engine-requirements.txt"
[ -f "$requirements" ] || { echo "plugin_env.sh: no $requirements"; exit 1; }

# Run one step; on failure say which, with the last lines it printed, on stdout (CI shows stdout).
step() {
    local what="$1" log
    shift
    log="$(mktemp)"
    if ! "$@" >"$log" 2>&1; then
        echo "plugin_env.sh ($engine): $what failed:"
        tail -n 25 "$log" | sed 's/^/    /'
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
}

# The new environment sees every site folder of the running interpreter (its own, and the base's
# where it was made with --system-site-packages), after its own. Each .pth line runs
# site.addsitedir so that the parent's own .pth files (editable installs) are processed too.
link_parent() {
    local own
    own="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    python - "$own/engramd-parent-env.pth" <<'PY'
import sys
import sysconfig

sites = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
sites += [path for path in sys.path if path.endswith(("site-packages", "dist-packages"))]
with open(sys.argv[1], "w") as pth:
    for path in dict.fromkeys(sites):
        pth.write(f"import site; site.addsitedir({path!r})\n")
PY
}

check() {
    "$venv/bin/python" - "$engine" <<'PY'
import importlib
import sys

import torch
import triton

engine = sys.argv[1]
module = importlib.import_module(engine)
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: the venv must reuse 2.13.0"
importlib.import_module(f"engramd.client.engines.{engine}")  # the plugin imports in this environment
print(f"{engine} test environment: {engine} {module.__version__}, triton {triton.__version__}, "
      f"torch {torch.__version__}")
PY
}

step "checking that $(command -v python) has torch" python -c "import torch"
step "creating the virtual environment $venv" python -m venv --clear "$venv"
step "linking it to the environment of $(command -v python)" link_parent
step "installing $requirements" \
    "$venv/bin/python" -m pip install -q --no-deps -r "$requirements"
step "installing engramd into it" "$venv/bin/python" -m pip install -q --no-deps -e "$repo"
check || { echo "plugin_env.sh: importing torch, triton, $engine and its plugin in $venv failed (above)"; exit 1; }
