#!/usr/bin/env bash
# The carry folder of an engine's GPU recipe (benchmarks/<engine>_gpu/): the engine's Python code
# and the packages its Engram code imports, for a GPU machine without a network. Run on a machine
# with PyPI access, through the recipe's own fetch.sh, which sets:
#
#   ENGINE       the package and the recipe's folder (vllm: benchmarks/vllm_gpu)
#   LABEL        its name in messages (vLLM)
#   LIMIT_MIB    the carry's default limit, CARRY_LIMIT_MIB overriding it: the working tree,
#                every carried folder and, where a run takes it too, .whl/ travel in 64 MiB in all
#   WHEEL_TAG    the engine's own wheel among the downloads, after "<engine>-<version>-" ('*': any)
#   EXCLUDE      what of the wheel stays behind (unzip -x patterns, space-separated)
#
#   bash benchmarks/<engine>_gpu/fetch.sh [CARRY]     (default: .<engine>-gpu in the repository)
#
# CARRY gets <engine>-<version>-py.tar.gz (the wheel without EXCLUDE, dist-info kept),
# wheels/*.whl (the other pins of the recipe's requirements.txt, cp312 manylinux x86_64 or pure)
# and SHA256SUMS of both, which the recipe's setup_device.sh checks. Downloads are cached in
# ${<ENGINE>_GPU_CACHE:-~/.cache/engramd-<engine>-gpu}.
set -euo pipefail
: "${ENGINE:?}" "${LABEL:?}" "${LIMIT_MIB:?}" "${WHEEL_TAG:?}" "${EXCLUDE?}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"
recipe="$repo/benchmarks/${ENGINE}_gpu"
carry="${1:-$repo/.${ENGINE}-gpu}"
cache_setting="${ENGINE^^}_GPU_CACHE"
cache="${!cache_setting:-$HOME/.cache/engramd-${ENGINE}-gpu}"
limit_mib="${CARRY_LIMIT_MIB:-$LIMIT_MIB}"
python="${PYTHON:-python3}"
requirements="$recipe/requirements.txt"

pin="$(grep -E "^${ENGINE}==" "$requirements")"
version="${pin#"${ENGINE}"==}"
# The GPU machine: CPython 3.12 on x86_64, glibc 2.39 (Ubuntu 24.04's Python 3.12.3); some
# engines' wheels are manylinux_2_34, llguidance's manylinux_2_31 only. pip there refuses a
# wheel whose tag does not fit.
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
        --abi none --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

mkdir -p "$cache/$ENGINE" "$cache/wheels"
pins="$cache/pins.txt"
grep -E '^[a-zA-Z].*==' "$requirements" | grep -vE "^${ENGINE}==" | sed 's/ *#.*//' >"$pins"
echo "downloading $pin and $(wc -l <"$pins") other pins into $cache"
"$python" -m pip download -q --no-deps "${target[@]}" -d "$cache/$ENGINE" "$pin"
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

# shellcheck disable=SC2086  # WHEEL_TAG: a glob
wheel="$(ls "$cache/$ENGINE/$ENGINE-$version-"$WHEEL_TAG.whl | head -1)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
read -ra excluded <<<"$EXCLUDE"
unzip -q "$wheel" -d "$tree" ${excluded[@]+-x "${excluded[@]}"}
find "$tree" -type d -empty -delete
packed="$ENGINE-$version-py.tar.gz"
tar czf "$carry/$packed" -C "$tree" .
(cd "$carry" && sha256sum "$packed" wheels/*.whl >SHA256SUMS)

mib() { echo "$1 / 1048576" | bc -l; }
bytes="$(du -cb "$carry" | tail -1 | cut -f1)"
tree_bytes="$(cd "$repo" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)"
whl_bytes=0
[ -d "$repo/.whl" ] && whl_bytes="$(du -cb "$repo/.whl" | tail -1 | cut -f1)"
printf 'carry %s: %.1f MiB (%s tree %.1f MiB, %d wheels); working tree %.1f MiB; .whl/ %.1f MiB; together %.1f of 64 MiB\n' \
    "$carry" "$(mib "$bytes")" "$LABEL" "$(mib "$(stat -c %s "$carry/$packed")")" \
    "$(ls "$carry"/wheels/*.whl | wc -l)" "$(mib "$tree_bytes")" "$(mib "$whl_bytes")" \
    "$(mib "$((bytes + tree_bytes + whl_bytes))")"
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
    echo "carry is over $limit_mib MiB (CARRY_LIMIT_MIB)" >&2
    exit 1
fi
