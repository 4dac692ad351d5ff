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
   hundred microseconds between two host-bound steps);
4. on a GPU, a few steps each alone (the device synchronised after it) under torch.profiler: each
   device operation's start and end from the step's first, the median over those steps, per
   stream (`<name>.timeline.txt`): which kernel overlaps which, and which one the step waits for.
The tables go to `<name>.txt`; profile_cell returns its head, and the third pass's table, for
the run's output.
"""

from __future__ import annotations

import collections
import cProfile
import gzip
import io
import json
import pstats
import shutil
import statistics
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
    timeline = _timeline(clock, step, pool, warm, path) if clock.cuda else ""
    return "\n".join([*report.splitlines()[:rows // 2], walls, timeline])


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


TIMELINE_STEPS = 10  # synchronised steps in pass 4
_SYNCED = "synchronised step"
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def read_trace(path: Path) -> list[dict]:
    """A Chrome trace's events, from its .json or .json.gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as trace:
        return json.load(trace)["traceEvents"]


def device_operations(events: Sequence[dict], categories: Sequence[str] = _DEVICE_CATEGORIES) -> list[dict]:
    """A Chrome trace's device operations (kernels, copies, sets), in order of start."""
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in categories),
                  key=lambda e: e["ts"])


def annotated_steps(events: Sequence[dict], name: str,
                    categories: Sequence[str] = _DEVICE_CATEGORIES) -> list[tuple[dict, list[dict]]]:
    """Each host annotation `name` (in order of start) with the device operations that start
    within it: a step synchronised before its annotation ends owns them all."""
    steps = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == name
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    device = device_operations(events, categories)
    return [(step, [e for e in device if step["ts"] <= e["ts"] < step["ts"] + step["dur"]])
            for step in steps]


def _timeline(clock, step: Callable[[Tensor], object], pool: Sequence[Tensor], warm: int,
              path: Path) -> str:
    """Pass 4: each of the first TIMELINE_STEPS steps after the warm ones alone, the device
    synchronised after it, so that every device operation between its annotation's start and
    the next one's is its own; their timeline_table, at `path` + .timeline.txt."""
    _run(clock, step, pool[:warm])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as torch_profile:
        for ids in pool[warm:warm + TIMELINE_STEPS]:
            with record_function(_SYNCED):
                step(ids)
                clock.sync()
    trace = path.with_suffix(".timeline.json")
    torch_profile.export_chrome_trace(str(trace))
    events = read_trace(trace)
    trace.unlink()
    table = f"{path.name}: device timeline of a synchronised step\n" + timeline_table(events)
    path.with_suffix(".timeline.txt").write_text(table)
    return table


def timeline_table(events: Sequence[dict]) -> str:
    """Chrome-trace `events` with `_SYNCED` annotations as a table: each device operation of a
    step (kernels, copies, sets), its stream, and the median over the steps of its start and
    end, in microseconds from the step's first device operation, in order of median start. An
    operation is known by its stream, its name and its place among the operations of that name
    on that stream, so that two streams' operations may start in either order. Only the steps
    with the most common set of operations count; the others, and steps with none, are counted."""
    per_step = [_keyed(ops) for _, ops in annotated_steps(events, _SYNCED)]
    busy = [ops for ops in per_step if ops]
    if not busy:
        return "no device operations in the synchronised steps\n"
    common = collections.Counter(frozenset(ops) for ops in busy).most_common(1)[0][0]
    kept = [ops for ops in busy if frozenset(ops) == common]
    rows = []
    for key in common:
        start = statistics.median(ops[key][0] for ops in kept)
        end = statistics.median(ops[key][1] for ops in kept)
        rows.append((start, end, key))
    lines = [f"{len(kept)} of {len(per_step)} steps alike ({len(per_step) - len(busy)} with no device "
             "operation); us from the step's first device operation",
             f"{'stream':>7} {'start':>8} {'end':>8} {'dur':>8}  name"]
    for start, end, (stream, name, _) in sorted(rows, key=lambda row: row[:2]):
        lines.append(f"{stream!s:>7} {start:8.1f} {end:8.1f} {end - start:8.1f}  {name[:90]}")
    span = statistics.median(max(end for _, end in ops.values()) for ops in kept)
    lines.append(f"step span (first start to last end): {span:.1f} us")
    return "\n".join(lines) + "\n"


def _keyed(ops: list[dict]) -> dict[tuple[str, str, int], tuple[float, float]]:
    """A step's operations (in order of start) by (stream, name, their place among that stream's
    operations of that name): (start, end) from the step's first operation."""
    keyed: dict[tuple[str, str, int], tuple[float, float]] = {}
    seen: collections.Counter = collections.Counter()
    first = ops[0]["ts"] if ops else 0.0
    for op in ops:
        stream = str(op.get("args", {}).get("stream", op.get("tid")))
        place = seen[stream, op["name"]]
        seen[stream, op["name"]] += 1
        keyed[stream, op["name"], place] = (op["ts"] - first, op["ts"] + op["dur"] - first)
    return keyed


def _write_trace(torch_profile, path: Path) -> None:
    trace = path.with_suffix(".trace.json")
    torch_profile.export_chrome_trace(str(trace))
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
