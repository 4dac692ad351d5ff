"""Stream timing for the GPU benchmarks: CUDA events on the device, host time on the CPU (where
everything runs in order, so the same loops run there under Triton's interpreter, untimed).

A Clock stamps streams; a StreamLoop queues iterations of one step on one stream at most `depth`
ahead of the device; run_loops feeds several loops at once from one host loop, so that every
stream stays fed whatever the relative speeds. What is timed is the caller's.

time_cell times one cell of the engine benchmarks (benchmarks/vllm_gpu, benchmarks/sglang_gpu):
a step function over a pool of IDs, in one of MODES:
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
import torch
from torch import Tensor

_GATE_CYCLES = 40_000_000  # ~20 ms at 2 GHz: the queue fills while the device waits


class Clock:
    """Timestamps on streams, and the device-side gate that lets a run's queue fill first."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def stream(self, stream: torch.cuda.Stream | None):
        return torch.cuda.stream(stream) if self.cuda and stream is not None else _NoStream()

    def mark(self, stream: torch.cuda.Stream | None = None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream | None, mark) -> None:
        if self.cuda:
            (stream or torch.cuda.current_stream()).wait_event(mark)

    def done(self, mark) -> bool:
        return mark.query() if self.cuda else True

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def gate(self, stream: torch.cuda.Stream | None) -> None:
        if self.cuda:
            with self.stream(stream):
                torch.cuda._sleep(_GATE_CYCLES)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


class StreamLoop:
    """Iterations of `step(k)` on one stream, queued at most `depth` ahead of the device.

    marks[0] is the loop's start and marks[k + 1] the end of iteration k, so iteration k took
    seconds(marks[k], marks[k + 1]). `starved` counts pushes made when nothing was queued any
    more, i.e. moments the device may have idled on this stream waiting for the host.
    """

    def __init__(self, clock: Clock, stream, step: Callable[[int], object], depth: int):
        self.clock, self.stream, self.step, self.depth = clock, stream, step, depth
        self.marks: list = []
        self.finished_marks = 0
        self.starved = 0

    @property
    def iterations(self) -> int:
        return max(0, len(self.marks) - 1)

    def begin(self, origin) -> None:
        self.clock.wait(self.stream, origin)
        self.marks.append(self.clock.mark(self.stream))

    def pending(self) -> int:
        while (self.finished_marks < len(self.marks)
               and self.clock.done(self.marks[self.finished_marks])):
            self.finished_marks += 1
        return len(self.marks) - self.finished_marks

    def push(self) -> None:
        if self.iterations and self.clock.cuda and self.pending() == 0:
            self.starved += 1
        with self.clock.stream(self.stream):
            self.step(self.iterations)
        self.marks.append(self.clock.mark(self.stream))

    def intervals(self, origin) -> list[tuple[float, float]]:
        times = [self.clock.seconds(origin, m) for m in self.marks]
        return list(zip(times, times[1:], strict=False))


def run_loops(clock: Clock, loops: Sequence[StreamLoop], counts: Sequence[int | None]):
    """Run loops together: loop i for counts[i] iterations, or (None) until the counted ones end.

    One push per loop per pass, each kept `depth` deep, so every stream stays fed whatever the
    relative speeds. Returns the origin mark that every loop started after.
    """
    if all(c is None for c in counts):
        raise ValueError("at least one loop needs an iteration count")
    clock.gate(loops[0].stream)
    origin = clock.mark(loops[0].stream)
    for loop in loops:
        loop.begin(origin)
    pairs = list(zip(loops, counts, strict=True))
    while True:
        # Open-ended loops are fed until every counted loop has finished on the device.
        busy = any(c is not None and (loop.iterations < c or loop.pending()) for loop, c in pairs)
        if not busy:
            break
        pushed = False
        for loop, count in pairs:
            wanted = loop.iterations < count if count is not None else True
            if wanted and loop.pending() < loop.depth:
                loop.push()
                pushed = True
        if not pushed:
            time.sleep(20e-6)
    clock.sync()
    return origin


def timed_steps(clock: Clock, step: Callable[[int], object], count: int,
                warm: int) -> list[float]:
    """Seconds per iteration of `step(k)`, k = 0..count-1, after `warm` untimed iterations."""
    for k in range(warm):
        step(k)
    clock.sync()
    loop = StreamLoop(clock, None, lambda k: step(warm + k), depth=8)
    origin = run_loops(clock, [loop], [count])
    return [end - start for start, end in loop.intervals(origin)]


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
