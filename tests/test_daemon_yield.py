"""The request loop makes room for CPU gathers: while they run it pauses, GIL released, after
every EVENTS_EVERY requests it reads (Daemon._drain_socket), and never pauses otherwise; and it
counts the connections the monitor reported as often."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import zmq

from engramd.server import daemon as daemon_module
from engramd.server.daemon import DRAIN_BATCH, EVENTS_EVERY, YIELD_S, Daemon


class Service:
    def __init__(self, gathering: bool):
        self.busy = gathering

    def gathering(self) -> bool:
        return self.busy


class Connections:
    """The request socket's connections (server/connections.py): how often the loop looked."""

    def __init__(self):
        self.looked = 0

    def events(self) -> None:
        self.looked += 1


def loop_reading(requests: int, gathering: bool) -> Daemon:
    """A daemon's request-reading state alone: `requests` waiting, then an empty socket."""
    loop = object.__new__(Daemon)
    loop._socket = SimpleNamespace(connections=Connections())
    loop.service = Service(gathering)
    loop._events = queue.SimpleQueue()
    loop._halt = None
    waiting = iter(range(requests))

    def recv() -> list[bytes]:
        if next(waiting, None) is None:
            raise zmq.Again()
        return [b"peer", b"request"]

    loop._recv_request = recv
    loop.handled = 0

    def handle(frames: list[bytes], received: float) -> None:
        loop.handled += 1

    loop._handle = handle
    return loop


@pytest.mark.parametrize("gathering", [True, False])
def test_the_loop_pauses_between_request_batches_only_while_gathers_run(monkeypatch, gathering):
    pauses: list[float] = []
    monkeypatch.setattr(daemon_module.time, "sleep", pauses.append)
    requests = 5 * EVENTS_EVERY + 3
    loop = loop_reading(requests, gathering)
    loop._drain_socket()
    assert loop.handled == requests
    assert pauses == ([YIELD_S] * 5 if gathering else [])
    assert loop._socket.connections.looked == 5, "a flood's reconnections are cut between batches"


def test_a_batch_still_ends_at_drain_batch_requests(monkeypatch):
    monkeypatch.setattr(daemon_module.time, "sleep", lambda seconds: None)
    loop = loop_reading(DRAIN_BATCH + 10, gathering=True)
    loop._drain_socket()
    assert loop.handled == DRAIN_BATCH


def test_completions_are_answered_after_the_pause_and_a_halt_ends_the_batch(monkeypatch):
    order: list[str] = []
    monkeypatch.setattr(daemon_module.time, "sleep", lambda seconds: order.append("pause"))
    loop = loop_reading(3 * EVENTS_EVERY, gathering=True)
    loop._events.put("a finished lookup")

    def run_events() -> None:
        while not loop._events.empty():
            loop._events.get()
            order.append("answered")
        loop._halt = "stop"  # as a stop request among the events would

    loop._run_events = run_events
    loop._drain_socket()
    assert order == ["pause", "answered"]  # and nothing read or paused after the halt
    assert loop.handled == EVENTS_EVERY
