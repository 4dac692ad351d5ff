"""Warnings a peer can provoke at will, said at most once per interval.

A flood of bad or unread messages must not become a flood of log lines (300,000 unread replies
once wrote 186,715 warnings, 17 MB in 10 s): each call site gets a Throttled logger that says its
warning once per interval and counts the ones it kept back, so nothing goes unreported.
"""

from __future__ import annotations

import logging
import time

INTERVAL_S = 10.0


class Throttled:
    def __init__(self, logger: logging.Logger, interval: float = INTERVAL_S):
        self._logger = logger
        self._interval = interval
        self._last = -float("inf")
        self._held = 0

    def warning(self, message: str, *args: object) -> None:
        self._say(logging.WARNING, message, *args)

    def info(self, message: str, *args: object) -> None:
        self._say(logging.INFO, message, *args)

    def _say(self, level: int, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._interval:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like it in the last {now - self._last:.0f} s)"
        self._logger.log(level, message, *args)
        self._last, self._held = now, 0


class ThrottledBy:
    """A Throttled logger per key (a peer's uid): one peer's flood of refusals is said once per
    interval, and never hides another peer's. At most `keys` are remembered."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL_S, keys: int = 1024):
        self._logger, self._interval, self._keys = logger, interval, keys
        self._by: dict[object, Throttled] = {}

    def __getitem__(self, key: object) -> Throttled:
        throttled = self._by.get(key)
        if throttled is None:
            if len(self._by) >= self._keys:
                self._by.clear()  # forgets who was held back, at worst a line more each
            throttled = self._by[key] = Throttled(self._logger, self._interval)
        return throttled
