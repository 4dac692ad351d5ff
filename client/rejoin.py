"""Registering again with a restarted daemon: the retry loop, and a mapped client's rejoin thread.

A served client's rows come from the daemon, so its lookups wait for a restarted daemon
(`retry_until`, in lookup()). A mapped client's rows come from its own mapping of the tables,
which stays valid whatever the daemon does: its lookups go on from that mapping while a `Rejoin`
thread registers with the restarted daemon and hands the registration to the client, which keeps
it if the new daemon serves the same tables in the same mode and layout (else the registration
is let go and the client reconnects as a served one does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from engramd.client.errors import DaemonUnavailableError, NotReadyError, NotRegisteredError

log = logging.getLogger("engramd.client")

T = TypeVar("T")

RETRIED = (DaemonUnavailableError, NotReadyError, NotRegisteredError)  # a daemon not (yet) there
# Pauses between attempts. The longest bounds how long a client sleeps past the moment its
# daemon is back: a standby takes over in about a second, and at 1.0 the served clients' outage
# was half a second longer than that. An attempt on an absent daemon costs one refused connect.
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.05, 0.2
LONGEST_ATTEMPT_S = 2.0  # a socket left by a dead daemon answers nothing: a short wait per attempt


class Stopped(Exception):
    """The retry loop was told to stop (the client closes)."""


def retry_until(attempt: Callable[[float], T], deadline: float, gone: str, patience: float,
                attempt_timeout: float, pause: Callable[[float], bool | None] = time.sleep) -> T:
    """`attempt(timeout)` with backoff until it succeeds or `deadline` (time.monotonic) passes;
    only RETRIED errors are retried. `pause(seconds)` waits between attempts and returns true to
    stop (Stopped). Past the deadline: DaemonUnavailableError saying what was `gone` and the
    last attempt's error, for a client that waited `patience` seconds."""
    delay = FIRST_PAUSE_S
    while True:
        try:
            return attempt(max(0.1, min(attempt_timeout, LONGEST_ATTEMPT_S, deadline - time.monotonic())))
        except RETRIED as exc:
            if time.monotonic() + delay > deadline:
                raise DaemonUnavailableError(
                    f"{gone}; no daemon to re-register with within {patience:.0f} s "
                    f"(last: {exc.message}); raise reconnect_timeout to wait longer") from None
            if pause(delay):
                raise Stopped from None
            delay = min(delay * 2, LONGEST_PAUSE_S)


class Rejoin(Generic[T]):
    """`join(timeout)` retried on a thread of its own until `deadline`; what it returns goes to
    `take` (true: kept), else to `drop`. `error`: why it ended without one (the lookup that sees
    it raises it); `stop()` ends it, dropping a registration not taken yet."""

    def __init__(self, join: Callable[[float], T], take: Callable[[T], bool], drop: Callable[[T], None],
                 deadline: float, gone: str, patience: float, attempt_timeout: float):
        self.error: BaseException | None = None
        self._join, self._take, self._drop = join, take, drop
        self._retry = (deadline, gone, patience, attempt_timeout)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engramd-rejoin", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        """Ask it to end and wait up to `timeout` s; a registration it makes after that goes to
        `take`, which must refuse it (the caller has moved on)."""
        self._stopping.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            joined = retry_until(self._join, *self._retry, pause=self._stopping.wait)
        except Stopped:
            return
        except BaseException as exc:  # told to the next lookup
            self.error = exc
            return
        try:
            taken = not self._stopping.is_set() and self._take(joined)
        except BaseException as exc:
            self.error, taken = exc, False
        if not taken:
            try:
                self._drop(joined)
            except Exception:  # the daemon forgets it with its lease; nothing else holds it
                log.exception("letting go of a registration not taken")
