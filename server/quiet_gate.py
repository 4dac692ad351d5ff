"""Driver calls that wait for the whole device, made only while the daemon has nothing queued there.

`cudaHostUnregister` (a freed slab's counter block, a reload's replaced tables) waits for the
device before it returns, and other threads' CUDA calls wait behind it meanwhile. In a daemon that
is a deadlock waiting for its moment: a daemon stream may hold a wait for IDs (IDS_READY) that a
dead client never wrote, which only the CPU release of that client's slab satisfies; the release
starts once every lookup of the client has been enqueued; and the thread that enqueues them is
blocked behind the unregister. Seen on an H200 (benchmarks/results/h200/served_faults/README.md,
run8): in one run of seven of the twenty-killed-clients test, fifteen threads sat in
cudaHostUnregister, the gather worker and the request loop in CUDA calls behind them, and the
daemon served nobody again.

So such a call is deferred here and made by the gate's one thread once every GPU it may touch is
quiet: the gate takes each GPU's enqueue lock (without waiting for it: a holder may be waiting
for the device itself), so that no lookup, and so no new wait for a client, is enqueued
meanwhile; gives the GPU's streams some milliseconds to finish what they hold (a live client
writes its IDs on its own); and makes the call only if every daemon stream of those GPUs is then
idle. What may still be queued during the call (a cache refresh, a counter copy) waits for no
client. Otherwise it lets go and tries again later, backing off to once a second and holding a
little longer each time: a stopped client whose IDs never come holds the calls back until it goes
on or is retired, and a call older than QUIET_WARN_S is logged.

What is not here: the releases themselves (cuda_slab.py), which must go on whatever this gate
waits for, and what follows a call (`Deferred.then` and `.after`, made without the locks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("engramd.cuda")

# How long the gate holds a GPU's enqueue lock for its streams to finish: 5 ms, doubling after
# each failed try to 50 ms (with the pause between tries at 1 s: lookups held 5% of the time
# at most, while a stopped client holds the calls back).
QUIESCE_S, QUIESCE_MAX_S = 0.005, 0.05
QUIET_FIRST_PAUSE_S, QUIET_MAX_PAUSE_S = 1e-3, 1.0  # between tries, doubling
QUIET_WARN_S = 60.0  # a deferred call this old is logged, once: a stream held up by a client


class QuietDevice(Protocol):
    """What the gate needs of a GPU: the lock its lookups are enqueued under, whether the
    daemon's streams there hold any work, and its context made current on the calling thread."""

    enqueue_lock: threading.Lock

    def quiet(self) -> bool: ...

    def make_current(self) -> None: ...


@dataclass(eq=False)  # each call its own, however alike
class Deferred:
    what: str
    call: Callable[[], None]  # made under the locks, once the GPUs are quiet
    then: Callable[[], None] | None  # made after it, without them, if it did not fail
    after: Callable[[], None] | None  # made after it (and `then`) in any case
    devices: tuple[int, ...]
    since: float = field(default_factory=time.monotonic)
    warned: bool = False
    failed: bool = False  # the call raised: its `then` is not made


class QuietGate:
    """Calls deferred until their GPUs are quiet, made by one thread, in order among those of the
    same GPUs."""

    def __init__(self, devices: Mapping[int, QuietDevice], warn_s: float = QUIET_WARN_S,
                 quiesce_s: float = QUIESCE_S, quiesce_max_s: float = QUIESCE_MAX_S):
        self._devices = devices
        self._warn_s = warn_s
        self._quiesce = (quiesce_s, max(quiesce_s, quiesce_max_s))
        self._hold_s = quiesce_s  # this try's: longer after each failed one
        self._waiting: list[Deferred] = []
        self._changed = threading.Condition()
        self._closed = False
        self._synchronised = False  # closed with the device synchronised (close(run_rest=True))
        self._thread = threading.Thread(target=self._run, name="engramd-quiet", daemon=True)
        self._thread.start()

    def defer(self, what: str, call: Callable[[], None], devices: Iterable[int] | None = None,
              then: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
        """Make `call` once every GPU of `devices` (None: all) is quiet, then `then` if it did
        not fail, then `after` in any case. Once the gate is closed: at once if the device was
        synchronised, else never (logged: the exit lets go of it all)."""
        chosen = self._devices if devices is None else devices
        item = Deferred(what, call, then, after, tuple(sorted(set(chosen))))
        with self._changed:
            if not self._closed:
                self._waiting.append(item)
                self._changed.notify()
                return
            synchronised = self._synchronised
        if synchronised:
            self._make(item)
        else:
            log.error("%s: left for the exit, the GPUs were never quiet", what)

    def waiting(self) -> list[str]:
        """What still waits for a quiet GPU."""
        with self._changed:
            return [item.what for item in self._waiting]

    def close(self, run_rest: bool) -> None:
        """Stop the gate's thread; `run_rest`: make every call still waiting, now (the caller has
        synchronised the device), else leave them (a stream that never drained would hold the
        calls' waits forever: the process's exit lets go of what they would have freed)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("the quiet gate cannot be closed from one of its own calls")
        with self._changed:
            self._closed, self._synchronised = True, run_rest
            self._changed.notify()
        self._thread.join()  # after its last try: what it made is off the list
        with self._changed:
            rest, self._waiting = self._waiting, []
        if not run_rest:
            if rest:
                log.error("left for the exit, their GPUs never quiet: %s",
                          ", ".join(item.what for item in rest))
            return
        for item in rest:
            self._make(item)

    def _run(self) -> None:
        pause = QUIET_FIRST_PAUSE_S
        while True:
            with self._changed:
                while not self._waiting and not self._closed:
                    self._changed.wait()
                    pause = QUIET_FIRST_PAUSE_S
                if self._closed:
                    return
                waiting = list(self._waiting)
            if self._settle(waiting):
                pause, self._hold_s = QUIET_FIRST_PAUSE_S, self._quiesce[0]
                continue
            self._warn_old(waiting)
            with self._changed:
                self._changed.wait(pause)
            pause = min(pause * 2, QUIET_MAX_PAUSE_S)
            self._hold_s = min(self._hold_s * 2, self._quiesce[1])

    def _settle(self, waiting: list[Deferred]) -> bool:
        """One try at each waiting call, in order; a call waits for the calls before it that
        need one of its GPUs. True if any was made."""
        held_back: set[int] = set()
        made = False
        for item in waiting:
            if held_back.intersection(item.devices) or not self._try(item):
                held_back.update(item.devices)
                continue
            made = True
            with self._changed:
                self._waiting.remove(item)
            self._follow(item)
        return made

    def _try(self, item: Deferred) -> bool:
        """Make the call if its GPUs can be made quiet now: their enqueue locks taken without
        waiting, their streams given this try's hold to finish. True if it was made (or failed)."""
        try:
            with ExitStack() as held:
                for index in item.devices:
                    lock = self._devices[index].enqueue_lock
                    if not lock.acquire(blocking=False):  # its holder may wait for the device
                        return False
                    held.callback(lock.release)
                deadline = time.monotonic() + self._hold_s
                while not self._quiet(item.devices):
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(self._hold_s / 10)
                item.failed = not self._call(item)
            return True
        except Exception:  # a broken GPU is never quiet; the calls wait for the exit
            log.exception("%s: looking at the streams of GPUs %s failed", item.what, list(item.devices))
            return False

    def _quiet(self, devices: tuple[int, ...]) -> bool:
        return all(self._devices[index].quiet() for index in devices)

    def _make(self, item: Deferred) -> None:
        item.failed = not self._call(item)
        self._follow(item)

    def _call(self, item: Deferred) -> bool:
        """Make the call; False if it failed (what it would have let go of stays held)."""
        try:
            if item.devices:
                self._devices[item.devices[0]].make_current()
            item.call()
        except Exception:  # the gate goes on for the others
            log.exception("%s failed", item.what)
            return False
        return True

    def _follow(self, item: Deferred) -> None:
        """`then` if the call did not fail, `after` in any case."""
        for follow, due in ((item.then, not item.failed), (item.after, True)):
            if follow is None or not due:
                continue
            try:
                follow()
            except Exception:
                log.exception("%s: what follows it failed", item.what)

    def _warn_old(self, waiting: list[Deferred]) -> None:
        now = time.monotonic()
        for item in waiting:
            if not item.warned and now - item.since > self._warn_s:
                item.warned = True
                log.warning("%s waits %.0f s for its GPUs' daemon streams to drain (a client "
                            "stream held up?)", item.what, now - item.since)
