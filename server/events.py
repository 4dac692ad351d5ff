"""The loop's event queue: work other threads hand to the daemon's loop, and the pipe that wakes it.

ZeroMQ sockets are not thread-safe, so what happens on another thread (a gather's completion,
the tables loaded, a signal, a handle-socket request, a reload's end) is posted here and run on
the loop's thread (Daemon._run_events). Posting is safe from any thread and from signal
handlers. Not the dispatch: which handler runs each kind of event is the daemon's.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class Event:
    kind: str  # "done" | "loaded" | "load_failed" | "signal" | "attach" | "refused" | ...
    value: Any


class EventQueue:
    def __init__(self) -> None:
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.RLock()  # post() may race close(); signal handlers post too
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)  # an empty pipe must never stop the loop

    @property
    def fd(self) -> int:
        """The wake pipe's read end, for the loop's poller: readable once an event is posted."""
        return self._wake_r

    def post(self, kind: str, value: Any = None) -> None:
        self._events.put(Event(kind, value))
        with self._wake_lock:
            if self._wake_w < 0:
                return  # closed: the loop is gone, nobody will read it
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:
                pass  # the pipe is full, so the loop is already due to wake

    def empty(self) -> bool:
        return self._events.empty()

    def get_nowait(self) -> Event:
        """The next event; queue.Empty if there is none."""
        return self._events.get_nowait()

    def clear_wake(self) -> None:
        """Once the poller saw the wake pipe readable: empty it (the events are read apart)."""
        try:
            while os.read(self._wake_r, 4096):  # non-blocking: BlockingIOError once empty
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1
