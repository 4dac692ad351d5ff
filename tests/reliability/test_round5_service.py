"""A fifth round of attacks by a hostile local user on a real daemon (CPU backend, demo tables),
on whether it keeps serving everyone else and answers every bad input with a typed error: its
locks, its start, its settings. Each test here is one finding, and fails without its fix.

What this is not: the earlier rounds (test_hostile.py, test_round3.py, test_round4.py), access
by file modes (test_access.py), rows under faults.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from helpers import (
    attach_raw,
    dealer,
    engramd_command,
    register,
    remove_tempdir,
    request,
    rows_match,
    shm_tempdir,
    short_tempdir,
    wait_until,
)
from reference import random_ids

# -- 1. the locks --------------------------------------------------------------------------------

# Runs as root, then as a member of the daemon's group (the engines' users are): opens each lock
# file it can and holds its flock as soon as it is free, as a process waiting for the daemon to
# go would.
LOCK_TAKER = textwrap.dedent("""
    import errno, fcntl, json, os, sys, time
    uid, gid, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    os.setgroups([gid])
    os.setgid(uid)
    os.setuid(uid)
    fds = {}
    for path in paths:
        try:
            fds[path] = os.open(path, os.O_RDONLY)
        except OSError as exc:
            print(json.dumps({"path": path, "open": errno.errorcode[exc.errno]}), flush=True)
    print(json.dumps({"opened": sorted(fds)}), flush=True)
    held, deadline = set(), time.monotonic() + 120
    while fds and len(held) < len(fds) and time.monotonic() < deadline:
        for path, fd in fds.items():
            try:
                if path not in held:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held.add(path)
                    print(json.dumps({"held": path}), flush=True)
            except BlockingIOError:
                pass
        time.sleep(0.001)
    sys.stdin.read()  # until the test lets go
""")

OTHER_USER = 65534  # nobody


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_member_of_the_daemons_group_cannot_hold_its_locks(daemon_factory):
    """The socket's lock (<socket>.lock, runtime folder) and the instance's (engramd.<instance>
    .lock, table folder) were made 0640 in folders of mode 0750: every member of the daemon's
    group (the engines' users, who may connect but not replace a socket) could open them, and
    flock needs no more than a descriptor. One that held them as soon as the daemon let go (a
    restart, an upgrade) kept every later daemon from starting (socket in use, exit 73) and a
    standby waiting for good: no daemon served anyone. The locks are the daemon's user's alone
    now (0600)."""
    from engramd.server.startup import EXIT_SOCKET_IN_USE

    first = daemon_factory()
    for folder in (first.workdir, first.shm_dir):
        os.chmod(folder, 0o755)  # as /run and /dev/shm are: only the daemon's own modes decide
    locks = [first.socket.with_name(first.socket.name + ".lock"),
             first.tables_dir / f"engramd.{'t'}.lock"]
    assert all(lock.exists() for lock in locks), list(first.socket.parent.iterdir())
    group = first.socket.stat().st_gid
    taker = subprocess.Popen([sys.executable, "-c", LOCK_TAKER, str(OTHER_USER), str(group),
                              *map(str, locks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        said = [json.loads(taker.stdout.readline())]
        while "opened" not in said[-1]:
            said.append(json.loads(taker.stdout.readline()))
        assert first.stop() == 0
        second = daemon_factory(workdir=first.workdir, shm_dir=first.shm_dir, ready=False)
        deadline = time.monotonic() + 120
        while not (second.health() or {}).get("ready"):
            status = second.proc.poll()
            assert status is None, (f"a second daemon exited {status} "
                                    f"({'socket in use' if status == EXIT_SOCKET_IN_USE else ''}); "
                                    f"the group member {said}:\n{second.log()[-2000:]}")
            assert time.monotonic() < deadline, second.log()[-2000:]
            time.sleep(0.1)
        assert said[-1] == {"opened": []}, said
        assert second.stop() == 0
    finally:
        taker.stdin.close()
        taker.wait(30)


# -- 2. signals ----------------------------------------------------------------------------------


def test_a_reload_signal_while_the_daemon_starts_does_not_end_it(daemon_factory):
    """SIGHUP asks for a reload (docs/operations.md), but the daemon installed its handler only
    once it listened: one that came while it imported, loaded or pinned its tables (seconds on
    a GPU node; `kill -HUP` after a table update, a reload sent to every instance) ended it
    with the signal's default action, no log line, and the socket's lock file left behind. A
    reload before the daemon serves has nothing to reload: it is ignored (with a warning once
    the daemon listens)."""
    daemon = daemon_factory(ready=False)
    lock = daemon.socket.with_name(daemon.socket.name + ".lock")
    wait_until(lambda: lock.exists() or daemon.proc.poll() is not None, timeout=120)
    sent, deadline = 0, time.monotonic() + 120
    while not (daemon.health(timeout=0.2) or {}).get("ready"):
        assert daemon.proc.poll() is None, \
            f"exit {daemon.proc.returncode} after {sent} SIGHUPs:\n{daemon.log()[-2000:]}"
        assert time.monotonic() < deadline, daemon.log()[-2000:]
        daemon.proc.send_signal(signal.SIGHUP)
        sent += 1
        time.sleep(0.02)
    assert sent > 0
    daemon.proc.send_signal(signal.SIGHUP)  # serving: a reload, of unchanged tables
    wait_until(lambda: "reload (asked by SIGHUP) unchanged" in daemon.log(), timeout=60)
    assert daemon.stop() == 0, daemon.log()[-2000:]


# -- 3. settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["socket", "shm_dir", "cache_dir", "hot_cache_warm_file"])
def test_a_setting_holding_a_nul_character_is_refused_at_start(demo_checkpoint, key):
    """TOML writes a NUL as \\u0000, and a string setting took one: each path that held it
    raised ValueError ("embedded null byte") where it was first used. A socket's ended the start
    in a traceback (exit 1), a warm file's too once the tables were loaded, and an shm_dir's or
    a demo cache_dir's was reported as unusable tables (exit 66) after the daemon had bound its
    socket. A string setting with a NUL is refused at start, naming it, with EXIT_CONFIG."""
    from engramd.server.startup import EXIT_CONFIG

    workdir, shm_dir = short_tempdir("egd-"), shm_tempdir()
    try:
        values = {"tables": "demo" if key == "cache_dir" else str(demo_checkpoint),
                  "socket": str(workdir / "run" / "engramd.sock"), "shm_dir": str(shm_dir),
                  "cache_dir": str(workdir / "cache"), "backend": "cpu",
                  "metrics_address": "127.0.0.1:0"}
        values[key] = values.get(key, str(workdir / "warm.npy")) + "\0x"
        config = workdir / "engramd.toml"
        config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
        try:
            run = subprocess.run([*engramd_command(), "serve", "--config", str(config)],
                                 capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"served with a NUL in {key}:\n{exc.stderr}") from None
        assert run.returncode == EXIT_CONFIG, (run.returncode, run.stderr[-3000:])
        assert repr(key) in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
    finally:
        remove_tempdir(workdir)
        remove_tempdir(shm_dir)


def test_a_warm_file_that_is_a_fifo_neither_hangs_the_daemon_nor_stops_it(daemon_factory, tmp_path):
    """hot_cache_warm_file is opened for mapped clients' caches on the request loop, as the
    daemon becomes ready. A FIFO there (a path in a folder others may write, swapped) made that
    open wait for a writer: the daemon never became ready, answered no `health`, and ignored
    SIGTERM (twice) until it was killed. A warm file that is no regular file is now one warning
    (mapped clients' caches start cold), as a missing one is; a GPU daemon, which reads it on
    its loader thread, refuses it at start as it refuses any file it cannot read as .npy."""
    from engramd.client.errors import ConfigError
    from engramd.client.shared.cache_keeper import warm_ids_array

    fifo = tmp_path / "warm.npy"
    os.mkfifo(fifo)
    daemon = daemon_factory(extra=["--hot-cache-warm-file", str(fifo)])
    assert "hot_cache_warm_file" in daemon.log() and "not a regular file" in daemon.log()
    assert daemon.stop() == 0, daemon.log()[-2000:]
    with pytest.raises(ConfigError, match="not a regular file"):
        warm_ids_array(str(fifo), 2, 24)  # the GPU daemon's check (server/table_loader.py)


@pytest.mark.parametrize(("before", "after"), [(0o755, 0o755), (0o711, 0o711), (0o770, 0o750)],
                         ids=["0755", "0711", "0770"])
def test_a_socket_in_a_folder_that_was_there_leaves_others_their_access(daemon_factory, before,
                                                                        after):
    """The daemon set its runtime folder (the socket's folder) to 0750 whatever it was, when
    the folder was its user's: a socket path straight in a system folder (--socket
    /run/engramd.sock as root) or a relative one (the working folder) locked every other user
    out of that folder, /run's other services' sockets included. A folder the daemon did not
    make keeps what its group and others may read and enter; only a group's write, with which
    it could replace a socket, goes (a warning says so)."""
    workdir = short_tempdir("egd-")
    try:
        runtime = workdir / "run"
        runtime.mkdir()
        runtime.chmod(before)
        daemon = daemon_factory(workdir=workdir)
        assert stat.S_IMODE(runtime.stat().st_mode) == after, oct(runtime.stat().st_mode)
        assert ("lets its group replace the sockets" in daemon.log()) == (before != after)
        assert daemon.stop() == 0, daemon.log()[-2000:]
    finally:
        remove_tempdir(workdir)


# -- 4. connections ------------------------------------------------------------------------------

# Opens `count` connections to the request socket, asks `stats` `each` times on every one and
# reads nothing; says "sent" and holds them until the test lets go.
STATS_FLOOD = textwrap.dedent("""
    import sys, msgpack, zmq
    from engramd.client.shared.protocol import PROTOCOL_VERSION
    path, count, each = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ctx = zmq.Context()
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": "stats", "rid": 1})
    peers = []
    for _ in range(count):
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.RCVHWM, 1)  # reads nothing, buffers (almost) nothing
        peer.setsockopt(zmq.SNDHWM, 0)
        peer.connect("ipc://" + path)
        peers.append(peer)
        for _ in range(each):
            peer.send(frame)
    print("sent", flush=True)
    sys.stdin.read()
""")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def socket_count(pid: int) -> int:
    """The sockets process `pid` holds open (its ZeroMQ connections among them)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            continue  # closed meanwhile
    return count


FLOOD_CONNECTIONS, FLOOD_STATS = 400, 400
FLOOD_GROWTH_BOUND = 512 << 20  # 128 connections of 256 replies of 7 KB: 230 MB


def test_one_users_connections_that_read_nothing_hold_a_bounded_amount_of_memory(daemon_factory,
                                                                                 reference):
    """The daemon queued up to 1,024 replies for each connection (test_round4.py), but took any
    number of connections: a process of one user that opened 300 and asked `stats` 300 times
    on each, reading nothing, made it hold 570 MB more (40 connections asking 1,200 times: 280
    MB), and as much again for every further 300, until the node's memory ran out for
    everyone. One user's connections are now bounded (four a client place, 128 by default):
    past it the oldest of the process that holds the most is closed, and its queue goes; a
    peer's queue holds four replies a slot, 256 at least. Another process of the same user
    keeps its clients and its lookups."""
    from engramd.client import EngramClient
    from engramd.server.connections import connections_per_uid

    daemon = daemon_factory()
    peer = dealer(daemon)
    leases = []
    flood = None
    try:
        for rid in range(1, 31):  # clients of long device names: a `stats` reply of 7 KB
            reply = register(peer, rid, mode="mapped", device="cuda:GPU-" + "a" * 55)
            assert reply["status"] == "ok", reply
            leases.append(attach_raw(daemon.socket, reply).lease)
        client = EngramClient(daemon.socket, max_tokens=8, timeout=30)
        pid = daemon.proc.pid
        sockets, memory = socket_count(pid), rss_bytes(pid)
        flood = subprocess.Popen([sys.executable, "-c", STATS_FLOOD, str(daemon.socket),
                                  str(FLOOD_CONNECTIONS), str(FLOOD_STATS)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert flood.stdout.readline().strip() == "sent"
        bound = connections_per_uid(32, 64)  # the defaults of max_clients_per_uid, max_clients
        rng, grown, settled, deadline = np.random.default_rng(5), 0, 0, time.monotonic() + 180
        while settled < 25:  # 5 s after the daemon held no more of them than the bound
            ids = random_ids(rng, 8, reference.rows, reference.heads)
            rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
            assert rows_match(rows, reference, ids), "a lookup beside the flood"
            grown = max(grown, rss_bytes(pid) - memory)
            assert grown < FLOOD_GROWTH_BOUND, f"{grown >> 20} MiB held for one user's connections"
            held = socket_count(pid) - sockets
            cut = "connections to the request socket" in daemon.log()
            settled = settled + 1 if cut and held <= bound else 0
            assert time.monotonic() < deadline, f"{held} connections held, bound {bound}"
            time.sleep(0.2)
        assert request(peer, "health", 99)["ready"] is True
        client.close()
    finally:
        if flood is not None:
            flood.stdin.close()
            flood.wait(60)
        for lease in leases:
            lease.close()
        peer.close(0)
