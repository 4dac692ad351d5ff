#!/usr/bin/env bash
# Run on a machine with PyPI access (not the GPU machine): builds the carry folder that takes
# SGLang 0.5.23's Python code and the packages its Engram code imports to the GPU machine
# (../common/fetch_engine.sh does it; what it writes is said there).
#
#   bash benchmarks/sglang_gpu/fetch.sh [CARRY]      (default: .sglang-gpu in the repository, ignored)
#
# The tree is SGLang's cp312 wheel without its Rust extensions (45 MB unpacked: the server's front
# end, its clients and its cache, not the Engram path; benchmarks/sglang_gpu/stubs.py stands in for
# the ones importing reaches). The JIT kernels' C++/CUDA sources stay (1 MB packed): SGLang checks
# at import that their folders exist. CARRY_LIMIT_MIB (default 45); downloads cached in
# ${SGLANG_GPU_CACHE:-~/.cache/engramd-sglang-gpu}.
ENGINE=sglang LABEL=SGLang LIMIT_MIB=45 WHEEL_TAG='cp312-*' EXCLUDE='*.so' \
    exec bash "$(dirname "$0")/../common/fetch_engine.sh" "$@"
