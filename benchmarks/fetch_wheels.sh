#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels that engramd needs on the GPU test
# machine and that its image lacks (it has torch, Triton and cuda-python, and no network), into
# .whl/ (ignored by git). gpu_session.sh installs them there from that folder:
#   bash benchmarks/fetch_wheels.sh && <device run, carrying .whl> bash benchmarks/gpu_session.sh OUT PHASE
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_5_x86_64; do
    platforms+=(--platform "$p")
done
# The daemon's and the client's own needs, and the test runner's plugins the GPU tests use.
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    pyzmq==27.1.0 msgpack==1.1.2 uvloop==0.22.1 prometheus-client==0.23.1 \
    pytest-timeout==2.4.0 hypothesis==6.140.2 sortedcontainers==2.4.0 pyyaml==6.0.3 safetensors==0.6.2
ls .whl
