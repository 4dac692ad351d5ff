"""A hostile local user against a real daemon (CPU backend, demo tables): each test here is one
finding of a hardening review, and fails without its fix.

What this is not: access by file modes (test_access.py) or fuzzed messages (test_fuzz.py).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import torch
import zmq
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.connection import probe


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
    assert probe(daemon.socket, "stats", 5.0).fields["errors"].get("internal", 0) == 0


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


FLOOD_MESSAGES = 150_000  # past the daemon's send queue per peer (SNDHWM 100,000)


def test_unread_replies_do_not_flood_the_log(daemon_factory):
    """A peer that sends heartbeats and never reads a reply fills its send queue; the daemon
    drops what no longer fits, keeps serving, and says so in a few lines, not one per reply."""
    daemon = daemon_factory()
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVHWM, 1)  # read nothing, buffer (almost) nothing
    peer.connect(f"ipc://{daemon.socket}")
    try:
        frame = msgpack.packb({"v": 1, "op": "heartbeat", "rid": 1, "client_id": None, "token": ""})
        for _ in range(FLOOD_MESSAGES):
            peer.send(frame)
        deadline = time.monotonic() + 60  # the daemon has read them all once it counts them
        while "dropping a reply" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert probe(daemon.socket, "health", 10.0).fields["live"]
    finally:
        peer.close(0)
    lines = [line for line in daemon.log().splitlines() if "dropping a reply" in line]
    assert 1 <= len(lines) <= 3, f"{len(lines)} warning lines for one peer's unread replies"
