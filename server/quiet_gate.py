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
quiet: the gate takes each GPU's locks (without waiting for them: a holder may be waiting for
the device itself), so that no lookup is enqueued and no refresh or counter copy queued meanwhile,
gives the GPU's streams a few milliseconds to finish what they hold (a live client writes its IDs
on its own), and makes the call only if every daemon stream of those GPUs is then idle: nothing
of the daemon's is left on the device for the call to wait for. Otherwise it lets go and tries
again later, backing off to once a second: a stopped client whose IDs never come holds its calls
back until it goes on or is retired, and a call older than QUIET_WARN_S is logged.

What is not here: the releases themselves (cuda_slab.py), which must go on whatever this gate
waits for, and what a call lets go of after it (`Deferred.then`, made without the locks).
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

QUIESCE_S = 0.005  # how long the gate holds a GPU's locks for its streams to finish
QUIET_FIRST_PAUSE_S, QUIET_MAX_PAUSE_S = 1e-3, 1.0  # between tries, doubling
QUIET_WARN_S = 60.0  # a deferred call this old is logged, once: a stream held up by a client


class QuietDevice(Protocol):
    """What the gate needs of a GPU: the locks under which work is queued on it, whether the
    daemon's streams there hold any work, and its context made current on the calling thread."""

    def queue_locks(self) -> list[threading.Lock]: ...

    def quiet(self) -> bool: ...

    def make_current(self) -> None: ...


@dataclass(eq=False)  # each call its own, however alike
class Deferred:
    what: str
    call: Callable[[], None]  # made under the locks, once the GPUs are quiet
    then: Callable[[], None] | None  # made after, without them
    devices: tuple[int, ...]
    since: float = field(default_factory=time.monotonic)
    warned: bool = False
    failed: bool = False  # the call raised: what follows it is not made


class QuietGate:
    """Calls deferred until their GPUs are quiet, made by one thread, in order among those of the
    same GPUs."""

    def __init__(self, devices: Mapping[int, QuietDevice], warn_s: float = QUIET_WARN_S,
                 quiesce_s: float = QUIESCE_S):
        self._devices = devices
        self._warn_s = warn_s
        self._quiesce_s = quiesce_s
        self._waiting: list[Deferred] = []
        self._changed = threading.Condition()
        self._closed = False
        self._synchronised = False  # closed with the device synchronised (close(run_rest=True))
        self._thread = threading.Thread(target=self._run, name="engramd-quiet", daemon=True)
        self._thread.start()

    def defer(self, what: str, call: Callable[[], None], devices: Iterable[int] | None = None,
              then: Callable[[], None] | None = None) -> None:
        """Make `call` once every GPU of `devices` (None: all) is quiet, then `then`. Once the
        gate is closed: at once if the device was synchronised, else never (logged)."""
        chosen = self._devices if devices is None else devices
        item = Deferred(what, call, then, tuple(sorted(set(chosen))))
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
                pause = QUIET_FIRST_PAUSE_S
                continue
            self._warn_old(waiting)
            with self._changed:
                self._changed.wait(pause)
            pause = min(pause * 2, QUIET_MAX_PAUSE_S)

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
            if not item.failed:
                self._then(item)
        return made

    def _try(self, item: Deferred) -> bool:
        """Make the call if its GPUs can be made quiet now: their locks taken without waiting,
        their streams given QUIESCE_S to finish."""
        with ExitStack() as held:
            for index in item.devices:
                for lock in self._devices[index].queue_locks():
                    if not lock.acquire(blocking=False):  # its holder may wait for the device
                        return False
                    held.callback(lock.release)
            deadline = time.monotonic() + self._quiesce_s
            while not self._quiet(item.devices):
                if time.monotonic() > deadline:
                    return False
                time.sleep(self._quiesce_s / 10)
            item.failed = not self._make(item, then=False)
        return True

    def _quiet(self, devices: tuple[int, ...]) -> bool:
        try:
            return all(self._devices[index].quiet() for index in devices)
        except Exception:  # a broken GPU is never quiet; the calls wait for the exit
            log.exception("looking at the streams of GPUs %s failed", list(devices))
            return False

    def _make(self, item: Deferred, then: bool = True) -> bool:
        """Make the call (and `then` after it, unless told not to); False if it failed."""
        try:
            if item.devices:
                self._devices[item.devices[0]].make_current()
            item.call()
        except Exception:  # the gate goes on for the others; what failed stays held
            log.exception("%s failed", item.what)
            return False
        if then:
            self._then(item)
        return True

    def _then(self, item: Deferred) -> None:
        if item.then is None:
            return
        try:
            item.then()
        except Exception:
            log.exception("%s: what follows it failed", item.what)

    def _warn_old(self, waiting: list[Deferred]) -> None:
        now = time.monotonic()
        for item in waiting:
            if not item.warned and now - item.since > self._warn_s:
                item.warned = True
                log.warning("%s waits %.0f s for its GPUs' daemon streams to drain (a client "
                            "stream held up?)", item.what, now - item.since)
