"""Lookups whose rows the daemon did not write, kept until the engine has been told.

A served GPU lookup's wait() returns at once: the engine's stream waits for the slot's ROWS_DONE
counter and the host moves on, usually to the next step, never syncing. If the daemon then dies,
retires the client or refuses the lookup, something other than the gather releases that wait (the
client's watchdog, or the daemon's refusal), and what the slot holds is not this lookup's rows: in
the slot's previous use, another batch's. So a release never passes for a success:

- before the wait is released, the rows are overwritten with NaN in stream order (the client:
  `CudaSlabView.invalidate` in client/served.py; the daemon: `enqueue_lookup`'s refusal), so a
  model that reads them computes NaN, never a plausible answer to another batch;
- the lookup is recorded here, and the client's next lookup(), wait() or result() raises
  LookupFailedError naming it (by `LookupFuture.seq`); `LookupFuture.failed()` says so at any
  time without waiting, for an engine that polls off its critical path.

This module is that record and its error; it knows nothing of CUDA or of the wire.
"""

from __future__ import annotations

import threading
from typing import Protocol

from engramd.client.errors import LookupFailedError


class Failable(Protocol):
    seq: int
    slots_epoch: int  # its registration: seqs start again at each
    failure: LookupFailedError | None


class FailedLookups:
    """The client's failed lookups not yet reported to its caller. Written by the watchdog
    thread and the lookup thread, read by the lookup thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unreported: dict[tuple[int, int], str] = {}  # (registration, seq) -> why

    def add(self, lookup: Failable, why: str) -> bool:
        """Mark `lookup` failed (its own wait()/result() raise from now on) and keep it for the
        client's next call; False if it was failed already (the watchdog and the lookup thread
        may both find it: it is failed, and reported, once)."""
        with self._lock:
            if lookup.failure is not None:
                return False
            lookup.failure = failure_error({lookup.seq: why})
            self._unreported[(lookup.slots_epoch, lookup.seq)] = why
            return True

    def reported(self, lookup: Failable) -> None:
        """`lookup`'s failure reached its caller through its own future: not raised again."""
        with self._lock:
            self._unreported.pop((lookup.slots_epoch, lookup.seq), None)

    def raise_unreported(self) -> None:
        """LookupFailedError naming every failure not yet reported, once."""
        with self._lock:
            if not self._unreported:
                return
            failed, self._unreported = self._unreported, {}
        raise failure_error({seq: why for (_, seq), why in failed.items()})

    def __len__(self) -> int:
        with self._lock:
            return len(self._unreported)


def failure_error(failed: dict[int, str]) -> LookupFailedError:
    seqs = tuple(sorted(failed))
    reasons = "; ".join(dict.fromkeys(failed.values()))
    shown = ", ".join(map(str, seqs[:8])) + (f" and {len(seqs) - 8} more" if len(seqs) > 8 else "")
    return LookupFailedError(
        f"the rows of lookup(s) seq {shown} were not written by the daemon ({reasons}); they "
        "hold NaN (or, where the fill could not run in time, older rows): whatever read them "
        "(the steps that waited on them) must be computed again", seqs)
