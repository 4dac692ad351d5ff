#!/usr/bin/env bash
# Run on the GPU machine, in the repository root, with the carry folder of fetch.sh present:
# installs SGLang's Python tree and the carried wheels into one folder, engramd editable (its
# sglang.srt.plugins entry point registered), and runs check_imports.py there
# (../common/setup_engine.sh does it; what it does is said there).
#
#   bash benchmarks/sglang_gpu/setup_device.sh [--test OUT]
#       then: export PYTHONPATH=${SGLANG_GPU_SITE:-/tmp/sglang-gpu-site}
#   --test OUT  also runs tests/gpu/test_sglang_gpu.py, its log in OUT/sglang_gpu.log
ENGINE=sglang LABEL=SGLang exec bash "$(dirname "$0")/../common/setup_engine.sh" "$@"
