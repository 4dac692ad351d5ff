"""Warnings a peer can provoke at will (server/throttle.py): once per interval per key, and no more
lines per interval over all keys than a ThrottledBy's `most`, whatever the number of keys."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from engramd.server import throttle


@pytest.fixture
def clock(monkeypatch):
    """The throttle's monotonic clock, set by the test."""
    now = [1000.0]
    monkeypatch.setattr(throttle, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def said(caplog) -> list[str]:
    lines = [record.getMessage() for record in caplog.records]
    caplog.clear()
    return lines


def test_each_key_is_said_once_per_interval_and_counts_what_it_held(clock, caplog):
    caplog.set_level(logging.INFO)
    by = throttle.ThrottledBy(logging.getLogger("t"), interval=10.0)
    for _ in range(3):
        by["a"].warning("drop %s", "a")
    by["b"].warning("drop %s", "b")
    assert said(caplog) == ["drop a", "drop b"]  # b is not hidden by a
    clock[0] += 10.0
    by["a"].warning("drop %s", "a")
    assert said(caplog) == ["drop a (2 more like it in the last 10 s)"]


def test_most_bounds_the_lines_of_all_keys_and_counts_what_it_held_back(clock, caplog):
    caplog.set_level(logging.INFO)
    by = throttle.ThrottledBy(logging.getLogger("t"), interval=10.0, most=2)
    for pid in range(50):  # a peer making new keys at will (a process each)
        by[pid].warning("drop %d", pid)
    assert said(caplog) == ["drop 0", "drop 1"]
    clock[0] += 4.0
    by[7].warning("drop %d", 7)  # its key said nothing yet, but the interval's lines are spent
    assert said(caplog) == []
    clock[0] += 6.0
    by[7].warning("drop %d", 7)  # 48 keys that may never speak again were held back, and 7 once
    assert said(caplog) == ["drop 7 (2 more like it in the last 10 s) (49 lines of any key held "
                            "back by the bound of 2 in 10 s, in the last 10 s)"]
