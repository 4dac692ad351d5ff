#!/usr/bin/env bash
# Run on the GPU machine, in the repository root, with the carry folder of fetch.sh present:
# installs vLLM's Python tree and the carried wheels into one folder (no network: --no-index),
# installs engramd (editable, so its vllm.general_plugins entry point is registered), and checks
# that vLLM, its Engram module and the plugin import there.
#
#   bash benchmarks/vllm_gpu/setup_device.sh [--test OUT]
#       then: export PYTHONPATH=${VLLM_GPU_SITE:-/tmp/vllm-gpu-site}
#   --test OUT  also runs tests/gpu/test_vllm_gpu.py, its log in OUT/vllm_gpu.log
#
# Settings: VLLM_GPU_CARRY (default .vllm-gpu), VLLM_GPU_SITE (default /tmp/vllm-gpu-site).
set -euo pipefail
cd "$(dirname "$0")/../.."
carry="${VLLM_GPU_CARRY:-.vllm-gpu}"
site="${VLLM_GPU_SITE:-/tmp/vllm-gpu-site}"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING="${CUDA_MODULE_LOADING:-EAGER}"  # as gpu_session.sh

[ -f "$carry/SHA256SUMS" ] || { echo "no $carry/SHA256SUMS: run benchmarks/vllm_gpu/fetch.sh and carry $carry" >&2; exit 1; }
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 12), f"Python {sys.version}: the carried wheels are cp312"'
(cd "$carry" && sha256sum --quiet -c SHA256SUMS)

start=$(date +%s)
rm -rf "$site"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$carry"/wheels/*.whl
tar xzf "$carry"/vllm-*-py.tar.gz -C "$site"
PYTHON="$python" bash benchmarks/common/install_editable.sh /tmp/vllm-gpu-engramd-install.log
export PYTHONPATH="$site"
echo "installed into $site in $(( $(date +%s) - start )) s"

"$python" - <<'PY'
import importlib.metadata as md
import sys
import time

sys.path.insert(0, "benchmarks/vllm_gpu")
import stubs

assert stubs.install(), "vLLM's tree is not on the path, or it is a full install"
started = time.monotonic()
import torch
import triton
import vllm
from vllm.platforms import current_platform

print(f"import vllm {vllm.__version__}: {time.monotonic() - started:.1f} s "
      f"(torch {torch.__version__}, triton {triton.__version__}, platform {type(current_platform).__name__})")
assert torch.cuda.is_available() and current_platform.is_cuda(), "vLLM does not see CUDA here"
import vllm.models.deepseek_v41.common.engram as engram

from engramd.client.engines import vllm as plugin

plugin.check_version(vllm.__version__)
plugin.check_seams(engram)
plugins = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "engramd" in plugins, f"engramd's entry point is not registered: {plugins}"
stood = sorted(n for n, m in list(sys.modules.items()) if stubs.is_stand_in(m))
print(f"vllm.models.deepseek_v41.common.engram and the engramd plugin import "
      f"({time.monotonic() - started:.1f} s); stand-ins loaded: {', '.join(stood)}")
PY

if [ "${1:-}" = "--test" ]; then
    out="${2:?--test needs an output folder}"
    mkdir -p "$out"
    set +e
    "$python" -m pytest -v -s -rA --durations=5 tests/gpu/test_vllm_gpu.py 2>&1 | tee "$out/vllm_gpu.log"
    exit "${PIPESTATUS[0]}"
fi
