"""The quiet gate (server/quiet_gate.py): a call that waits for the whole device is made only while
every GPU it needs is quiet, under their locks (taken without waiting), in order, never lost; and
the CUDA backend's lookups are enqueued under the lock the gate takes.

GPUs are stand-ins here: what makes a real GPU quiet is its daemon streams (GpuState.quiet, run by
the GPU suite's twenty-killed-clients test)."""

from __future__ import annotations

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
    look and whether its locks were held then."""

    def __init__(self):
        self.enqueue_lock = threading.Lock()
        self.refresh_lock = threading.Lock()
        self.busy = False
        self.answers: list[bool] = []
        self.looks: list[bool] = []  # both locks held at each look
        self.current = 0

    def queue_locks(self) -> list[threading.Lock]:
        return [self.enqueue_lock, self.refresh_lock]

    def held(self) -> bool:
        return self.enqueue_lock.locked() and self.refresh_lock.locked()

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


def test_a_call_is_made_under_every_lock_of_its_gpu_and_its_then_after_them(gpus, gate):
    held = []
    gate.defer("unregister", lambda: held.append(("call", gpus[0].held())), [0],
               then=lambda: held.append(("then", gpus[0].held())))
    wait_until(lambda: len(held) == 2, timeout=WAIT_S)
    assert held == [("call", True), ("then", False)]
    assert all(gpus[0].looks)  # every look under the locks
    assert gpus[0].current >= 1  # its context made current first


def test_a_gpu_busy_a_moment_is_given_time_under_its_locks(gpus, gate):
    """Its streams finish within the quiesce time while nothing new can be queued: made in
    the same try, not a later one."""
    made = threading.Event()
    gpus[0].enqueue_lock = CountingLock()
    gpus[0].answers = [False, False, True]
    gate.defer("unregister", made.set, [0])
    assert made.wait(WAIT_S)
    assert gpus[0].looks[:3] == [True, True, True]
    assert gpus[0].enqueue_lock.tries == 1  # one hold of the locks


def test_a_lock_held_elsewhere_is_not_waited_for(gpus, gate):
    """A holder of a GPU's lock may itself wait for the device: the gate never blocks on it,
    and lets go of what it took."""
    made = threading.Event()
    gpus[0].refresh_lock = CountingLock()
    with gpus[0].refresh_lock:
        gate.defer("unregister", made.set, [0])
        wait_until(lambda: gpus[0].refresh_lock.tries >= 4, timeout=WAIT_S)  # three tries failed
        assert not made.is_set()
        assert gpus[0].looks == []  # it never looked: it had only part of the locks
        assert gpus[0].enqueue_lock.acquire(timeout=WAIT_S)  # let go of
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
    gate.defer("failing", fail, [0], then=lambda: made.append("then of failing"))
    gate.defer("third", lambda: made.append("third"), [0])
    with caplog.at_level(logging.ERROR, logger="engramd.cuda"):
        release.set()
        wait_until(lambda: gate.waiting() == [] and len(made) == 2, timeout=WAIT_S)
    assert made == ["first", "third"]  # a failed call's `then` is not made
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
    gate.defer("the counter block", lambda: made.append(1), [0])
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
