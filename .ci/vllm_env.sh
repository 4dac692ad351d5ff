#!/usr/bin/env bash
# Build the environment the vLLM plugin's tests run in: a virtual environment over the main one
# (--system-site-packages, so torch 2.13.0 CPU and engramd's dependencies are reused, never
# replaced), with vLLM and what its Engram code imports pinned in .ci/vllm-requirements.txt, and
# engramd installed in it so that its `vllm.general_plugins` entry point is visible there.
#   .ci/vllm_env.sh [DIR]        (default: .venv-vllm in the repository)
#   DIR/bin/python -m pytest -q tests/vllm
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --no-deps -r "$repo/.ci/vllm-requirements.txt"
"$venv/bin/python" -m pip install -q --no-deps -e "$repo"
"$venv/bin/python" - <<'PY'
import torch, triton, vllm
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: the venv must reuse 2.13.0"
print(f"vLLM test environment: vllm {vllm.__version__}, triton {triton.__version__}, torch {torch.__version__}")
PY
