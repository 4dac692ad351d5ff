#!/usr/bin/env bash
# The image built from the Dockerfile, run as docs/operations.md's "Containers" says: the daemon
# in one container, engines in others, each with its own PID, IPC and network namespaces, sharing only
# the runtime folder (a host folder bind-mounted at /run/engramd). Checks, on the CPU backend:
#   - rows bit-exact against the checkpoint: clients in containers (served, and mapped under
#     another uid that holds only the daemon's group) and on the host;
#   - `engramd health` from the host and the image's HEALTHCHECK;
#   - a client container killed with `podman kill` retired within two heartbeat periods (plus a
#     second for podman), seen in the daemon's client listing from the host;
#   - `podman stop` drains the daemon: exit 0;
#   - a new daemon container re-attaches the tables kept in a host tmpfs folder (its /dev/shm),
#     and a client that looked up across the restart gets rows again.
# Each step prints what it saw and how long it took.
#
#   tests/container/run.sh      (root, podman with runc; tests/container/test_container.py runs it)
#
# No registry is needed: the base image is a Debian bookworm made with debootstrap and kept as
# $ENGRAMD_TEST_BASE (made once, reused). Pip options come from this machine's pip configuration
# (`pip config list`); the folders it names are mounted read-only into the build, as is the CA
# bundle, so torch==2.13.0 comes from the same place as on the host (the CPU build, where CI
# keeps it). Podman's settings for this run are a private file (CONTAINERS_CONF): nothing in /etc
# changes.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/tests/container
BASE_IMAGE=${ENGRAMD_TEST_BASE:-localhost/engramd-test-base:bookworm}
IMAGE=${ENGRAMD_TEST_IMAGE:-localhost/engramd:container-test}
HEARTBEAT=0.5
NAME=engramd-ctest-$$
WORK=$(mktemp -d /tmp/engramd-ctest.XXXXXX)
SHM=$(mktemp -d /dev/shm/engramd-ctest.XXXXXX)  # the daemon's /dev/shm: outlives its container
RUN=$WORK/run        # the runtime folder: the two sockets
OUT=$WORK/out        # what the clients save
CKPT=$WORK/tables    # the checkpoint, written on the host
SOCK=$RUN/engramd.sock
STARTED=$(date +%s.%N)
export CONTAINERS_CONF=$WORK/containers.conf

say() { printf '%s\n' "$*"; }
since() { python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$1"; }
step() {  # step "what" command...: run it, then say how long it took
    local what=$1 t0
    shift
    t0=$(date +%s.%N)
    say "== $what"
    "$@"
    say "   ($what: $(since "$t0") s)"
}
fail() { say "FAILED: $*"; exit 1; }

cleanup() {
    local rc=$? c
    set +e  # clean up all of it, whatever fails
    for c in $(podman ps -a --format '{{.Names}}' | grep "^$NAME-"); do
        podman rm -f -t 0 "$c" >/dev/null 2>&1
    done
    podman image prune -f >/dev/null 2>&1  # what a rebuild left dangling
    rm -rf "$WORK" "$SHM"
    say "container test: $([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)") in $(since "$STARTED") s"
}
trap cleanup EXIT

# This machine's settings: root cannot raise its own limits (crun's setrlimit fails), and crun
# refuses a hybrid cgroup setup.
cat > "$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF

make_base() {
    if podman image exists "$BASE_IMAGE"; then
        say "   reusing $BASE_IMAGE"
        return
    fi
    local mirror rootfs=$WORK/rootfs
    mirror=$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
    [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
    mirror=${mirror:-http://deb.debian.org/debian}
    say "   debootstrap bookworm from $mirror"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -n 20 "$WORK/debootstrap.log"; fail "debootstrap"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    say "   made $BASE_IMAGE"
}

# The host's pip configuration as a pip.conf for the build, and read-only mounts of every file
# or folder it names (local wheels, a local index, constraints).
pip_options() {
    python3 -m pip config list 2>/dev/null | python3 -c '
import ast, os, sys
conf = {}
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    section, _, name = key.rpartition(".")
    section = "global" if section == ":env:" else section
    conf.setdefault(section, {}).setdefault(name, ast.literal_eval(value))
for section, values in conf.items():
    print(f"[{section}]")
    for name, value in values.items():
        print(f"{name} = {value}")
' >"$WORK/pip.conf"
    BUILD_MOUNTS=()
    local word path
    for word in $(sed -n 's/^[^=]*= *//p' "$WORK/pip.conf"); do
        path=${word#file://}
        path=${path%/}
        [[ $path == */simple ]] && path=${path%/simple}  # a local index: its files lie beside it
        if [[ $path == /* && -e $path && $path != /etc/ssl/certs/* ]]; then
            BUILD_MOUNTS+=(-v "$path:$path:ro")
        fi
    done
    # HTTPS may be re-signed on the way out: the build trusts what the host trusts.
    [ -f /etc/ssl/certs/ca-certificates.crt ] \
        && BUILD_MOUNTS+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
    say "   pip options: $(grep -v '^\[' "$WORK/pip.conf" | tr '\n' ';')"
}

build_image() {
    pip_options
    podman build --format docker --layers --build-arg "BASE=$BASE_IMAGE" --secret "id=pip,src=$WORK/pip.conf" \
        "${BUILD_MOUNTS[@]}" -t "$IMAGE" -f "$ROOT/Dockerfile" "$ROOT" >"$WORK/build.log" 2>&1 \
        || { tail -n 30 "$WORK/build.log"; fail "podman build"; }
    say "   built $IMAGE: $(podman image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}'), torch $(podman run --rm --network=none --no-healthcheck --entrypoint python "$IMAGE" -c 'import torch; print(torch.__version__)')"
}

write_tables() {
    mkdir -p "$RUN" "$OUT"
    # The daemon's uid owns the runtime folder and its shared-memory folder; the clients write
    # their results into OUT under whatever uid they run as.
    chown 990:990 "$RUN" "$SHM"
    chmod 0750 "$RUN"
    chmod 0777 "$OUT"
    engramd make-tables --geometry demo --seed 0 --out "$CKPT" >"$WORK/make-tables.log" 2>&1 \
        || { cat "$WORK/make-tables.log"; fail "engramd make-tables"; }
    say "   demo checkpoint (seed 0) at $CKPT: $(du -sh "$CKPT" | cut -f1)"
}

# The daemon as docs/operations.md says to run it, its tables read-only from the host and its
# /dev/shm a host tmpfs folder (so that a new container re-attaches them).
start_daemon() {  # start_daemon NAME
    podman run -d --name "$1" --network=none --ipc=private --pid=private --no-healthcheck \
        -v "$RUN:/run/engramd" -v "$CKPT:/tables:ro" -v "$SHM:/dev/shm" \
        "$IMAGE" --config /etc/engramd/demo.toml --socket /run/engramd/engramd.sock \
        --tables /tables --backend cpu --heartbeat-interval "$HEARTBEAT" --admin-uids 0 >/dev/null
    local t0
    t0=$(date +%s.%N)
    until engramd health --socket "$SOCK" --timeout 1 >/dev/null 2>&1; do
        [ "$(podman inspect -f '{{.State.Running}}' "$1")" = true ] \
            || { podman logs "$1" | tail -n 20; fail "daemon container $1 exited"; }
        (( $(since "$t0" | cut -d. -f1) < 180 )) || fail "daemon not ready after 180 s"
        sleep 0.2
    done
    say "   $1 ready $(since "$t0") s after podman run; its log: $(podman logs "$1" 2>&1 | grep -o 'tables \(loaded\|re-attached\) in [0-9.]* s' | tail -n1)"
}

# A client container: its own namespaces, the runtime folder and this folder mounted.
client() {  # client NAME USER-ARGS... -- client.py ARGS...
    local name=$1
    shift
    local user=()
    while [ "$1" != -- ]; do user+=("$1"); shift; done
    shift
    podman run --name "$name" --network=none --ipc=private --pid=private --no-healthcheck "${user[@]}" \
        -v "$RUN:/run/engramd" -v "$HERE:/test:ro" -v "$OUT:/out" \
        -e ENGRAMD_SOCKET=/run/engramd/engramd.sock --entrypoint python "$IMAGE" \
        /test/client.py "$@" --socket /run/engramd/engramd.sock
}

check_rows() {
    client "$NAME-served" --user 990:990 -- lookups --mode served --seed 1 --out /out/container-served.npz >/dev/null
    client "$NAME-mapped" --user 4242:4242 --group-add 990 -- \
        lookups --mode mapped --seed 1 --out /out/container-mapped.npz >/dev/null
    python3 "$HERE/client.py" lookups --socket "$SOCK" --mode served --seed 1 --out "$OUT/host-served.npz"
    python3 "$HERE/client.py" lookups --socket "$SOCK" --mode mapped --seed 1 --out "$OUT/host-mapped.npz"
    python3 "$HERE/check.py" rows --checkpoint "$CKPT" "$OUT"/container-served.npz \
        "$OUT"/container-mapped.npz "$OUT"/host-served.npz "$OUT"/host-mapped.npz
}

check_health() {
    say "   engramd health (host): $(engramd health --socket "$SOCK" --timeout 3 2>&1 | head -n1) (exit 0)"
    # The image's HEALTHCHECK command, run in the daemon's container (podman's own timers for it
    # need systemd, which a CI machine may not run: the containers are started without them).
    local check
    check=$(podman image inspect -f '{{range $i, $w := .Config.Healthcheck.Test}}{{if $i}}{{$w}} {{end}}{{end}}' "$IMAGE")
    [[ $check == "engramd health "* ]] || fail "the image has no HEALTHCHECK running engramd health: '$check'"
    # shellcheck disable=SC2086 # the command's words
    podman exec "$NAME-daemon" $check >/dev/null || fail "the image's HEALTHCHECK failed: $check"
    say "   the image's HEALTHCHECK in the daemon's container: '$check' exit 0"
}

check_kill() {
    client "$NAME-idle" -d --user 990:990 -- idle --mode served --out /out/idle.txt >/dev/null
    local t0
    t0=$(date +%s.%N)
    until [ -s "$OUT/idle.txt" ]; do
        (( $(since "$t0" | cut -d. -f1) < 60 )) || fail "the idle client did not register"
        sleep 0.1
    done
    local id
    id=$(cat "$OUT/idle.txt")
    say "   before: $(engramd stats --socket "$SOCK" | grep -m1 '^clients')," \
        "client $id in container $NAME-idle"
    python3 "$HERE/check.py" retired --socket "$SOCK" --client-id "$id" \
        --deadline "$(python3 -c "print(2 * $HEARTBEAT + 1.0)")" -- podman kill "$NAME-idle"
    say "   after: $(engramd stats --socket "$SOCK" | tr '\n' ' ' | cut -c1-200)"
}

check_restart() {
    client "$NAME-loop" -d --user 990:990 -- loop --mode served --out /out/loop.txt >/dev/null
    local t0
    t0=$(date +%s.%N)
    until grep -q ' ok ' "$OUT/loop.txt" 2>/dev/null; do
        (( $(since "$t0" | cut -d. -f1) < 60 )) || fail "the looping client got no rows"
        sleep 0.1
    done
    say "   looping client: $(tail -n1 "$OUT/loop.txt" | cut -d' ' -f2-)"
    local stop_at
    stop_at=$(date +%s.%N)
    podman stop -t 30 "$NAME-daemon" >/dev/null
    local code
    code=$(podman inspect -f '{{.State.ExitCode}}' "$NAME-daemon")
    say "   podman stop (SIGTERM): exit $code after $(since "$stop_at") s;" \
        "log: $(podman logs "$NAME-daemon" 2>&1 | tail -n1 | cut -c1-160)"
    [ "$code" = 0 ] || fail "the daemon exited $code on SIGTERM"
    [[ $(podman logs "$NAME-daemon" 2>&1) == *"tables loaded"* ]] || fail "the first daemon did not load its tables"
    podman rm "$NAME-daemon" >/dev/null
    say "   kept in the host's tmpfs: $(find "$SHM" -type f | wc -l) table files"
    start_daemon "$NAME-daemon"
    [[ $(podman logs "$NAME-daemon" 2>&1) == *"tables re-attached"* ]] \
        || fail "the new daemon container did not re-attach the tables: $(podman logs "$NAME-daemon" 2>&1 | grep tables)"
    local back_at
    back_at=$(date +%s.%N)
    local before
    before=$(grep -c ' ok ' "$OUT/loop.txt")
    until [ "$(grep -c ' ok ' "$OUT/loop.txt")" -gt "$before" ]; do
        (( $(since "$back_at" | cut -d. -f1) < 60 )) || fail "the client got no rows after the restart: $(tail -n3 "$OUT/loop.txt")"
        sleep 0.1
    done
    say "   looping client, rows again $(since "$back_at") s after the daemon was ready" \
        "($(grep -c ' error ' "$OUT/loop.txt") failed lookups while it was away; last: $(tail -n1 "$OUT/loop.txt" | cut -d' ' -f2-))"
    say "   $(engramd stats --socket "$SOCK" | grep -m1 '^clients') listed after the restart"
    podman kill "$NAME-loop" >/dev/null
    stop_at=$(date +%s.%N)
    podman stop -t 30 "$NAME-daemon" >/dev/null
    code=$(podman inspect -f '{{.State.ExitCode}}' "$NAME-daemon")
    say "   podman stop of the new daemon: exit $code after $(since "$stop_at") s"
    [ "$code" = 0 ] || fail "the new daemon exited $code on SIGTERM"
}

step "base image" make_base
step "build the image" build_image
step "checkpoint and folders" write_tables
step "daemon container" start_daemon "$NAME-daemon"
step "rows: two client containers and the host against the checkpoint" check_rows
step "health" check_health
step "a client container killed (podman kill)" check_kill
step "SIGTERM drain, restart, re-attach, re-register" check_restart
