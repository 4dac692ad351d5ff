#!/usr/bin/env bash
# GPU checks and timings in one go, for a lent GPU machine that has torch, Triton and
# cuda-python but no pyzmq and no network (wheels come in .whl/, see benchmarks/results/h200/README.md).
#
#   bash benchmarks/gpu_session.sh OUT PHASE...
#
# Phases: tests (tests/gpu without MPS), tests-daemon (its end-to-end files alone),
# tests-containers (namespaced clients, descriptor slabs), tests-mps (the cross-process GPU tests under MPS),
# lookup (benchmarks/gpu_lookup.py, both MPS modes; with the mapped column (d)), lookup-mps-inline (under MPS, inline only),
# tests-ids-wait (a lookup whose IDs are late; served rows), counter-placement (benchmarks/counter_placement.py),
# step (benchmarks/model_step.py, both modes, all four variants: compute, inproc, engramd served,
# mapped), step-mapped (the same as step: its name for runs that want the mapped variant),
# lookup-variants (under MPS, inline dispatch: daemon defaults vs no cache and all SMs),
# step-long (under MPS, 150 steps a cell at 256 and 4,096 tokens),
# attach (benchmarks/mapped_attach.py, 16 GiB: mapped client attach, daemon restart to ready),
# attach-64 (the same at 64 GiB, two restarts), attach-64-huge (attach-64 on hugetlbfs), tests-pin (pinning in parts, then test_cuda_daemon.py),
# tests-pin-only, start-probe (benchmarks/start_probe.py: torch import, CUDA context and pin, in which order),
# tests-kill, tests-kill-mps (the twenty-killed-clients test alone, without and with MPS, both
# dispatch modes), tests-kill-mps-connections (the same with CUDA_DEVICE_MAX_CONNECTIONS=32),
# tests-kill-mps-worker, tests-kill-mps-inline, tests-kill-mps-inline-connections (one dispatch mode, 200 s),
# tests-counters (host-memory counters, then test_cuda_daemon.py),
# tests-warm-up (the daemon's kernel warm-up against the variants it launches), tests-gather (all of test_gather_triton.py), tests-rows (rows and counts of every kind of IDs), unmap-probe (benchmarks/unmap_probe.py),
# pin-probe (benchmarks/pin_probe.py: ways to pin a table file already in shared memory),
# floods (benchmarks/floods.py: a good client beside floods, on more cores than a CI machine),
# floods-switch20 and floods-omp1 (experiments: a 20 us GIL switch interval; one intra-op thread),
# floods-profile (floods with py-spy on the daemon per phase), lookup-base, lookup-head-first and
# floods-base (A/B runs on one host against another commit's tree, see ab_install below),
# node-mapped (benchmarks/node_run.py with mapped clients), step-rounds (model_step, 3 rounds a cell).
# lookup-host (benchmarks/lookup_host.py: host time of one lookup), lookup-host-base (the same of .ab_base, then of this tree).
# step-text (step-rounds on real-text row IDs: the trace folder .traces travels with the run),
# standby-64-huge (benchmarks/standby_takeover.py: restart to ready, plain against a standby, 64 GiB on hugetlbfs),
# thp-probe (benchmarks/thp_probe.py: pinning /dev/shm pages collapsed into 2 MiB folios),
# tests-pin-files (pinning through HugeViews: pin, standby, reload GPU tests),
# standby-64-shm (the same on /dev/shm), tests-standby (tests/gpu/test_standby_gpu.py: a standby's pins across a reload and a takeover),
# step-grid (step-text without MPS at 16 and 4,096 tokens, the daemon's grid then all SMs), gather-pages (benchmarks/gather_pages.py), gather-grids (the same, more grids, folios only), sm-cap-rows (benchmarks/sm_cap.py at 16 and 32 rows per block), sm-cap-sorted (the same, sorted reads, 8 and 32),
# step-profile (model_step --profile: in-process against mapped, kernel by kernel), step-hint (step-text, mapped lookups of lead 1 on all SMs), step-hint-near (leads 1 and 4), step-client-cache (step-hint-near, mapped clients with caches of their own), tests-client-cache,
# tests-gather-at (test_cuda_daemon, reload, hot cache and adapter GPU tests), tests-gather-at-review (the tests of the review's fixes), step-gather-at (the mapped client's gather queued at the wait against in lookup()),
# step-launch-order (step-client-cache with the in-process gather also queued behind the first matmul and behind all of them),
# start-costs (torch's import and CUDA start, EAGER against LAZY, with and without a CUDA context
# made first, as the daemon's preload does; the daemon's imports by cumulative time).
# faults, faults-mps (a served client across kills, takeovers, drains and reloads), tests-kill-repeat
# (the twenty-killed-clients test, worker dispatch, KILL_REPEAT times).
# The wheels it installs: benchmarks/fetch_wheels.sh, run here first.
# Logs and results are packed into OUT/results.tgz (one file); each phase's exit code is
# printed at the end.
set -u
final=$1; shift
out=$(mktemp -d)
trap 'tar czf "$final/results.tgz" -C "$out" .' EXIT
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}  # as the daemon runs, unless set
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
    || { tail -20 "$out/install.log"; exit 1; }

mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control; sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

phase_tests() { python3 -m pytest tests/gpu -q --durations=5 2>&1 | tee "$out/gpu_tests.log"; }
phase_tests_daemon() {  # the end-to-end GPU tests alone (served and mapped clients), no MPS
  python3 -m pytest tests/gpu/test_cuda_daemon.py tests/gpu/test_adapter_gpu.py -q --durations=5 \
    2>&1 | tee "$out/gpu_tests_daemon.log"
}
phase_tests_containers() {  # namespaced clients and descriptor slabs alone, no MPS
  python3 -m pytest tests/gpu/test_containers_gpu.py -q --durations=5 2>&1 | tee "$out/gpu_tests_containers.log"
}
phase_tests_kill() {  # the twenty-killed-clients test alone, no MPS; interrupted (its stack shown) at 400 s
  timeout -s INT 400 python3 -m pytest tests/gpu/test_containers_gpu.py -q -k twenty -s 2>&1 | tee -a "$out/gpu_tests_kill.log"
}
phase_tests_kill_mps() {  # the same under MPS (KILL_DISPATCH=inline|worker: that mode alone)
  mps_start
  echo "# under MPS, dispatch ${KILL_DISPATCH:-both}, CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}" \
    | tee -a "$out/gpu_tests_kill_mps.log"
  timeout -s INT "${KILL_TIMEOUT:-400}" python3 -m pytest tests/gpu/test_containers_gpu.py -q \
    -k "twenty${KILL_DISPATCH:+ and $KILL_DISPATCH}" -s 2>&1 | tee -a "$out/gpu_tests_kill_mps.log"
  local rc=${PIPESTATUS[0]}
  mps_stop
  return "$rc"
}
phase_tests_counters() {  # host-memory counters, then the end-to-end daemon tests that use them, no MPS
  python3 -m pytest tests/gpu/test_host_counters_gpu.py tests/gpu/test_cuda_daemon.py -q -s --durations=5 \
    2>&1 | tee "$out/gpu_tests_counters.log"
}
phase_tests_rows() {  # served and mapped rows of every kind of IDs, and their out-of-range counts
  python3 -m pytest tests/gpu/test_cuda_daemon.py -q -k rows_match_reference 2>&1 | tee "$out/gpu_tests_rows.log"
}
phase_tests_gather() {  # the gather kernel's GPU tests (rows of every grid, sort, warm-up), no MPS
  python3 -m pytest tests/gpu/test_gather_triton.py -q --durations=5 2>&1 | tee "$out/gpu_tests_gather.log"
}
phase_tests_warm_up() {  # the daemon's warm-up covers the variants its lookups launch
  python3 -m pytest tests/gpu/test_gather_triton.py -q -k warm_up 2>&1 | tee "$out/gpu_tests_warm_up.log"
}
phase_tests_kill_mps_connections() {  # the same with a hardware queue per stream (up to 32)
  ( export CUDA_DEVICE_MAX_CONNECTIONS=32; phase_tests_kill_mps )
}
phase_tests_kill_mps_worker() { ( KILL_DISPATCH=worker KILL_TIMEOUT=200; phase_tests_kill_mps ); }
phase_tests_kill_mps_inline() { ( KILL_DISPATCH=inline KILL_TIMEOUT=200; phase_tests_kill_mps ); }
phase_tests_kill_mps_inline_connections() {
  ( export CUDA_DEVICE_MAX_CONNECTIONS=32; KILL_DISPATCH=inline KILL_TIMEOUT=200; phase_tests_kill_mps )
}
floods_runs=0
phase_floods() {  # benchmarks/floods.py (CPU backend) on this machine's 16 cores; again: floods_2, ...
  local name=floods
  floods_runs=$((floods_runs + 1))
  [ "$floods_runs" -gt 1 ] && name=floods_$floods_runs
  python3 benchmarks/floods.py --seconds 4 --out "$out/$name" 2>&1 | tee "$out/$name.log" | tail -20
}
phase_floods_switch20() {  # experiment: the daemon's GIL switch interval at 20 us (200 us in the code)
  sed -i 's/^SWITCH_INTERVAL_S = 0.0002$/SWITCH_INTERVAL_S = 0.00002/' server/daemon.py
  grep -n '^SWITCH_INTERVAL_S' server/daemon.py
  python3 benchmarks/floods.py --seconds 4 --floods heavy unread --out "$out/floods_switch20" 2>&1 \
    | tee "$out/floods_switch20.log" | tail -6
  local rc=${PIPESTATUS[0]}
  sed -i 's/^SWITCH_INTERVAL_S = 0.00002$/SWITCH_INTERVAL_S = 0.0002/' server/daemon.py
  return "$rc"
}
phase_floods_omp1() {  # experiment: one intra-op thread in every process (daemon and clients)
  OMP_NUM_THREADS=1 python3 benchmarks/floods.py --seconds 4 --floods heavy unread --out "$out/floods_omp1" 2>&1 \
    | tee "$out/floods_omp1.log" | tail -6
}
phase_floods_profile() {  # the floods with py-spy on the daemon in each phase (its wheel in .whl/)
  local stacks
  python3 benchmarks/floods.py --seconds 4 --py-spy /tmp/site/bin/py-spy \
    --out "$out/floods_profile" 2>&1 | tee "$out/floods_profile.log" | tail -12 || return 1
  for stacks in "$out"/floods_profile/stacks_*.txt; do
    python3 benchmarks/stack_summary.py "$stacks" --top 12 >"${stacks%.txt}_summary.txt"
  done
}
# A/B phases on one host against another commit's tree, in an ignored folder that the run
# carries: `git archive REV | tar x -C FOLDER`. lookup-*: .ab_base; floods-base: .ab_floods.
ab_install() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" >>"$out/install.log" 2>&1; }
lookup_ab() {  # gpu_lookup (MPS, inline, 4 GiB) of tree $1 into $out/$2
  (cd "$1" && python3 benchmarks/gpu_lookup.py --table-gib 4 --mps on --dispatch inline --out "$out/$2") 2>&1 \
    | tee "$out/$2.log" | tail -28
}
phase_lookup_base() {  # the base tree's, then this one's
  [ -d .ab_base ] || { echo "no .ab_base folder"; return 1; }
  local rc=0
  ab_install .ab_base && { lookup_ab .ab_base lookup_base || rc=1; }
  ab_install . && { lookup_ab . lookup_head || rc=1; }
  return "$rc"
}
phase_lookup_head_first() {  # this tree's, then the base tree's (the order reversed)
  [ -d .ab_base ] || { echo "no .ab_base folder"; return 1; }
  local rc=0
  lookup_ab . lookup_head_first || rc=1
  ab_install .ab_base && { lookup_ab .ab_base lookup_base_second || rc=1; }
  ab_install . || rc=1
  return "$rc"
}
phase_floods_base() {  # benchmarks/floods.py of the tree in .ab_floods, then this tree's, twice
  [ -d .ab_floods ] || { echo "no .ab_floods folder"; return 1; }
  local rc=0 run
  for run in 1 2; do
    ab_install .ab_floods && (cd .ab_floods && python3 benchmarks/floods.py --seconds 4 --out "$out/floods_base_$run") \
      2>&1 | tail -12 | tee "$out/floods_base_$run.log" || rc=1
    ab_install . && python3 benchmarks/floods.py --seconds 4 --out "$out/floods_head_$run" \
      2>&1 | tail -12 | tee "$out/floods_head_$run.log" || rc=1
  done
  return "$rc"
}
phase_pin_probe() { python3 benchmarks/pin_probe.py --gib 16 --out "$out/pin" 2>&1 | tee "$out/pin_probe.log" | tail -40; }
phase_unmap_probe() { python3 benchmarks/unmap_probe.py 2>&1 | tee "$out/unmap_probe.log"; }
phase_tests_mps() {
  mps_start
  python3 -m pytest tests/gpu/test_cuda_daemon.py tests/gpu/test_adapter_gpu.py \
    tests/gpu/test_containers_gpu.py -q 2>&1 | tee "$out/gpu_tests_mps.log"
  local rc=${PIPESTATUS[0]}
  mps_stop
  return "$rc"
}
phase_lookup() {
  python3 benchmarks/gpu_lookup.py --table-gib 16 --mps both --out "$out/lookup" 2>&1 \
    | tee "$out/lookup.log" | tail -30
}
phase_lookup_mps_inline() {  # gpu_lookup under MPS, inline dispatch only (the served default)
  python3 benchmarks/gpu_lookup.py --table-gib 16 --mps on --dispatch inline --out "$out/lookup_inline" 2>&1 \
    | tee "$out/lookup_inline.log" | tail -30
}
phase_tests_ids_wait() {  # a lookup whose IDs are late, and served rows, no MPS
  python3 -m pytest tests/gpu/test_cuda_daemon.py -q -k "ids_are_late or rows_match_reference" 2>&1 \
    | tee "$out/gpu_tests_ids_wait.log"
}
phase_counter_placement() {  # benchmarks/counter_placement.py, without MPS, then under it
  python3 benchmarks/counter_placement.py --out "$out/counters" 2>&1 | tee "$out/counter_placement.log" &&
  mps_start && echo "# under MPS" | tee -a "$out/counter_placement.log" &&
  python3 benchmarks/counter_placement.py --out "$out/counters_mps" 2>&1 | tee -a "$out/counter_placement.log"
  local rc=$?
  mps_stop
  return "$rc"
}
phase_step() {
  # all variants by default (compute, inproc, engramd, mapped)
  python3 benchmarks/model_step.py --mps both --out "$out/step" 2>&1 | tee "$out/step.log" | tail -30
}
phase_step_mapped() { phase_step; }
phase_attach() {
  python3 benchmarks/mapped_attach.py --table-gib 16 --out "$out/attach" 2>&1 \
    | tee "$out/attach.log" | tail -45
}

phase_attach_64() {  # the restart target's size: 64 GiB already in /dev/shm, two restarts
  python3 benchmarks/mapped_attach.py --table-gib 64 --restarts 2 --out "$out/attach64" 2>&1 \
    | tee "$out/attach64.log" | tail -45
}
# `on_hugetlbfs NAME TAIL CMD...`: CMD with HUGE set to a hugetlbfs mount of 2 MiB pages that
# holds 64 GiB of tables (root), its output in $out/NAME.log; the pool is given back after.
on_hugetlbfs() {
  local name=$1 lines=$2 pool=/proc/sys/vm/nr_hugepages before need rc; shift 2
  before=$(cat $pool); need=$(( 64 * 512 + 1024 ))  # 64 GiB of rows in 2 MiB pages, and room
  echo $(( before + need )) > $pool
  echo "huge pages: $before before, $(cat $pool) now, $(grep HugePages_Free /proc/meminfo)"
  export HUGE=/tmp/engramd-huge
  mkdir -p $HUGE && mount -t hugetlbfs -o pagesize=2M none $HUGE
  "$@" 2>&1 | tee "$out/$name.log" | tail -"$lines"
  rc=${PIPESTATUS[0]}
  umount $HUGE; echo "$before" > $pool
  return "$rc"
}
phase_attach_64_huge() {  # the same with the tables on hugetlbfs (2 MiB pages); root
  on_hugetlbfs attach64_huge 45 sh -c 'python3 benchmarks/mapped_attach.py --table-gib 64 --restarts 2 \
    --shm-root "$HUGE" --out "$0"' "$out/attach64_huge"
}
phase_start_probe() { python3 benchmarks/start_probe.py --gib 64 --out "$out/start" 2>&1 | tee "$out/start_probe.log" | tail -12; }
phase_tests_pin_only() { python3 -m pytest tests/gpu/test_host_pin_gpu.py -q 2>&1 | tee "$out/gpu_tests_pin_only.log"; }
phase_tests_pin() {  # pinning in parts, then the end-to-end daemon tests, no MPS
  python3 -m pytest tests/gpu/test_host_pin_gpu.py tests/gpu/test_cuda_daemon.py -q --durations=5 \
    2>&1 | tee "$out/gpu_tests_pin.log"
}

phase_lookup_variants() {
  local common=(--table-gib 16 --mps on --dispatch inline)
  python3 benchmarks/gpu_lookup.py "${common[@]}" --out "$out/variants/default" 2>&1 \
    | tee "$out/variants_default.log" | tail -9 &&
  python3 benchmarks/gpu_lookup.py "${common[@]}" --out "$out/variants/plain" \
    --daemon-args='--hot-cache-gib 0 --gather-sm-fraction 1.0' 2>&1 \
    | tee "$out/variants_plain.log" | tail -9
}
phase_step_long() {
  python3 benchmarks/model_step.py --mps on --steps 150 --tokens 256 4096 --out "$out/step_long" \
    2>&1 | tee "$out/step_long.log" | tail -12
}
phase_node_mapped() {  # node_run with mapped clients: PSS of daemon + clients, rows, throughput
  python3 benchmarks/node_run.py --table-gib 33 --tokens 4096 --seconds 5 --mode mapped \
    --machine-kind nvidia-h200 --daemon-args "--hot-cache-gib 0 --sort-min-tokens 0 --gather-sm-fraction 1.0" \
    --out "$out/node_mapped" 2>&1 | tee "$out/node_mapped.log" | tail -30
}
phase_step_rounds() {  # model_step, both MPS modes, each cell 3 times (variants rotated), 80 steps
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --out "$out/step_rounds" 2>&1 \
    | tee "$out/step_rounds.log" | tail -30
}
phase_step_text() {  # step-rounds on the row IDs of real text (benchmarks/traces.py build -> .traces)
  [ -f .traces/tokens.npz ] || { echo "no .traces folder (carry it)"; return 1; }
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --ids text --traces .traces \
    --out "$out/step_text" 2>&1 | tee "$out/step_text.log" | tail -30
}
phase_standby_64_huge() {  # restart to ready at 64 GiB on hugetlbfs: plain against a standby's takeover
  on_hugetlbfs standby_64_huge 14 sh -c 'python3 benchmarks/standby_takeover.py --backend cuda \
    --table-gib 64 --restarts 2 --shm-root "$HUGE" --out "$0"' "$out/standby_64_huge"
}
phase_standby_64_shm() {  # the same on /dev/shm, where pinning is ~3x slower than on hugetlbfs
  python3 benchmarks/standby_takeover.py --backend cuda --table-gib 64 --restarts 2 \
    --out "$out/standby_64_shm" 2>&1 | tee "$out/standby_64_shm.log" | tail -14
}
phase_thp_probe() { python3 benchmarks/thp_probe.py --gib 16 --out "$out/thp" 2>&1 | tee "$out/thp_probe.log" | tail -12; }
phase_tests_pin_files() {
  python3 -m pytest tests/gpu/test_host_pin_gpu.py tests/gpu/test_standby_gpu.py tests/gpu/test_reload_gpu.py \
    -q --durations=5 2>&1 | tee "$out/gpu_tests_pin_files.log"
}
phase_step_grid() {  # step-text without MPS at 16 and 4,096 tokens: the daemon's default grid, then all SMs
  local name extra rc=0
  for name in default all_sms; do
    extra=""
    [ "$name" = all_sms ] && extra="--gather-sm-fraction 1.0"
    python3 benchmarks/model_step.py --mps off --steps 80 --rounds 3 --ids text --traces .traces \
      --tokens 16 4096 --daemon-args="$extra" --out "$out/step_grid_$name" 2>&1 \
      | tee "$out/step_grid_$name.log" | tail -12 || rc=1
  done
  return "$rc"
}
phase_gather_pages() {  # gather rates from 4 KiB pages, 2 MiB folios and a pinned copy, by grid
  python3 benchmarks/gather_pages.py --out "$out/pages" 2>&1 | tee "$out/gather_pages.log" | tail -40
}
phase_gather_grids() {  # gather_pages on the folios alone, more grids, sorted lookups of 1,024-4,096 tokens
  python3 benchmarks/gather_pages.py --memories folios --grids 132:8 132:16 132:32 132:64 66:8 66:16 \
    66:32 66:64 33:64 --lookups 256 1024s 2048s 4096s 4096 --out "$out/grids" 2>&1 \
    | tee "$out/gather_grids.log" | tail -50
}
phase_sm_cap_rows() {  # sm_cap with 16 and 32 rows per block (the half grid's candidates)
  local rows rc=0
  for rows in 16 32; do
    python3 benchmarks/sm_cap.py --block-rows "$rows" --out "$out/sm_cap_rows$rows" 2>&1 \
      | tee "$out/sm_cap_rows$rows.log" | tail -10 || rc=1
  done
  return "$rc"
}
phase_step_profile() {  # model_step --profile at 16 and 4,096 tokens, leads 1 and 12: in-process against mapped, kernel by kernel
  [ -f .traces/tokens.npz ] || { echo "no .traces folder (carry it)"; return 1; }
  python3 benchmarks/model_step.py --profile --ids text --traces .traces --tokens 16 4096 --lead 1 12 \
    --variants inproc mapped --steps 40 --out "$out/step_profile" 2>&1 | tee "$out/step_profile.log" | tail -16
}
phase_step_hint() {  # step-text with the mapped lookups of lead 1 on all SMs (lookup(..., sm_fraction=1.0))
  [ -f .traces/tokens.npz ] || { echo "no .traces folder (carry it)"; return 1; }
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --ids text --traces .traces \
    --mapped-sm-fraction 1=1.0 --out "$out/step_hint" 2>&1 | tee "$out/step_hint.log" | tail -30
}
phase_step_hint_near() {  # step-hint with the mapped lookups of leads 1 and 4 on all SMs
  [ -f .traces/tokens.npz ] || { echo "no .traces folder (carry it)"; return 1; }
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --ids text --traces .traces \
    --mapped-sm-fraction 1=1.0 4=1.0 --out "$out/step_hint_near" 2>&1 | tee "$out/step_hint_near.log" | tail -30
}
phase_tests_client_cache() {  # the end-to-end GPU tests, where mapped clients keep hot-row caches of their own, with the reload's and the cache's
  python3 -m pytest tests/gpu/test_cuda_daemon.py tests/gpu/test_reload_gpu.py tests/gpu/test_hot_cache_gpu.py \
    -q --durations=5 2>&1 | tee "$out/gpu_tests_client_cache.log"
}
phase_step_client_cache() {  # step-hint-near, the mapped client reading through a hot-row cache of its own
  [ -f .traces/tokens.npz ] || { echo "no .traces folder (carry it)"; return 1; }
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --ids text --traces .traces \
    --mapped-sm-fraction 1=1.0 4=1.0 --out "$out/step_client_cache" 2>&1 | tee "$out/step_client_cache.log" | tail -30
}
phase_step_launch_order() {  # step-client-cache plus inproc_late and inproc_at_wait: what the gather's place in the launch order costs
  [ -f .traces/tokens.npz ] || { echo "no .traces folder (carry it)"; return 1; }
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --ids text --traces .traces \
    --variants compute inproc inproc_late inproc_at_wait engramd mapped \
    --mapped-sm-fraction 1=1.0 4=1.0 --out "$out/step_launch_order" 2>&1 | tee "$out/step_launch_order.log" | tail -30
}
phase_tests_gather_at() {  # the end-to-end GPU tests with mapped gathers queued at the wait, and the adapter's
  python3 -m pytest tests/gpu/test_cuda_daemon.py tests/gpu/test_reload_gpu.py tests/gpu/test_hot_cache_gpu.py \
    tests/gpu/test_adapter_gpu.py -q --durations=5 2>&1 | tee "$out/gpu_tests_gather_at.log"
}
phase_tests_gather_at_review() {  # the GPU tests of what the review of the gather at the wait changed: queueing, a failed gather, the cache's warm-up, the reload
  python3 -m pytest tests/gpu/test_cuda_daemon.py tests/gpu/test_reload_gpu.py -q --durations=5 \
    -k "gather_at_says or fails_is_raised or own_cache or slow_reader or reload" 2>&1 | tee "$out/gpu_tests_gather_at_review.log"
}
phase_step_gather_at() {  # step-launch-order with the mapped client's gather queued at the wait, against one that queues it in lookup()
  [ -f .traces/tokens.npz ] || { echo "no .traces folder (carry it)"; return 1; }
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --ids text --traces .traces \
    --variants compute inproc engramd mapped mapped_at_lookup \
    --mapped-sm-fraction 1=1.0 4=1.0 --out "$out/step_gather_at" 2>&1 | tee "$out/step_gather_at.log" | tail -30
}
phase_sm_cap_sorted() {  # sm_cap with sorted reads, 8 and 32 rows per block (sorted_block_rows' two sizes)
  local rows rc=0
  for rows in 8 32; do
    python3 benchmarks/sm_cap.py --sort --block-rows "$rows" --out "$out/sm_cap_sorted$rows" 2>&1 \
      | tee "$out/sm_cap_sorted$rows.log" | tail -10 || rc=1
  done
  return "$rc"
}
phase_tests_standby() { python3 -m pytest tests/gpu/test_standby_gpu.py -q 2>&1 | tee "$out/gpu_tests_standby.log"; }
phase_start_costs() {  # what a daemon's start pays for torch: import, then CUDA, by loading mode
  local mode order
  for mode in EAGER LAZY; do
    for order in plain context-first plain context-first; do
      CUDA_MODULE_LOADING=$mode python3 benchmarks/start_costs.py --order $order
    done
  done 2>&1 | tee "$out/start_costs.log"
  python3 -X importtime -c "import engramd.server.daemon, engramd.server.cuda_backend" 2>"$out/importtime.txt"
  echo "# the daemon's imports, cumulative us, top 25" | tee -a "$out/start_costs.log"
  sort -t'|' -k2 -n "$out/importtime.txt" | tail -25 | tee -a "$out/start_costs.log"
}

phase_faults() {  # a served client across kills, standby takeovers, drains and reloads: no wrong row
  # without an error (tests/gpu/test_served_faults_gpu.py, ENGRAMD_TEST_KILLS per run), and the
  # killed-mid-lookup test (FAULTS_K: a pytest -k expression for a part of them); no MPS
  python3 -m pytest tests/gpu/test_served_faults_gpu.py tests/gpu/test_cuda_daemon.py -q -s \
    -k "${FAULTS_K:-never_takes or killed_mid_lookup}" --timeout 280 --durations=10 2>&1 | tee "$out/gpu_tests_faults.log"
}
phase_faults_mps() {  # the same under MPS
  mps_start
  ( set -o pipefail; python3 -m pytest tests/gpu/test_served_faults_gpu.py tests/gpu/test_cuda_daemon.py \
    -q -s -k "${FAULTS_K:-never_takes or killed_mid_lookup}" --timeout 280 --durations=10 2>&1 | tee "$out/gpu_tests_faults_mps.log" )
  local rc=$?
  mps_stop
  return "$rc"
}
phase_tests_kill_repeat() {  # the twenty-killed-clients test, worker dispatch, KILL_REPEAT runs in a row
  # KILL_REPEAT_BUDGET_S: start no run later than this many seconds after the first, less one
  # run's 70 s (a run is 50-60 s): a run cut off by the machine's limit leaves no log at all.
  local i rc=0 started=$SECONDS
  for i in $(seq "${KILL_REPEAT:-10}"); do
    if [ -n "${KILL_REPEAT_BUDGET_S:-}" ] && (( SECONDS - started + 70 > KILL_REPEAT_BUDGET_S )); then
      echo "# stopped before run $i: KILL_REPEAT_BUDGET_S=$KILL_REPEAT_BUDGET_S" | tee -a "$out/gpu_tests_kill_repeat.log"
      break
    fi
    echo "# run $i $(date -u +%H:%M:%S)" | tee -a "$out/gpu_tests_kill_repeat.log"
    timeout -s INT 200 python3 -m pytest tests/gpu/test_containers_gpu.py -q -s -k "twenty and worker" \
      2>&1 | tee -a "$out/gpu_tests_kill_repeat.log" | tail -4 || rc=1
  done
  return "$rc"
}

phase_lookup_host() {  # benchmarks/lookup_host.py: host time of a lookup, mapped / served / in-process
  python3 benchmarks/lookup_host.py --out "$out/lookup_host" 2>&1 | tee "$out/lookup_host.log" | tail -50
}
phase_lookup_host_base() {  # the same of the tree in .ab_base, then of this one
  [ -d .ab_base ] || { echo "no .ab_base folder"; return 1; }
  local rc=0
  ab_install .ab_base && { (cd .ab_base && python3 benchmarks/lookup_host.py --out "$out/lookup_host_base") \
    2>&1 | tee "$out/lookup_host_base.log" | tail -14 || rc=1; }
  ab_install . && { phase_lookup_host || rc=1; }
  return "$rc"
}

declare -A status
for phase in "$@"; do
  echo "=== $phase $(date -u +%H:%M:%S)"
  set -o pipefail
  "phase_${phase//-/_}"
  status[$phase]=$?
  set +o pipefail
  tar czf "$final/results.tgz" -C "$out" .  # after every phase: a later one may run out of time
done
for phase in "$@"; do echo "phase $phase: exit ${status[$phase]}"; done
