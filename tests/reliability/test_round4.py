"""A fourth round of attacks by a hostile local user on a real daemon (CPU backend, demo tables):
each test here is one finding, and fails without its fix.

What this is not: the earlier rounds (test_hostile.py, test_round3.py), access by file modes
(test_access.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from helpers import attach_raw, dealer, engramd_command, engramd_stats, register, request

from engramd.client.shared.connection import probe
from engramd.client.shared.protocol import PROTOCOL_VERSION


def wait_ready_in_log(daemon, timeout: float = 120.0) -> None:
    """Ready, as the daemon's log says: no probe connects meanwhile (each takes a routing id)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert daemon.proc.poll() is None, daemon.log()
        if " ready: " in daemon.log():
            return
        time.sleep(0.05)
    raise AssertionError(f"daemon not ready within {timeout} s:\n{daemon.log()}")


def unseeded_rand_start() -> int:
    """Where libzmq's routing ids start in a process whose C library's rand() was never seeded:
    its generate_random() of the first two rand() numbers (glibc's seed 1)."""
    libc = ctypes.CDLL(None)
    libc.srand(1)
    low, high = libc.rand(), libc.rand()
    return ((high << 31) | low) & 0xFFFFFFFF


# -- 1. routing ids ------------------------------------------------------------------------------


def test_peers_that_claim_routing_ids_cannot_abort_the_daemon(daemon_factory):
    """libzmq names a peer that names no routing id of its own (every client of this library)
    by a counter, and aborts the process (an assertion) when that counter reaches an id a peer
    claimed for itself. The counter started at rand() of a C library nobody had seeded: at the
    same number in every daemon. A peer that claimed the next 64 ids aborted the daemon at the
    next `engramd health`."""
    daemon = daemon_factory(ready=False)
    wait_ready_in_log(daemon)
    start = unseeded_rand_start()
    claims = [dealer(daemon, routing_id=b"\x00" + struct.pack(">I", (start + k) & 0xFFFFFFFF))
              for k in range(64)]
    try:
        for rid, peer in enumerate(claims, 1):  # each a peer of the daemon's, once answered
            assert request(peer, "health", rid)["status"] == "ok"
        for _ in range(8):  # good peers, each named by the counter
            assert daemon.health(timeout=10.0) is not None, \
                f"no answer; the daemon's exit status {daemon.proc.poll()}:\n{daemon.log()[-2000:]}"
        assert daemon.proc.poll() is None, daemon.log()
    finally:
        for peer in claims:
            peer.close(0)


# -- 2. what `stats` carries ---------------------------------------------------------------------


def test_a_device_name_past_any_real_one_is_refused_and_stats_keep_working(daemon_factory):
    """A mapped registration's `device` was never checked (only a served one's, against the
    backend's devices) and every client's reaches `stats`: three mapped clients naming devices
    of 30,000 characters made the stats reply larger than any reply a client reads (64 KiB), and
    `engramd stats` failed for everyone while they lived. A device is now "cpu" or
    "cuda:<id>" of at most 64 letters, digits and dashes; anything else is refused by name."""
    daemon = daemon_factory()
    peer = dealer(daemon)
    leases = []
    try:
        for rid, device in enumerate(["cuda:GPU-" + "x" * 30_000] * 3 + ["cpu\x1b[2J", "cuda:",
                                                                         "GPU-0"], 1):
            reply = register(peer, rid, mode="mapped", device=device)
            if reply["status"] == "ok":
                leases.append(attach_raw(daemon.socket, reply).lease)
            assert (reply["status"], reply["code"]) == ("error", "bad_request"), reply["code"]
            assert "device" in reply["message"] and len(reply["message"]) < 400, reply["message"]
        good = register(peer, 10, mode="mapped", device="cuda:GPU-5a1f0c2e-9d7b-4e1a-8c3f-0b6d2e4f1a2b")
        assert good["status"] == "ok", good
        leases.append(attach_raw(daemon.socket, good).lease)
        cli = engramd_stats(daemon)
        assert cli.returncode == 0, cli.stderr
        assert "cuda:GPU-5a1f0c2e" in cli.stdout
    finally:
        for lease in leases:
            lease.close()
        peer.close(0)


def test_stats_of_a_daemon_with_hundreds_of_clients_still_reach_the_cli(daemon_factory):
    """max_clients may be 4,096, and the admins' `clients` reply is read up to 4 MiB for them,
    but a client read no reply header over 64 KiB: past about 300 clients of GPU engines the
    `stats` reply (a summary per client) was larger, and `engramd stats` failed with a protocol
    error on a daemon doing nothing wrong. Replies are read up to 4 MiB now."""
    daemon = daemon_factory(extra=["--max-clients", "400", "--max-clients-per-uid", "0"])
    peer = dealer(daemon)
    leases = []
    try:
        for rid in range(1, 351):
            reply = register(peer, rid, mode="mapped",
                             device=f"cuda:GPU-5a1f0c2e-9d7b-4e1a-8c3f-{rid:012x}")
            assert reply["status"] == "ok", reply
            leases.append(attach_raw(daemon.socket, reply).lease)
        stats = probe(daemon.socket, "stats", 30.0).body
        assert len(stats.clients) == 350
        cli = engramd_stats(daemon, "--timeout", "30")
        assert cli.returncode == 0, cli.stderr
        assert "clients 350" in cli.stdout
    finally:
        for lease in leases:
            lease.close()
        peer.close(0)


# -- 3. settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["heartbeat_interval = nan", "slab_budget_gib = nan",
                                     "gather_sm_fraction = nan", "--heartbeat-interval=nan"])
def test_a_setting_that_is_not_a_number_is_refused_at_start(daemon_factory, tmp_path, setting):
    """TOML and float() both read `nan`, which passes every bound (each comparison is false):
    a NaN heartbeat_interval or slab_budget_gib killed the daemon with a traceback once it had
    bound its socket (exit 1, not EXIT_CONFIG), and a NaN gather_sm_fraction was served, and
    told to every mapped client. A float setting must be a finite number, named if it is not."""
    from engramd.server.startup import EXIT_CONFIG

    if setting.startswith("--"):
        extra = [setting]
    else:
        config = tmp_path / "engramd.toml"
        config.write_text(setting + "\n")
        extra = ["--config", str(config)]
    daemon = daemon_factory(extra=extra, ready=False)
    assert daemon.proc.wait(120) == EXIT_CONFIG, daemon.log()[-3000:]
    key = setting.removeprefix("--").split("=")[0].strip().replace("-", "_")
    assert repr(key) in daemon.log() and "Traceback" not in daemon.log(), daemon.log()[-3000:]


def test_a_metrics_port_past_65535_is_refused_at_start(daemon_factory):
    """metrics_address took any port of up to five digits: 127.0.0.1:99999 passed the config's
    check and killed the daemon with a traceback (OverflowError from bind) once it had bound its
    socket, exit 1. A port must be one (0 to 65535)."""
    from engramd.server.startup import EXIT_CONFIG

    daemon = daemon_factory(extra=["--metrics-address", "127.0.0.1:99999"], ready=False)
    assert daemon.proc.wait(120) == EXIT_CONFIG, daemon.log()[-3000:]
    assert "'metrics_address'" in daemon.log() and "Traceback" not in daemon.log(), daemon.log()[-3000:]


# -- 4. the command line -------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", ["nan", "-1", "inf", "0"])
def test_the_cli_refuses_a_timeout_that_is_no_number_of_seconds(daemon_factory, timeout):
    """`engramd health --timeout nan` against a daemon whose loop is stuck (SIGSTOP here) waited
    forever, where a health check exists to say it is stuck; `--timeout -1` ended `engramd stats`
    in a traceback; `--timeout 0` asked whether the daemon was running. A timeout is a finite
    number of seconds, > 0, or a usage error (exit 2)."""
    import signal

    daemon = daemon_factory()
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        for command in ("health", "stats"):
            result = subprocess.run([*engramd_command(), command, "--socket", str(daemon.socket),
                                     f"--timeout={timeout}"], capture_output=True, text=True,
                                    timeout=60)
            assert result.returncode == 2, (command, result.returncode, result.stderr[-2000:])
            assert "--timeout" in result.stderr and "Traceback" not in result.stderr, result.stderr
    finally:
        daemon.proc.send_signal(signal.SIGCONT)


# -- 5. where the daemon listens -----------------------------------------------------------------


@pytest.mark.parametrize("length", [106, 120])
def test_a_socket_path_too_long_for_a_unix_socket_is_refused_at_start(daemon_factory, tmp_path,
                                                                      length):
    """A Unix socket's path holds 107 bytes. A socket path of 106 bound the ZeroMQ socket, then
    died with a traceback binding the handle socket beside it, whose name is 3 bytes longer
    (engramd.handles); one of 120 died with a traceback from ZeroMQ. Both exited 1 once the lock
    was taken. The socket setting is refused at start now, naming it, with EXIT_CONFIG."""
    from engramd.server.startup import EXIT_CONFIG

    tail = "/run/engramd.sock"
    pad = length - len(str(tmp_path)) - 1 - len(tail)
    assert pad > 0, tmp_path
    workdir = tmp_path / ("w" * pad)
    workdir.mkdir()
    daemon = daemon_factory(workdir=workdir, ready=False)
    assert len(str(daemon.socket)) == length
    assert daemon.proc.wait(120) == EXIT_CONFIG, daemon.log()[-3000:]
    assert "socket" in daemon.log() and "Traceback" not in daemon.log(), daemon.log()[-3000:]


@pytest.mark.parametrize("which, kind", [("engramd.sock", "file"), ("engramd.sock", "folder"),
                                         ("engramd.handles", "file")])
def test_something_other_than_a_socket_where_the_daemon_binds_is_kept_and_refused(
        daemon_factory, tmp_path, which, kind):
    """The start unlinked whatever was at the socket path before binding there: a user's file at
    the path given as --socket was deleted without a word, and a folder there ended the start
    with IsADirectoryError's traceback. Only a socket (a dead daemon's) is replaced now; anything
    else is refused at start, named, with EXIT_CONFIG, and left as it was."""
    from engramd.server.startup import EXIT_CONFIG

    workdir = tmp_path / "w"
    (workdir / "run").mkdir(parents=True)
    in_the_way = workdir / "run" / which
    if kind == "file":
        in_the_way.write_text("a user's notes")
    else:
        (in_the_way / "inside").mkdir(parents=True)
    daemon = daemon_factory(workdir=workdir, ready=False)
    assert daemon.proc.wait(120) == EXIT_CONFIG, daemon.log()[-3000:]
    log = daemon.log()
    assert f"{in_the_way} is a {kind}, not a socket" in log and "Traceback" not in log, log[-3000:]
    if kind == "file":
        assert in_the_way.read_text() == "a user's notes"
    else:
        assert (in_the_way / "inside").is_dir()


# -- 6. memory held for replies nobody reads -------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


UNREAD_STATS = 150_000
UNREAD_GROWTH_BOUND = 256 << 20


def test_replies_a_peer_never_reads_hold_a_bounded_amount_of_memory(daemon_factory):
    """The daemon queued up to 100,000 replies for each peer before it dropped one. A peer that
    asks for `stats` (7 KB with 30 clients) and reads nothing made it hold 680 MB, and every
    further connection as much again: a few exhausted the node's memory. A peer's queue holds
    1,024 replies now (a client has at most a slot's worth of lookups in flight, 256 at most,
    and reads its replies)."""
    daemon = daemon_factory()
    peer = dealer(daemon)
    leases = []
    try:
        for rid in range(1, 31):
            reply = register(peer, rid, mode="mapped", device="cuda:GPU-" + "a" * 55)
            assert reply["status"] == "ok", reply
            leases.append(attach_raw(daemon.socket, reply).lease)
        before = rss_bytes(daemon.proc.pid)
        flood = zmq.Context.instance().socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        flood.setsockopt(zmq.RCVHWM, 1)  # reads nothing, buffers (almost) nothing
        flood.setsockopt(zmq.SNDHWM, 0)
        flood.connect(f"ipc://{daemon.socket}")
        try:
            frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": "stats", "rid": 1})
            for _ in range(UNREAD_STATS):
                flood.send(frame)
            deadline = time.monotonic() + 300  # until it drops one, or has answered them all
            while "dropping a reply" not in daemon.log() and time.monotonic() < deadline:
                time.sleep(0.2)
            grown = rss_bytes(daemon.proc.pid) - before
            assert grown < UNREAD_GROWTH_BOUND, f"{grown >> 20} MiB held for one peer's unread replies"
            assert request(peer, "health", 99)["ready"] is True
        finally:
            flood.close(0)
    finally:
        for lease in leases:
            lease.close()
        peer.close(0)


# -- 7. a daemon in the client's default folder that is not the user's --------------------------

VICTIM = textwrap.dedent("""
    import json, os, sys
    from engramd.client.errors import EngramError
    from engramd.client.shared.connection import default_socket_path, probe
    os.setgroups([])
    os.setgid(int(sys.argv[1]))
    os.setuid(int(sys.argv[1]))
    try:
        reply = probe(default_socket_path(), "health", 10.0)
        print(json.dumps({"outcome": "answered", "ready": reply.body.ready}))
    except EngramError as exc:
        print(json.dumps({"outcome": type(exc).__name__, "error": str(exc)}))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_client_does_not_talk_to_a_daemon_in_a_default_folder_another_user_made(daemon_factory):
    """A user's default socket is <tmp>/engramd-<uid>/engramd.sock, in a folder anyone may make
    first. The daemon refuses such a folder (test_hostile.py), but a client used it: another user
    who made the folder and ran a daemon there answered the user's `engramd health`, and would
    have served its engines rows of its own. A client now refuses a default folder that is not
    its own user's, naming its owner."""
    victim, attacker = 65534, 12345
    tmp = Path(tempfile.mkdtemp(prefix="egd-", dir="/tmp"))
    try:
        tmp.chmod(0o1777)  # as /tmp is: anyone may make a folder in it
        folder = tmp / f"engramd-{victim}"
        socket_path = folder / "engramd.sock"
        daemon = daemon_factory(extra=["--socket", str(socket_path)], ready=False)
        deadline = time.monotonic() + 120
        while not (socket_path.exists() and probe(socket_path, "health", 2.0).body.ready):
            assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log()[-3000:]
            time.sleep(0.1)
        os.chown(folder, attacker, attacker)  # as if that user had made it, and serves there
        folder.chmod(0o755)
        for path in (socket_path, folder / "engramd.handles"):
            path.chmod(0o666)
        result = subprocess.run([sys.executable, "-c", VICTIM, str(victim)], capture_output=True,
                                text=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp)})
        assert result.returncode == 0, result.stderr[-3000:]
        outcome = json.loads(result.stdout.splitlines()[-1])
        assert outcome["outcome"] == "DaemonUnavailableError", outcome
        assert str(folder) in outcome["error"] and str(attacker) in outcome["error"], outcome
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
