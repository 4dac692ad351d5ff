"""The quiet gate (server/quiet_gate.py): a call that waits for the whole device is made only while
every GPU it needs is quiet, under their locks (taken without waiting), in order, never lost; and
what feeds it: the CUDA backend's lookups enqueued under the lock the gate takes, its view of a
GPU's streams, tables never served and a reload's failed pin handed to it.

GPUs are stand-ins here: what makes a real GPU quiet is its daemon streams (GpuState.quiet, run by
the GPU suite's twenty-killed-clients test)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from types import SimpleNamespace

import pytest
from helpers import wait_until

from engramd.server import cuda_backend
from engramd.server.quiet_gate import QuietGate

WAIT_S = 30.0  # generous: CI runs beside other work


class FakeGpu:
    """quiet() says `busy`'s opposite, unless `answers` holds scripted replies; it records each
    look and whether the enqueue lock was held then."""

    def __init__(self):
        self.enqueue_lock = threading.Lock()
        self.busy = False
        self.answers: list[bool] = []
        self.looks: list[bool] = []  # the lock held at each look
        self.current = 0

    def held(self) -> bool:
        return self.enqueue_lock.locked()

    def quiet(self) -> bool:
        self.looks.append(self.held())
        return self.answers.pop(0) if self.answers else not self.busy

    def make_current(self) -> None:
        self.current += 1


class CountingLock:
    """A lock that counts the tries to take it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.tries = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.tries += 1
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


@pytest.fixture
def gpus():
    return {0: FakeGpu(), 1: FakeGpu()}


@pytest.fixture
def gate(gpus):
    gate = QuietGate(gpus, quiesce_s=0.002)
    yield gate
    gate.close(run_rest=False)


def test_a_call_waits_while_its_gpu_is_busy_and_is_made_once_it_is_quiet(gpus, gate):
    made = threading.Event()
    gpus[0].busy = True
    gate.defer("unregister", made.set, [0])
    wait_until(lambda: len(gpus[0].looks) >= 3, timeout=WAIT_S)  # it looked, and held back
    assert not made.is_set()
    assert gate.waiting() == ["unregister"]
    gpus[0].busy = False
    assert made.wait(WAIT_S)
    wait_until(lambda: gate.waiting() == [], timeout=WAIT_S)


def test_a_call_is_made_under_the_lock_of_its_gpu_and_what_follows_without_it(gpus, gate):
    held = []
    gate.defer("unregister", lambda: held.append(("call", gpus[0].held())), [0],
               then=lambda: held.append(("then", gpus[0].held())),
               after=lambda: held.append(("after", gpus[0].held())))
    wait_until(lambda: len(held) == 3, timeout=WAIT_S)
    assert held == [("call", True), ("then", False), ("after", False)]
    assert all(gpus[0].looks)  # every look under the locks
    assert gpus[0].current >= 1  # its context made current first


def test_a_gpu_busy_a_moment_is_given_time_under_its_lock(gpus):
    """Its streams finish within the hold while nothing new can be enqueued: made in the same
    try, not a later one (a hold long enough that the clock cannot decide it)."""
    gate = QuietGate(gpus, quiesce_s=WAIT_S)
    made = threading.Event()
    gpus[0].enqueue_lock = CountingLock()
    gpus[0].answers = [False, False, True]
    gate.defer("unregister", made.set, [0])
    assert made.wait(WAIT_S)
    gate.close(run_rest=False)
    assert gpus[0].looks[:3] == [True, True, True]
    assert gpus[0].enqueue_lock.tries == 1  # one hold of the lock


def test_a_lock_held_elsewhere_is_not_waited_for(gpus, gate):
    """A holder of a GPU's lock may itself wait for the device: the gate never blocks on it,
    and lets go of the locks it took."""
    made = threading.Event()
    gpus[1].enqueue_lock = CountingLock()
    with gpus[1].enqueue_lock:
        gate.defer("on both", made.set)
        wait_until(lambda: gpus[1].enqueue_lock.tries >= 4, timeout=WAIT_S)  # three tries failed
        assert not made.is_set()
        assert gpus[0].looks == [] and gpus[1].looks == []  # it never looked
        assert gpus[0].enqueue_lock.acquire(timeout=WAIT_S)  # GPU 0's let go of
        gpus[0].enqueue_lock.release()
    assert made.wait(WAIT_S)


def test_a_call_of_several_gpus_waits_for_all_and_holds_every_lock(gpus, gate):
    held = []
    gpus[1].busy = True
    gate.defer("the replaced tables", lambda: held.append([g.held() for g in gpus.values()]))
    wait_until(lambda: len(gpus[1].looks) >= 3, timeout=WAIT_S)
    assert held == []
    gpus[1].busy = False
    wait_until(lambda: held, timeout=WAIT_S)
    assert held == [[True, True]]


def test_an_enqueue_waits_for_a_call_in_progress(gpus, gate):
    inside, release = threading.Event(), threading.Event()

    def unregister():
        inside.set()
        release.wait(WAIT_S)

    gate.defer("unregister", unregister, [0])
    assert inside.wait(WAIT_S)
    enqueued = threading.Event()

    def enqueue():
        with gpus[0].enqueue_lock:
            enqueued.set()

    threading.Thread(target=enqueue, daemon=True).start()
    assert not enqueued.wait(0.2)  # held: the lock is the gate's until the call returns
    release.set()
    assert enqueued.wait(WAIT_S)


def test_calls_of_a_gpu_are_made_in_order_and_a_failing_one_stops_no_other(gpus, gate, caplog):
    made, first_in, release = [], threading.Event(), threading.Event()

    def first():
        first_in.set()
        release.wait(WAIT_S)
        made.append("first")

    def fail():
        raise RuntimeError("cudaHostUnregister failed")

    gate.defer("first", first, [0])
    assert first_in.wait(WAIT_S)  # the rest are queued while it runs
    gate.defer("failing", fail, [0], then=lambda: made.append("then of failing"),
               after=lambda: made.append("after failing"))
    gate.defer("third", lambda: made.append("third"), [0])
    with caplog.at_level(logging.ERROR, logger="engramd.cuda"):
        release.set()
        wait_until(lambda: gate.waiting() == [] and len(made) == 3, timeout=WAIT_S)
    # A failed call's `then` (what needs it done) is not made; its `after` is.
    assert made == ["first", "after failing", "third"]
    assert "failing failed" in caplog.text and "cudaHostUnregister failed" in caplog.text


def test_a_busy_gpu_holds_back_only_its_own_calls(gpus, gate):
    made = []
    gpus[0].busy = True
    gate.defer("on gpu 0", lambda: made.append(0), [0])
    gate.defer("on gpu 1", lambda: made.append(1), [1])
    wait_until(lambda: made == [1] and gate.waiting() == ["on gpu 0"], timeout=WAIT_S)


def test_a_call_waits_for_an_earlier_one_of_its_gpus(gpus, gate):
    made = []
    gpus[0].busy = True
    gate.defer("on both", lambda: made.append("both"))
    gate.defer("on gpu 1 after it", lambda: made.append(1), [1])
    wait_until(lambda: len(gpus[0].looks) >= 3, timeout=WAIT_S)
    assert made == []
    gpus[0].busy = False
    wait_until(lambda: made == ["both", 1], timeout=WAIT_S)


def test_a_broken_gpu_is_never_quiet_and_the_gate_goes_on(gpus, gate, caplog):
    made = []

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    gpus[0].quiet = broken
    with caplog.at_level(logging.ERROR, logger="engramd.cuda"):
        gate.defer("on gpu 0", lambda: made.append(0), [0])
        gate.defer("on gpu 1", lambda: made.append(1), [1])
        wait_until(lambda: made == [1], timeout=WAIT_S)
    assert gate.waiting() == ["on gpu 0"]
    assert "illegal memory access" in caplog.text


def test_a_call_waiting_long_is_logged_once(gpus, caplog):
    gate = QuietGate(gpus, warn_s=0.0, quiesce_s=0.001)
    gpus[0].busy = True
    with caplog.at_level(logging.WARNING, logger="engramd.cuda"):
        gate.defer("the counter block", lambda: None, [0])
        wait_until(lambda: "the counter block waits" in caplog.text, timeout=WAIT_S)
        wait_until(lambda: len(gpus[0].looks) >= 5, timeout=WAIT_S)
    gate.close(run_rest=False)
    assert caplog.text.count("the counter block waits") == 1


def test_close_makes_what_waits_when_the_device_is_synchronised_and_later_calls_at_once(gpus):
    gate = QuietGate(gpus)
    made = []
    gpus[0].busy = True
    gate.defer("left", lambda: made.append(("left", threading.current_thread().name)), [0],
               then=lambda: made.append(("then", "")))
    gate.close(run_rest=True)
    assert made == [("left", threading.current_thread().name), ("then", "")]
    gate.defer("after", lambda: made.append(("after", "")), [0])
    assert made[-1] == ("after", "")


def test_close_otherwise_leaves_what_waits_and_what_comes_later_and_says_so(gpus, caplog):
    gate = QuietGate(gpus)
    made = []
    gpus[0].busy = True
    gate.defer("the counter block", lambda: made.append(1), [0], after=lambda: made.append("after"))
    with caplog.at_level(logging.ERROR, logger="engramd.cuda"):
        gate.close(run_rest=False)
        gate.defer("a late one", lambda: made.append(2), [0])  # a stuck stream may still wait
    assert made == []
    assert "left for the exit" in caplog.text
    assert "the counter block" in caplog.text and "a late one" in caplog.text


def test_a_call_cannot_close_its_own_gate(gpus, gate, caplog):
    with caplog.at_level(logging.ERROR, logger="engramd.cuda"):
        gate.defer("closing", lambda: gate.close(run_rest=False), [0])
        wait_until(lambda: "cannot be closed from one of its own calls" in caplog.text, timeout=WAIT_S)
    gate.defer("after it", lambda: None, [0])
    wait_until(lambda: gate.waiting() == [], timeout=WAIT_S)  # the gate still runs


def test_a_lookup_is_enqueued_under_the_lock_the_gate_takes(monkeypatch):
    """The CUDA backend's run_job: what the gate's hold keeps out (inline and worker dispatch
    both come through it)."""
    gpu = SimpleNamespace(enqueue_lock=threading.Lock())
    seen = []
    monkeypatch.setattr(cuda_backend, "enqueue_lookup", lambda job: seen.append(gpu.enqueue_lock.locked()))
    job = SimpleNamespace(slab=SimpleNamespace(gpu=gpu), context=SimpleNamespace(enqueued=None),
                          error=None)
    done = []
    cuda_backend.run_job(job, done.append)
    assert seen == [True] and done == [job] and not gpu.enqueue_lock.locked()


class FakeStream:
    def __init__(self, idle: bool = True):
        self.idle = idle

    def query(self) -> bool:
        return self.idle


class FakeSlab:  # hashable, as a CudaSlab
    def __init__(self):
        self.stream = FakeStream()


def fake_gpu_state(monkeypatch) -> cuda_backend.GpuState:
    """A GpuState with nothing but what quiet() and the slab hand-over read; streams are
    stand-ins (torch.cuda.device is a no-op here)."""
    monkeypatch.setattr(cuda_backend.torch.cuda, "device", lambda index: contextlib.nullcontext())
    gpu = cuda_backend.GpuState.__new__(cuda_backend.GpuState)
    gpu.index, gpu._freed_lock = 0, threading.Lock()
    gpu.slabs, gpu._draining, gpu.stuck = set(), set(), set()
    gpu.count_stream, gpu.keeper = FakeStream(), None
    return gpu


def test_a_gpu_is_quiet_only_when_every_daemon_stream_of_it_is_idle(monkeypatch):
    gpu = fake_gpu_state(monkeypatch)
    live, closed, stuck = (FakeSlab() for _ in range(3))
    gpu.add_slab(live)
    gpu.add_slab(closed)
    gpu.retire_slab(closed)  # live to draining in one step
    assert closed in gpu._draining and closed not in gpu.slabs
    gpu.stuck.add(stuck)
    gpu.keeper = SimpleNamespace(stream=FakeStream())
    assert gpu.quiet()
    for busy in (live.stream, closed.stream, stuck.stream, gpu.count_stream, gpu.keeper.stream):
        busy.idle = False
        assert not gpu.quiet()
        busy.idle = True


def test_tables_never_served_are_unpinned_through_the_gate_and_let_go_after(monkeypatch):
    deferred = []
    backend = cuda_backend.CudaBackend.__new__(cuda_backend.CudaBackend)
    backend.gate = SimpleNamespace(defer=lambda what, call, then=None, after=None: deferred.append(
        (call, then, after)))
    registration = SimpleNamespace(unregister=lambda: None, close=lambda: None)
    let_go = []
    backend.unpin(registration, lambda: let_go.append(1))
    assert deferred == [(registration.unregister, registration.close, deferred[0][2])]
    assert let_go == []  # not before the unregister
    deferred[0][2]()
    assert let_go == [1]
    backend.unpin(None, lambda: let_go.append(2))  # nothing pinned: at once
    assert let_go == [1, 2]


def test_a_reload_that_will_not_switch_leaves_the_store_at_once_and_unpins_later():
    from engramd.server.reload import NextTables

    events = []
    store = SimpleNamespace(detach_next=lambda: events.append("detached") or [
        SimpleNamespace(close=lambda: events.append("table closed"))])
    unpins = []
    registration = object()
    tables = NextTables(None, store, [], registration,
                        unpin=lambda reg, let_go: unpins.append((reg, let_go)))
    tables.close()
    assert events == ["detached"] and unpins[0][0] is registration
    unpins[0][1]()  # the backend's let-go, once it has unregistered
    assert events == ["detached", "table closed"]


def test_a_pin_that_fails_partway_hands_what_it_registered_to_unregister_later(monkeypatch):
    """A serving daemon's reload pins beside the served tables: a failure there must not
    unregister (it waits for the device) on the pinning thread, but hand the parts over."""
    from engramd.client.shared import host_pin

    unregistered, registered = [], []

    def register(part, flags, device):
        if registered:
            raise host_pin.CudaError("cudaHostRegister: out of memory")
        registered.append(part[0])
        return part[0]

    monkeypatch.setattr(host_pin, "require_cuda_python", lambda: None)
    monkeypatch.setattr(host_pin, "read_only_supported", lambda: False)
    monkeypatch.setattr(host_pin, "_register", register)
    monkeypatch.setattr(host_pin, "cudart", SimpleNamespace(
        cudaHostRegisterPortable=1, cudaHostRegisterMapped=2,
        cudaHostUnregister=lambda address: (unregistered.append(address) or 0,)))
    monkeypatch.setattr(host_pin, "check", lambda what, result: None)
    memory = ctypes.create_string_buffer(2 * host_pin.PART_ALIGN)
    start = ctypes.addressof(memory)
    ranges = [(start, host_pin.PART_ALIGN), (start + host_pin.PART_ALIGN, host_pin.PART_ALIGN)]

    handed = []
    with pytest.raises(host_pin.CudaError, match="out of memory"):
        host_pin.HostRegistration(ranges, workers=1, unregister_later=handed.append)
    assert len(handed) == 1 and unregistered == []  # nothing unregistered on this thread
    handed[0].unregister()
    assert unregistered == registered

    registered.clear()
    unregistered.clear()
    with pytest.raises(host_pin.CudaError, match="out of memory"):
        host_pin.HostRegistration(ranges, workers=1)  # no one to hand it to: unregistered here
    assert unregistered == registered and registered
