"""The CPU backend's fair queue: pieces handed out client after client, nothing lost."""

from __future__ import annotations

import threading

import pytest

from engramd.server.fair_queue import FairQueue


def test_owners_take_turns_and_each_keeps_its_order():
    queue = FairQueue()
    queue.put("heavy", [f"h{i}" for i in range(4)])
    queue.put("small", ["s0"])
    queue.put("other", ["o0", "o1"])
    queue.put("small", ["s1"])  # back in line behind the others
    got = [queue.get() for _ in range(8)]
    assert got == ["h0", "s0", "o0", "h1", "s1", "o1", "h2", "h3"]


def test_close_hands_out_what_is_left_then_none_and_wakes_waiters():
    queue = FairQueue()
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(queue.get()))
    waiter.start()
    queue.close()
    waiter.join(5)
    assert woke == [None] and not waiter.is_alive()
    with pytest.raises(RuntimeError):
        queue.put("late", [1])
    queue = FairQueue()
    queue.put("a", [1, 2])
    queue.close()
    assert [queue.get(), queue.get(), queue.get()] == [1, 2, None]


def test_drop_takes_out_one_owners_items_and_leaves_the_others_in_turn():
    queue = FairQueue()
    queue.put("gone", ["g0", "g1"])
    queue.put("live", ["l0", "l1"])
    queue.put("other", ["o0"])
    assert queue.drop("gone") == ["g0", "g1"]
    assert queue.drop("gone") == [] and queue.drop("never") == []
    assert [queue.get() for _ in range(3)] == ["l0", "o0", "l1"]
