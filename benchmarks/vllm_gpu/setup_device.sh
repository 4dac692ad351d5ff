#!/usr/bin/env bash
# Run on the GPU machine, in the repository root, with the carry folder of fetch.sh present:
# installs vLLM's Python tree and the carried wheels into one folder, engramd editable (its
# vllm.general_plugins entry point registered), and runs check_imports.py there
# (../common/setup_engine.sh does it; what it does is said there).
#
#   bash benchmarks/vllm_gpu/setup_device.sh [--test OUT]
#       then: export PYTHONPATH=${VLLM_GPU_SITE:-/tmp/vllm-gpu-site}
#   --test OUT  also runs tests/gpu/test_vllm_gpu.py, its log in OUT/vllm_gpu.log
ENGINE=vllm LABEL=vLLM exec bash "$(dirname "$0")/../common/setup_engine.sh" "$@"
