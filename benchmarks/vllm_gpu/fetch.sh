#!/usr/bin/env bash
# Run on a machine with PyPI access (not the GPU machine): builds the carry folder that takes
# vLLM 0.33.0's Python code and the packages its Engram code imports to the GPU machine.
#
#   bash benchmarks/vllm_gpu/fetch.sh [CARRY]      (default: .vllm-gpu in the repository, ignored)
#
# CARRY gets:
#   vllm-0.33.0-py.tar.gz   vLLM's wheel without its compiled parts (*.so, the vllm-rs binary,
#                           C/C++/CUDA sources and headers), dist-info kept
#   wheels/*.whl            the other pins of requirements.txt, cp312 manylinux x86_64 or pure
#   SHA256SUMS              of both, checked by setup_device.sh
# Downloads are cached in ${VLLM_GPU_CACHE:-~/.cache/engramd-vllm-gpu}. Fails if CARRY is over
# CARRY_LIMIT_MIB (default 48): the working tree and every carried folder travel in 64 MiB in all.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
carry="${1:-$repo/.vllm-gpu}"
cache="${VLLM_GPU_CACHE:-$HOME/.cache/engramd-vllm-gpu}"
limit_mib="${CARRY_LIMIT_MIB:-48}"
python="${PYTHON:-python3}"
requirements="$here/requirements.txt"

vllm_pin="$(grep -E '^vllm==' "$requirements")"
vllm_version="${vllm_pin#vllm==}"
# The GPU machine: CPython 3.12 on x86_64 with a recent glibc (its Python 3.12.3 is Ubuntu 24.04's,
# glibc 2.39); llguidance ships manylinux_2_31 wheels only. pip there refuses a wheel whose tag
# does not fit.
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
        --abi none --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

mkdir -p "$cache/vllm" "$cache/wheels"
echo "downloading $vllm_pin and $(grep -cE '^[a-zA-Z].*==' "$requirements") pins into $cache"
"$python" -m pip download -q --no-deps "${target[@]}" -d "$cache/vllm" "$vllm_pin"
grep -E '^[a-zA-Z].*==' "$requirements" | grep -vE '^vllm==' | sed 's/ *#.*//' >"$cache/pins.txt"
"$python" -m pip download -q --no-deps "${target[@]}" -d "$cache/wheels" -r "$cache/pins.txt"

rm -rf "$carry"
mkdir -p "$carry/wheels"
# Only the pinned version of each package (the cache may hold older downloads).
"$python" - "$cache/wheels" "$cache/pins.txt" "$carry/wheels" <<'PY'
import re, shutil, sys
from pathlib import Path

cache, pins, dest = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()
wanted = {}
for line in pins.read_text().split():
    name, version = line.split("==")
    wanted[norm(name)] = version
found = {}
for wheel in sorted(cache.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    if wanted.get(norm(name)) == version:
        found.setdefault(norm(name), []).append(wheel)
missing = sorted(set(wanted) - set(found))
twice = {name: [w.name for w in wheels] for name, wheels in found.items() if len(wheels) > 1}
if missing or twice:
    sys.exit(f"wheels missing: {missing}; more than one wheel of a pin: {twice}")
for wheels in found.values():
    shutil.copy2(wheels[0], dest)
PY

wheel="$(ls "$cache"/vllm/vllm-"$vllm_version"-*.whl | head -1)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
# Compiled extensions (633 MB) cannot load over another torch and would not fit the carry;
# benchmarks/vllm_gpu/stubs.py stands in for the ones `import vllm` reaches.
unzip -q "$wheel" -d "$tree" -x '*.so' 'vllm/vllm-rs' '*.h' '*.hpp' '*.cuh' '*.inl' '*.cu' '*.cpp' \
    '*/Makefile'
find "$tree" -type d -empty -delete
tar czf "$carry/vllm-$vllm_version-py.tar.gz" -C "$tree" .
(cd "$carry" && sha256sum "vllm-$vllm_version-py.tar.gz" wheels/*.whl >SHA256SUMS)

bytes="$(du -cb "$carry" | tail -1 | cut -f1)"
tree_bytes="$(cd "$repo" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)"
printf 'carry %s: %.1f MiB (vLLM tree %.1f MiB, %d wheels); working tree %.1f MiB; together %.1f of 64 MiB\n' \
    "$carry" "$(echo "$bytes / 1048576" | bc -l)" \
    "$(echo "$(stat -c %s "$carry/vllm-$vllm_version-py.tar.gz") / 1048576" | bc -l)" \
    "$(ls "$carry"/wheels/*.whl | wc -l)" "$(echo "$tree_bytes / 1048576" | bc -l)" \
    "$(echo "($bytes + $tree_bytes) / 1048576" | bc -l)"
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
    echo "carry is over $limit_mib MiB" >&2
    exit 1
fi
