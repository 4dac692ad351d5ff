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
# /tmp/<engine>-gpu-site), ENGINE_TESTS_N (with --test: the tests in N processes at once, where
# pytest-xdist is installed; each test has its own daemon, socket and port).
#
# A site already installed from the same carry (its SHA256SUMS) by the same interpreter, and
# checked with the same plugin, stand-ins and entry points, is kept, its import check not run
# again: a later command on a warm machine, or a second set-up of the same engine beside the
# first (gpu_session.sh's vllm-tests+vllm-tests-mps), skips the ~40 s. Set-ups of one engine
# take a lock on its site (for the install only, not the tests), so such a second one waits for
# the first's install, at most 10 minutes.
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

# What the site was installed from and checked with: the carry's contents, the interpreter, and
# what check_imports.py checks with (the plugin, the stand-ins, the entry points), so that an edit
# of those between commands is checked again. Each part its own assignment: a failure in a
# command substitution then stops the set-up.
inputs=$(cat "$carry/SHA256SUMS" pyproject.toml client/engines/*.py benchmarks/common/plugin_check.py \
    "benchmarks/${ENGINE}_gpu/check_imports.py" "benchmarks/${ENGINE}_gpu/stubs.py" | sha256sum)
interpreter=$("$python" -c 'import sys; print(sys.executable)')
stamp="${inputs%% *} $interpreter"
exec {lock}>"$site.lock"
flock -w 600 "$lock" || { echo "another set-up of $LABEL held $site.lock for 600 s" >&2; exit 1; }
PYTHON="$python" bash benchmarks/common/install_editable.sh "/tmp/${ENGINE}-gpu-engramd-install.log"
if [ "$(cat "$site/.installed-from" 2>/dev/null)" = "$stamp" ]; then
    echo "$LABEL already installed into $site from this carry: kept"
else
    start=$(date +%s)
    rm -rf "$site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$carry"/wheels/*.whl
    tar xzf "$carry"/"$ENGINE"-*-py.tar.gz -C "$site"
    echo "installed $LABEL into $site in $(( $(date +%s) - start )) s"
    PYTHONPATH="$site" "$python" "benchmarks/${ENGINE}_gpu/check_imports.py"
    echo "$stamp" >"$site/.installed-from"  # last: a set-up stopped half-way is redone
fi
flock -u "$lock"
export PYTHONPATH="$site"

if [ "${1:-}" = "--test" ]; then
    out="${2:?--test needs an output folder}"
    mkdir -p "$out"
    set +e
    processes=()
    [[ ${ENGINE_TESTS_N:-1} =~ ^[1-9][0-9]*$ ]] || { echo "ENGINE_TESTS_N=$ENGINE_TESTS_N: not a count of processes" >&2; exit 2; }
    if [ "${ENGINE_TESTS_N:-1}" -gt 1 ]; then
        if "$python" -c "import xdist" 2>/dev/null; then
            processes=(-n "$ENGINE_TESTS_N")
        else
            echo "ENGINE_TESTS_N=$ENGINE_TESTS_N: no pytest-xdist here, the tests run one by one"
        fi
    fi
    "$python" -m pytest -v -s -rA --durations=5 "${processes[@]}" ${ENGINE_TESTS_K:+-k "$ENGINE_TESTS_K"} \
        "tests/gpu/test_${ENGINE}_gpu.py" 2>&1 | tee "$out/${ENGINE}_gpu.log"
    exit "${PIPESTATUS[0]}"
fi
