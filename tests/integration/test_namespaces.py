"""Clients in PID, IPC and mount namespaces of their own, as engines in containers run.

The daemon runs in this test's namespaces; each client runs under `unshare --pid --ipc --mount
--fork --mount-proc` with a fresh, empty tmpfs on /dev/shm, so it cannot see the daemon's
processes, its System V IPC or its shared-memory folder. What it shares is the runtime folder
(the two sockets), as a container that mounts only that folder would. Covered: exact rows in
served and mapped mode (the slab and the tables arrive as descriptors), and kill -9 of such a
client freeing its slab within the daemon's promise (its lease closes; no PID is needed).

Needs root and a working `unshare` (CI runs as root); skipped elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    NAMESPACES_UNAVAILABLE,
    client_pids,
    namespaced,
    run_client_processes,
    slab_files,
    wait_until,
)
from test_daemon_lookups import check_worker_output

from engramd.client.shared.connection import probe

WORKER = Path(__file__).parent / "client_worker.py"
HEARTBEAT_S = 0.2  # what helpers' DaemonProcess passes
# The promise for a killed client (README, "Client death"): retired within two heartbeat
# periods, its idle slab with it; plus what a loaded 2-core machine may add. The tight figure
# (tens of milliseconds) is benchmarks/reap_latency.py's.
FREE_DEADLINE_S = 2 * HEARTBEAT_S + 1.0
pytestmark = pytest.mark.skipif(NAMESPACES_UNAVAILABLE is not None, reason=str(NAMESPACES_UNAVAILABLE))


def test_namespaced_clients_get_exact_rows_in_both_modes(daemon_factory, reference, tmp_path):
    daemon = daemon_factory()
    runs = [("served", 0, 1), ("mapped", 0, 1), ("served", 1, 2), ("mapped", 1, 2)]
    commands = [namespaced([sys.executable, str(WORKER), "--socket", str(daemon.socket),
                            "--out", str(tmp_path / f"{i}.npz"), "--mode", mode,
                            "--tp-rank", str(rank), "--tp-size", str(shards), "--seed", str(70 + i),
                            "--tokens", "1", "16", "200"])
                for i, (mode, rank, shards) in enumerate(runs)]
    run_client_processes(commands)
    for i, (mode, rank, shards) in enumerate(runs):
        saved = np.load(tmp_path / f"{i}.npz")
        assert str(saved["mode"]) == mode
        assert int(saved["pid"]) == 1, "the client ran in a PID namespace of its own"
        assert int(saved["shm_entries"]) == 0, "the client saw none of the daemon's /dev/shm"
        assert check_worker_output(tmp_path / f"{i}.npz", reference, rank, shards) == 6


IDLE_CLIENT = textwrap.dedent("""
    import sys, time
    from engramd.client import EngramClient
    client = EngramClient(sys.argv[1], max_tokens=64, mode=sys.argv[2])
    print(client.client_id, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("mode", ["served", "mapped"])
def test_killed_namespaced_client_is_freed_within_the_promise(daemon_factory, mode):
    daemon = daemon_factory()
    proc = subprocess.Popen(namespaced([sys.executable, "-c", IDLE_CLIENT, str(daemon.socket), mode]),
                            stdout=subprocess.PIPE, text=True)
    try:
        client_id = int(proc.stdout.readline())
        # The daemon knows the client's process by the kernel's credentials of its lease, in
        # the daemon's own PID namespace; the client itself believes it is pid 1.
        pid = client_pids(daemon.socket)[client_id]
        ns_pids = [line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("NSpid:")][0]
        assert ns_pids == [str(pid), "1"], ns_pids
        assert (len(slab_files(daemon.proc.pid)) == 1) == (mode == "served")
        os.kill(pid, signal.SIGKILL)
        took = wait_until(lambda: not [c for c in probe(daemon.socket, "stats", 5.0).body.clients
                                       if c["client_id"] == client_id] and not slab_files(daemon.proc.pid),
                          timeout=10.0, step=0.005)
        assert took <= FREE_DEADLINE_S, f"freed {took:.3f} s after kill -9"
        assert probe(daemon.socket, "stats", 5.0).body.reaped == 1
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
