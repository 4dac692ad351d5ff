#!/usr/bin/env bash
# Run on a machine with PyPI access (not the GPU machine): builds the carry folder that takes
# vLLM 0.33.0's Python code and the packages its Engram code imports to the GPU machine
# (../common/fetch_engine.sh does it; what it writes is said there).
#
#   bash benchmarks/vllm_gpu/fetch.sh [CARRY]      (default: .vllm-gpu in the repository, ignored)
#
# The tree leaves vLLM's compiled parts behind: 633 MB of extensions that cannot load over another
# torch and would not fit the carry (benchmarks/vllm_gpu/stubs.py stands in for the ones `import
# vllm` reaches), the vllm-rs binary, and the C/C++/CUDA sources and headers. CARRY_LIMIT_MIB
# (default 48); downloads cached in ${VLLM_GPU_CACHE:-~/.cache/engramd-vllm-gpu}.
ENGINE=vllm LABEL=vLLM LIMIT_MIB=48 WHEEL_TAG='*' \
EXCLUDE='*.so vllm/vllm-rs *.h *.hpp *.cuh *.inl *.cu *.cpp */Makefile' \
    exec bash "$(dirname "$0")/../common/fetch_engine.sh" "$@"
