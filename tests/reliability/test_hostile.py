"""A hostile local user against a real daemon (CPU backend, demo tables): each test here is one
finding of a hardening review, and fails without its fix.

What this is not: access by file modes (test_access.py) or fuzzed messages (test_fuzz.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from helpers import (
    attach_raw,
    engramd_command,
    fd_count,
    free_port,
    shm_tempdir,
    short_tempdir,
    slab_files,
    wait_until,
)
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.errors import ResourceError
from engramd.client.shared.connection import probe
from engramd.client.shared.handles import admin_request, handle_socket_path
from engramd.client.shared.protocol import PROTOCOL_VERSION


def test_ids_scribbled_into_the_slab_during_lookups_change_nothing(daemon_factory, reference):
    """The slab is the client's to write at any time. A client that scribbles garbage over its
    slots' IDs while its lookups run still gets the rows of the IDs it sent (the daemon gathers
    from its own copy), and the daemon counts no internal error."""
    daemon = daemon_factory()
    rng = np.random.default_rng(12)
    with EngramClient(daemon.socket, max_tokens=256, slots=2) as client:
        layout, buffer = client.layout, client._slab.buffer
        ids_region = buffer[layout.ids_offset(0):layout.rows_offset(0)]
        stop = threading.Event()

        def scribble() -> None:
            noise = np.random.default_rng(13)
            while not stop.is_set():
                ids_region.copy_(torch.from_numpy(noise.integers(0, 256, len(ids_region), dtype=np.uint8)))

        thread = threading.Thread(target=scribble, daemon=True)
        thread.start()
        try:
            for i in range(60):
                ids = random_ids(rng, int(rng.integers(1, 257)), reference.rows, reference.heads)
                rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
                wrong = np.argwhere(rows != reference.expected(ids))
                assert wrong.size == 0, f"lookup {i}: {len(wrong)} wrong values"
        finally:
            stop.set()
            thread.join(10)
    assert probe(daemon.socket, "stats", 5.0).body.errors.get("internal", 0) == 0


HEALTH_WITHOUT_TORCH = """
import sys
from engramd.server.cli import main
status = main(["health", "--socket", sys.argv[1], "--timeout", "5"])
heavy = sorted(m for m in ("torch", "numpy", "triton") if m in sys.modules)
print(status, ",".join(heavy))
"""


def test_health_probe_loads_neither_torch_nor_numpy(daemon_factory):
    """`engramd health` is what liveness probes run, often with a 1 s budget: importing torch
    took 1.6-2.4 s of it. The probe must not load the client library's heavy half."""
    daemon = daemon_factory()
    result = subprocess.run([sys.executable, "-c", HEALTH_WITHOUT_TORCH, str(daemon.socket)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2].split(" ") == ["0", ""], result.stdout


FLOOD_MESSAGES = 150_000  # far past the daemon's send queue per peer (request_socket.send_queue)


def test_unread_replies_do_not_flood_the_log(daemon_factory):
    """A peer that sends heartbeats and never reads a reply fills its send queue; the daemon
    drops what no longer fits, keeps serving, and says so in a few lines, not one per reply."""
    daemon = daemon_factory()
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVHWM, 1)  # read nothing, buffer (almost) nothing
    peer.connect(f"ipc://{daemon.socket}")
    try:
        frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": "heartbeat", "rid": 1, "client_id": None, "token": ""})
        for _ in range(FLOOD_MESSAGES):
            peer.send(frame)
        deadline = time.monotonic() + 60  # the daemon has read them all once it counts them
        while "dropping a reply" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert probe(daemon.socket, "health", 10.0).body.live
    finally:
        peer.close(0)
    lines = [line for line in daemon.log().splitlines() if "dropping a reply" in line]
    assert 1 <= len(lines) <= 3, f"{len(lines)} warning lines for one peer's unread replies"


IDLE_CONNECTIONS = 300


def test_idle_connections_past_the_soft_file_limit_do_not_stop_the_daemon(daemon_factory):
    """With a soft open-file limit of 160, 300 idle ZeroMQ connections made libzmq abort the
    daemon (an assertion in its ipc listener). The daemon raises its soft limit to the hard one
    at start, keeps serving, and its clients' registrations stay alive. (One user may hold four
    connections a client place: 100 places let this process hold all 300 and its client's.)"""
    daemon = daemon_factory(nofile=(160, 4096), extra=["--max-clients-per-uid", "100"])
    with EngramClient(daemon.socket, max_tokens=4) as client:
        ctx = zmq.Context()
        ctx.setsockopt(zmq.MAX_SOCKETS, IDLE_CONNECTIONS + 100)
        idle = []
        opened = fd_count(daemon.proc.pid)
        try:
            for _ in range(IDLE_CONNECTIONS):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"ipc://{daemon.socket}")
                idle.append(sock)
            # libzmq accepts them in the background: each is a descriptor of the daemon's.
            wait_until(lambda: daemon.proc.poll() is not None
                       or fd_count(daemon.proc.pid) >= opened + IDLE_CONNECTIONS, timeout=30.0)
            assert probe(daemon.socket, "health", 10.0).body.ready
            assert daemon.proc.poll() is None, daemon.log()[-2000:]
            assert client.lookup(torch.zeros((1, 2, 24), dtype=torch.int64)).result().shape[1] == 1
        finally:
            for sock in idle:
                sock.close(0)
            ctx.term()
    assert daemon.proc.poll() is None




def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def test_idle_metrics_connections_hold_a_bounded_number_of_threads(daemon_factory):
    """Idle TCP connections to the metrics port once took a thread each without end (243 of
    them also took every descriptor). Now at most MAX_SCRAPERS are served at once, each for at most
    SCRAPE_TIMEOUT_S; the others are closed, and scrapes work again once the idle ones go."""
    from engramd.server.metrics import MAX_SCRAPERS, SCRAPE_TIMEOUT_S

    port = free_port()
    daemon = daemon_factory(extra=["--metrics-address", f"127.0.0.1:{port}"])
    before = threads_of(daemon.proc.pid)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4 * MAX_SCRAPERS)]
    try:
        time.sleep(0.5)
        assert threads_of(daemon.proc.pid) <= before + MAX_SCRAPERS
        assert probe(daemon.socket, "health", 10.0).body.ready
    finally:
        for conn in idle:
            conn.close()
    def scraped() -> bool:  # the slots come back as the idle connections close (or time out)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                return b"engramd_ready 1.0" in reply.read()
        except OSError:
            return False

    wait_until(scraped, timeout=SCRAPE_TIMEOUT_S + 10, step=0.2)  # a hang bound, not a figure
    assert daemon.proc.poll() is None


NOBODY = 65534


def refused_start(daemon, timeout: float = 60.0) -> str:
    """The daemon's exit status must be EXIT_CONFIG; returns its log."""
    from engramd.server.startup import EXIT_CONFIG

    assert daemon.proc.wait(timeout) == EXIT_CONFIG, daemon.log()[-3000:]
    return daemon.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder another user owns")
def test_a_runtime_folder_someone_else_made_is_refused(daemon_factory):
    """The non-root default runtime folder is /tmp/engramd-<uid>: whoever makes it first could
    replace the socket. A folder owned by another user is refused, naming it and its owner."""
    workdir = short_tempdir("egd-")
    try:
        (workdir / "run").mkdir()
        os.chown(workdir / "run", NOBODY, NOBODY)
        log = refused_start(daemon_factory(workdir=workdir, ready=False))
        assert f"runtime folder {workdir / 'run'} belongs to uid {NOBODY}" in log
        assert not (workdir / "run" / "engramd.sock").exists()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_symlink_at_the_lock_file_is_refused_and_its_target_untouched(daemon_factory, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    workdir = short_tempdir("egd-")
    try:
        (workdir / "run").mkdir(mode=0o770)
        (workdir / "run" / "engramd.sock.lock").symlink_to(victim)
        log = refused_start(daemon_factory(workdir=workdir, ready=False))
        assert "cannot open the lock file" in log and "symlink" in log
        assert victim.read_text() == "precious\n"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder another user owns")
def test_a_demo_cache_folder_someone_else_made_is_refused(daemon_factory, tmp_path):
    """Tables planted in a demo cache folder someone else made first must not be served."""
    planted = tmp_path / "cache"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)
    log = refused_start(daemon_factory(tables="demo", extra=["--cache-dir", str(planted)], ready=False))
    assert f"demo cache folder {planted} belongs to uid {NOBODY}" in log


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a file to another user")
def test_table_files_someone_else_owns_are_never_reattached(daemon_factory, reference):
    """Table files with a valid header and a matching checksum, but owned (and writable) by
    another user, were re-attached and served: that user could change rows at will. They are
    reloaded from the checkpoint instead, and the new files are the daemon's own, 0640."""
    first = daemon_factory(instance="planted")
    assert first.stop() == 0
    tables = sorted(first.tables_dir.glob("*.tbl"))
    for path in tables:  # what an attacker who planted them (or was handed them) would hold
        os.chown(path, NOBODY, NOBODY)
        os.chmod(path, 0o666)
    second = daemon_factory(instance="planted", shm_dir=first.shm_dir, workdir=first.workdir)
    assert f"owned by uid {NOBODY}" in second.log()
    for path in sorted(second.tables_dir.glob("*.tbl")):
        info = path.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.geteuid(), 0o640), path
    ids = random_ids(np.random.default_rng(14), 64, reference.rows, reference.heads)
    with EngramClient(second.socket, max_tokens=64) as client:
        rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
    assert np.array_equal(rows, reference.expected(ids))


def test_the_self_check_samples_different_rows_at_every_start(daemon_factory):
    """A fixed sample (always the same 384 rows per layer) let crafted tables pass."""
    seeds = set()
    for instance in ("s1", "s2", "s3"):
        daemon = daemon_factory(instance=instance)
        line = next(line for line in daemon.log().splitlines() if "self-check passed" in line)
        seeds.add(line.split("sample seed ")[1].split(")")[0])
    assert len(seeds) == 3, seeds


ADMIN_AS = """
import os, sys
from engramd.client.errors import EngramError
from engramd.client.shared.handles import admin_request
uid, gid, group = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([group])
os.setgid(gid)
os.setuid(uid)
try:
    admin_request(sys.argv[1], sys.argv[5], 5.0)
    print("done")
except EngramError as exc:
    print(exc.code)
"""


def test_admin_operations_need_an_admin_not_just_a_connection(daemon_factory):
    """`drain` from any connection stopped the daemon (with exit 0, so a Restart=on-failure unit
    stayed down). Over ZeroMQ it is refused; over the handle socket a member of the socket's
    group who is not an admin (admin_uids; by default the daemon's own user) is refused `drain`
    and `reload`; the daemon's user drains."""
    daemon = daemon_factory()
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, 10_000)
    peer.connect(f"ipc://{daemon.socket}")
    peer.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "drain", "rid": 1}))
    reply = msgpack.unpackb(peer.recv())
    peer.close(0)
    assert (reply["status"], reply["code"]) == ("error", "permission_denied"), reply
    if os.geteuid() == 0:
        for folder in (daemon.workdir, daemon.socket.parent):
            os.chmod(folder, 0o755 if folder == daemon.workdir else 0o750)
        for op in ("drain", "reload"):
            member = subprocess.run([sys.executable, "-c", ADMIN_AS, str(handle_socket_path(daemon.socket)),
                                     str(NOBODY), str(NOBODY), str(daemon.socket.stat().st_gid), op],
                                    capture_output=True, text=True, timeout=60)
            assert member.stdout.strip() == "permission_denied", op + member.stdout + member.stderr
        assert "reload asked" not in daemon.log()  # refused before anything started
    assert probe(daemon.socket, "health", 5.0).body.ready and daemon.proc.poll() is None
    assert admin_request(handle_socket_path(daemon.socket), "drain", 5.0).in_flight == 0
    assert daemon.proc.wait(30) == 0


def raw_register(peer: zmq.Socket, rid: int) -> dict:
    peer.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "register", "rid": rid, "pid": os.getpid(), "device": "cpu",
                             "tp_rank": 0, "tp_size": 1, "max_tokens": 4, "slots": 1}))
    return msgpack.unpackb(peer.recv())


def test_one_connection_cannot_take_every_client_place(daemon_factory, reference):
    """One connection took all 64 places in 0.08 s with registrations it never used. Now a
    connection holds at most MAX_PENDING_PER_CONNECTION unattached ones, and a user at most
    max_clients_per_uid attached ones; a well-behaved client of another connection still gets in."""
    from engramd.server.registry import MAX_PENDING_PER_CONNECTION

    daemon = daemon_factory(extra=["--max-clients", "8", "--max-clients-per-uid", "3"])
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, 10_000)
    peer.connect(f"ipc://{daemon.socket}")
    try:
        replies = [raw_register(peer, rid) for rid in range(1, 11)]
        assert [r["status"] for r in replies] == ["ok"] * MAX_PENDING_PER_CONNECTION + \
            ["error"] * (10 - MAX_PENDING_PER_CONNECTION)
        assert "not attached yet" in replies[-1]["message"]
        leases = [attach_raw(daemon.socket, r).lease for r in replies[:3]]  # the user's 3 places
        try:
            with pytest.raises(ResourceError, match="max_clients_per_uid"):
                attach_raw(daemon.socket, replies[3])
            assert len(slab_files(daemon.proc.pid)) == 3  # the refused attach got nothing
        finally:
            for lease in leases:
                lease.close()
        wait_until(lambda: not slab_files(daemon.proc.pid), timeout=10.0)
        with EngramClient(daemon.socket, max_tokens=4) as good:  # the places came back
            ids = random_ids(np.random.default_rng(15), 4, reference.rows, reference.heads)
            rows = good.lookup(torch.from_numpy(ids)).result().double().numpy()
            assert np.array_equal(rows, reference.expected(ids))
    finally:
        peer.close(0)


def cut_off(conn: socket.socket) -> bool:
    """Without waiting: has the other end closed (or reset) this connection?"""
    timeout = conn.gettimeout()
    conn.setblocking(False)  # with a timeout set, a recv waits for it whatever its flags
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        conn.settimeout(timeout)


def test_a_trickling_metrics_peer_is_cut_off_at_the_deadline(daemon_factory):
    """A per-read timeout alone let a peer sending a byte every few seconds hold a scrape
    thread for ever; each scrape now has SCRAPE_TIMEOUT_S in all. A peer that sends its
    request line a byte per quarter of that is cut off before the line is complete (the
    trickle lasts six times the deadline)."""
    from engramd.server.metrics import SCRAPE_TIMEOUT_S

    port = free_port()
    daemon = daemon_factory(extra=["--metrics-address", f"127.0.0.1:{port}"])
    request = b"GET /metrics HTTP/1.1\r\n"
    sent, cut = 0, False
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        while sent < len(request) and not cut:
            try:
                conn.sendall(request[sent:sent + 1])
            except OSError:
                cut = True  # the daemon closed it under us
                break
            sent += 1
            time.sleep(SCRAPE_TIMEOUT_S / 4)
            cut = cut_off(conn)
    assert cut, f"the whole request line ({sent} bytes, a byte per {SCRAPE_TIMEOUT_S / 4} s) was read"
    assert daemon.proc.poll() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder another user owns")
def test_tables_live_in_a_folder_of_the_daemons_own(daemon_factory):
    """In a shared shm_dir (/dev/shm) anyone may create files at the names the daemon will use;
    a planted file it could not remove stopped it from starting (exit 66, again and again under
    Restart=on-failure). Its tables and lock now live in a folder of its own: a folder someone
    else made at that name is refused, naming its owner; files planted beside it are ignored."""
    shm = shm_tempdir()
    try:
        os.chmod(shm, 0o1777)  # like /dev/shm
        (shm / "engramd.t.lock").write_text("planted")
        os.chown(shm / "engramd.t.lock", NOBODY, NOBODY)
        daemon = daemon_factory(shm_dir=shm)  # starts: the planted lock is not its lock
        assert daemon.tables_dir.is_dir() and stat.S_IMODE(daemon.tables_dir.stat().st_mode) == 0o750
        assert daemon.stop() == 0
        shutil.rmtree(daemon.tables_dir)
        daemon.tables_dir.mkdir()
        os.chown(daemon.tables_dir, NOBODY, NOBODY)
        log = refused_start(daemon_factory(shm_dir=shm, ready=False))
        assert f"table folder {daemon.tables_dir} belongs to uid {NOBODY}" in log
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_message_of_many_frames_is_dropped_with_a_typed_error(daemon_factory, reference):
    """libzmq bounds each frame (64 MiB) but hands over a message of any number of them: 4 GiB
    in 32 MiB frames stalled the loop while it copied them. A message of more frames than any
    request has is dropped uncopied and answered with a protocol error naming the limit; the
    daemon keeps serving a good client, rows exact."""
    daemon = daemon_factory()
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, 30_000)
    peer.connect(f"ipc://{daemon.socket}")
    header = msgpack.packb({"v": PROTOCOL_VERSION, "op": "health", "rid": 7})
    peer.send_multipart([header, *[bytes(1 << 20)] * 96])  # 96 MiB
    reply = msgpack.unpackb(peer.recv())
    peer.close(0)
    assert (reply["status"], reply["code"], reply["rid"]) == ("error", "bad_message", 7), reply
    assert f"97 frames ({len(header) + 96 * (1 << 20)} bytes) dropped unread" in reply["message"], reply
    ids = random_ids(np.random.default_rng(12), 16, reference.rows, reference.heads)
    with EngramClient(daemon.socket, max_tokens=16) as client:
        rows = client.lookup(torch.from_numpy(ids)).result().float().numpy()
    assert np.array_equal(rows.astype(np.float64), reference.expected(ids))
    assert probe(daemon.socket, "stats", 5.0).body.errors["bad_message"] == 1


CLIENTS_AS = """
import os, sys
from engramd.client.errors import EngramError
from engramd.client.shared.handles import admin_request
os.setgroups([int(sys.argv[3])])
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[2]))
try:
    print(admin_request(sys.argv[1], "clients", 5.0).clients)
except EngramError as exc:
    print(exc.code)
"""


def test_who_the_clients_are_is_for_admins_only(daemon_factory):
    """`stats` named every client's pid and name to anyone who could connect. Over ZeroMQ it now
    gives counts alone; the `clients` admin operation (handle socket, kernel credentials) says
    who they are, and `engramd stats` shows that to an admin (the next test: a non-admin is
    refused)."""
    daemon = daemon_factory()
    with EngramClient(daemon.socket, name="private-name") as client:
        (public,) = probe(daemon.socket, "stats", 5.0).body.clients
        assert public["client_id"] == client.client_id
        assert not {"pid", "name", "uid"} & public.keys(), public
        (private,) = admin_request(handle_socket_path(daemon.socket), "clients", 5.0).clients
        assert private == {"client_id": client.client_id, "pid": os.getpid(), "name": "private-name",
                           "uid": os.geteuid()}
        shown = subprocess.run([*engramd_command(), "stats", "--socket", str(daemon.socket)],
                               capture_output=True, text=True, timeout=60)
        assert f"#{client.client_id} pid {os.getpid()} private-name uid {os.geteuid()}" in shown.stdout, shown
    opened = fd_count(daemon.proc.pid)
    for _ in range(50):  # each answer closes its connection: a monitoring loop leaks nothing
        admin_request(handle_socket_path(daemon.socket), "clients", 5.0)
    assert fd_count(daemon.proc.pid) <= opened + 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as nobody")
def test_a_group_member_who_is_not_an_admin_may_not_ask_who_the_clients_are(daemon_factory):
    daemon = daemon_factory()
    for folder in (daemon.workdir, daemon.socket.parent):
        os.chmod(folder, 0o755 if folder == daemon.workdir else 0o750)
    member = subprocess.run([sys.executable, "-c", CLIENTS_AS, str(handle_socket_path(daemon.socket)),
                             str(NOBODY), str(daemon.socket.stat().st_gid)],
                            capture_output=True, text=True, timeout=60)
    assert member.stdout.strip() == "permission_denied", member.stdout + member.stderr
