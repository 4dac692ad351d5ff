#!/usr/bin/env bash
# The GPU test suite and the GPU benchmarks whose figures docs/performance.md quotes, in one go, on a
# GPU machine that has torch, Triton and cuda-python but no pyzmq and no network: the other wheels
# come in .whl/ (benchmarks/fetch_wheels.sh, run where there is a network). benchmarks/README.md
# says how to set such a machine up.
#
#   bash benchmarks/gpu_session.sh OUT PHASE[+PHASE...]...
#
# Logs and results are packed into OUT/results.tgz (one file, rewritten every 30 s and after every
# phase, so a command stopped at its time limit still brings back what its phases wrote); each
# phase's exit code is printed at the end, and the script exits 1 if any phase failed. CUDA_MODULE_LOADING is EAGER, as the daemon runs,
# unless set. After every group, kernel_gpu.log holds the kernel's NVRM and Xid lines (where dmesg
# can be read): a GPU fault's Xid names the process, channel and address that faulted.
#
# BUDGET_S (570): seconds from the start after which the repeating phases begin no run, so that
# a command (10 minutes at most) ends with its summary.
#
# Phases joined by `+` run side by side, each its output in <phase>.out: only those whose tests
# count no free GPU memory and bound no time tighter than seconds (faults, faults-mps,
# captured-repeat, vllm-tests, vllm-tests-mps, sglang-tests; not tests, whose enqueue bounds are
# in milliseconds), each at most once. An engine's phases side by side share one set-up (the
# second waits for the first's: common/setup_engine.sh). A phase named *-mps runs under one MPS
# server that its group shares; the others of the group stay outside it.
#
# Tests (tests/gpu; in results.tgz, the log named):
#   tests              tests/gpu, no MPS, but for what the faults and tests-kill* phases
#                      run; GPU_TESTS: some of its files instead (the whole folder
#                      takes about 10 min: split it over two commands)            gpu_tests.log
#   tests-mps          the cross-process GPU tests under MPS                      gpu_tests_mps.log
#   tests-kill         the twenty-killed-clients test alone, no MPS, stopped
#                      (its stack shown) at 400 s                                 gpu_tests_kill.log
#   tests-kill-repeat  the same test, worker dispatch, KILL_REPEAT runs (10) in a row, none
#                      begun that would end past BUDGET_S (a run: 58 s)          gpu_tests_kill_repeat.log
#   faults             a served client across kills, standby takeovers, drains and reloads
#                      (tests/gpu/test_served_faults_gpu.py; ENGRAMD_TEST_KILLS kills a run)
#                      and the killed-mid-lookup test, no MPS; FAULTS_K: a pytest -k
#                      expression for a part of them                              gpu_tests_faults.log
#   faults-mps         the same under MPS                                         gpu_tests_faults_mps.log
#   captured-repeat    captured lookups across a reload and a daemon restart
#                      (tests/gpu/test_captured_gpu.py), CAPTURED_REPEAT runs (20)
#                      in a row, after the short tests under compute-sanitizer's
#                      memcheck where it is installed (a run: 60 s; with
#                      MEMCHECK_INHERITED=1 once more, the daemon in the
#                      sanitizer's environment: exit 1 where that crashes it;
#                      MEMCHECK_K: a pytest -k expression for other tests of the
#                      file, "reload or restart" say, MEMCHECK_TIMEOUT_S (240) each run);
#                      none begun that would end past BUDGET_S (a run: 35 s)      gpu_tests_captured.log
# Engines (each its recipe's folder carried: .vllm-gpu or .sglang-gpu; README there):
#   vllm-tests         benchmarks/vllm_gpu/setup_device.sh --test: vLLM's Engram
#                      modules against the plugin's, rows bit for bit;
#                      ENGINE_TESTS_K: a pytest -k expression, ENGINE_TESTS_N: the
#                      tests in N processes at once (both also sglang-tests)     vllm_gpu.log
#   vllm-tests-mps     the same under MPS (its served test's IPC through MPS)     mps/vllm_gpu.log
#   vllm-bench         benchmarks/vllm_gpu/bench_lookup.py, the mapped plugin's gather at
#                      the wait and in lookup(); VLLM_BENCH_MPS (both), _ROUNDS (3),
#                      _GIB (16; at 64 one MPS mode a command), _IDS (uniform, or
#                      text: carry .traces), _GATHER_AT (the mapped plugin's builds in
#                      this order: wait lookup), _ARGS (more of its options, words:
#                      --paired --parts step --tokens 1 16 256, say)              vllm_bench/
#   vllm-profile       the model step's lead-1 cells at T = 1 and 16 of each variant
#                      profiled, both MPS modes (a run of its own: profiling
#                      slows what is timed after it)                              vllm_profile/
#   sglang-tests       benchmarks/sglang_gpu/setup_device.sh --test               sglang_gpu.log
#   sglang-bench       benchmarks/sglang_gpu/bench_lookup.py, both MPS modes      sglang_bench/
#   sglang-profile     its lead-1 model-step cells at T = 1 and 16 profiled, both MPS
#                      modes, with the wall time inside SGLang's and the plugin's
#                      step functions (a run of its own)                          sglang_profile/
# Benchmarks (in results.tgz: each its .json and .md in <name>/, its output in <name>.log):
#   sync-probe         benchmarks/experiments/sync_probe.py: which CUDA calls wait for
#                      the device while a stream of this process, then of another,
#                      waits on a host counter (40 s)                             sync_probe*.log
#   sync-probe-mps     the same under MPS                                         sync_probe*_mps.log
#   capture-probe      benchmarks/experiments/capture_probe.py: which of a client's
#                      background CUDA calls spoil a capture in CUDA's default mode,
#                      the worker relaxed (10 trials a call), then in the default
#                      mode (the control, 3 trials); a process per call (about
#                      2.5 min)                                                   capture_probe*.log
#   capture-keeper     benchmarks/experiments/capture_beside_keeper.py: the default-mode
#                      capture test's loop beside a mapped client with a hot-row
#                      cache, in variants that each take one suspect away or first
#                      ride a captured lookup through a daemon restart, every step
#                      traced with the capture's status (about 4 min);
#                      CAPTURE_VARIANTS: some of them                            capture_beside_keeper.log
#   described-cost     benchmarks/experiments/described_cost.py: the captured lookup's
#                      kernel against the in-process one, part by part (counter,
#                      cache probe, descriptor), each in a captured step, 5 rounds
#                      (about 2 min)                                              described_cost.log
#   lookup             benchmarks/gpu_lookup.py, 16 GiB, without and under MPS    lookup/
#   lookup-host        benchmarks/lookup_host.py: host time of one lookup         lookup_host/
#   lookup-host-base   the same of the tree in .ab_base and of this one, in turn,
#                      LOOKUP_HOST_ROUNDS (3) rounds (about 1.5 min a round)     lookup_host_base/
#   step-text          benchmarks/model_step.py on real text's row IDs, both MPS
#                      modes, 3 rounds of 80 steps a cell                         step_text/
#   step-gather-at     step-text's cells with the variants of docs/performance.md's
#                      model-step figure (mapped at the wait, and in lookup())    step_gather_at/
#   captured-step      benchmarks/captured_step.py, both MPS modes, 3 rounds a cell: the
#                      whole step in a CUDA graph, engramd's captured lookup against an
#                      in-process gather captured alike (about 4 min); CAPTURED_STEP_ARGS:
#                      more of its options                                        captured_step/
#   captured-step-text  captured-step on real text's row IDs, as step-text's         captured_step_text/
#   attach             benchmarks/mapped_attach.py, 16 GiB: a mapped client's attach,
#                      a daemon's restart to ready                                attach/
#   attach-64          the same at 64 GiB in /dev/shm, two restarts               attach64/
#   attach-64-huge     attach-64 on hugetlbfs (root: it mounts one)               attach64_huge/
#   standby-64-shm     benchmarks/standby_takeover.py, 64 GiB in /dev/shm: restart to
#                      ready, plain against a standby's takeover                  standby_64_shm/
#   standby-64-huge    the same on hugetlbfs (root)                               standby_64_huge/
#
# step-text, step-gather-at and captured-step-text read a trace of real text in .traces (carry it: `python
# benchmarks/traces.py build`). lookup-host-base compares with another commit's tree in the ignored
# folder .ab_base (carry it: `git archive REV | tar x -C .ab_base`).
# The experiments in benchmarks/experiments/ have no phase: run them as their docstrings say.
set -u
# Absolute (the script moves to the tree's root) and made now: packing into a folder that is
# not there loses every result, silently.
final=$(realpath -m -- "$1"); shift
mkdir -p "$final" || { echo "cannot make OUT $final" >&2; exit 2; }
cd "$(dirname "$0")/.."
out=$(mktemp -d)
pack() {  # results.tgz from what the phases wrote so far; renamed into place whole
  tar czf "$final/results.$1.tgz" -C "$out" . 2>/dev/null; mv -f "$final/results.$1.tgz" "$final/results.tgz"
}
BUDGET_S=${BUDGET_S:-570}
kernel_gpu_log() {  # the kernel's GPU messages so far: which process faulted, when one did
  local kernel
  if ! kernel=$(dmesg 2>/dev/null); then
    echo "dmesg cannot be read on this machine" >"$out/kernel_gpu.log"
  else
    grep -E "NVRM|Xid" <<<"$kernel" >"$out/kernel_gpu.log" || echo "no NVRM or Xid line" >"$out/kernel_gpu.log"
  fi
}
have_traces() {  # real text's trace (benchmarks/traces.py build), which the run must carry
  [ -f .traces/tokens.npz ] || { echo "no .traces folder (carry it)"; return 1; }
}
fits() { (( SECONDS + $1 <= BUDGET_S )); }  # a run of $1 s, begun now, ends within BUDGET_S
# MPS_HELD: a group's MPS server, which its *-mps phases share (and do not start or stop).
mps_start() {
  [ -n "${MPS_HELD:-}" ] && return 0
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  # A server left by a command stopped at its limit (no trap ran) goes first.
  [ -e /tmp/mps/control ] && { echo quit | nvidia-cuda-mps-control; sleep 1; }
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d
}
mps_stop() {  # the server's logs are kept, one folder a server: what it said of a faulted client
  [ -n "${MPS_HELD:-}" ] && return 0
  echo quit | nvidia-cuda-mps-control; sleep 1
  local kept; kept=$out/mpslog.$(date -u +%H%M%S)
  mkdir -p "$kept" && cp /tmp/mpslog/*.log "$kept"/ 2>/dev/null && rm -f /tmp/mpslog/*.log
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
# A/B phases run another commit's tree from an ignored folder that the run carries.
# `ab_install TREE`: engramd installed editable from TREE, the one install of it: older trees name the
# distribution engramd (now engramd-daemon), and an install under one name leaves the other's finder,
# which may win the import.
ab_install() {
  python3 -m pip uninstall -q -y engramd engramd-daemon >>"$out/install.log" 2>&1
  python3 -m pip install -q --no-deps --no-build-isolation -e "$1" >>"$out/install.log" 2>&1
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

# --- tests
phase_tests() {  # tests/gpu (or GPU_TESTS) but the faults and the killed clients: phases of their own
  # shellcheck disable=SC2086  # GPU_TESTS: paths, split on spaces
  python3 -m pytest ${GPU_TESTS:-tests/gpu} -v --ignore=tests/gpu/test_served_faults_gpu.py \
    -k "not twenty" --durations=5 2>&1 | tee -a "$out/gpu_tests.log"
}
phase_tests_mps() {  # the cross-process GPU tests under MPS
  mps_start
  python3 -m pytest tests/gpu/test_cuda_daemon.py tests/gpu/test_adapter_gpu.py \
    tests/gpu/test_containers_gpu.py -q 2>&1 | tee "$out/gpu_tests_mps.log"
  local rc=${PIPESTATUS[0]}
  mps_stop
  return "$rc"
}
phase_tests_kill() {  # the twenty-killed-clients test alone, no MPS; interrupted (its stack shown) at 400 s
  timeout -s INT 400 python3 -m pytest tests/gpu/test_containers_gpu.py -q -k twenty -s 2>&1 | tee -a "$out/gpu_tests_kill.log"
}
phase_tests_kill_repeat() {  # the twenty-killed-clients test, worker dispatch, KILL_REPEAT runs in a row
  local i rc=0
  for i in $(seq "${KILL_REPEAT:-10}"); do
    fits 58 || { echo "# stopped before run $i: BUDGET_S=$BUDGET_S" | tee -a "$out/gpu_tests_kill_repeat.log"; break; }
    echo "# run $i $(date -u +%H:%M:%S)" | tee -a "$out/gpu_tests_kill_repeat.log"
    timeout -s INT -k 20 200 python3 -m pytest tests/gpu/test_containers_gpu.py -q -s -k "twenty and worker" \
      2>&1 | tee -a "$out/gpu_tests_kill_repeat.log" | tail -4 || rc=1
  done
  return "$rc"
}
phase_faults() {  # a served client across kills, standby takeovers, drains and reloads: no wrong row
  # without an error (tests/gpu/test_served_faults_gpu.py, ENGRAMD_TEST_KILLS per run), and the
  # killed-mid-lookup test (FAULTS_K: a pytest -k expression for a part of them); no MPS
  python3 -m pytest tests/gpu/test_served_faults_gpu.py tests/gpu/test_cuda_daemon.py -q -s \
    -k "${FAULTS_K:-never_takes or killed_mid_lookup}" --timeout 420 --durations=10 2>&1 | tee "$out/gpu_tests_faults.log"
}
phase_faults_mps() {  # the same under MPS
  mps_start
  ( set -o pipefail; python3 -m pytest tests/gpu/test_served_faults_gpu.py tests/gpu/test_cuda_daemon.py \
    -q -s -k "${FAULTS_K:-never_takes or killed_mid_lookup}" --timeout 420 --durations=10 2>&1 | tee "$out/gpu_tests_faults_mps.log" )
  local rc=$?
  mps_stop
  return "$rc"
}
memcheck_captured() {  # $1: compute-sanitizer; $2: the daemons' environment file ("": the sanitizer's); $3: whose
  local log="$out/gpu_tests_captured.log"
  local limit=${MEMCHECK_TIMEOUT_S:-240}
  fits $((limit + 20)) || { echo "# memcheck, the daemon in $3 environment: not begun, BUDGET_S=$BUDGET_S" | tee -a "$log"; return 0; }
  echo "# compute-sanitizer memcheck $(date -u +%H:%M:%S), the daemon in $3 environment" | tee -a "$log"
  # The run's own temp folder holds its daemons' sockets (tests/helpers.py short_tempdir), so
  # those still running after it are known by their command lines.
  local run_tmp
  run_tmp=$(mktemp -d /tmp/memcheck.XXXXXX) && [ -n "$run_tmp" ] \
    || { echo "# memcheck: no temp folder for the run" | tee -a "$log"; return 1; }
  # Not the daemon (application-only), nor the driver-symbol probes torch makes (API errors):
  # under both, the first run never got past its start in 8 minutes. Into the log, not through
  # a pipe: the reload and restart tests' run printed nothing in its 420 s, and the phase then
  # waited on its pipe past the kill until the command's own limit (results/h100/2026-12-06-f/).
  # A test that runs longer than the limit less 60 s has every thread's stack written out
  # (pytest-timeout's timer thread: a main thread inside a CUDA call never sees a signal).
  TMPDIR=$run_tmp ENGRAMD_TEST_DAEMON_ENV=$2 timeout -s INT -k 20 "$limit" "$1" --tool memcheck \
    --target-processes application-only --report-api-errors no \
    python3 -m pytest tests/gpu/test_captured_gpu.py -q -s -k "${MEMCHECK_K:-equal_the_reference or closed}" \
    --timeout "$(( limit > 120 ? limit - 60 : limit / 2 ))" --timeout-method thread >>"$log" 2>&1
  local rc=$?
  tail -n 8 "$log"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "# memcheck: stopped at its limit, $limit s" | tee -a "$log"; fi
  # Test daemons that outlive the run (it was stopped, or a test timed out: os._exit skips the
  # teardown) hold GPU and host memory.
  if pkill -KILL -f -- "--socket $run_tmp/"; then
    echo "# killed the test daemons the run left" | tee -a "$log"
    sleep 2  # their sockets' folder goes once they are gone
  fi
  rm -rf "$run_tmp"
  return "$rc"
}
phase_captured_repeat() {  # captured lookups across a reload and a restart, CAPTURED_REPEAT runs
  local i rc=0 log="$out/gpu_tests_captured.log" tests=tests/gpu/test_captured_gpu.py
  local sanitizer; sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [ -n "$sanitizer" ]; then  # reads of freed or unmapped memory: the short tests, this process only
    # The test daemons start in this shell's environment, not the sanitizer's (tests/helpers.py
    # daemon_base_env): in the sanitizer's, the daemon dies in cuMemCreate, while in this
    # shell's the same tests pass with 0 errors (results/h100/2026-12-06-e/; MEMCHECK_INHERITED=1
    # repeats the run in the sanitizer's).
    local daemon_env
    daemon_env=$(mktemp) && env -0 > "$daemon_env" \
      || { echo "# memcheck: this shell's environment could not be saved" | tee -a "$log"; return 1; }
    memcheck_captured "$sanitizer" "$daemon_env" "this shell's" || rc=1
    rm -f "$daemon_env"
    if [ "${MEMCHECK_INHERITED:-0}" = 1 ]; then  # fails where that environment crashes the daemon
      memcheck_captured "$sanitizer" "" "the sanitizer's" || rc=1
    fi
  else
    echo "# no compute-sanitizer on this machine" | tee -a "$log"
  fi
  for i in $(seq "${CAPTURED_REPEAT:-20}"); do
    fits 35 || { echo "# stopped before run $i: BUDGET_S=$BUDGET_S" | tee -a "$log"; break; }
    echo "# run $i $(date -u +%H:%M:%S)" | tee -a "$log"
    timeout -s INT -k 20 200 python3 -m pytest "$tests" -q -k "reload or restart" 2>&1 | tee -a "$log" | tail -3 || rc=1
  done
  return "$rc"
}

# --- engines: each recipe's set-up installs the engine's tree into a site of its own
phase_vllm_tests() {  # vLLM's Engram modules against the plugin's on the GPU
  bash benchmarks/vllm_gpu/setup_device.sh --test "$out" >"$out/vllm_setup.log" 2>&1
  local rc=$?
  tail -n 25 "$out/vllm_setup.log"
  return "$rc"
}
phase_vllm_tests_mps() {  # the same under MPS
  mps_start
  bash benchmarks/vllm_gpu/setup_device.sh --test "$out/mps" >"$out/vllm_setup_mps.log" 2>&1
  local rc=$?
  mps_stop
  tail -n 25 "$out/vllm_setup_mps.log"
  return "$rc"
}
phase_vllm_bench() {  # vLLM's lookup and model step against engramd's: VLLM_BENCH_* (header)
  local ids=${VLLM_BENCH_IDS:-uniform}
  [ "$ids" = uniform ] || have_traces || return 1
  local gib=${VLLM_BENCH_GIB:-16}
  if (( ${gib%%.*} >= 64 )) && [ "${VLLM_BENCH_MPS:-both}" = both ]; then
    echo "VLLM_BENCH_GIB=${VLLM_BENCH_GIB}: one MPS mode a command (VLLM_BENCH_MPS=off, then on)"; return 1
  fi
  bash benchmarks/vllm_gpu/setup_device.sh >"$out/vllm_setup.log" 2>&1 || return 1
  local more; read -ra more <<<"${VLLM_BENCH_ARGS:-}"  # words, none of them globbed
  # shellcheck disable=SC2086  # VLLM_BENCH_GATHER_AT: words, split on spaces
  PYTHONPATH=${VLLM_GPU_SITE:-/tmp/vllm-gpu-site} python3 benchmarks/vllm_gpu/bench_lookup.py \
    --mps "${VLLM_BENCH_MPS:-both}" --rounds "${VLLM_BENCH_ROUNDS:-3}" --table-gib "$gib" \
    --ids "$ids" --traces .traces --plugin-gather-at ${VLLM_BENCH_GATHER_AT:-wait lookup} \
    "${more[@]}" --out "$out/vllm_bench" 2>&1 \
    | tee "$out/vllm_bench.log" | grep -v "^|" | tail -60
}
phase_vllm_profile() {  # the lead-1 cells at T = 1 and 16 of every variant profiled, both MPS modes
  bash benchmarks/vllm_gpu/setup_device.sh >"$out/vllm_setup.log" 2>&1 || return 1
  PYTHONPATH=${VLLM_GPU_SITE:-/tmp/vllm-gpu-site} python3 benchmarks/vllm_gpu/bench_lookup.py --mps both \
    --parts step --tokens 1 16 --lead 1 --plugin-gather-at wait lookup --profile 1:1 16:1 \
    --out "$out/vllm_profile" 2>&1 | tee "$out/vllm_profile.log" | grep -v "^|" | tail -40
}
phase_sglang_tests() {  # SGLang's Engram modules on its CUDA path against the plugin's
  bash benchmarks/sglang_gpu/setup_device.sh --test "$out" >"$out/sglang_setup.log" 2>&1
  local rc=$?
  tail -n 25 "$out/sglang_setup.log"
  return "$rc"
}
phase_sglang_bench() {  # SGLang's lookup and model step against engramd's, both MPS modes
  bash benchmarks/sglang_gpu/setup_device.sh >"$out/sglang_bench_setup.log" 2>&1 || return 1
  PYTHONPATH=${SGLANG_GPU_SITE:-/tmp/sglang-gpu-site} python3 benchmarks/sglang_gpu/bench_lookup.py --mps both \
    --out "$out/sglang_bench" 2>&1 | tee "$out/sglang_bench.log" | grep -v "^|" | tail -60
}

phase_sglang_profile() {  # the lead-1 cells at T = 1 and 16 of every step variant profiled, both MPS modes
  bash benchmarks/sglang_gpu/setup_device.sh >"$out/sglang_profile_setup.log" 2>&1 || return 1
  PYTHONPATH=${SGLANG_GPU_SITE:-/tmp/sglang-gpu-site} python3 benchmarks/sglang_gpu/bench_lookup.py --mps both \
    --parts step --tokens 1 16 --lead 1 --profile 1:1 16:1 --out "$out/sglang_profile" 2>&1 \
    | tee "$out/sglang_profile.log" | grep -v "^|" | tail -40
}

# --- benchmarks
phase_sync_probe() {  # which calls wait for the device while a stream waits (server/quiet_gate.py):
  # this process's stream, then another process's
  local rc=0 name
  for name in sync_probe sync_probe_peer; do
    timeout -s INT -k 10 120 python3 benchmarks/experiments/sync_probe.py \
      $([ $name = sync_probe_peer ] && echo --peer) --out "$out/${name}${1:-}.json" 2>&1 \
      | tee "$out/${name}${1:-}.log" || rc=1
  done
  return "$rc"
}
phase_capture_probe() {  # which background calls spoil a capture in the default mode: relaxed, then the control
  local rc=0
  timeout -s INT -k 10 330 python3 benchmarks/experiments/capture_probe.py --worker-mode relaxed \
    --trials 10 --out "$out/capture_probe_relaxed.json" 2>&1 | tee "$out/capture_probe_relaxed.log" || rc=1
  # The control, on calls it can judge: each must spoil the capture from a thread left in the default mode.
  timeout -s INT -k 10 150 python3 benchmarks/experiments/capture_probe.py --worker-mode global \
    --trials 3 --ops event_query item new_allocation unique keeper_warm device_synchronize \
    --out "$out/capture_probe_global.json" 2>&1 | tee "$out/capture_probe_global.log" || rc=1
  return "$rc"
}
phase_capture_keeper() {  # which suspect of a mapped client with a hot-row cache spoils a default-mode capture
  timeout -s INT -k 10 420 python3 benchmarks/experiments/capture_beside_keeper.py ${CAPTURE_VARIANTS:+--variants $CAPTURE_VARIANTS} \
    --out "$out/capture_beside_keeper.json" 2>&1 | tee "$out/capture_beside_keeper.log"
}
phase_sync_probe_mps() {  # the same under MPS, where every client's work shares one server
  mps_start
  phase_sync_probe _mps
  local rc=$?
  mps_stop
  return "$rc"
}
phase_lookup() {  # benchmarks/gpu_lookup.py, 16 GiB, without and under MPS
  python3 benchmarks/gpu_lookup.py --table-gib 16 --mps both --out "$out/lookup" 2>&1 \
    | tee "$out/lookup.log" | tail -30
}
phase_lookup_host() {  # benchmarks/lookup_host.py: host time of a lookup, mapped / served / in-process
  python3 benchmarks/lookup_host.py --out "$out/lookup_host" 2>&1 | tee "$out/lookup_host.log" | tail -50
}
lookup_host_of() {  # lookup_host.py of the tree `$1` (installed first) into $2
  if ! ab_install "$1"; then echo "installing $1 failed (install.log)"; return 1; fi
  (cd "$1" && python3 benchmarks/lookup_host.py --out "$2") >>"$out/lookup_host_base.log" 2>&1
}
phase_lookup_host_base() {  # the same of the tree in .ab_base and of this one, in turn, LOOKUP_HOST_ROUNDS (3)
  [ -d .ab_base ] || { echo "no .ab_base folder"; return 1; }
  local rc=0 round ab="$out/lookup_host_base"
  for round in $(seq "${LOOKUP_HOST_ROUNDS:-3}"); do  # which goes first alternates
    if (( round % 2 )); then
      lookup_host_of .ab_base "$ab/base_$round" || rc=1; lookup_host_of "$PWD" "$ab/current_$round" || rc=1
    else
      lookup_host_of "$PWD" "$ab/current_$round" || rc=1; lookup_host_of .ab_base "$ab/base_$round" || rc=1
    fi
  done
  python3 benchmarks/lookup_host.py --compare "$ab" || rc=1
  return "$rc"
}
phase_step_text() {  # model_step, both MPS modes, 3 rounds of 80 steps a cell, on real text's row IDs
  have_traces || return 1
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --ids text --traces .traces \
    --out "$out/step_text" 2>&1 | tee "$out/step_text.log" | tail -30
}
phase_step_gather_at() {  # step-text's cells: mapped (gather at the wait) against mapped_at_lookup
  have_traces || return 1
  python3 benchmarks/model_step.py --mps both --steps 80 --rounds 3 --ids text --traces .traces \
    --variants compute inproc engramd mapped mapped_at_lookup \
    --mapped-sm-fraction 1=1.0 4=1.0 --out "$out/step_gather_at" 2>&1 | tee "$out/step_gather_at.log" | tail -30
}
phase_captured_step() {  # the whole step in a CUDA graph: engramd's captured lookup against in-process
  # shellcheck disable=SC2086  # CAPTURED_STEP_ARGS: more options, split on spaces
  python3 benchmarks/captured_step.py --mps both --rounds 3 ${CAPTURED_STEP_ARGS:-} --out "$out/captured_step" 2>&1 \
    | tee "$out/captured_step.log" | tail -40
}
phase_captured_step_text() {  # the same on real text's row IDs (the hot-row caches warmed by its first half)
  have_traces || return 1
  python3 benchmarks/captured_step.py --mps both --rounds 3 --ids text --traces .traces \
    --out "$out/captured_step_text" 2>&1 | tee "$out/captured_step_text.log" | tail -40
}
phase_described_cost() {  # the captured lookup's kernel against the in-process one, part by part
  python3 benchmarks/experiments/described_cost.py --out "$out/described_cost.json" 2>&1 \
    | tee "$out/described_cost.log" | tail -12
}
phase_attach() {  # benchmarks/mapped_attach.py, 16 GiB: a mapped client's attach, restart to ready
  python3 benchmarks/mapped_attach.py --table-gib 16 --out "$out/attach" 2>&1 \
    | tee "$out/attach.log" | tail -45
}
phase_attach_64() {  # the restart target's size: 64 GiB already in /dev/shm, two restarts
  python3 benchmarks/mapped_attach.py --table-gib 64 --restarts 2 --out "$out/attach64" 2>&1 \
    | tee "$out/attach64.log" | tail -45
}
phase_attach_64_huge() {  # the same with the tables on hugetlbfs (2 MiB pages); root
  on_hugetlbfs attach64_huge 45 sh -c 'python3 benchmarks/mapped_attach.py --table-gib 64 --restarts 2 \
    --shm-root "$HUGE" --out "$0"' "$out/attach64_huge"
}
phase_standby_64_shm() {  # the same on /dev/shm, where pinning is ~3x slower than on hugetlbfs
  python3 benchmarks/standby_takeover.py --backend cuda --table-gib 64 --restarts 2 \
    --out "$out/standby_64_shm" 2>&1 | tee "$out/standby_64_shm.log" | tail -14
}
phase_standby_64_huge() {  # restart to ready at 64 GiB on hugetlbfs: plain against a standby's takeover
  on_hugetlbfs standby_64_huge 14 sh -c 'python3 benchmarks/standby_takeover.py --backend cuda \
    --table-gib 64 --restarts 2 --shm-root "$HUGE" --out "$0"' "$out/standby_64_huge"
}

# Phases that may run side by side: their tests assert no timing and no free GPU memory.
SIDE_BY_SIDE=" faults faults-mps captured-repeat vllm-tests vllm-tests-mps sglang-tests "
for group in "$@"; do  # a misspelt phase is found before the GPU's minutes are spent
  IFS=+ read -ra phases <<<"$group"
  for phase in "${phases[@]}"; do
    declare -F "phase_${phase//-/_}" >/dev/null || { echo "unknown phase: $phase" >&2; exit 2; }
    if [[ $group == *+* && $SIDE_BY_SIDE != *" $phase "* ]]; then
      echo "$phase times or counts the GPU's memory: it cannot run beside another phase" >&2; exit 2
    fi
  done
  if (( $(printf '%s\n' "${phases[@]}" | sort | uniq -d | wc -l) > 0 )); then
    echo "$group: a phase twice (its logs would mix)" >&2; exit 2
  fi
done

( exec >/dev/null 2>&1; while sleep 30; do pack periodic; done ) &  # holds no output open
packer=$!
trap 'kill $packer 2>/dev/null; wait $packer 2>/dev/null; pack exit; rm -f "$final"/results.periodic.tgz' EXIT
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}  # as the daemon runs, unless set
if [ -d .whl ]; then  # the engine phases need only their own recipe's folder
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # a caller's kept
fi
bash benchmarks/common/install_editable.sh "$out/install.log" || exit 1

declare -A status
run_group() {  # PHASE+PHASE...: side by side, each its output in <phase>.out; one MPS server for the *-mps
  local phase i pids=() phases
  IFS=+ read -ra phases <<<"$1"
  # Held whether or not it started: its phases then fail on their own, never stop it under another.
  if [[ $1 == *-mps* ]]; then mps_start; MPS_HELD=1; fi
  for phase in "${phases[@]}"; do
    ( [[ $phase == *-mps ]] || unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      set -o pipefail; "phase_${phase//-/_}" ) >"$out/$phase.out" 2>&1 &
    pids+=($!)
  done
  for i in "${!phases[@]}"; do
    wait "${pids[$i]}"; status[${phases[$i]}]=$?
    echo "--- ${phases[$i]}: exit ${status[${phases[$i]}]}; the end of its output:"
    tail -n 25 "$out/${phases[$i]}.out"
  done
  if [ -n "${MPS_HELD:-}" ]; then unset MPS_HELD; mps_stop; fi
}
for group in "$@"; do
  echo "=== $group $(date -u +%H:%M:%S)"
  if [[ $group == *+* ]]; then
    run_group "$group"
  else
    set -o pipefail
    "phase_${group//-/_}"
    status[$group]=$?
    set +o pipefail
  fi
  kernel_gpu_log
  pack phase  # after every group: a later one may run out of time
done
failed=0
for group in "$@"; do
  IFS=+ read -ra phases <<<"$group"
  for phase in "${phases[@]}"; do
    echo "phase $phase: exit ${status[$phase]}"
    (( status[$phase] == 0 )) || failed=1
  done
done
exit "$failed"  # 1 if any phase failed: a caller (vllm_gpu/whole_run.sh) records it
