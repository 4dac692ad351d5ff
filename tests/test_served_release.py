"""The served client's release when its daemon's lease closes (ServedGpu.invalidate), on the
CPU: which lookups fail, in which order their rows are filled and their waits released, and that
every slot is released whatever happens on the way. A slab whose counters are a dict stands in
for the GPU's (the GPU tests run the real one: tests/gpu/test_served_faults_gpu.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from engramd.client.failures import FailedLookups
from engramd.client.served import CudaSlabView, ServedGpu
from engramd.client.shared.slab import FAILED, ROWS_DONE, release_value


class Event:
    def __init__(self, done: bool = True, after: threading.Event | None = None):
        self.done = done
        self.after = after  # done once this is set

    def query(self) -> bool:
        return self.done and (self.after is None or self.after.is_set())


class Slab(CudaSlabView):
    """Counters in a dict; what the release did, in order, in `calls`."""

    def __init__(self, slots: int, fill: str = "ok"):  # no GPU: none of the parent's set-up
        self.layout = SimpleNamespace(slots=slots)
        self.words: dict[tuple[int, int], int] = {}
        self.calls: list[tuple] = []
        self.fill = fill
        self.fill_done: threading.Event | None = None  # set: fills finish when it is set

        self.counters = self  # the parent's written() and failed_seq() read through load()

    def load(self, slot: int, word: int) -> int:
        return self.words.get((slot, word), 0)

    def invalidate(self, slot: int, tokens: int, after) -> Event:
        self.calls.append(("fill", slot, after))
        if self.fill == "raises":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return Event(done=self.fill == "ok", after=self.fill_done)

    def fail(self, slot: int, seq: int) -> None:
        self.calls.append(("fail", slot, seq))
        self.words[(slot, FAILED)] = seq
        self.words[(slot, ROWS_DONE)] = max(seq, self.load(slot, ROWS_DONE))

    def release(self, slot: int, last_seq: int) -> None:
        self.calls.append(("release", slot))
        self.words[(slot, ROWS_DONE)] = release_value(last_seq)


def lookup(seq: int, slot: int, error=None):
    return SimpleNamespace(seq=seq, slot=slot, tokens=4, slots_epoch=1, _error=error, failure=None,
                           submitted=f"submitted {seq}")


def client(slab: Slab, last_seq: int) -> ServedGpu:
    """The served path, over a stand-in for the client with the attributes invalidate reads."""
    served = object.__new__(ServedGpu)
    served._client = SimpleNamespace(_slab=slab, _slots_epoch=1, _failed=FailedLookups(),
                                     _dead="the daemon exited")
    served._invalidating = threading.Lock()
    served.last_seq = last_seq
    return served


def invalidate(fake: ServedGpu, lookups) -> None:
    fake.invalidate(lookups)


def test_unwritten_lookups_fail_in_seq_order_each_filled_after_its_own_submission():
    """Slot 0 holds lookups 1 (written) and 3 and 5 (not), slot 1 lookup 4 (not): each unwritten
    one is filled once its stream handed its IDs over (after the slot's earlier readers), then its
    waits pass, up to its seq only, before the next one's fill; then every slot is released."""
    slab = Slab(slots=2)
    slab.words[(0, ROWS_DONE)] = 1
    fake = client(slab, last_seq=5)
    lookups = [lookup(5, 0), lookup(1, 0), lookup(4, 1), lookup(3, 0)]
    invalidate(fake, lookups)
    assert slab.calls == [("fill", 0, "submitted 3"), ("fail", 0, 3),
                          ("fill", 1, "submitted 4"), ("fail", 1, 4),
                          ("fill", 0, "submitted 5"), ("fail", 0, 5),
                          ("release", 0), ("release", 1)]
    assert [x.failure is not None for x in lookups] == [True, False, True, True]
    with pytest.raises(Exception, match=r"seq 3, 4, 5 "):
        fake._client._failed.raise_unreported()


def test_a_fill_that_fails_still_fails_its_lookup_and_releases_every_slot():
    slab = Slab(slots=3, fill="raises")
    fake = client(slab, last_seq=2)
    lost = lookup(2, 1)
    invalidate(fake, [lost])
    assert lost.failure is not None
    assert slab.calls == [("fill", 1, "submitted 2"), ("fail", 1, 2),
                          ("release", 0), ("release", 1), ("release", 2)]


def test_a_fill_that_does_not_finish_in_time_releases_all_the_same(monkeypatch):
    monkeypatch.setattr("engramd.client.served.RELEASE_DEADLINE_S", 0.05)
    slab = Slab(slots=1, fill="never")
    invalidate(client(slab, last_seq=1), [lookup(1, 0)])
    assert slab.calls == [("fill", 0, "submitted 1"), ("fail", 0, 1), ("release", 0)]


def test_a_second_release_neither_fails_nor_fills_again():
    """The client's disconnect releases again what its watchdog released: the lookup failed and
    reported once stays reported, and its rows are not filled twice."""
    slab = Slab(slots=1)
    fake = client(slab, last_seq=1)
    lost = lookup(1, 0)
    invalidate(fake, [lost])
    with pytest.raises(Exception, match="seq 1 "):
        fake._client._failed.raise_unreported()
    slab.calls.clear()
    invalidate(fake, [lost])
    assert slab.calls == [("release", 0)]
    fake._client._failed.raise_unreported()  # nothing new


def test_a_refused_lookup_the_daemon_filled_is_not_filled_again_but_its_slot_is_released():
    """The daemon fills a refused lookup's rows itself, on its stream, and marks it FAILED."""
    slab = Slab(slots=2)
    slab.words[(1, FAILED)] = slab.words[(1, ROWS_DONE)] = 3
    refused = lookup(3, 1, error=RuntimeError("tables changed"))
    invalidate(client(slab, last_seq=3), [refused])
    assert slab.calls == [("release", 0), ("release", 1)]


def test_a_refused_lookup_whose_fill_the_daemons_death_cut_is_filled_but_not_reported_twice():
    """The refusal's reply precedes the daemon's fill: a daemon that died in between left the
    slot's old rows, which the release must not hand to readers. The lookup raises its own error,
    so the next call does not report it again."""
    slab = Slab(slots=2)
    fake = client(slab, last_seq=3)
    refused = lookup(3, 1, error=RuntimeError("tables changed"))
    invalidate(fake, [refused])
    assert slab.calls == [("fill", 1, "submitted 3"), ("fail", 1, 3), ("release", 0), ("release", 1)]
    fake._client._failed.raise_unreported()  # nothing: its own error is what its caller sees
    slab.calls.clear()
    invalidate(fake, [refused])
    assert slab.calls == [("release", 0), ("release", 1)]


def test_a_lookup_that_finds_the_daemon_gone_waits_for_the_watchdogs_release():
    """The watchdog fails lookup 40 (slot 0; its fill still running) while a lookup thread sends
    41 on the same slot, finds the daemon gone and fails every unsettled lookup. Had the second
    release run beside the first, fail(41) would pass 40's waits before 40's NaN, and 40's
    consumer would read the slot's old rows: the releases run one after the other."""
    slab = Slab(slots=1)
    slab.fill_done = threading.Event()
    fake = client(slab, last_seq=41)
    first, second = lookup(40, 0), lookup(41, 0)
    watchdog = threading.Thread(target=invalidate, args=(fake, [first]))
    watchdog.start()
    deadline = time.monotonic() + 10
    while ("fill", 0, "submitted 40") not in slab.calls and time.monotonic() < deadline:
        time.sleep(0.001)
    lookup_thread = threading.Thread(target=invalidate, args=(fake, [first, second]))
    lookup_thread.start()
    time.sleep(0.05)  # room for the lookup thread to run ahead, if nothing holds it
    slab.fill_done.set()
    watchdog.join(10)
    lookup_thread.join(10)
    assert slab.calls == [("fill", 0, "submitted 40"), ("fail", 0, 40), ("release", 0),
                          ("fill", 0, "submitted 41"), ("fail", 0, 41), ("release", 0)]


def stopping_client(slab: Slab, unsettled, lease_open: bool = True):
    """The attributes await_stopping_daemon and settle read: a daemon that said "stopping"."""
    fake = client(slab, last_seq=max(x.seq for x in unsettled))
    fake._client._dead = None
    fake._client._conn = SimpleNamespace(notice="stopping")
    fake.unsettled = list(unsettled)
    fake._client._watchdog = SimpleNamespace(
        lease_gone=lambda: None if lease_open else "the daemon closed this client's lease")
    fake.daemon_failed = lambda future: slab.load(future.slot, FAILED) == future.seq
    return fake


def test_a_stopping_daemons_rows_on_their_way_are_awaited_not_failed():
    """A drain: the daemon writes the rows of the lookups it took, then closes its leases. A
    client that heard "stopping" and re-registers first waits for those rows, so its release
    fails none of them."""
    slab = Slab(slots=2)
    lookups = [lookup(1, 0), lookup(2, 1)]
    fake = stopping_client(slab, lookups)

    def gathers_finish() -> None:
        time.sleep(0.05)
        slab.words[(0, ROWS_DONE)], slab.words[(1, ROWS_DONE)] = 1, 2

    writer = threading.Thread(target=gathers_finish)
    writer.start()
    fake.await_stopping_daemon()
    writer.join()
    assert fake.unsettled == []
    invalidate(fake, lookups)
    assert [x.failure for x in lookups] == [None, None]
    assert slab.calls == [("release", 0), ("release", 1)]


def test_a_stopping_daemon_that_closed_the_lease_is_not_awaited():
    """The lookups it never got will not be written: once the lease is closed they fail at once."""
    slab = Slab(slots=1)
    lost = lookup(1, 0)
    fake = stopping_client(slab, [lost], lease_open=False)
    looks = []
    fake.settle = lambda: looks.append(1) or [lost]  # a wait would look at the counters again
    fake.await_stopping_daemon()
    assert looks == []
    invalidate(fake, [lost])
    assert lost.failure is not None
