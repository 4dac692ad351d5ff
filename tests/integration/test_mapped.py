"""Mapped mode on the CPU backend: clients that map the daemon's tables and gather themselves.

A real daemon and real client processes, as in test_daemon_lookups.py. Covered: served and
mapped clients of one daemon at once (rows exact against the independent reference), mode
negotiation (forced, forbidden, auto), the handle socket (read-only descriptors, bad, foreign and
replayed tokens refused), counts reported with heartbeats, a mapped client riding through a
daemon restart (and giving up on one that does not come back), and a killed mapped client.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from helpers import attach_raw, run_client_processes, wait_until
from reference import random_ids
from test_daemon_lookups import assert_rows_equal, check_worker_output

from engramd.client import BadRequestError, DaemonUnavailableError, EngramClient, NotRegisteredError
from engramd.client.errors import ProtocolError
from engramd.client.rejoin import REJOIN_STOP_S
from engramd.client.shared.connection import probe
from engramd.client.shared.handles import attach, handle_socket_path, recv_message, send_message
from engramd.client.shared.protocol import PROTOCOL_VERSION

WORKER = Path(__file__).parent / "client_worker.py"
HEARTBEAT_S = 0.2  # helpers' DaemonProcess passes this interval


def test_served_and_mapped_clients_of_one_daemon_get_exact_rows(daemon_factory, reference, tmp_path):
    daemon = daemon_factory()
    runs = [("served", 0, 1), ("mapped", 0, 1), ("mapped", 1, 2), ("served", 1, 2), ("mapped", 4, 5)]
    commands = [[sys.executable, str(WORKER), "--socket", str(daemon.socket), "--out",
                 str(tmp_path / f"{i}.npz"), "--mode", mode, "--tp-rank", str(rank),
                 "--tp-size", str(shards), "--seed", str(40 + i), "--tokens", "1", "16", "200"]
                for i, (mode, rank, shards) in enumerate(runs)]
    run_client_processes(commands)
    for i, (mode, rank, shards) in enumerate(runs):
        path = tmp_path / f"{i}.npz"
        assert str(np.load(path)["mode"]) == mode
        assert check_worker_output(path, reference, rank, shards) == 6


def test_mapped_out_of_range_count_matches_the_served_one(daemon_factory, reference):
    daemon = daemon_factory()
    ids = random_ids(np.random.default_rng(3), 64, reference.rows, reference.heads)
    counts = {}
    for mode in ("served", "mapped"):
        with EngramClient(daemon.socket, mode=mode, max_tokens=64) as client:
            future = client.lookup(torch.from_numpy(ids))
            assert_rows_equal(future.result().double().numpy(), reference.expected(ids), mode)
            counts[mode] = future.out_of_range
    assert counts["served"] == counts["mapped"] > 0


def test_a_lookups_result_after_close_says_the_client_is_closed(daemon_factory, reference):
    daemon = daemon_factory()
    ids = torch.from_numpy(random_ids(np.random.default_rng(5), 8, reference.rows, reference.heads))
    for mode in ("served", "mapped"):
        client = EngramClient(daemon.socket, mode=mode, max_tokens=64)
        future = client.lookup(ids)
        client.close()
        for read in (future.result, future.wait):
            with pytest.raises(DaemonUnavailableError, match="client is closed"):
                read()


@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_a_lookups_sm_fraction_is_checked_in_both_modes(daemon_factory, reference, mode):
    """A share of the SMs for one lookup's gather: out of (0, 1] it is a typed error, in either
    mode (an engine under `auto` learns of a bad one wherever it runs); the client goes on."""
    daemon = daemon_factory()
    ids = random_ids(np.random.default_rng(4), 16, reference.rows, reference.heads)
    with EngramClient(daemon.socket, mode=mode, max_tokens=16) as client:
        for bad in (0, 0.0, -0.5, 1.5, 10**400, float("nan"), True, "1.0", [0.5]):
            with pytest.raises(BadRequestError, match="sm_fraction"):
                client.lookup(torch.from_numpy(ids), sm_fraction=bad)
        for fraction in (1, 0.01, 1.0):
            rows = client.lookup(torch.from_numpy(ids), sm_fraction=fraction).result()
            assert_rows_equal(rows.double().numpy(), reference.expected(ids), f"{mode} {fraction}")


def test_a_client_caps_its_own_cache_and_a_bad_cap_is_refused(daemon_factory):
    """An engine short of GPU memory caps (or turns off, 0) the hot-row cache a mapped GPU
    client keeps: the size is the daemon's capped by the client's, and an older daemon, which
    offers none, gets none. A cap that is no size of GiB is a typed error before anything is
    registered."""
    from engramd.client.mapped_path import cache_budget

    daemon = daemon_factory()
    for bad in (-1, float("nan"), True, "2", [1], 10**9):
        with pytest.raises(BadRequestError, match="hot_cache_gib"):
            EngramClient(daemon.socket, hot_cache_gib=bad)
    assert probe(daemon.socket, "stats", 5.0).body.encode()["registrations"] == 0
    with EngramClient(daemon.socket, mode="mapped", hot_cache_gib=0.5) as client:
        assert client.mode == "mapped" and client.hot_cache_stats() is None  # a CPU client keeps none
    offered = {"cache_bytes": 2 << 30}
    assert cache_budget(offered, None) == 2 << 30
    assert cache_budget(offered, 1 << 29) == 1 << 29
    assert cache_budget(offered, 0) == 0
    assert cache_budget({}, None) == cache_budget({"cache_bytes": "2"}, 1 << 29) == 0


def test_auto_mode_and_forbidden_modes(daemon_factory):
    both = daemon_factory()
    with EngramClient(both.socket) as client:
        assert client.mode == "served"  # a CPU client: nothing to overlap, the daemon gathers
    served_only = daemon_factory(instance="s", extra=["--client-modes", "served"])
    with pytest.raises(BadRequestError, match=r"mode 'mapped' is not allowed .*client_modes = served"):
        EngramClient(served_only.socket, mode="mapped")
    mapped_only = daemon_factory(instance="m", extra=["--client-modes", "mapped"])
    with EngramClient(mapped_only.socket) as client:
        assert client.mode == "mapped"  # auto takes what the daemon allows
    with pytest.raises(BadRequestError, match="mode 'served' is not allowed"):
        EngramClient(mapped_only.socket, mode="served")
    with pytest.raises(BadRequestError, match="mode 'sideways'"):
        EngramClient(both.socket, mode="sideways")
    with pytest.raises(BadRequestError, match="gather_at 'soon': expected one of wait, lookup"):
        EngramClient(both.socket, mode="mapped", gather_at="soon")
    with EngramClient(mapped_only.socket, gather_at="lookup") as client:  # CPU: gathers in lookup()
        assert client.mode == "mapped" and client.gather_at == "lookup"
        assert client.lookup(torch.zeros((1, 2, 24), dtype=torch.int64)).result().shape[1] == 1


def raw_register(daemon, mode: str, device: str = "cpu", **fields) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"ipc://{daemon.socket}")
    sock.send_multipart([msgpack.packb({"v": PROTOCOL_VERSION, "op": "register", "rid": 1, "pid": os.getpid(),
                                        "device": device, "tp_rank": 0, "tp_size": 1,
                                        "max_tokens": 4, "slots": 1, "mode": mode, **fields})])
    reply = msgpack.unpackb(sock.recv_multipart()[0])
    assert reply["status"] == "ok", reply
    return {"reply": reply, "sock": sock}


def test_attach_passes_read_only_tables_and_a_sealed_slab_once_per_token(daemon_factory, reference):
    daemon = daemon_factory()
    path = handle_socket_path(daemon.socket)
    assert oct(path.stat().st_mode & 0o777) == "0o660"
    mapped = raw_register(daemon, "mapped")
    client_id, token = mapped["reply"]["client_id"], mapped["reply"]["token"]
    with pytest.raises(NotRegisteredError):
        attach(path, client_id, "0" * len(token))  # forged
    other = raw_register(daemon, "mapped")
    with pytest.raises(NotRegisteredError):
        attach(path, client_id, other["reply"]["token"])  # another registration's token
    other["sock"].close(0)
    attached = attach(path, client_id, token)
    try:
        assert attached.slab is None and [g.rows for g in attached.tables] == list(reference.rows)
        for grant in attached.tables:
            assert fcntl.fcntl(grant.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            with pytest.raises(PermissionError):
                mmap.mmap(grant.fd, grant.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            view = mmap.mmap(grant.fd, grant.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
            assert len(view) == grant.file_bytes
            view.close()
        with pytest.raises(BadRequestError, match="attaches once"):
            attach(path, client_id, token)  # replayed
    finally:
        attached.close_descriptors()
        attached.lease.close()
    served = raw_register(daemon, "served")
    slab = attach(path, served["reply"]["client_id"], served["reply"]["token"])
    try:
        assert slab.slab["kind"] == "memfd" and slab.tables == []
        seals = fcntl.fcntl(slab.slab_fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):  # a client cannot shrink the slab under the daemon
            os.ftruncate(slab.slab_fd, 4096)
        assert os.fstat(slab.slab_fd).st_size == slab.slab["layout"]["size"]
    finally:
        slab.close_descriptors()
        slab.lease.close()
    for registration in (mapped, served):
        registration["sock"].close(0)


def test_handle_socket_answers_garbage_with_a_typed_error_and_keeps_serving(daemon_factory):
    daemon = daemon_factory()
    path = handle_socket_path(daemon.socket)
    for request, expected in (({"op": "attach", "client_id": "1", "token": 5}, "bad_message"),
                              ({"op": "attach", "client_id": 1}, "bad_message"),
                              ({"op": "format"}, "unknown_op")):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(5)
        conn.connect(str(path))
        send_message(conn, request)
        reply, fds = recv_message(conn, 8)
        conn.close()
        assert reply["status"] == "error" and reply["code"] == expected, reply
        assert fds == []
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5)
    conn.connect(str(path))
    conn.sendall(b"\xff\xff\xff\xff")  # a length past the limit
    reply, _ = recv_message(conn, 8)
    conn.close()
    assert reply["code"] == "bad_message"
    with pytest.raises(ProtocolError):
        recv_message(_closed_pair(), 8)

    def counted() -> bool:  # refused on the handle threads, counted by the loop
        errors = probe(daemon.socket, "stats", 5.0).body.errors
        return errors.get("bad_message", 0) == 3 and errors.get("unknown_op", 0) == 1

    wait_until(counted, timeout=10)
    with EngramClient(daemon.socket, mode="mapped") as client:
        assert client.mode == "mapped"


def _closed_pair() -> socket.socket:
    mine, theirs = socket.socketpair()
    theirs.close()
    return mine


def test_mapped_counts_reach_the_daemon_with_heartbeats(daemon_factory, reference):
    daemon = daemon_factory()
    rng = np.random.default_rng(8)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=32) as client:
        for _ in range(5):
            client.lookup(torch.from_numpy(random_ids(rng, 32, reference.rows, reference.heads))).result()
        rows = 5 * 32 * 2 * 24

        def reported() -> bool:
            stats = probe(daemon.socket, "stats", 5.0).body.encode()
            mine = [c for c in stats["clients"] if c["client_id"] == client.client_id]
            return stats["lookups"] == 5 and mine[0]["rows"] == rows and mine[0]["mode"] == "mapped"

        wait_until(reported, timeout=20 * HEARTBEAT_S)
        assert client.counts["out_of_range"] > 0
        wait_until(lambda: probe(daemon.socket, "stats", 5.0).body.out_of_range
                   == client.counts["out_of_range"], timeout=20 * HEARTBEAT_S)
    stats = probe(daemon.socket, "stats", 5.0).body.encode()
    assert stats["lookups"] == 5 and stats["rows"] == rows  # kept after the client is gone


@pytest.mark.parametrize("pin_tables", [False, True])
def test_mapped_client_rides_through_a_daemon_restart(daemon_factory, reference, pin_tables):
    """Its rows come from its own mapping, which the daemon's death does not change: lookups go
    on with no daemon at all (one made before the kill stays valid), and once a daemon is back
    on the same tables the client registers with it in the background, keeping its mapping."""
    first = daemon_factory(instance="again")
    rng = np.random.default_rng(4)
    client = EngramClient(first.socket, mode="mapped", timeout=10, reconnect_timeout=60,
                          pin_tables=pin_tables)
    try:
        ids = random_ids(rng, 16, reference.rows, reference.heads)
        assert_rows_equal(client.lookup(torch.from_numpy(ids)).result().double().numpy(),
                          reference.expected(ids), "before the restart")
        epoch, mapping, tables = client.epoch, client.mapped_tables, client.tables_id
        before = random_ids(rng, 5, reference.rows, reference.heads)
        in_flight = client.lookup(torch.from_numpy(before), slot=1)
        first.proc.kill()
        first.proc.wait()
        for n in range(4):  # no daemon: the mapping serves
            ids = random_ids(rng, 1 + 7 * n, reference.rows, reference.heads)
            assert_rows_equal(client.lookup(torch.from_numpy(ids), slot=0).result().double().numpy(),
                              reference.expected(ids), f"lookup {n} with no daemon")
        assert_rows_equal(in_flight.result().double().numpy(), reference.expected(before),
                          "the lookup made before the kill")
        second = daemon_factory(instance="again", shm_dir=first.shm_dir, workdir=first.workdir)
        wait_until(lambda: client.epoch != epoch, timeout=30)
        assert client.mode == "mapped" and client.registrations == 2 and client.tables_id == tables
        assert client.mapped_tables is mapping, "the tables were mapped again"
        for tokens in (16, 3, 9):
            ids = random_ids(rng, tokens, reference.rows, reference.heads)
            assert_rows_equal(client.lookup(torch.from_numpy(ids)).result().double().numpy(),
                              reference.expected(ids), f"{tokens} tokens after the restart")
        # Its heartbeats reach the new daemon, which counts its lookups from the hand-over on
        # (like a new registration's), not the 6 it made before.
        expected = (3, 28 * len(reference.rows) * reference.heads)

        def counted() -> tuple[int, int]:
            stats = probe(second.socket, "stats", 5.0).body.encode()
            return stats["lookups"], stats["rows"]
        try:
            wait_until(lambda: counted() == expected, timeout=10)
        except AssertionError:
            raise AssertionError(f"the new daemon counted (lookups, rows) {counted()}, "
                                 f"not {expected}") from None
    finally:
        client.close()
    assert second.stop() == 0, second.log()


def test_a_mapped_client_registers_from_scratch_with_a_daemon_on_other_tables(
        daemon_factory, reference, demo_checkpoint, tmp_path):
    """Riding through ends where the restarted daemon serves other tables: the client lets the
    background registration go and registers again in a lookup, mapping the new tables (as a
    served client would find them: tables_id tells, test_lifecycle.py)."""
    other = tmp_path / "other-checkpoint"
    shutil.copytree(demo_checkpoint, other)  # the same rows, but its files were written again
    for shard in other.glob("*.safetensors"):
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    first = daemon_factory(instance="other")
    client = EngramClient(first.socket, mode="mapped", timeout=10, reconnect_timeout=60)
    try:
        before, mapping = client.tables_id, client.mapped_tables
        ids = random_ids(np.random.default_rng(8), 9, reference.rows, reference.heads)
        first.proc.kill()
        first.proc.wait()
        second = daemon_factory(tables=other, instance="other", shm_dir=first.shm_dir,
                                workdir=first.workdir)

        def rows_exact() -> np.ndarray:
            rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
            assert_rows_equal(rows, reference.expected(ids), f"tables {client.tables_id}")
            return rows

        wait_until(lambda: rows_exact() is not None and client.tables_id != before, timeout=30)
        assert client.registrations == 2 and client.mode == "mapped"
        assert client.mapped_tables is not mapping, "other tables, the old mapping"
    finally:
        client.close()
    assert second.stop() == 0


def test_a_mapped_client_with_no_daemon_back_gives_up_and_lets_the_mapping_go(daemon_factory, reference):
    daemon = daemon_factory()
    client = EngramClient(daemon.socket, mode="mapped", timeout=10, reconnect_timeout=3)
    try:
        ids = random_ids(np.random.default_rng(6), 4, reference.rows, reference.heads)
        daemon.proc.kill()
        daemon.proc.wait()
        assert_rows_equal(client.lookup(torch.from_numpy(ids)).result().double().numpy(),
                          reference.expected(ids), "right after the kill")

        def refused() -> bool:
            try:
                client.lookup(torch.from_numpy(ids)).result()
            except DaemonUnavailableError as exc:
                assert "no daemon to re-register with within 3 s" in exc.message
                return True
            return False

        wait_until(refused, timeout=30, step=0.2)
        assert client.mapped_tables is None, "the mapping outlived the give-up"
        with pytest.raises(DaemonUnavailableError):
            client.lookup(torch.from_numpy(ids))
    finally:
        client.close()


def test_close_while_a_mapped_client_rejoins_returns_and_stops_the_rejoin(daemon_factory, reference):
    daemon = daemon_factory()
    client = EngramClient(daemon.socket, mode="mapped", timeout=10, reconnect_timeout=60)
    ids = torch.zeros((1, client.geometry.n_layers, client.geometry.heads), dtype=torch.int64)
    daemon.proc.kill()
    daemon.proc.wait()
    client.lookup(ids).result()  # the rejoin thread starts, and finds no daemon
    started = time.monotonic()
    client.close()
    # Its promise: it stops the rejoin (waiting REJOIN_STOP_S at most) instead of waiting out
    # the reconnect_timeout that the rejoin would go on for; half of that is margin enough.
    assert REJOIN_STOP_S < client.reconnect_timeout / 2
    assert time.monotonic() - started < client.reconnect_timeout / 2, "close() waited out the rejoin"
    wait_until(lambda: not [t for t in threading.enumerate() if t.name == "engramd-rejoin"],
               timeout=15)


KILLED_MAPPED = textwrap.dedent("""
    import sys, time, torch
    from engramd.client import EngramClient
    client = EngramClient(sys.argv[1], mode="mapped", max_tokens=8)
    client.lookup(torch.zeros((8, 2, 24), dtype=torch.int64)).result()
    print(client.client_id, flush=True)
    time.sleep(600)
""")


def test_killed_mapped_client_is_retired_and_leaks_no_descriptor(daemon_factory):
    daemon = daemon_factory()
    pid = daemon.proc.pid
    with EngramClient(daemon.socket, mode="mapped"):
        pass  # the daemon's first grant: anything it opens once for good is open from here on
    fds_before = len(os.listdir(f"/proc/{pid}/fd"))
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_MAPPED, str(daemon.socket)],
                                stdout=subprocess.PIPE, text=True)
        client_id = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        wait_until(lambda gone=client_id: all(
            c["client_id"] != gone for c in probe(daemon.socket, "stats", 5.0).body.clients),
            timeout=10.0)
    wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= fds_before + 3, timeout=5.0)
    assert probe(daemon.socket, "stats", 5.0).body.clients == []


TOUCHING_MAPPED = textwrap.dedent("""
    import sys, torch
    from engramd.client import EngramClient
    client = EngramClient(sys.argv[1], mode="mapped", max_tokens=1024)
    heads, top = client.geometry.heads, max(client.geometry.rows)
    every_row = torch.arange(-(-top // heads) * heads).view(-1, 1, heads).expand(-1, 2, heads)
    for start in range(0, every_row.shape[0], 1024):  # reads every row of both tables
        client.lookup(every_row[start:start + 1024].contiguous()).result()
    print("ready", flush=True)
    sys.stdin.readline()
    client.close()
""")


def table_memory(pid: int) -> tuple[int, int]:
    """(Rss, Pss) in bytes of this process's mappings of the daemon's table files."""
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5].endswith(".tbl")
        elif inside and fields[0] in ("Rss:", "Pss:"):
            value = int(fields[1]) * 1024
            rss, pss = (rss + value, pss) if fields[0] == "Rss:" else (rss, pss + value)
    return rss, pss


def test_daemon_and_mapped_clients_hold_one_copy_of_the_tables(daemon_factory, reference):
    daemon = daemon_factory()
    table_bytes = sum(reference.rows) * 264
    clients = [subprocess.Popen([sys.executable, "-c", TOUCHING_MAPPED, str(daemon.socket)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(3)]
    try:
        for proc in clients:
            assert proc.stdout.readline().strip() == "ready"
        memory = {pid: table_memory(pid) for pid in [daemon.proc.pid] + [p.pid for p in clients]}
    finally:
        for proc in clients:
            proc.stdin.close()
            proc.wait(30)
            proc.stdout.close()
    for pid, (rss, _) in memory.items():
        assert rss >= 0.95 * table_bytes, f"pid {pid} has only {rss} of {table_bytes} table bytes resident"
    total_pss = sum(pss for _, pss in memory.values())
    # Four processes each have every page resident, yet their proportional shares add up to one
    # copy (rounding: a page-aligned file holds a little more than its rows).
    assert 0.95 * table_bytes <= total_pss <= 1.05 * table_bytes + 4 * 2 * 4096, (total_pss, table_bytes)


def test_silent_handle_peers_block_no_one_and_not_the_stop(daemon_factory):
    """Peers that connect to the handle socket and send nothing (or trickle) hold a connection
    each until its deadline; a mapped client attaches meanwhile, and SIGTERM still stops."""
    daemon = daemon_factory()
    path = handle_socket_path(daemon.socket)
    silent = []
    for _ in range(3):
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect(str(path))
        silent.append(peer)
    silent[0].sendall(b"\x10")  # the first byte of a length, and no more
    try:
        with EngramClient(daemon.socket, mode="mapped") as client:
            assert client.mode == "mapped"
        assert daemon.stop() == 0, daemon.log()
    finally:
        for peer in silent:
            peer.close()


def test_mapped_gpu_clients_get_the_warm_up_trace_read_only_for_their_own_cache(daemon_factory, tmp_path):
    """A mapped GPU client keeps a hot-row cache of its own, warmed from the daemon's
    hot_cache_warm_file: its attach passes the file as a read-only descriptor after the tables,
    which reads as the file's row IDs. Only to a client that asks (warm_file): a CPU client
    keeps no cache, and one predating the field counts no such descriptor."""
    from engramd.client.geometry import TableGeometry
    from engramd.client.shared.cache_keeper import load_warm_ids

    probe = daemon_factory()
    geometry = TableGeometry.from_config(raw_register(probe, "mapped")["reply"]["geometry"])
    probe.stop()
    ids = np.random.default_rng(5).integers(-1, 100, (64, geometry.n_layers, geometry.heads))
    np.save(tmp_path / "warm.npy", ids)
    daemon = daemon_factory(extra=["--hot-cache-warm-file", str(tmp_path / "warm.npy")])
    gpu = raw_register(daemon, "mapped", device="cuda:0", warm_file=True)
    older = raw_register(daemon, "mapped", device="cuda:0")
    cpu = raw_register(daemon, "mapped")
    attached = [attach_raw(daemon.socket, r["reply"], keep_descriptors=True) for r in (gpu, older, cpu)]
    try:
        warm_fd = attached[0].warm_fd
        assert warm_fd is not None and attached[1].warm_fd is None and attached[2].warm_fd is None
        assert fcntl.fcntl(warm_fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        warm = load_warm_ids(warm_fd, geometry.n_layers, geometry.heads)
        assert torch.equal(warm, torch.from_numpy(ids.astype(np.int64)))
        assert all(len(a.tables) == geometry.n_layers for a in attached)
    finally:
        for a in attached:
            a.close_descriptors()
            a.lease.close()
        for r in (gpu, older, cpu):
            r["sock"].close(0)


def test_mapped_clients_are_told_the_daemons_gather_policy(daemon_factory):
    """Mapped clients gather themselves, by the daemon's policy: sorted reads from the same
    token count, a grid on the same share of the SMs, and a hot-row cache of their own of the
    configured size, refreshed as often as the daemon's (client/shared/mapped.py applies them)."""
    daemon = daemon_factory(extra=["--gather-sm-fraction", "0.25", "--sort-min-tokens", "77",
                                   "--mapped-hot-cache-gib", "0.5", "--hot-cache-refresh-ms", "20"])
    mapped = raw_register(daemon, "mapped")
    try:
        assert mapped["reply"]["gather"] == {"sort_min_tokens": 77, "sm_fraction": 0.25,
                                             "cache_bytes": 2**29, "cache_refresh_s": 0.02}
    finally:
        mapped["sock"].close(0)


@pytest.mark.parametrize("mode", ["mapped", "served"])
def test_a_cpu_client_cannot_make_a_capturable_lookup_and_says_why(daemon_factory, mode):
    from engramd.client import CaptureUnsupportedError

    daemon = daemon_factory()
    with EngramClient(daemon.socket, mode=mode, max_tokens=8) as client:
        ids = torch.zeros(8, client.geometry.n_layers, client.geometry.heads, dtype=torch.int64)
        with pytest.raises(CaptureUnsupportedError, match=f"cpu client in {mode} mode"):
            client.capturable_lookup(ids)
        assert client.lookup(ids).result().shape[1] == 8, "the client serves on"
