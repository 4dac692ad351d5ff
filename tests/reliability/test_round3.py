"""A third round of attacks by a hostile local user on a real daemon (CPU backend, demo tables):
each test here is one finding, and fails without its fix.

What this is not: the earlier rounds (test_hostile.py), access by file modes (test_access.py).
"""

from __future__ import annotations

import select
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import attach_raw, dealer, engramd_stats, register, request, wait_until
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.shared import handles
from engramd.client.shared.connection import probe
from engramd.client.shared.handles import admin_request, handle_socket_path
from engramd.client.shared.protocol import PROTOCOL_VERSION

# -- 2. what a mapped client reports -------------------------------------------------------------


def test_heartbeat_counts_past_any_sane_bound_are_refused_and_stats_keep_working(daemon_factory):
    """One heartbeat reporting lookups = 2**64 - 1 overflowed the daemon's totals: every later
    `stats` answered `internal` (a traceback logged each time) and `engramd stats` exited 1 until
    a restart. Counts that are not ints in [0, 2**53], or that go down, are refused with a typed
    error and not counted; good ones still are."""
    daemon = daemon_factory()
    peer = dealer(daemon)
    try:
        reply = register(peer, 1, mode="mapped")
        assert reply["status"] == "ok", reply
        attached = attach_raw(daemon.socket, reply)
        try:
            beat = {"client_id": reply["client_id"], "token": reply["token"]}
            good = request(peer, "heartbeat", 2, **beat, counts={"lookups": 5, "rows": 50,
                                                                  "out_of_range": 0})
            assert good["status"] == "ok", good
            for rid, counts in enumerate([{"lookups": 2**64 - 1}, {"rows": 2**53 + 1},
                                          {"lookups": -1}, {"lookups": 4},  # went down
                                          {"rows": "lots"}], start=3):
                bad = request(peer, "heartbeat", rid, **beat, counts=counts)
                assert (bad["status"], bad["code"]) == ("error", "bad_request"), (counts, bad)
            for _ in range(3):
                stats = probe(daemon.socket, "stats", 5.0).body
                assert (stats.lookups, stats.rows) == (5, 50)
            cli = engramd_stats(daemon)
            assert cli.returncode == 0, cli.stderr
            assert "lookups 5  rows 50" in cli.stdout
        finally:
            attached.lease.close()
    finally:
        peer.close(0)
    assert "Traceback" not in daemon.log()


ESCAPE = "\x1b]0;owned\x07\x1b[2J\x1b[31m"


def test_client_supplied_text_reaches_neither_stats_nor_the_terminal_raw(daemon_factory):
    """A heartbeat's `tables` with terminal escape sequences reached `engramd stats` raw (and so
    did a client's name, for an admin). A tables id must now look like one (16 hex digits), else
    the heartbeat is refused; names are stored with non-printables escaped; and the CLI escapes
    whatever else a daemon says."""
    daemon = daemon_factory()
    peer = dealer(daemon)
    try:
        reply = register(peer, 1, mode="mapped", name=f"engine{ESCAPE}")
        attached = attach_raw(daemon.socket, reply)
        try:
            refused = request(peer, "heartbeat", 2, client_id=reply["client_id"],
                              token=reply["token"], tables=ESCAPE)
            assert (refused["status"], refused["code"]) == ("error", "bad_request"), refused
            assert "\x1b" not in refused["message"]
            stats = probe(daemon.socket, "stats", 5.0).body
            assert all(c["tables"] == stats.tables for c in stats.clients), stats.clients
            cli = engramd_stats(daemon)
            assert cli.returncode == 0, cli.stderr
            assert "\x1b" not in cli.stdout and "\x07" not in cli.stdout
            assert "engine\\x1b]0;owned\\x07" in cli.stdout  # the admin still sees what it was
        finally:
            attached.lease.close()
    finally:
        peer.close(0)


# -- 5. memory held for what a peer sends ----------------------------------------------------------


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def zmtp_peer(path: Path) -> socket.socket:
    """A connection that speaks ZMTP 3.0 by hand (NULL mechanism, as a DEALER): it can announce
    a frame and then never finish it, which no ZeroMQ library lets a caller do."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10.0)
    conn.connect(str(path))
    conn.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32))
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    conn.sendall(bytes([0x04, len(ready)]) + ready)
    return conn


def cut_by_the_daemon(conn: socket.socket, timeout: float) -> bool:
    """Whether the daemon closed the connection within `timeout` (its handshake read past)."""
    conn.settimeout(timeout)
    try:
        while conn.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


UNFINISHED_PEERS = 8
FRAME_ANNOUNCED = 48 << 20  # under the protocol's 64 MiB bound, far over what demo clients send
FRAME_SENT = 40 << 20


def test_frames_larger_than_any_request_are_cut_before_they_are_buffered(daemon_factory, reference):
    """libzmq's frame bound was the protocol's 64 MiB whatever the tables: 16 peers each leaving
    a 64 MiB frame unfinished held 1.2 GB of the daemon's memory for as long as they stayed
    connected. The bound is now the largest frame this daemon's clients send (inline IDs at
    max_tokens, plus a header's margin): peers announcing larger frames are cut at the frame's
    header, the daemon's RSS does not grow by what they sent, and a client's largest lookup
    still goes through."""
    daemon = daemon_factory()
    with EngramClient(daemon.socket, max_tokens=16384) as client:  # the default max_tokens
        ids = random_ids(np.random.default_rng(5), 16384, reference.rows, reference.heads)
        rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
        assert np.array_equal(rows, reference.expected(ids))  # 6 MiB of inline IDs fit
        before = rss_bytes(daemon.proc.pid)
        peers = [zmtp_peer(daemon.socket) for _ in range(UNFINISHED_PEERS)]
        try:
            for conn in peers:
                try:
                    conn.sendall(bytes([0x02]) + struct.pack(">Q", FRAME_ANNOUNCED))
                    conn.sendall(bytes(FRAME_SENT))
                except OSError:
                    pass  # cut while sending: what should happen
            # sendall returned once the kernel took every byte: the daemon has read what was
            # sent (but a socket buffer's worth) or cut the peer.
            grown = rss_bytes(daemon.proc.pid) - before
            assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB for {UNFINISHED_PEERS} peers"
            assert all(cut_by_the_daemon(conn, 5.0) for conn in peers)
        finally:
            for conn in peers:
                conn.close()
        rows = client.lookup(torch.from_numpy(ids[:64])).result().double().numpy()
        assert np.array_equal(rows, reference.expected(ids[:64]))
    assert daemon.proc.poll() is None


# -- 1. silent connections to the handle socket ----------------------------------------------------


SILENT_PEER = """
import os, socket, sys, time

path, count = sys.argv[1], int(sys.argv[2])
conns, opened, said = [], 0, False


def closed(conn):  # the daemon writes to a connection that sent nothing only as it closes it
    try:
        conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


while True:
    for conn in [c for c in conns if closed(c)]:
        conns.remove(conn)
        conn.close()
    while len(conns) < count:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(1.0)
        try:
            conn.connect(path)
        except OSError:
            conn.close()
            break
        conn.setblocking(False)  # a recv on a socket with a timeout waits for it, flags or not
        conns.append(conn)
        opened += 1
    if len(conns) == count and not said:
        print("full", flush=True)
        said = True
    with open(sys.argv[3] + ".new", "w") as f:
        f.write(str(opened))
    os.replace(sys.argv[3] + ".new", sys.argv[3])  # whole, for the test to read at any time
    time.sleep(0.01)
"""


class SilentPeer:
    """A process holding `count` connections to the handle socket that never send a byte, each
    reopened as soon as the daemon closes it, until stop()."""

    def __init__(self, path: Path, count: int, workdir: Path):
        self.count = count
        self._opened = workdir / "silent-opened"
        self.proc = subprocess.Popen([sys.executable, "-c", SILENT_PEER, str(path), str(count),
                                      str(self._opened)], stdout=subprocess.PIPE, text=True)

    def wait_full(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return bool(ready) and self.proc.stdout.readline().strip() == "full"

    @property
    def opened(self) -> int:
        return int(self._opened.read_text())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


@pytest.mark.parametrize("silent", [40, 100, 270])
def test_silent_handle_connections_lock_no_client_out(daemon_factory, reference, silent, monkeypatch):
    """Connections to the handle socket that send nothing, reopened whenever the daemon closed
    them, locked everyone out: with 40 of them each registration took 5.5-6 s, with 100 every one
    timed out, with 270 new clients failed at once, and so did an admin's `clients`. The handle
    socket now reads every connection without waiting on any, and a user's idle connections past
    handle_connections_per_uid close the oldest of the process with the most. With a flood of them
    from a process of the daemon's own user, a client still attaches, its rows exact, and
    `clients` answers, each within twice the first-message deadline, and no client's attach is
    closed under it (a closed one would be asked again: each client sends one)."""
    from engramd.server.handle_server import REQUEST_DEADLINE_S

    send, attaches = handles._send_request, []

    def counted(sock, request):
        attaches.extend([request.OP] if request.OP == "attach" else [])
        send(sock, request)

    monkeypatch.setattr(handles, "_send_request", counted)
    daemon = daemon_factory(extra=["--handle-connections-per-uid", "32"])
    path = handle_socket_path(daemon.socket)
    flood = SilentPeer(path, silent, daemon.workdir)
    try:
        assert flood.wait_full(30.0), "the silent connections were never all open at once"
        ids = random_ids(np.random.default_rng(9), 4, reference.rows, reference.heads)
        for attempt in range(5):
            started = time.monotonic()
            with EngramClient(daemon.socket, max_tokens=4) as client:
                attached = time.monotonic() - started
                rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
                assert np.array_equal(rows, reference.expected(ids))
                started = time.monotonic()
                listed = admin_request(path, "clients", 5.0).clients
                asked = time.monotonic() - started
                assert client.client_id in [c["client_id"] for c in listed]
            assert attached < 2 * REQUEST_DEADLINE_S, f"attempt {attempt}: attached in {attached:.1f} s"
            assert asked < 2 * REQUEST_DEADLINE_S, f"attempt {attempt}: `clients` took {asked:.1f} s"
        assert len(attaches) == 5, f"{len(attaches)} attach requests for 5 clients: some were closed"
        assert flood.opened > silent  # the daemon did close some, and they came back
    finally:
        flood.stop()
    assert daemon.proc.poll() is None


# The flood, a process of its own (connects, asks hello, closes before the answer; 4 threads).
HELLO_FLOOD = Path(__file__).resolve().parents[2] / "benchmarks" / "common" / "hello_flood.py"
FLOOD_FILLS_S = 60.0  # the flood's start (an interpreter, imports) and its first refused connect


def test_a_flood_of_short_handle_connections_delays_clients_but_fails_none(daemon_factory, reference):
    """Threads of one process that connect to the handle socket, ask `hello` and close before the
    answer, as fast as they can, keep its queue of connections not yet accepted full, and a Unix
    socket refuses a connect to a full queue at once: 292 of 300 new clients failed that way
    (EAGAIN). A client now waits for room, within its timeout: every one attaches, rows exact."""
    daemon = daemon_factory()
    counter = daemon.workdir / "flood-refused"
    flood = subprocess.Popen([sys.executable, str(HELLO_FLOOD), str(handle_socket_path(daemon.socket)),
                              str(counter), "4"])
    try:
        # Not a bound on the daemon: only how long the flood may take to fill the queue at all.
        wait_until(lambda: counter.exists() and int(counter.read_text()) > 0, timeout=FLOOD_FILLS_S)
        ids = random_ids(np.random.default_rng(11), 4, reference.rows, reference.heads)
        refused_before = int(counter.read_text())
        for _ in range(10):
            with EngramClient(daemon.socket, max_tokens=4) as client:
                rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
            assert np.array_equal(rows, reference.expected(ids))
        assert int(counter.read_text()) > refused_before, "the queue was not full while clients came"
    finally:
        flood.kill()
        flood.wait()
    assert daemon.proc.poll() is None


# -- 3. registrations that never attach ------------------------------------------------------------

RENEWER = """
import os, sys, time
import msgpack, zmq

ctx = zmq.Context()
peers = []
for _ in range(int(sys.argv[2])):
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect("ipc://" + sys.argv[1])
    peers.append(peer)
request = msgpack.packb({"v": int(sys.argv[3]), "op": "register", "rid": 1, "pid": os.getpid(),
                        "device": "cpu", "tp_rank": 0, "tp_size": 1, "max_tokens": 4, "slots": 1})
ok, said = 0, False
while True:  # every connection registers again and again, and attaches none of them
    for peer in peers:
        peer.send(request)
    for peer in peers:
        ok += msgpack.unpackb(peer.recv())["status"] == "ok"
    if ok >= 64 and not said:
        print("renewing", flush=True)
        said = True
"""


def test_registrations_never_attached_do_not_crowd_out_good_clients(daemon_factory, reference):
    """Registrations renewed from 32 connections without ever attaching (so with no credentials
    and no per-user cap) let a good client in 0-1 times in 20. libzmq names the kernel's
    credentials of each connection's process, so a user may now hold only
    pending_registrations_per_uid unattached registrations, and past it the oldest of its
    process with the most goes: the renewing process is of the test's own user, and a good
    client of that user gets in every time."""
    daemon = daemon_factory()
    renewer = subprocess.Popen([sys.executable, "-c", RENEWER, str(daemon.socket), "32",
                                str(PROTOCOL_VERSION)], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([renewer.stdout], [], [], 60.0)
        assert ready and renewer.stdout.readline().strip() == "renewing"
        ids = random_ids(np.random.default_rng(3), 4, reference.rows, reference.heads)
        for attempt in range(20):
            with EngramClient(daemon.socket, max_tokens=4) as client:
                rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
                assert np.array_equal(rows, reference.expected(ids)), attempt
        stats = probe(daemon.socket, "stats", 5.0).body
        assert sum(not c["attached"] for c in stats.clients) <= 8  # the setting's default
    finally:
        renewer.kill()
        renewer.wait()
        renewer.stdout.close()
    assert daemon.proc.poll() is None


# -- 6. what a refused peer costs the log ----------------------------------------------------------


def test_refused_handle_requests_do_not_flood_the_log(daemon_factory):
    """Each refused handle-socket request wrote a log line (3,200 refusals in 1.4 s wrote 564 KB).
    They are said once per interval per peer uid, with a count of those held back."""
    from engramd.client.errors import NotRegisteredError
    from engramd.client.shared.handles import attach

    daemon = daemon_factory()
    path = handle_socket_path(daemon.socket)
    for i in range(500):
        with pytest.raises(NotRegisteredError):
            attach(path, 10_000 + i, "not-a-token")
    assert probe(daemon.socket, "health", 5.0).body.ready
    lines = [line for line in daemon.log().splitlines() if "handle socket: refused attach" in line]
    assert 1 <= len(lines) <= 2, f"{len(lines)} lines for 500 refusals"
