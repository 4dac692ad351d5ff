#!/usr/bin/env bash
# The whole comparison of the plugin with vLLM's own Engram code on one GPU machine, in five
# commands of at most 10 minutes, one after another on one warm machine (each also runs alone on
# a fresh one: its set-up is then not kept from the one before):
#
#   bash benchmarks/vllm_gpu/whole_run.sh OUT STEP      STEP: one of the steps below, in order
#   bash benchmarks/vllm_gpu/whole_run.sh --list        the steps, their carry and expected time
#
# Each step is one benchmarks/gpu_session.sh command, its files in OUT/STEP/results.tgz. Then,
# where the results are unpacked (one folder a step, named as the step):
#
#   python benchmarks/vllm_gpu/whole_run_targets.py DIR     the targets, met or missed
#
# Settings other than these steps' are experiments and belong in gpu_session.sh's commands.
# The expected seconds are estimates from the runs they name; a fresh machine adds about 40 s of
# set-up to its first step, which a warm one keeps for the steps after it.
set -euo pipefail

# step | carry | expected s | what it runs
STEPS=(
  "tests|.vllm-gpu|110|vLLM's Engram modules against the plugin's, rows, embed and forward bit for bit: mapped, served, captured, every scale byte; without MPS and under it, side by side, 4 tests at once each (~140 s each alone, 2026-12-06-d)"
  "uniform|.vllm-gpu|400|16 GiB, uniform IDs, both MPS modes, 2 rounds, --paired: lookups, then the step at T 1 16 256 4096 x lead 1 4 12, pipelined and synced, every plugin variant beside vLLM's step or graph (about 130 s a mode for plugin_captured alone, 2026-12-07-f)"
  "text|.vllm-gpu .traces|390|the same on real text's IDs (359 s without --paired, 2026-12-06-e)"
  "64-off|.vllm-gpu|240|64 GiB, uniform IDs, without MPS, 1 round: lookups and the step (279 s with the set-up, 2026-12-06-e)"
  "64-on|.vllm-gpu|220|the same under MPS (259 s with the set-up, 2026-12-06-e)"
)

field() { cut -d'|' -f"$2" <<<"$1"; }

if [ "${1:-}" = --list ]; then
  total=0
  for step in "${STEPS[@]}"; do
    printf '%-8s carry %-19s ~%3s s  %s\n' "$(field "$step" 1)" "$(field "$step" 2)" \
      "$(field "$step" 3)" "$(field "$step" 4)"
    total=$(( total + $(field "$step" 3) ))
  done
  echo "expected in all: ~$(( total / 60 )) min of commands (a fresh machine's set-up once more)"
  exit 0
fi

names=() known=no
for step in "${STEPS[@]}"; do names+=("$(field "$step" 1)"); done
for step in "${names[@]}"; do [ $# -eq 2 ] && [ "$2" = "$step" ] && known=yes; done
if [ $known = no ]; then
  echo "usage: whole_run.sh OUT STEP (STEP: ${names[*]}), or whole_run.sh --list" >&2; exit 2
fi
out=$(realpath -m -- "$1") name=$2  # the caller's OUT, before the move to the tree's root
cd "$(dirname "$0")/../.."
# Only this recipe's settings: a caller's own (a test subset, other IDs) would change the step.
unset ENGINE_TESTS_K ENGINE_TESTS_N "${!VLLM_BENCH_@}"

# The command's own limit is 600 s: the timeout stops whatever runs on, so that results.tgz
# (packed every 30 s) still comes back.
session() { timeout -k 5 590 bash benchmarks/gpu_session.sh "$out/$name" "$@"; }
bench() { VLLM_BENCH_GATHER_AT=wait session vllm-bench; }  # the plugin's default gather only

started=$SECONDS
set +e
case $name in
  tests)   ENGINE_TESTS_N=4 session vllm-tests+vllm-tests-mps ;;
  uniform) VLLM_BENCH_MPS=both VLLM_BENCH_ROUNDS=2 VLLM_BENCH_ARGS=--paired bench ;;
  text)    VLLM_BENCH_IDS=text VLLM_BENCH_MPS=both VLLM_BENCH_ROUNDS=2 VLLM_BENCH_ARGS=--paired bench ;;
  64-off)  VLLM_BENCH_GIB=64 VLLM_BENCH_MPS=off VLLM_BENCH_ROUNDS=1 bench ;;
  64-on)   VLLM_BENCH_GIB=64 VLLM_BENCH_MPS=on VLLM_BENCH_ROUNDS=1 bench ;;
esac
rc=$?
# Beside results.tgz: what whole_run_targets.py adds up against the run's time target.
mkdir -p "$out/$name"
printf '{"step": "%s", "seconds": %d, "exit": %d}\n' "$name" $(( SECONDS - started )) "$rc" \
  >"$out/$name/whole_run.json"
exit "$rc"
