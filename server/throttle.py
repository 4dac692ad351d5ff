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
        now = time.monotonic()
        if now - self._last < self._interval:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like it in the last {now - self._last:.0f} s)"
        self._logger.warning(message, *args)
        self._last, self._held = now, 0
