"""A mapped GPU client's gather, queued after its lookup (EngramClient gather_at="wait"): the
ordering between the thread that queues it and the one that waits for it, and the errors a wait
raises, with stand-ins for CUDA's streams and events (the real ones: tests/gpu/test_cuda_daemon.py).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from engramd.client import DaemonUnavailableError
from engramd.client.errors import InternalError
from engramd.client.future import LookupFuture
from engramd.client.mapped_path import MappedPath
from engramd.client.shared.mapped import DeferredGather


class Event:
    def __init__(self) -> None:
        self.recorded = False

    def record(self, stream: Stream) -> None:
        self.recorded = True


class Stream:
    def __init__(self) -> None:
        self.waits: list[bool] = []  # per wait_event: was the event recorded by then?

    def wait_event(self, event: Event) -> None:
        self.waits.append(event.recorded)


class Ids:
    def record_stream(self, stream: Stream) -> None:
        pass


def path_with_one_lookup(gather) -> tuple[MappedPath, LookupFuture]:
    """A mapped path over a stand-in for the client with only what queueing and waiting touch
    (its device and lock), and one lookup whose gather waits to be queued."""
    path = MappedPath(SimpleNamespace(device=torch.device("cpu"), _tables_lock=threading.RLock()))
    path.side = Stream()
    path.gather = gather
    future = object.__new__(LookupFuture)
    future.consumers, future.event, future._error, future.tokens = [], Event(), None, 16
    future.deferred = DeferredGather(Ids(), None, [Event()], None)
    path.unqueued = future
    return path, future


def test_a_wait_on_another_thread_while_the_gather_is_queued_waits_for_its_event():
    """The watch thread (a reload's switch) queues the gather, whose launch lets go of the GIL;
    the engine's wait() meanwhile must not make its stream wait on an event not recorded yet
    (CUDA takes that as no wait at all: the rows would be read before they are written)."""
    started = threading.Event()

    def slow_gather(ids, out, side, sm_fraction):
        started.set()
        time.sleep(0.05)

    path, future = path_with_one_lookup(slow_gather)

    def queue_on_the_watch_thread():
        with path._client._tables_lock:
            path.queue_gather()

    watch = threading.Thread(target=queue_on_the_watch_thread)
    watch.start()
    assert started.wait(5.0)
    engine = Stream()
    path.stream_wait(future, engine)
    watch.join()
    assert engine.waits == [True] and future.deferred is None and future.consumers == [engine]


def test_a_gather_that_fails_is_raised_by_its_own_wait_and_a_dropped_one_says_so():
    def failing_gather(ids, out, side, sm_fraction):
        raise RuntimeError("CUDA out of memory")

    path, future = path_with_one_lookup(failing_gather)
    path.queue_gather()  # as the next lookup would: it must not raise there
    with pytest.raises(InternalError, match="gather of a lookup of 16 tokens failed: CUDA out of memory"):
        path.stream_wait(future, Stream())

    path, future = path_with_one_lookup(lambda *args: None)
    path.unqueued = None  # what close() does while the daemon is gone (unmap)
    engine = Stream()
    with pytest.raises(DaemonUnavailableError, match="gather was dropped"):
        path.stream_wait(future, engine)
    assert engine.waits == []
