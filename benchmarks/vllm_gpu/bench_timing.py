"""How bench_lookup.py times one cell: a step function over a pool of IDs, the device timed with
CUDA events on the current stream (common/timing.Clock; host clocks in a dry run), the host with
perf_counter around each call.

  pipelined  no synchronize between steps, one after the last
  synced     a synchronize after every step
  gpu_us     from an event recorded before the call to one recorded after it (after the wait,
             so when the rows are ready in the current stream's order), median over the steps
  host_us    the call's host time, p50
  step_us    pipelined: wall time of all steps / steps; synced: call + synchronize, p50
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch import Tensor

MODES = ("pipelined", "synced")


def time_cell(clock, step: Callable[[Tensor], object], pool: Sequence[Tensor], warm: int,
              synced: bool) -> dict[str, Any]:
    """`step(ids)` over the pool: the first `warm` batches untimed, then the rest timed."""
    for ids in pool[:warm]:
        step(ids)
    clock.sync()
    marks, host, wall = [], [], []
    begun = time.perf_counter()
    for ids in pool[warm:]:
        start = clock.mark()
        called = time.perf_counter()
        step(ids)
        host.append(time.perf_counter() - called)
        marks.append((start, clock.mark()))
        if synced:
            clock.sync()
            wall.append(time.perf_counter() - called)
    clock.sync()
    steps = len(marks)
    gpu = [clock.seconds(start, end) for start, end in marks]
    step_s = np.percentile(wall, 50) if synced else (time.perf_counter() - begun) / steps
    return {"gpu_us": _us(np.median(gpu)), "host_us": _us(np.percentile(host, 50)),
            "step_us": _us(step_s), "steps": steps}


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 1)
