"""How long the daemon's garbage collections stop it: a histogram per generation, for metrics.

CPython's cycle collector runs on whichever thread allocates past a generation's threshold and
holds the GIL throughout, so a collection stops every thread that runs Python: the request
loop, and the gather threads between their torch calls. Observing the pauses (gc.callbacks)
tells such stalls from the others. The callback runs inside the collector, so it takes no lock
(prometheus_client's histograms do, and a collection that starts while this thread holds that
lock would deadlock): it only adds to lists, and the metrics collector reads them (a scrape is
at most one collection behind).
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Sequence
from typing import Any

GENERATIONS = 3


class GcPauses:
    """Counts of collection pauses per generation and bucket (upper bounds in seconds)."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        # counts[generation][i]: pauses in (buckets[i-1], buckets[i]]; the last one past them all
        self.counts = [[0] * (len(self.buckets) + 1) for _ in range(GENERATIONS)]
        self.seconds = [0.0] * GENERATIONS
        self._started: float | None = None

    def install(self) -> None:
        if self._observe not in gc.callbacks:
            gc.callbacks.append(self._observe)

    def uninstall(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        if self._started is None:  # installed during a collection
            return
        took, self._started = now - self._started, None
        generation = info["generation"]
        self.counts[generation][bisect.bisect_left(self.buckets, took)] += 1
        self.seconds[generation] += took

    def histogram(self, generation: int) -> tuple[list[tuple[str, int]], float]:
        """(cumulative (upper bound, count) pairs ending with +Inf, sum of seconds)."""
        running, pairs = 0, []
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts[generation], strict=True):
            running += count
            pairs.append((bound, running))
        return pairs, self.seconds[generation]
