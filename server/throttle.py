"""Warnings a peer can provoke at will, said at most once per interval.

A flood of bad or unread messages must not become a flood of log lines (300,000 unread replies
once wrote 186,715 warnings, 17 MB in 10 s): each call site gets a Throttled logger that says its
warning once per interval and counts the ones it kept back, so nothing goes unreported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

INTERVAL_S = 10.0


class Throttled:
    def __init__(self, logger: logging.Logger, interval: float = INTERVAL_S,
                 allowed: Callable[[float], bool] = lambda now: True):
        """`allowed(now)`: whether a line due now may be said (a budget shared with others)."""
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
        if now - self._last < self._interval or not self._allowed(now):
            if not self._held:
                self._first_held = now
            self._held += 1
            return
        if self._held:  # since its last line, or (never said before) since the first held back
            since = now - self._last if self._last > -float("inf") else now - self._first_held
            message += f" ({self._held} more like it in the last {since:.0f} s)"
        self._logger.log(level, message, *args)
        self._last, self._held = now, 0


class ThrottledBy:
    """A Throttled logger per key (a peer's uid or pid): one peer's flood of refusals is said once
    per interval, and never hides another peer's. At most `keys` are remembered, and at most
    `most` lines are said per interval over all keys (None: no bound), so that keys a peer can
    make at will (new processes) do not multiply the lines; those held back are counted in the
    next line of their key."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL_S, keys: int = 1024,
                 most: int | None = None):
        self._logger, self._interval, self._keys = logger, interval, keys
        self._by: dict[object, Throttled] = {}
        self._most, self._window, self._said = most, -float("inf"), 0

    def _allowed(self, now: float) -> bool:
        if self._most is None:
            return True
        if now - self._window >= self._interval:
            self._window, self._said = now, 0
        self._said += 1
        return self._said <= self._most

    def __getitem__(self, key: object) -> Throttled:
        throttled = self._by.get(key)
        if throttled is None:
            if len(self._by) >= self._keys:
                self._by.clear()  # forgets who was held back, at worst a line more each
            throttled = self._by[key] = Throttled(self._logger, self._interval, self._allowed)
        return throttled
