"""Operating the daemon: systemd notifications, self-check, metrics, drain, stop notices."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import numpy as np
import pytest
import torch
from helpers import GatherGate, SettleGate, engramd_command, free_port, wait_until
from reference import ReferenceTables
from test_daemon_lookups import assert_rows_equal

from engramd.client import DaemonUnavailableError, EngramClient
from engramd.client.shared.connection import probe
from engramd.client.shared.handles import lease_closed


def test_systemd_sees_status_ready_and_stopping(daemon_factory, tmp_path):
    address = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(address)
    listener.settimeout(30)
    daemon = daemon_factory(env={"NOTIFY_SOCKET": address})
    messages = []
    while not any(m.startswith("READY=1") for m in messages):
        messages.append(listener.recv(4096).decode())
    assert messages[0].startswith("STATUS=loading")
    ready = messages[-1]
    assert f"MAINPID={daemon.proc.pid}" in ready and "ready: cpu backend" in ready
    assert daemon.health()["ready"]  # READY=1 only once clients can be served
    daemon.proc.send_signal(signal.SIGTERM)
    while not messages[-1].startswith("STOPPING=1"):
        messages.append(listener.recv(4096).decode())
    assert daemon.stop() == 0
    listener.close()


def test_self_check_catches_tables_that_do_not_hold_the_checkpoint(daemon_factory, demo_checkpoint, tmp_path):
    """A checkpoint edited in place with its mtime restored keeps its fingerprint, so the daemon
    re-attaches the old tables; the self-check compares with the checkpoint bytes and catches
    it. The tables are then compared row by row and what differs loaded again (it once exited
    66 here, and at every later start): the edited row is served."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint, checkpoint)
    first = daemon_factory(tables=checkpoint, instance="sc")
    assert first.stop() == 0
    index = __import__("json").loads((checkpoint / "model.safetensors.index.json").read_text())
    shard = checkpoint / index["weight_map"]["layers.1.engram.embed.weight"]
    stat = shard.stat()
    with open(shard, "r+b") as f:  # row 0 of layer 1's weights: the first tensor data here
        header = int.from_bytes(f.read(8), "little")
        meta = __import__("json").loads(f.read(header))
        begin = meta["layers.1.engram.embed.weight"]["data_offsets"][0]
        f.seek(8 + header + begin)
        row = bytearray(f.read(256))
        f.seek(8 + header + begin)
        f.write(bytes(b ^ 0x01 for b in row))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = daemon_factory(tables=checkpoint, instance="sc", shm_dir=first.shm_dir,
                            workdir=first.workdir, ready=False)
    second.wait_ready()
    assert "self-check failed on re-attached tables" in second.log() and "layer 1 row 0" in second.log()
    ids = torch.full((1, 2, 24), -1, dtype=torch.int64)
    ids[0, 0, 0] = 0  # row 0 of layer id 1 (the first Engram layer), the edited one
    with EngramClient(second.socket, max_tokens=1) as client:
        rows = client.lookup(ids).result().double().numpy()
    expected = ReferenceTables(checkpoint).expected(ids.numpy())
    assert_rows_equal(rows, expected, "the edited row as the checkpoint holds it")
    with pytest.raises(AssertionError):
        assert_rows_equal(rows, ReferenceTables(demo_checkpoint).expected(ids.numpy()), "the old row")


def test_metrics_endpoint(daemon_factory):
    port = free_port()
    daemon = daemon_factory(extra=["--metrics-address", f"127.0.0.1:{port}"])
    with EngramClient(daemon.socket, name="metrics-test") as client:
        client.lookup(torch.zeros((5, 2, 24), dtype=torch.int64)).result()
        client_id = client.client_id

        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

        # The loop publishes every heartbeat interval (0.2 s here): wait for the lookup to show.
        wait_until(lambda: "\nengramd_lookups_total 1.0" in scrape(), timeout=30.0)
        text = scrape()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["engramd_ready"] == 1.0 and values["engramd_clients"] == 1.0
    assert values["engramd_lookups_total"] == 1.0 and values["engramd_rows_total"] == 5 * 2 * 24
    assert values["engramd_lookup_dispatch_seconds_count"] == 1.0
    (per_client,) = [k for k in values if k.startswith("engramd_client_lookups_total{")]
    assert f'client_id="{client_id}"' in per_client and "pid=" not in per_client \
        and "name=" not in per_client, per_client  # who a client is: admins only (engramd stats)
    assert any(k.startswith("engramd_epoch_info{") for k in values)


def _in_flight(daemon) -> int:
    """Lookups the daemon reports received and not yet answered, over all its clients."""
    return sum(c["in_flight"] for c in probe(daemon.socket, "stats", 5.0).body.encode()["clients"])


@pytest.mark.parametrize("end", ["rows written", "second signal"])
def test_a_drain_waits_for_its_last_gathers_in_its_loop(daemon_factory, tmp_path, end):
    """A stopping daemon waits for the rows of the gathers its devices still run (held here by a
    hook, as a GPU's running gathers hold it) inside its request loop: it goes on answering, and
    exits once they are written, or at once on a second signal. Not blocked after the loop, where
    no request, lease or signal would be handled until the wait ended."""
    gate = SettleGate(tmp_path)
    daemon = daemon_factory(env=gate.env())
    daemon.proc.send_signal(signal.SIGTERM)
    # The loop marks itself stopping and starts the wait in one turn: a reply saying
    # "stopping" comes from a loop that is already waiting.
    wait_until(lambda: (daemon.health() or {}).get("state") == "stopping", timeout=30.0)
    for _ in range(3):
        assert (daemon.health(timeout=10.0) or {}).get("state") == "stopping", daemon.log()
    assert daemon.proc.poll() is None, "the drain did not wait for its gathers"
    if end == "rows written":
        gate.open()
    else:
        daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(30) == 0, daemon.log()
    assert ("stopped by a second SIGTERM" in daemon.log()) == (end == "second signal")


def test_a_stopping_daemon_sends_its_replies_before_it_closes_the_leases(daemon_factory):
    """A client that sees its lease close fails the lookups whose replies have not come; a
    daemon that closed its leases first, and its request socket after them without waiting for
    its queues, failed a drain's last lookups on a loaded machine ("lease closed"), though it
    had answered them. Its request socket (its replies flushed, its path gone) closes first."""
    daemon = daemon_factory()
    with EngramClient(daemon.socket, max_tokens=4, timeout=30) as client:
        lease = client._watchdog.lease
        daemon.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: lease_closed(lease), timeout=60, step=0.0002)
        assert not daemon.socket.exists(), "the lease closed before the request socket"
    assert daemon.proc.wait(30) == 0, daemon.log()


def test_drain_finishes_in_flight_lookups_and_exits(daemon_factory, reference, tmp_path):
    gate = GatherGate(tmp_path)  # the daemon's gathers wait until the test opens it
    daemon = daemon_factory(env=gate.env())
    client = EngramClient(daemon.socket, reconnect_timeout=1.0)
    ids = np.random.default_rng(2).integers(0, min(reference.rows), size=(64, 2, 24))
    epoch = probe(daemon.socket, "health", 5.0).epoch
    future = client.lookup(torch.from_numpy(ids))
    wait_until(lambda: _in_flight(daemon) == 1, timeout=30.0)  # received, its gather held
    drain = subprocess.Popen([*engramd_command(), "drain", "--socket", str(daemon.socket),
                              "--timeout", "30"], stdout=subprocess.PIPE, text=True)
    wait_until(lambda: (daemon.health() or {}).get("state") == "stopping", timeout=30.0)
    assert _in_flight(daemon) == 1 and daemon.proc.poll() is None, "a drain waits for its lookup"
    gate.open()
    rows = future.result(timeout=30)  # the in-flight lookup is answered
    assert np.array_equal(rows.double().numpy(), reference.expected(ids))
    assert drain.wait(40) == 0
    assert f"drained: daemon epoch {epoch} finished 1 lookups and exited" in drain.stdout.read()
    assert daemon.proc.wait(30) == 0
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match="no daemon to re-register with within 1 s"):
        client.lookup(torch.from_numpy(ids))
    assert time.monotonic() - started < 5
    client.close()
