"""The quiet gate (server/quiet_gate.py): a call that waits for the whole device is made only while
every GPU it needs is quiet, under their enqueue locks, in order, and never lost.

GPUs are stand-ins here: what makes a GPU quiet is its daemon streams (GpuState.quiet, run by the
GPU suite's twenty-killed-clients test)."""

from __future__ import annotations

import logging
import threading

import pytest
from helpers import wait_until

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

    def quiet(self) -> bool:
        self.looks.append(self.enqueue_lock.locked())
        return self.answers.pop(0) if self.answers else not self.busy

    def make_current(self) -> None:
        self.current += 1


@pytest.fixture
def gpus():
    return {0: FakeGpu(), 1: FakeGpu()}


@pytest.fixture
def gate(gpus):
    gate = QuietGate(gpus)
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


def test_a_call_is_made_under_the_enqueue_lock_after_a_second_look_there(gpus, gate):
    held = []
    gpus[0].answers = [True, False]  # quiet at the first look, busy again once locked
    gate.defer("unregister", lambda: held.append(gpus[0].enqueue_lock.locked()), [0])
    wait_until(lambda: held, timeout=WAIT_S)
    assert held == [True]
    # Made only after a look under the lock said quiet: the first locked look said busy.
    assert gpus[0].looks[:2] == [False, True]
    assert gpus[0].looks.count(True) >= 2
    assert gpus[0].current >= 1  # its context made current first


def test_a_call_of_several_gpus_waits_for_all_and_holds_every_lock(gpus, gate):
    held = []
    gpus[1].busy = True
    gate.defer("the replaced tables", lambda: held.append([g.enqueue_lock.locked() for g in gpus.values()]),
               [1, 0])
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


def test_calls_are_made_in_order_and_a_failing_one_stops_no_other(gpus, gate, caplog):
    made = []
    gpus[0].busy = True

    def fail():
        raise RuntimeError("cudaHostUnregister failed")

    gate.defer("first", lambda: made.append("first"), [0])
    gate.defer("failing", fail, [0])
    gate.defer("third", lambda: made.append("third"), [0])
    with caplog.at_level(logging.ERROR, logger="engramd.cuda"):
        gpus[0].busy = False
        wait_until(lambda: gate.waiting() == [], timeout=WAIT_S)
    assert made == ["first", "third"]
    assert "failing failed" in caplog.text and "cudaHostUnregister failed" in caplog.text


def test_a_busy_gpu_holds_back_only_its_own_calls(gpus, gate):
    made = []
    gpus[0].busy = True
    gate.defer("on gpu 0", lambda: made.append(0), [0])
    gate.defer("on gpu 1", lambda: made.append(1), [1])
    wait_until(lambda: made == [1], timeout=WAIT_S)
    assert gate.waiting() == ["on gpu 0"]


def test_a_call_waiting_long_is_logged_once(gpus, caplog):
    gate = QuietGate(gpus, warn_s=0.0)
    gpus[0].busy = True
    with caplog.at_level(logging.WARNING, logger="engramd.cuda"):
        gate.defer("the counter block", lambda: None, [0])
        wait_until(lambda: "the counter block waits" in caplog.text, timeout=WAIT_S)
        wait_until(lambda: len(gpus[0].looks) >= 5, timeout=WAIT_S)
    gate.close(run_rest=False)
    assert caplog.text.count("the counter block waits") == 1


def test_close_makes_what_waits_when_asked_and_later_calls_at_once(gpus):
    gate = QuietGate(gpus)
    made = []
    gpus[0].busy = True
    gate.defer("left", lambda: made.append(("left", threading.current_thread().name)), [0])
    gate.close(run_rest=True)  # the device is synchronised by then
    assert made == [("left", threading.current_thread().name)]
    gate.defer("after", lambda: made.append(("after", "")), [0])
    assert made[-1] == ("after", "")


def test_close_leaves_what_waits_otherwise_and_says_so(gpus, caplog):
    gate = QuietGate(gpus)
    made = []
    gpus[0].busy = True
    gate.defer("the counter block", lambda: made.append(1), [0])
    with caplog.at_level(logging.ERROR, logger="engramd.cuda"):
        gate.close(run_rest=False)
    assert made == []
    assert "left for the exit" in caplog.text and "the counter block" in caplog.text
