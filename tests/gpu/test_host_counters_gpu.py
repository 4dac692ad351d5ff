"""Completion counters in pinned host memory (client/shared/host_counters.py): GPU writes land where
the other process's mapping reads them, and a CPU store releases a stream wait whatever the GPU's
hardware queues hold."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engramd.client.shared import cuda
from engramd.client.shared.host_counters import HostCounters
from engramd.client.shared.slab import FAILED, IDS_READY, ROWS_DONE, SlabLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def layout(slots: int) -> SlabLayout:
    return SlabLayout(slots=slots, max_tokens=1, n_layers=1, heads=1, local_heads=1, head_dim=1)


def finished(event: torch.cuda.Event, timeout: float) -> bool:
    """Whether the event completes within `timeout` s (polled: a test must not hang)."""
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def test_both_mappings_see_gpu_writes_and_a_cpu_store_releases_a_wait():
    daemon_side = HostCounters.create(layout(4), "engramd-test-counters", 0)
    fd = daemon_side.descriptor()
    try:
        client_side = HostCounters(fd, layout(4), 0)  # a second mapping and registration, as a client's
    finally:
        os.close(fd)
    stream = cuda.new_stream(0)
    try:
        assert [daemon_side.load(s, w) for s in range(4) for w in (IDS_READY, ROWS_DONE, FAILED)] == [0] * 12
        cuda.stream_write_u32(stream.cuda_stream, client_side.address(1, IDS_READY), 7)
        cuda.stream_write_u32(stream.cuda_stream, daemon_side.address(3, FAILED), 0xFFFFFFFF)
        stream.synchronize()
        assert daemon_side.load(1, IDS_READY) == 7 and client_side.load(3, FAILED) == 0xFFFFFFFF
        assert daemon_side.load(1, ROWS_DONE) == 0  # the words are apart

        cuda.stream_wait_u32(stream.cuda_stream, client_side.address(2, ROWS_DONE), 5)
        waited = recorded(stream)
        assert not finished(waited, 0.2), "the wait passed before its counter was set"
        daemon_side.store(2, ROWS_DONE, 4)
        assert not finished(waited, 0.2), "a wait for 5 passed at 4"
        daemon_side.store(2, ROWS_DONE, 5)
        assert finished(waited, 10.0), "a CPU store did not release the stream's wait"
    finally:
        torch.cuda.synchronize()
        cuda.STREAMS.give(stream)
        client_side.close()
        daemon_side.close()


def test_cpu_stores_release_waits_when_every_hardware_queue_holds_one():
    """More waiting streams than the device has hardware queues (CUDA_DEVICE_MAX_CONNECTIONS,
    at most 32): every queue then holds a wait at its head, and so does any new stream's. A
    release the GPU would have to write waits behind one of them; the CPU's stores release
    all of them, and the late stream's write then runs too."""
    waiting = 48
    counters = HostCounters.create(layout(waiting + 1), "engramd-test-counters", 0)
    streams = [cuda.new_stream(0) for _ in range(waiting)]
    late = cuda.new_stream(0)
    try:
        for slot, stream in enumerate(streams):
            cuda.stream_wait_u32(stream.cuda_stream, counters.address(slot, IDS_READY), 1)
        waits = [recorded(s) for s in streams]
        cuda.stream_write_u32(late.cuda_stream, counters.address(waiting, ROWS_DONE), 1)
        late_write = recorded(late)
        ran_alone = finished(late_write, 1.0)
        assert not any(w.query() for w in waits)
        for slot in range(waiting):
            counters.store(slot, IDS_READY, 1)
        assert all(finished(w, 10.0) for w in waits), "CPU stores did not release every wait"
        assert finished(late_write, 10.0) and counters.load(waiting, ROWS_DONE) == 1
        print(f"a GPU write on a new stream, while {waiting} streams waited: "
              f"{'ran' if ran_alone else 'held up until the CPU released them'}")
    finally:
        torch.cuda.synchronize()
        for stream in [*streams, late]:
            cuda.STREAMS.give(stream)
        counters.close()
