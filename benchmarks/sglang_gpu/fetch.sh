#!/usr/bin/env bash
# Run on a machine with PyPI access (not the GPU machine): builds the carry folder that takes
# SGLang 0.5.23's Python code and the packages its Engram code imports to the GPU machine.
#
#   bash benchmarks/sglang_gpu/fetch.sh [CARRY]      (default: .sglang-gpu in the repository, ignored)
#
# CARRY gets:
#   sglang-0.5.23-py.tar.gz   SGLang's cp312 wheel without its compiled parts (the Rust extensions'
#                             *.so), dist-info kept; the JIT kernels' C++/CUDA sources stay (1 MB
#                             packed): SGLang checks at import that their folders exist
#   wheels/*.whl              the other pins of requirements.txt, cp312 manylinux x86_64 or pure
#   SHA256SUMS                of both, checked by setup_device.sh
# Downloads are cached in ${SGLANG_GPU_CACHE:-~/.cache/engramd-sglang-gpu}. Fails if CARRY is over
# CARRY_LIMIT_MIB (default 45): the working tree (about 7 MiB), every carried folder and, where a
# run takes it too, .whl/ travel in 64 MiB in all.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
carry="${1:-$repo/.sglang-gpu}"
cache="${SGLANG_GPU_CACHE:-$HOME/.cache/engramd-sglang-gpu}"
limit_mib="${CARRY_LIMIT_MIB:-45}"
python="${PYTHON:-python3}"
requirements="$here/requirements.txt"

sglang_pin="$(grep -E '^sglang==' "$requirements")"
sglang_version="${sglang_pin#sglang==}"
# The GPU machine: CPython 3.12 on x86_64, glibc 2.39 (Ubuntu 24.04's Python 3.12.3). SGLang's own
# wheel is manylinux_2_34. pip there refuses a wheel whose tag does not fit.
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
        --abi none --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

mkdir -p "$cache/sglang" "$cache/wheels"
pins="$cache/pins.txt"
grep -E '^[a-zA-Z].*==' "$requirements" | grep -vE '^sglang==' | sed 's/ *#.*//' >"$pins"
echo "downloading $sglang_pin and $(wc -l <"$pins") other pins into $cache"
"$python" -m pip download -q --no-deps "${target[@]}" -d "$cache/sglang" "$sglang_pin"
"$python" -m pip download -q --no-deps "${target[@]}" -d "$cache/wheels" -r "$pins"

rm -rf "$carry"
mkdir -p "$carry/wheels"
# Only the pinned version of each package (the cache may hold older downloads), one wheel each.
"$python" - "$cache/wheels" "$pins" "$carry/wheels" <<'PY'
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

wheel="$(ls "$cache"/sglang/sglang-"$sglang_version"-cp312-*.whl | head -1)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
# The Rust extensions (45 MB unpacked) serve the server's front end, its clients and its cache,
# not the Engram path; benchmarks/sglang_gpu/stubs.py stands in for the ones importing reaches.
unzip -q "$wheel" -d "$tree" -x '*.so'
tar czf "$carry/sglang-$sglang_version-py.tar.gz" -C "$tree" .
(cd "$carry" && sha256sum "sglang-$sglang_version-py.tar.gz" wheels/*.whl >SHA256SUMS)

mib() { echo "$1 / 1048576" | bc -l; }
bytes="$(du -cb "$carry" | tail -1 | cut -f1)"
tree_bytes="$(cd "$repo" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)"
whl_bytes=0
[ -d "$repo/.whl" ] && whl_bytes="$(du -cb "$repo/.whl" | tail -1 | cut -f1)"
printf 'carry %s: %.1f MiB (SGLang tree %.1f MiB, %d wheels); working tree %.1f MiB; .whl/ %.1f MiB; together %.1f of 64 MiB\n' \
    "$carry" "$(mib "$bytes")" "$(mib "$(stat -c %s "$carry/sglang-$sglang_version-py.tar.gz")")" \
    "$(ls "$carry"/wheels/*.whl | wc -l)" "$(mib "$tree_bytes")" "$(mib "$whl_bytes")" \
    "$(mib "$((bytes + tree_bytes + whl_bytes))")"
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
    echo "carry is over $limit_mib MiB (CARRY_LIMIT_MIB)" >&2
    exit 1
fi
