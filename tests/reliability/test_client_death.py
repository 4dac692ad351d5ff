"""Client death: a killed client is retired within two heartbeat periods and its slab freed once
its in-flight lookups finish; live ones stay.

Real `engramd serve` processes (conftest's `daemon_factory`, heartbeat interval HEARTBEAT_S) and
real client processes running the client library. Rows of the well-behaved clients are compared
exactly with the independent reference (tests/reference.py).

Client processes that are killed come from a multiprocessing forkserver that imported torch and
engramd once, so a hundred of them start in seconds on two cores; the forkserver, not this
process, is their parent and reaps them. One test keeps the killed client a zombie of this
process on purpose.

What this is not: a test of daemon death (tests/integration/test_lifecycle.py) or of bad input.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import torch
import zmq
from helpers import SLAB_MEMFD, engramd_command, fd_count, wait_until
from helpers import slab_files as slab_files_of
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.shared.connection import probe
from engramd.client.shared.protocol import PROTOCOL_VERSION
from engramd.server.registry import ATTACH_TIMEOUT_S

HEARTBEAT_S = 0.2  # what helpers' DaemonProcess passes as --heartbeat-interval
# The daemon's promise (README, "Client death"): a client whose process died is retired within
# RETIRE_PERIODS heartbeat periods, and its slab is freed as soon as its in-flight lookups finish.
RETIRE_PERIODS = 2
# What a loaded 2-core machine may add on top: the kernel's delivery of SIGKILL, the daemon's
# and this test's wake-ups (seen: up to ~0.3 s beside a CPU hog). The tight figure is measured by
# benchmarks/reap_latency.py, not here.
SCHEDULING_MARGIN_S = 1.0
RETIRE_DEADLINE_S = RETIRE_PERIODS * HEARTBEAT_S + SCHEDULING_MARGIN_S
# Freeing waits for the client's in-flight gathers (a CPU gather of 4,096 tokens takes ~0.3 s
# idle, several times that on a loaded machine): a bound that only says "no hang".
FREE_TIMEOUT_S = 30.0
KILL_CYCLES = 100
FD_SLACK = 3  # ZeroMQ may keep a socket or two for a moment after a peer goes
IDLE_PERIODS = 15  # heartbeat periods a live idle client must survive
WARMUP_CYCLES = 5
# Pause between a load client's lookups: the load stays continuous, but leaves the two cores
# some room for the kill cycles' own process starts.
LOAD_PAUSE_S = 0.005
# A registration never attached is retired after the store's attach deadline; the margin is
# this test's, for a loaded machine.
ATTACH_DEADLINE_S = ATTACH_TIMEOUT_S + SCHEDULING_MARGIN_S

_forkserver: multiprocessing.context.BaseContext | None = None


def forkserver() -> multiprocessing.context.BaseContext:
    """Forkserver context whose server has imported the client stack (and this module) once."""
    global _forkserver
    if _forkserver is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["numpy", "torch", "zmq", "engramd.client", __name__])
        _forkserver = ctx
    return _forkserver


def doomed_client(socket: str, seed: int, mode: str, conn) -> None:
    """Child process: register, report the client id, then idle or look up until killed.

    mode "idle": wait for orders on `conn` ("lookup": one lookup, rows sent back; "exit").
    mode "lookups": back-to-back lookups of 256 tokens; mode "big": of 4096 tokens.
    """
    torch.set_num_threads(1)
    tokens = {"idle": 64, "lookups": 256, "big": 4096}[mode]
    rng = np.random.default_rng(seed)
    client = EngramClient(socket, max_tokens=tokens, slots=2, timeout=60, name=f"doomed-{seed}")
    conn.send(("registered", client.client_id))
    rows, heads = list(client.geometry.rows), client.geometry.heads
    if mode == "idle":
        while conn.recv() == "lookup":
            ids = random_ids(rng, tokens, rows, heads)
            conn.send((ids, client.lookup(torch.from_numpy(ids)).result().float().numpy()))
        client.close()
        return
    while True:
        client.lookup(torch.from_numpy(random_ids(rng, tokens, rows, heads))).result()


class Doomed:
    """One doomed client process and the parent's end of its pipe."""

    def __init__(self, socket: Path, seed: int, mode: str):
        ctx = forkserver()
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=doomed_client, args=(str(socket), seed, mode, child_conn),
                                daemon=True)
        self.proc.start()
        child_conn.close()
        self.client_id: int | None = None

    def wait_registered(self, timeout: float = 30.0) -> int:
        if not self.conn.poll(timeout):
            raise AssertionError(f"client process {self.proc.pid} did not register in {timeout} s "
                                 f"(exit code {self.proc.exitcode})")
        tag, self.client_id = self.conn.recv()
        assert tag == "registered"
        return self.client_id

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        assert self.proc.exitcode == -signal.SIGKILL, self.proc.exitcode
        self.conn.close()


def slab_files(daemon) -> set[str]:
    return slab_files_of(daemon.proc.pid)


def slab_of(daemon, client_id: int) -> str:
    name = f"{SLAB_MEMFD}{client_id}"
    assert name in slab_files(daemon), (client_id, sorted(slab_files(daemon)))
    return name


def slab_mappings(pid: int) -> int:
    """Slabs the daemon still has mapped (a mapping outliving its client is a leak)."""
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path[ (deleted)]]
        if len(fields) == 6 and fields[5].startswith(SLAB_MEMFD):
            paths.add(fields[5])
    return len(paths)


def live_client_ids(daemon) -> list[int]:
    return [c["client_id"] for c in probe(daemon.socket, "stats", 5.0).body.clients]


def assert_retired_then_freed(daemon, client_id: int, slab: str) -> None:
    """The daemon's promise for a dead client: retired in time, then freed without hanging."""
    took = wait_until(lambda: client_id not in live_client_ids(daemon), timeout=FREE_TIMEOUT_S)
    assert took <= RETIRE_DEADLINE_S, (
        f"client {client_id} retired {took:.3f} s after its death; the daemon promises "
        f"{RETIRE_PERIODS} heartbeat periods ({RETIRE_PERIODS * HEARTBEAT_S:.1f} s) and this "
        f"test allows {SCHEDULING_MARGIN_S} s more")
    wait_until(lambda: slab not in slab_files(daemon), timeout=FREE_TIMEOUT_S)


def stats_cli(daemon) -> dict:
    result = subprocess.run([*engramd_command(), "stats", "--socket", str(daemon.socket), "--json"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result
    return json.loads(result.stdout)


def assert_rows_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    wrong = np.argwhere(actual != expected)
    assert wrong.size == 0, f"{what}: {len(wrong)} wrong values, first at {wrong[:5].tolist()}"


class LoadThread(threading.Thread):
    """A well-behaved client doing checked lookups until stopped; failures are collected."""

    def __init__(self, socket: Path, reference, seed: int, rank: int, shards: int):
        super().__init__(name=f"load-{seed}", daemon=True)
        self.socket, self.reference = socket, reference
        self.seed, self.rank, self.shards = seed, rank, shards
        self.stop = threading.Event()
        self.registered = threading.Event()
        self.client_id: int | None = None
        self.lookups = 0
        self.failures: list[str] = []

    def run(self) -> None:
        rng = np.random.default_rng(self.seed)
        ref = self.reference
        try:
            with EngramClient(self.socket, tp_rank=self.rank, tp_size=self.shards, max_tokens=64,
                              slots=2, timeout=30, name=f"load-{self.seed}") as client:
                self.client_id = client.client_id
                self.registered.set()
                while not self.stop.is_set():
                    ids = random_ids(rng, int(rng.integers(1, 65)), ref.rows, ref.heads)
                    rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
                    expected = ref.expected(ids, self.rank, self.shards)
                    assert_rows_equal(rows, expected, f"{self.name} lookup {self.lookups}")
                    self.lookups += 1
                    time.sleep(LOAD_PAUSE_S)
        except BaseException as exc:  # reported by the test thread
            self.failures.append(f"{self.name}: {type(exc).__name__}: {exc}")
            self.registered.set()


def start_load(daemon, reference) -> list[LoadThread]:
    threads = [LoadThread(daemon.socket, reference, 1, 0, 1), LoadThread(daemon.socket, reference, 2, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        assert t.registered.wait(30) and not t.failures, t.failures
    return threads


def stop_load(threads: list[LoadThread]) -> None:
    for t in threads:
        t.stop.set()
    for t in threads:
        t.join(30)
    failures = [f for t in threads for f in t.failures]
    assert not failures, failures


def test_killed_idle_client_is_freed_within_two_heartbeats(daemon_factory, reference):
    daemon = daemon_factory()
    doomed = Doomed(daemon.socket, seed=5, mode="idle")
    client_id = doomed.wait_registered()
    slab = slab_of(daemon, client_id)
    with EngramClient(daemon.socket, max_tokens=16) as survivor:
        doomed.kill()
        assert_retired_then_freed(daemon, client_id, slab)
        clients = probe(daemon.socket, "stats", 5.0).body.clients
        assert [c["client_id"] for c in clients] == [survivor.client_id]
        ids = random_ids(np.random.default_rng(0), 16, reference.rows, reference.heads)
        rows = survivor.lookup(torch.from_numpy(ids)).result().double().numpy()
        assert_rows_equal(rows, reference.expected(ids), "survivor")


def test_client_killed_mid_lookup_is_freed_and_others_stay_correct(daemon_factory, reference):
    daemon = daemon_factory()
    with EngramClient(daemon.socket, max_tokens=32) as survivor:
        doomed = Doomed(daemon.socket, seed=6, mode="big")
        client_id = doomed.wait_registered()
        slab = slab_of(daemon, client_id)

        def in_flight() -> bool:
            clients = probe(daemon.socket, "stats", 5.0).body.clients
            return any(c["client_id"] == client_id and c["in_flight"] for c in clients)

        wait_until(in_flight, timeout=10.0, step=0.002)
        doomed.kill()  # a 4096-token gather is running for it right now
        assert_retired_then_freed(daemon, client_id, slab)
        rng = np.random.default_rng(1)
        for i in range(5):
            ids = random_ids(rng, 32, reference.rows, reference.heads)
            rows = survivor.lookup(torch.from_numpy(ids)).result().double().numpy()
            assert_rows_equal(rows, reference.expected(ids), f"survivor lookup {i}")
        stats = probe(daemon.socket, "stats", 5.0).body.encode()
        assert stats["reaped"] == 1
        assert [c["client_id"] for c in stats["clients"]] == [survivor.client_id]
    assert daemon.proc.poll() is None


def test_live_idle_and_stopped_clients_are_never_reaped(daemon_factory, reference):
    """A live client that sends nothing, and one frozen by SIGSTOP, outlive many heartbeats."""
    daemon = daemon_factory()
    frozen = Doomed(daemon.socket, seed=7, mode="idle")
    frozen_id = frozen.wait_registered()
    with EngramClient(daemon.socket, max_tokens=8) as idle:
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(IDLE_PERIODS * HEARTBEAT_S)
            stats = probe(daemon.socket, "stats", 5.0).body.encode()
            assert sorted(c["client_id"] for c in stats["clients"]) == sorted([idle.client_id, frozen_id])
            assert stats["reaped"] == 0
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        ids = random_ids(np.random.default_rng(2), 8, reference.rows, reference.heads)
        rows = idle.lookup(torch.from_numpy(ids)).result().double().numpy()
        assert_rows_equal(rows, reference.expected(ids), "idle client")
        frozen.conn.send("lookup")
        assert frozen.conn.poll(30), "the thawed client got no rows"
        frozen_ids, frozen_rows = frozen.conn.recv()
        assert_rows_equal(frozen_rows.astype(np.float64), reference.expected(frozen_ids), "thawed client")
        frozen.conn.send("exit")
        frozen.proc.join(30)
        assert frozen.proc.exitcode == 0
    assert not slab_files(daemon)


ZOMBIE_CLIENT = textwrap.dedent("""
    import sys, time
    from engramd.client import EngramClient
    client = EngramClient(sys.argv[1], max_tokens=4)
    print(client.client_id, flush=True)
    time.sleep(600)
""")


def test_killed_client_not_yet_waited_for_is_freed(daemon_factory):
    """A client killed while its parent has not reaped it (a zombie) counts as dead."""
    daemon = daemon_factory()
    proc = subprocess.Popen([sys.executable, "-c", ZOMBIE_CLIENT, str(daemon.socket)],
                            stdout=subprocess.PIPE, text=True)
    try:
        client_id = int(proc.stdout.readline())
        slab = slab_of(daemon, client_id)
        os.kill(proc.pid, signal.SIGKILL)
        wait_until(lambda: Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] == "Z", 5.0)
        assert_retired_then_freed(daemon, client_id, slab)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_registration_never_attached_is_retired(daemon_factory):
    """A registration whose client never attaches (it died, or claims a PID that is not its
    own) holds no slab and is retired after the attach deadline; the claimed PID counts for
    nothing."""
    daemon = daemon_factory()
    invisible_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # never a live PID
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 10_000)
    raw.connect(f"ipc://{daemon.socket}")
    raw.send_multipart([msgpack.packb({"v": PROTOCOL_VERSION, "op": "register", "rid": 1, "pid": invisible_pid,
                                       "device": "cpu", "tp_rank": 0, "tp_size": 1,
                                       "max_tokens": 4, "slots": 1})])
    reply = msgpack.unpackb(raw.recv_multipart()[0])
    raw.close(0)
    assert reply["status"] == "ok", reply
    assert reply["client_id"] in live_client_ids(daemon) and not slab_files(daemon)
    wait_until(lambda: reply["client_id"] not in live_client_ids(daemon), timeout=ATTACH_DEADLINE_S)


EARLY_DEATH_CLIENT = textwrap.dedent("""
    import os, sys, msgpack, zmq
    from engramd.client.shared.protocol import PROTOCOL_VERSION
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect("ipc://" + sys.argv[1])
    sock.send_multipart([msgpack.packb({"v": PROTOCOL_VERSION, "op": "health", "rid": 1})])
    sock.recv_multipart()  # connected: the ZeroMQ handshake is done
    print("connected", flush=True)
    sys.stdin.readline()
    sock.send_multipart([msgpack.packb({"v": PROTOCOL_VERSION, "op": "register", "rid": 2,
                                        "pid": os.getpid(), "device": "cpu", "tp_rank": 0,
                                        "tp_size": 1, "max_tokens": 4, "slots": 1})])
    sock.close(linger=-1)
    sock.context.term()  # returns once the request is written to the daemon's socket
    print("sent", flush=True)
    sys.stdin.readline()
""")


def test_client_dead_before_its_registration_is_read_leaves_nothing(daemon_factory):
    """The daemon is busy (here: stopped) while a client sends `register` and dies; by the time
    the daemon reads the request the PID is gone. Nothing may stay registered."""
    daemon = daemon_factory()
    child = subprocess.Popen([sys.executable, "-c", EARLY_DEATH_CLIENT, str(daemon.socket)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "connected"
        daemon.proc.send_signal(signal.SIGSTOP)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "sent"  # in the daemon's socket buffer
        child.kill()
        child.wait()  # reaped: the PID no longer exists when the daemon reads the request
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()
    # The daemon reads the request and registers it; never attached, it holds nothing and is
    # gone within the promise for unattached registrations.
    wait_until(lambda: probe(daemon.socket, "stats", 5.0).body.registrations == 1,
               timeout=FREE_TIMEOUT_S)
    assert not slab_files(daemon)
    wait_until(lambda: not live_client_ids(daemon), timeout=ATTACH_DEADLINE_S)


def test_kill_cycles_under_load_leak_nothing(daemon_factory, reference):
    """KILL_CYCLES clients killed at random moments while two others do checked lookups."""
    daemon = daemon_factory()
    pid = daemon.proc.pid
    load = start_load(daemon, reference)
    live_ids = sorted(t.client_id for t in load)
    rng = np.random.default_rng(2024)
    registered = 0
    try:
        for cycle in range(KILL_CYCLES + WARMUP_CYCLES):
            if cycle == WARMUP_CYCLES:  # ZeroMQ and the allocator settle in the first cycles
                wait_until(lambda: len(slab_files(daemon)) == 2, timeout=5.0)
                fds_before = fd_count(pid)
            doomed = Doomed(daemon.socket, seed=1000 + cycle, mode="lookups")
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0.0, 0.05))  # possibly before or during registration
            else:
                doomed.wait_registered()
                registered += 1
                time.sleep(rng.uniform(0.0, 0.1))  # idle, mid-lookup, or between lookups
            doomed.kill()
            assert daemon.proc.poll() is None, daemon.log()
        wait_until(lambda: len(slab_files(daemon)) == 2, timeout=FREE_TIMEOUT_S)
        assert sorted(slab_files(daemon)) == sorted(slab_of(daemon, c) for c in live_ids)
        stats = stats_cli(daemon)
        assert sorted(c["client_id"] for c in stats["clients"]) == live_ids
        assert stats["registrations"] - stats["reaped"] == 2 and stats["reaped"] >= registered
        assert slab_mappings(pid) == 2
        try:  # ZeroMQ closes a dead peer's socket on its I/O thread, a moment later
            wait_until(lambda: fd_count(pid) <= fds_before + FD_SLACK, timeout=2.0)
        except AssertionError:
            raise AssertionError(f"daemon fds {fds_before} -> {fd_count(pid)} after "
                                 f"{KILL_CYCLES} kill cycles") from None
    finally:
        stop_load(load)
    assert min(t.lookups for t in load) > 20, [t.lookups for t in load]
    wait_until(lambda: slab_mappings(pid) == 0 and not slab_files(daemon), timeout=2.0)
