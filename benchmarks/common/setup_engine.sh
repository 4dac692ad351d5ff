#!/usr/bin/env bash
# The set-up half of an engine's GPU recipe (benchmarks/<engine>_gpu/), run on the GPU machine in
# the repository root with the recipe's carry folder present (../common/fetch_engine.sh wrote
# it): installs the engine's Python tree and the carried wheels into one folder (no network:
# --no-index), installs engramd editable (so the plugin's entry point is registered), and runs
# the recipe's check_imports.py there. The recipe's own setup_device.sh sets:
#
#   ENGINE   the package and the recipe's folder (vllm: benchmarks/vllm_gpu)
#   LABEL    its name in messages (vLLM)
#
#   bash benchmarks/<engine>_gpu/setup_device.sh [--test OUT]
#       then: export PYTHONPATH=${<ENGINE>_GPU_SITE:-/tmp/<engine>-gpu-site}
#   --test OUT  also runs tests/gpu/test_<engine>_gpu.py, its log in OUT/<engine>_gpu.log;
#               ENGINE_TESTS_K: a pytest -k expression for some of its tests
#
# Settings: <ENGINE>_GPU_CARRY (default .<engine>-gpu), <ENGINE>_GPU_SITE (default
# /tmp/<engine>-gpu-site).
set -euo pipefail
: "${ENGINE:?}" "${LABEL:?}"
cd "$(dirname "$0")/../.."
carry_setting="${ENGINE^^}_GPU_CARRY" site_setting="${ENGINE^^}_GPU_SITE"
carry="${!carry_setting:-.${ENGINE}-gpu}"
site="${!site_setting:-/tmp/${ENGINE}-gpu-site}"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING="${CUDA_MODULE_LOADING:-EAGER}"  # as gpu_session.sh

[ -f "$carry/SHA256SUMS" ] || {
    echo "no $carry/SHA256SUMS: run benchmarks/${ENGINE}_gpu/fetch.sh and carry $carry" >&2; exit 1; }
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 12), f"Python {sys.version}: the carried wheels are cp312"'
(cd "$carry" && sha256sum --quiet -c SHA256SUMS)

start=$(date +%s)
rm -rf "$site"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$carry"/wheels/*.whl
tar xzf "$carry"/"$ENGINE"-*-py.tar.gz -C "$site"
PYTHON="$python" bash benchmarks/common/install_editable.sh "/tmp/${ENGINE}-gpu-engramd-install.log"
export PYTHONPATH="$site"
echo "installed $LABEL into $site in $(( $(date +%s) - start )) s"
"$python" "benchmarks/${ENGINE}_gpu/check_imports.py"

if [ "${1:-}" = "--test" ]; then
    out="${2:?--test needs an output folder}"
    mkdir -p "$out"
    set +e
    "$python" -m pytest -v -s -rA --durations=5 ${ENGINE_TESTS_K:+-k "$ENGINE_TESTS_K"} \
        "tests/gpu/test_${ENGINE}_gpu.py" 2>&1 | tee "$out/${ENGINE}_gpu.log"
    exit "${PIPESTATUS[0]}"
fi
