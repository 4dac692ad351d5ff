"""Work of many clients, handed out one piece at a time, client after client.

The CPU backend splits each lookup into pieces of a few hundred tokens and queues them per
client; its workers take the next piece of the next client in turn. A client that floods the
daemon with large lookups then delays another client's small one by about one piece per worker,
not by its whole backlog (measured: a 64-token lookup's p99 went from 5 ms to 427 ms beside a
client looking up 4,096 tokens back to back, benchmarks/floods.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from typing import Any


class FairQueue:
    def __init__(self) -> None:
        self._queues: OrderedDict[Hashable, deque[Any]] = OrderedDict()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, owner: Hashable, items: Iterable[Any]) -> None:
        items = list(items)
        with self._ready:
            if self._closed:
                raise RuntimeError("the queue is closed")
            self._queues.setdefault(owner, deque()).extend(items)
            self._ready.notify(len(items))

    def get(self) -> Any | None:
        """The next owner's next item (waits for one); None once closed and empty."""
        with self._ready:
            while not self._queues:
                if self._closed:
                    return None
                self._ready.wait()
            owner, queue = self._queues.popitem(last=False)
            item = queue.popleft()
            if queue:
                self._queues[owner] = queue  # to the back of the line
            return item

    def drop(self, owner: Hashable) -> list[Any]:
        """Take out every item of `owner` not yet handed out, in order."""
        with self._ready:
            return list(self._queues.pop(owner, ()))

    def close(self) -> None:
        """No more puts; get() returns what is left, then None."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
