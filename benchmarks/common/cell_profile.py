"""A profile of one benchmark cell, for a cell whose step time its totals cannot explain (the
engine benchmarks' --profile T:LEAD): what the host's Python spends each step on, and what torch
and, on a GPU, the device run.

Two passes over the same steps, after the cell's warm steps, so that neither inflates the other:
1. torch.profiler (CPU, and CUDA on a GPU): a Chrome trace, gzipped (`<name>.trace.json.gz`,
   chrome://tracing or Perfetto: where the device idles, which stream waits for which), and the
   operators by self host time and by self device time;
2. cProfile: the Python functions by their own time and by cumulative time, per step, which is
   where a host-side wait (a lock, a poll, a sleep, an event's synchronize) shows by name;
3. where the caller names functions (`timed`), their inclusive wall time per step at nearly the
   step's own speed (common/wall_timers.py: cProfile slows every call, and hides a gap of a few
   hundred microseconds between two host-bound steps).
The tables go to `<name>.txt`; profile_cell returns its head, and the third pass's table, for
the run's output.
"""

from __future__ import annotations

import cProfile
import gzip
import io
import pstats
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import Tensor
from torch.profiler import ProfilerActivity, profile, record_function

from common.wall_timers import WallTimers


def parse_cells(texts: Sequence[str] | None) -> set[tuple[int, int]]:
    """'T:LEAD' strings as (tokens, lead) pairs; ValueError naming a malformed one."""
    cells = set()
    for text in texts or ():
        tokens, sep, lead = text.partition(":")
        if not sep or not tokens.isdigit() or not lead.isdigit() or int(tokens) < 1:
            raise ValueError(f"--profile {text!r}: a cell is T:LEAD, T >= 1 and LEAD >= 0 (e.g. 1:1)")
        cells.add((int(tokens), int(lead)))
    return cells


def profile_cell(clock, step: Callable[[Tensor], object], pool: Sequence[Tensor], warm: int,
                 path: Path, rows: int = 25, timed: Sequence[str] = ()) -> str:
    """Profile `step(ids)` over pool[warm:] after pool[:warm] untimed, twice (torch.profiler,
    then cProfile), and a third time with the `timed` functions' wall time where any are named:
    files at `path` + .trace.json.gz and .txt. Returns the .txt's first lines and the third
    pass's table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = len(pool) - warm
    _run(clock, step, pool[:warm])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    with profile(activities=activities) as torch_profile:
        for ids in pool[warm:]:
            with record_function("benchmark step"):
                step(ids)
        clock.sync()
    _write_trace(torch_profile, path)
    averages = torch_profile.key_averages()
    parts = [f"{path.name}: {steps} steps\n",
             "torch operators by self host time:\n"
             + averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if clock.cuda:
        parts.append("torch operators by self device time:\n"
                     + averages.table(sort_by="self_device_time_total", row_limit=rows))

    _run(clock, step, pool[:warm])
    python_profile = cProfile.Profile()
    python_profile.enable()
    _run(clock, step, pool[warm:])
    python_profile.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(python_profile, stream=text).sort_stats(order).print_stats(rows)
        parts.append(f"Python functions by {order} ({steps} steps, under cProfile):\n{text.getvalue()}")

    report = "\n".join(parts)
    path.with_suffix(".txt").write_text(report)  # kept, should the third pass fail
    walls = _wall_times(clock, step, pool, warm, timed) if timed else ""
    path.with_suffix(".txt").write_text("\n".join([report, walls]))
    return "\n".join([*report.splitlines()[:rows // 2], walls])


def _wall_times(clock, step: Callable[[Tensor], object], pool: Sequence[Tensor], warm: int,
                timed: Sequence[str]) -> str:
    _run(clock, step, pool[:warm])
    with WallTimers(timed) as timers:
        started = time.perf_counter_ns()
        _run(clock, step, pool[warm:])
        elapsed = time.perf_counter_ns() - started
    return timers.report(len(pool) - warm, elapsed)


def _run(clock, step: Callable[[Tensor], object], pool: Sequence[Tensor]) -> None:
    for ids in pool:
        step(ids)
    clock.sync()


def _write_trace(torch_profile, path: Path) -> None:
    trace = path.with_suffix(".trace.json")
    torch_profile.export_chrome_trace(str(trace))
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
