"""Driver calls that wait for the whole device, made only while the device has nothing to wait for.

`cudaHostUnregister` (a freed slab's counter block, a reload's replaced tables) waits for the
device before it returns, and other threads' CUDA calls wait behind it meanwhile. In a daemon that
is a deadlock waiting for its moment: a daemon stream may hold a wait for IDs (IDS_READY) that a
dead client never wrote, which only the CPU release of that client's slab satisfies; the release
starts once every lookup of the client has been enqueued; and the thread that enqueues them is
blocked behind the unregister. Seen on an H200 (benchmarks/results/h200/served_faults/README.md, run8):
in one run of seven of the twenty-killed-clients test, fifteen threads sat in cudaHostUnregister,
the gather worker and the request loop in CUDA calls behind them, and the daemon served nobody
again.

So such a call is deferred here and made by one thread of the gate, holding the enqueue lock of
every GPU it needs quiet (no lookup can be enqueued meanwhile), once every daemon stream of those
GPUs has finished all it holds: nothing left on the device then waits for a client, so the call's
own wait ends with the work already running (a hot-cache refresh, a counter copy).

What is not here: the releases themselves (cuda_slab.py), which must go on whatever this gate
waits for, and the unregisters of a stopping daemon, made by `close(run_rest=True)` once the
device is synchronised.
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

# While something waits: look again after 1 ms, doubling to 50 ms (a few stream queries a look).
QUIET_FIRST_PAUSE_S, QUIET_MAX_PAUSE_S = 1e-3, 5e-2
QUIET_WARN_S = 60.0  # a deferred call this old is logged, once: a stream held up by a client


class QuietDevice(Protocol):
    """What the gate needs of a GPU: the lock its lookups are enqueued under, whether its daemon
    streams hold any work, and its context made current on the calling thread."""

    enqueue_lock: threading.Lock

    def quiet(self) -> bool: ...

    def make_current(self) -> None: ...


@dataclass(eq=False)  # each call its own, however alike
class Deferred:
    what: str
    call: Callable[[], None]
    devices: tuple[int, ...]
    since: float = field(default_factory=time.monotonic)
    warned: bool = False


class QuietGate:
    """Calls deferred until their GPUs are quiet, made in order by one thread."""

    def __init__(self, devices: Mapping[int, QuietDevice], warn_s: float = QUIET_WARN_S):
        self._devices = devices
        self._warn_s = warn_s
        self._waiting: list[Deferred] = []
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engramd-quiet", daemon=True)
        self._thread.start()

    def defer(self, what: str, call: Callable[[], None], devices: Iterable[int]) -> None:
        """Make `call` once every GPU of `devices` is quiet (at once, on this thread, once the
        gate is closed: the device is synchronised then)."""
        item = Deferred(what, call, tuple(sorted(set(devices))))
        with self._changed:
            if not self._closed:
                self._waiting.append(item)
                self._changed.notify()
                return
        self._make(item)

    def waiting(self) -> list[str]:
        """What still waits for a quiet GPU."""
        with self._changed:
            return [item.what for item in self._waiting]

    def close(self, run_rest: bool) -> None:
        """Stop the gate's thread; `run_rest`: make every call still waiting, now (the caller has
        synchronised the device), else leave them (a stream that never drained would hold the
        calls' waits forever: the process's exit lets go of what they would have freed)."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()  # after its last look: what it made is off the list
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
            done = self._settle(waiting)
            if done:
                with self._changed:
                    self._waiting = [item for item in self._waiting if item not in done]
                pause = QUIET_FIRST_PAUSE_S
                continue
            self._warn_old(waiting)
            with self._changed:
                self._changed.wait(pause)
            pause = min(pause * 2, QUIET_MAX_PAUSE_S)

    def _settle(self, waiting: list[Deferred]) -> list[Deferred]:
        """Make, in order, each waiting call whose GPUs are quiet now, under their enqueue locks
        (looked at first without them: a busy GPU costs its lookups no lock)."""
        done: list[Deferred] = []
        for item in waiting:
            if not all(self._devices[i].quiet() for i in item.devices):
                continue
            with ExitStack() as locks:
                for index in item.devices:  # in index order: the only thread taking several
                    locks.enter_context(self._devices[index].enqueue_lock)
                if all(self._devices[i].quiet() for i in item.devices):
                    self._make(item)
                    done.append(item)
        return done

    def _make(self, item: Deferred) -> None:
        try:
            if item.devices:
                self._devices[item.devices[0]].make_current()
            item.call()
        except Exception:  # the gate goes on for the others; what failed stays held
            log.exception("%s failed", item.what)

    def _warn_old(self, waiting: list[Deferred]) -> None:
        now = time.monotonic()
        for item in waiting:
            if not item.warned and now - item.since > self._warn_s:
                item.warned = True
                log.warning("%s waits %.0f s for its GPU's daemon streams to drain (a client "
                            "stream held up?)", item.what, now - item.since)
