"""Warnings a peer can provoke at will, said at most once per interval.

A flood of bad or unread messages must not become a flood of log lines (300,000 unread replies
once wrote 186,715 warnings, 17 MB in 10 s): each call site gets a Throttled logger that says its
warning once per interval and counts the ones it kept back, so nothing goes unreported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

INTERVAL_S = 10.0


class Throttled:
    def __init__(self, logger: logging.Logger, interval: float = INTERVAL_S,
                 allowed: Callable[[float], str | None] = lambda now: ""):
        """`allowed(now)`: None where a line due now may not be said (a budget shared with
        others), else what to add to it."""
        self._logger = logger
        self._interval = interval
        self._allowed = allowed
        self._last = -float("inf")
        self._held, self._first_held = 0, 0.0

    def warning(self, message: str, *args: object) -> None:
        self._say(logging.WARNING, message, *args)

    def info(self, message: str, *args: object) -> None:
        self._say(logging.INFO, message, *args)

    def _say(self, level: int, message: str, *args: object) -> None:
        now = time.monotonic()
        others = None if now - self._last < self._interval else self._allowed(now)
        if others is None:
            if not self._held:
                self._first_held = now
            self._held += 1
            return
        if self._held:  # since its last line, or (never said before) since the first held back
            since = now - self._last if self._last > -float("inf") else now - self._first_held
            message += f" ({self._held} more like it in the last {since:.0f} s)"
        self._logger.log(level, message + others, *args)
        self._last, self._held = now, 0


class ThrottledBy:
    """A Throttled logger per key (a peer's uid or pid): one peer's flood of refusals is said once
    per interval, and never hides another peer's. At most `keys` are remembered, and at most
    `most` lines are said per interval over all keys (None: no bound), so that keys a peer can
    make at will (new processes) do not multiply the lines; those the bound held back are counted
    in the next line it lets through, whatever its key (their own key may never speak again)."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL_S, keys: int = 1024,
                 most: int | None = None):
        self._logger, self._interval, self._keys = logger, interval, keys
        self._by: dict[object, Throttled] = {}
        self._most, self._window, self._said = most, -float("inf"), 0
        self._bounded, self._first_bounded = 0, 0.0  # lines the bound held back, since when
        self._lock = threading.Lock()  # the handle socket's threads share one

    def _allowed(self, now: float) -> str | None:
        if self._most is None:
            return ""
        with self._lock:
            if now - self._window >= self._interval:
                self._window, self._said = now, 0
            self._said += 1
            if self._said > self._most:
                if not self._bounded:
                    self._first_bounded = now
                self._bounded += 1
                return None
            bounded, self._bounded = self._bounded, 0
        return (f" ({bounded} lines of any key held back by the bound of {self._most} in "
                f"{self._interval:.0f} s, in the last {now - self._first_bounded:.0f} s)") if bounded else ""

    def __getitem__(self, key: object) -> Throttled:
        with self._lock:
            throttled = self._by.get(key)
            if throttled is None:
                if len(self._by) >= self._keys:
                    self._by.clear()  # forgets who was held back: their counts are lost
                throttled = self._by[key] = Throttled(self._logger, self._interval, self._allowed)
            return throttled
