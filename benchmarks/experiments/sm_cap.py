"""SM cap for the gather: what a concurrent lookup costs a bf16 matmul, with and without the cap.

    python benchmarks/experiments/sm_cap.py [--table-gib 16] [--out DIR]
    python benchmarks/experiments/sm_cap.py --sort --block-rows 32 --out DIR   # sorted lookups, wide blocks
    TRITON_INTERPRET=1 python benchmarks/experiments/sm_cap.py --smoke --out DIR   # CPU, tiny, no timings

A lookup prefetched while the model computes runs beside its kernels; the gather's persistent grid
(GatherPlan's num_programs) decides how many SMs it can take from them. On one GPU:
  1. a bf16 matmul ([n, n] @ [n, n], random operands) looped alone on one stream;
  2. the gather alone (GatherPlan, packed rows of a pinned --table-gib host table, T tokens x 2
     layers x 24 heads per lookup, fresh random IDs) with num_programs = all SMs, 1/2, 1/4, 1/8;
  3. both at once on two streams, for each of those grid sizes: the matmul's time per iteration
     (and its slowdown against step 1) while the gather runs, and the gather's rows/s meanwhile;
  4. the matmul alone again, so drift over the run shows.
Times are CUDA events between consecutive iterations of each stream; only the matmul iterations
that lie wholly inside the gather's busy window (and gather iterations inside the matmul's) count
as concurrent. Both streams are fed from one host loop that keeps each a few iterations deep, so
neither waits on the host. The rows are checked bit for bit against kernels/gather_ref at every grid
size first. The script stops (NotExactError, RuntimeError) rather than report a broken measurement.

The packed host table and the run metadata come from gather_layouts.py beside this file; IDs,
clock and stream loops from benchmarks/common.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from engramd.client.geometry import TableGeometry
from engramd.kernels import gather_ref
from engramd.kernels.gather_triton import GatherPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common.ids import bucket_ids  # noqa: E402
from common.rows import assert_exact, poisoned  # noqa: E402
from common.timing import Clock, StreamLoop, run_loops  # noqa: E402
from gather_layouts import (  # noqa: E402
    HostLayout,
    device_programs,
    geometry_for,
    kernels_interpreted,
    run_meta,
)

FRACTIONS = (1, 2, 4, 8)  # the gather's grid: all SMs, then 1/2, 1/4, 1/8 of them
MATMUL_DEPTH = 16  # iterations queued ahead per stream: ~20 ms of matmuls, ~30 ms of gathers
GATHER_DEPTH = 4
MIN_ITERATIONS = 3
CALIBRATION = 3  # iterations timed to size a run
MIN_CONCURRENT = 5  # matmul iterations inside the gather's window below which a point is refused


@dataclass
class Settings:
    device: torch.device
    sms: int
    tokens: int
    matmul_n: int
    seconds: float  # per timed point, alone
    concurrent_seconds: float  # matmul loop length (at its speed alone) beside the gather
    id_batches: int
    check_tokens: int
    block_rows: int
    num_warps: int
    sort: bool  # GatherPlan's sorted reads (a sort of the IDs, then the gather)
    seed: int
    smoke: bool

    @property
    def caps(self) -> list[int]:
        return sorted({max(1, self.sms // f) for f in FRACTIONS}, reverse=True)


class IdPool:
    """Pre-drawn ID batches, handed out in turn so that consecutive lookups never repeat.

    A pool of N batches repeats a batch only after N - 1 others (by default 256 x 196,608 random
    rows, tens of millions of row reads in between): no translation or cache state survives that.
    """

    def __init__(self, batches: list[Tensor]):
        self.batches = batches
        self.handed = 0

    def next(self) -> Tensor:
        batch = self.batches[self.handed % len(self.batches)]
        self.handed += 1
        return batch

    @property
    def cycled(self) -> bool:
        return self.handed > len(self.batches)


class Bench:
    """The matmul, the gather plan and the two streams of one run."""

    def __init__(self, s: Settings, layout: HostLayout, geometry: TableGeometry):
        self.s = s
        self.clock = Clock(s.device)
        self.rows = s.tokens * geometry.n_layers * geometry.heads
        gen = torch.Generator(device=s.device).manual_seed(s.seed)
        self.a = torch.randn(s.matmul_n, s.matmul_n, device=s.device, generator=gen).bfloat16()
        self.b = torch.randn(s.matmul_n, s.matmul_n, device=s.device, generator=gen).bfloat16()
        self.c = torch.empty_like(self.a)
        self.plan = GatherPlan(layout.layer_tables(), geometry.shard(0, 1), s.device)
        self.out = torch.empty(self.plan.output_shape(s.tokens), dtype=torch.bfloat16,
                               device=s.device)
        self.ids = IdPool(bucket_ids(geometry, s.tokens, s.id_batches, s.device, gen))
        cuda = s.device.type == "cuda"
        self.mm_stream = torch.cuda.Stream(s.device) if cuda else None
        self.g_stream = torch.cuda.Stream(s.device) if cuda else None

    def matmul(self, k: int = 0) -> None:
        torch.matmul(self.a, self.b, out=self.c)

    def gather_step(self, programs: int):
        def step(k: int = 0) -> None:
            self.plan(self.ids.next(), self.out, num_programs=programs,
                      block_rows=self.s.block_rows, num_warps=self.s.num_warps, sort=self.s.sort)
        return step

    def matmul_loop(self) -> StreamLoop:
        return StreamLoop(self.clock, self.mm_stream, self.matmul, MATMUL_DEPTH)

    def gather_loop(self, programs: int) -> StreamLoop:
        return StreamLoop(self.clock, self.g_stream, self.gather_step(programs), GATHER_DEPTH)

    def alone(self, make_loop, seconds: float) -> tuple[list[float], int]:
        """Per-iteration seconds of a loop run alone for about `seconds`, and its starved count."""
        calibration = make_loop()
        origin = run_loops(self.clock, [calibration], [CALIBRATION])
        estimate = float(np.mean(_durations(self.clock, calibration, origin)))
        loop = make_loop()
        origin = run_loops(self.clock, [loop], [iterations_for(seconds, estimate)])
        return _durations(self.clock, loop, origin), loop.starved

    def concurrent(self, programs: int, matmul_estimate: float) -> dict:
        """The matmul loop with the gather looping beside it until the matmuls are done."""
        mm, g = self.matmul_loop(), self.gather_loop(programs)
        count = iterations_for(self.s.concurrent_seconds, matmul_estimate)
        origin = run_loops(self.clock, [mm, g], [count, None])
        mm_spans, g_spans = mm.intervals(origin), g.intervals(origin)
        mm_inside = _inside(mm_spans, (g_spans[0][0], g_spans[-1][1]))
        g_inside = _inside(g_spans, (mm_spans[0][0], mm_spans[-1][1]))
        if not self.s.smoke and len(mm_inside) < MIN_CONCURRENT:
            raise RuntimeError(f"only {len(mm_inside)} of {count} matmul iterations ran while the "
                               f"gather ({programs} programs) was busy; no concurrent measurement")
        return {"matmul_s": [b - a for a, b in mm_inside], "gather_s": [b - a for a, b in g_inside],
                "matmul_iters": count, "gather_iters": g.iterations,
                "starved": {"matmul": mm.starved, "gather": g.starved}}


def _durations(clock: Clock, loop: StreamLoop, origin) -> list[float]:
    return [b - a for a, b in loop.intervals(origin)]


def _inside(spans: list[tuple[float, float]], window: tuple[float, float]) -> list:
    lo, hi = window
    return [(a, b) for a, b in spans if a >= lo and b <= hi]


def iterations_for(seconds: float, estimate: float) -> int:
    return max(MIN_ITERATIONS, math.ceil(seconds / max(estimate, 1e-9)))


def check_gather(bench: Bench, layout: HostLayout, geometry: TableGeometry, s: Settings) -> None:
    """GatherPlan at every grid size against gather_ref (DEAD IDs included); raises if not exact."""
    generator = torch.Generator(device="cpu").manual_seed(s.seed + 17)
    ids = bucket_ids(geometry, s.check_tokens, 1, torch.device("cpu"), generator,
                     dead_fraction=0.1)[0]
    want, _ = gather_ref.gather(layout.packed_tables(), ids, geometry.shard(0, 1))
    for programs in s.caps:
        got = bench.plan(ids.to(s.device), poisoned(want.shape, s.device), num_programs=programs,
                         block_rows=s.block_rows, num_warps=s.num_warps, sort=s.sort)
        assert_exact(got, want, f"GatherPlan with {programs} programs")
    print(f"GatherPlan matches gather_ref bit for bit at {s.caps} programs", flush=True)


def _stats(seconds: Sequence[float]) -> dict:
    if not seconds:
        return {"iters": 0, "mean_ms": None, "p50_ms": None}
    lat = np.asarray(seconds) * 1e3
    return {"iters": len(lat), "mean_ms": float(lat.mean()), "p50_ms": float(np.median(lat))}


def _gather_stats(seconds: Sequence[float], rows: int) -> dict:
    stats = _stats(seconds)
    stats["rows_per_s"] = rows * len(seconds) / sum(seconds) if seconds else None
    return stats


def measure(bench: Bench, s: Settings) -> dict:
    """Steps 1-4 of the module docstring; returns the results part of the report."""
    for _ in range(CALIBRATION):  # cuBLAS handle and heuristics, Triton compile and load
        bench.matmul()
        for programs in s.caps:
            bench.gather_step(programs)()
    bench.clock.sync()
    mm_first, mm_starved = bench.alone(bench.matmul_loop, s.seconds)
    print(f"matmul alone: {_stats(mm_first)}", flush=True)
    points = []
    for programs in s.caps:
        g_alone, g_starved = bench.alone(lambda p=programs: bench.gather_loop(p), s.seconds)
        together = bench.concurrent(programs, float(np.mean(mm_first)))
        points.append({"programs": programs, "share_of_sms": programs / s.sms,
                       "gather_alone": {**_gather_stats(g_alone, bench.rows), "starved": g_starved},
                       "concurrent": together})
        print(f"{programs} programs: gather alone {_rate_text(points[-1]['gather_alone'])}", flush=True)
    mm_second, mm_starved2 = bench.alone(bench.matmul_loop, s.seconds)
    baseline = float(np.mean([np.mean(mm_first), np.mean(mm_second)]))
    for point in points:
        summarize_concurrent(point, baseline, bench.rows)
        print(point_text(point), flush=True)
    flops = 2 * s.matmul_n**3
    return {
        "matmul": {"n": s.matmul_n, "dtype": "bfloat16", "alone_first": _stats(mm_first),
                   "alone_second": _stats(mm_second), "baseline_mean_ms": baseline * 1e3,
                   "tflops": flops / baseline / 1e12, "starved": mm_starved + mm_starved2},
        "gather": {"tokens": s.tokens, "rows_per_lookup": bench.rows, "id_batches": s.id_batches,
                   "ids_reused_after_pool": bench.ids.cycled, "block_rows": s.block_rows,
                   "num_warps": s.num_warps, "sorted": s.sort},
        "points": points,
    }


def summarize_concurrent(point: dict, baseline_s: float, rows: int) -> None:
    """Replace a point's raw concurrent samples by statistics and the matmul's slowdown."""
    raw = point["concurrent"]
    matmul = _stats(raw.pop("matmul_s"))
    gather = _gather_stats(raw.pop("gather_s"), rows)
    slowdown = matmul["mean_ms"] / (baseline_s * 1e3) - 1 if matmul["mean_ms"] else None
    point["concurrent"] = {"matmul": matmul, "matmul_slowdown": slowdown, "gather": gather, **raw}


def _rate_text(stats: dict) -> str:
    rate = stats.get("rows_per_s")
    return "n/a" if rate is None else f"{rate / 1e6:.2f} M rows/s"


def point_text(point: dict) -> str:
    c = point["concurrent"]
    slowdown = c["matmul_slowdown"]
    return (f"{point['programs']:>4} programs: gather alone {_rate_text(point['gather_alone'])}, "
            f"beside the matmul {_rate_text(c['gather'])}; matmul "
            f"{c['matmul']['mean_ms'] or float('nan'):.3f} ms/iter "
            f"({'n/a' if slowdown is None else f'{slowdown * 100:+.1f}%'})")


def markdown(meta: dict, results: dict) -> str:
    mm, g = results["matmul"], results["gather"]
    lines = [
        "# SM cap: a bf16 matmul beside a concurrent gather",
        "",
        f"{meta['gpu']} ({meta['sms']} SMs), torch {meta['torch']}, triton {meta['triton']}, "
        f"{meta['date']}; `{meta['command']}`",
        "",
        f"- matmul: [{mm['n']} x {mm['n']}] @ [{mm['n']} x {mm['n']}] bf16, alone "
        f"{_ms(mm['alone_first']['mean_ms'])} ms/iter before the gather runs and "
        f"{_ms(mm['alone_second']['mean_ms'])} after ({mm['tflops']:.0f} TFLOP/s on their mean, "
        f"the baseline of the slowdowns)",
        f"- gather: GatherPlan bf16, T = {g['tokens']} tokens x 2 layers x 24 heads = "
        f"{g['rows_per_lookup']:,} rows per lookup from {meta['table_gib']} GiB of packed rows in "
        f"registered host memory, fresh random IDs{', sorted reads' if g.get('sorted') else ''}, "
        f"{g['block_rows']} rows per block, "
        f"{g['num_warps']} warps",
        "",
        "| gather programs | share of SMs | gather alone M rows/s | gather beside matmul M rows/s "
        "| matmul ms/iter beside gather | matmul slowdown | matmul iters counted |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in results["points"]:
        c = p["concurrent"]
        lines.append(
            f"| {p['programs']} | {p['share_of_sms']:.3f} | {_mrows(p['gather_alone'])} | "
            f"{_mrows(c['gather'])} | {_ms(c['matmul']['mean_ms'])} | {_pct(c['matmul_slowdown'])} "
            f"| {c['matmul']['iters']} of {c['matmul_iters']} |")
    starved = sum(p["concurrent"]["starved"]["matmul"] + p["concurrent"]["starved"]["gather"]
                  for p in results["points"])
    lines += ["", f"Host-starved pushes (a stream had run dry before the host queued more): "
              f"{starved} concurrent, {mm['starved']} matmul alone.", ""]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _mrows(stats: dict) -> str:
    rate = stats.get("rows_per_s")
    return "n/a" if rate is None else f"{rate / 1e6:.2f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def settings_from(args: argparse.Namespace) -> Settings:
    if args.smoke:
        if not kernels_interpreted():
            raise SystemExit("--smoke runs on the CPU under Triton's interpreter: "
                             "set TRITON_INTERPRET=1")
        return Settings(torch.device("cpu"), 8, 8, 64, 0.0, 0.0, 4, 8, args.block_rows or 32,
                        args.num_warps, args.sort, args.seed, True)
    if not torch.cuda.is_available() or kernels_interpreted():
        raise SystemExit("needs a CUDA GPU and TRITON_INTERPRET unset (or --smoke on the CPU)")
    device = torch.device("cuda", torch.cuda.current_device())
    return Settings(device, device_programs(device), args.tokens, args.matmul_n, args.seconds,
                    args.concurrent_seconds, args.id_batches, 64, args.block_rows or 8,
                    args.num_warps, args.sort, args.seed, False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=16.0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=1.0, help="per point, run alone")
    parser.add_argument("--concurrent-seconds", type=float, default=1.5,
                        help="matmul loop length (at its speed alone) beside the gather")
    parser.add_argument("--id-batches", type=int, default=256)
    parser.add_argument("--block-rows", type=int, default=None,
                        help="GatherPlan rows per block (default 8, its default; smoke 32)")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--sort", action="store_true", help="sorted reads (GatherPlan sort=True)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny table and matmul on the CPU under TRITON_INTERPRET=1")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    s = settings_from(args)
    geometry = geometry_for(0.001 if s.smoke else args.table_gib)
    with HostLayout("packed", geometry, s.device, s.seed) as layout:
        print(f"{layout.nbytes / 2**30:.2f} GiB of packed rows built in "
              f"{time.monotonic() - started:.1f} s", flush=True)
        bench = Bench(s, layout, geometry)
        check_gather(bench, layout, geometry, s)
        results = measure(bench, s)
        del bench
    meta = run_meta("sm_cap.py", s.device, geometry, s.smoke)
    meta["sms"] = s.sms
    meta["seconds"] = round(time.monotonic() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sm_cap.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    (out / "sm_cap.md").write_text(markdown(meta, results))
    print(f"done in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
