"""What the captured lookup's kernel costs over the in-process one, part by part.

benchmarks/results/h100/captured_step_rounds.md: on uniform IDs, 10 of 36 cells of the captured
step (T <= 256) were over the step with the in-process gather captured alike in every round, by
0.1-5.8%. Both run `_gather_kernel` (kernels/gather_triton.py), in different variants: the
captured lookup's reads its tables through a descriptor block, probes and counts the hot-row
cache (masked off when the descriptor names none), and ends each launch with the descriptor's
accounting; the in-process one does none of these. Here each variant below is captured in a
step of captured_step.py's shape (the gather forked to a side stream, LEAD bf16 matmuls, the
join, a read of the rows, TAIL matmuls), over the same pinned host tables, and replayed:

  plain             GatherPlan, no counter, no cache, no descriptor (captured_step's inproc_graph)
  counted           plain, counting out-of-range IDs (every engramd gather counts)
  cached            counted, through an empty hot-row cache: every row probed and sketched
  described         through a descriptor that names no cache (mapped_graph, client cache off)
  described_cached  through a descriptor that names the cache (mapped_graph as it runs)

Per cell (T, LEAD), the variants run in turn, their order rotated every round; each round's
time per step over `plain`'s in the same round is reported (median, range, rounds over 1.00).
LEAD 0 is the gather with nothing beside it. Uniform IDs in each head's bucket, a fresh batch
each step, copied into the graphs' IDs buffer before each replay (as an engine writes its
inputs). After the timing, every variant's rows after one replay equal `plain`'s, bit for bit.
The cache stays empty (nothing admits rows): its probes all miss, as on uniform IDs; what a hit
costs or saves is not measured here.

    python benchmarks/experiments/described_cost.py [--table-gib 4] [--tokens 16 256]
        [--lead 0 4 12] [--rounds 5] [--steps 50] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engramd.kernels import descriptor as desc
from engramd.kernels import hot_cache
from engramd.kernels.gather_triton import GatherPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common.ids import bucket_ids  # noqa: E402
from common.steps import Matmuls  # noqa: E402
from common.tables import geometry_for  # noqa: E402
from common.timing import Clock, time_cell  # noqa: E402

VARIANTS = ("plain", "counted", "cached", "described", "described_cached")
MATMUL_N = 4096  # model_step.py's operands
TAIL = 4
WARM = 5
CACHE_GIB = 0.5
FILL_CHUNK = 256 << 20


def pinned_tables(geometry, seed: int) -> list[torch.Tensor]:
    """Each layer's rows in pinned host memory, random bytes made on the GPU in chunks."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tables = []
    for rows in geometry.rows:
        table = torch.empty((rows, geometry.row_bytes), dtype=torch.uint8, pin_memory=True)
        flat = table.view(-1)
        for start in range(0, flat.numel(), FILL_CHUNK):
            part = flat[start:start + FILL_CHUNK]
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device="cuda",
                                     generator=generator))
        tables.append(table)
    return tables


class Steps:
    """The matmul operands, one plan over the tables, and a graph per (variant, T, LEAD)."""

    def __init__(self, geometry, tables: list[torch.Tensor], max_tokens: int):
        device = torch.device("cuda", 0)
        self.geometry, self.shard = geometry, geometry.shard(0, 1)
        self.plan = GatherPlan(tables, self.shard, device)
        self.side, self.own = torch.cuda.Stream(), torch.cuda.Stream()
        self.fork, self.join = torch.cuda.Event(), torch.cuda.Event()
        self.matmuls, self.clock = Matmuls(MATMUL_N, device, seed=0), Clock(device)
        self.ids = torch.full((max_tokens, geometry.n_layers, geometry.heads), -1,
                              dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        layout = hot_cache.CacheLayout.from_budget(int(CACHE_GIB * 2**30), geometry.row_bytes)
        self.cache = hot_cache.HotCache(layout, geometry.n_layers, device)
        layers = self.plan.tables
        addresses, rows = [t.address for t in layers], [t.rows for t in layers]
        self.descriptors = {
            "described": desc.TableDescriptor(
                desc.Contents.of(addresses, rows, self.shard.row_ranges), device, stream=self.own),
            "described_cached": desc.TableDescriptor(
                desc.Contents.of(addresses, rows, self.shard.row_ranges, self.cache), device,
                stream=self.own)}
        self.plan.warm_up(caches=(None, self.cache), dedupe=(False,), sort=(False,),
                          packed=(False,), counted=(False, True))
        self.outs = {v: torch.empty(self.plan.output_shape(max_tokens), dtype=torch.bfloat16,
                                    device=device) for v in VARIANTS}
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        torch.cuda.synchronize()

    def gather(self, variant: str, tokens: int) -> torch.Tensor:
        out, ids = self.outs[variant][:, :tokens], self.ids[:tokens]
        options: dict = {}
        if variant != "plain" and not variant.startswith("described"):
            options["out_of_range"] = self.counter
        if variant == "cached":
            options["cache"] = self.cache
        if variant.startswith("described"):
            options["descriptor"] = self.descriptors[variant]
        return self.plan(ids, out, stream=self.side, **options)

    def step(self, variant: str, tokens: int, lead: int) -> None:
        main = torch.cuda.current_stream()
        self.fork.record(main)
        self.side.wait_event(self.fork)
        rows = self.gather(variant, tokens)
        self.join.record(self.side)
        self.matmuls(lead)
        main.wait_event(self.join)
        torch.sum(rows[0], dim=(0, 1), out=self.matmuls.a[0, :rows.shape[-1]])  # a read of the rows
        self.matmuls(TAIL)

    def graph(self, variant: str, tokens: int, lead: int) -> torch.cuda.CUDAGraph:
        key = (variant, tokens, lead)
        if key not in self.graphs:
            self.step(variant, tokens, lead)  # its kernels loaded outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.step(variant, tokens, lead)
            self.graphs[key] = graph
        return self.graphs[key]

    def time(self, variant: str, tokens: int, lead: int, pool: list[torch.Tensor]) -> float:
        """us per step, replays back to back (time_cell's pipelined step), WARM untimed first."""
        graph = self.graph(variant, tokens, lead)

        def replay(ids: torch.Tensor) -> None:
            self.ids[:tokens].copy_(ids, non_blocking=True)
            graph.replay()
        return time_cell(self.clock, replay, pool, WARM, synced=False)["step_us"]

    def rows_after_one(self, variant: str, tokens: int, lead: int, ids: torch.Tensor) -> torch.Tensor:
        self.ids[:tokens].copy_(ids)
        self.graph(variant, tokens, lead).replay()
        torch.cuda.synchronize()
        return self.outs[variant][:, :tokens].cpu()


def run(args: argparse.Namespace) -> dict:
    geometry = geometry_for(args.table_gib)
    started = time.monotonic()
    tables = pinned_tables(geometry, args.seed)
    steps = Steps(geometry, tables, max(args.tokens))
    print(f"tables and plan ready in {time.monotonic() - started:.1f} s", flush=True)
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    cells = []
    for tokens in args.tokens:
        for lead in args.lead:
            rounds = {v: [] for v in VARIANTS}
            for number in range(args.rounds):
                shift = number % len(VARIANTS)
                for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                    pool = bucket_ids(geometry, tokens, WARM + args.steps, torch.device("cuda"), generator)
                    torch.cuda.synchronize()
                    rounds[variant].append(steps.time(variant, tokens, lead, pool))
            check = bucket_ids(geometry, tokens, 1, torch.device("cuda"), generator)[0]
            want = steps.rows_after_one("plain", tokens, lead, check)
            exact = {v: bool(torch.equal(steps.rows_after_one(v, tokens, lead, check).view(torch.int16),
                                         want.view(torch.int16))) for v in VARIANTS}
            cell = {"tokens": tokens, "lead": lead, "us": rounds, "rows_exact": exact,
                    "ratios": {v: [r / p for r, p in zip(rounds[v], rounds["plain"], strict=True)]
                               for v in VARIANTS if v != "plain"}}
            cells.append(cell)
            print(line(cell), flush=True)
    return {"gpu": torch.cuda.get_device_name(0), "table_gib": args.table_gib,
            "rows": list(geometry.rows), "rounds": args.rounds, "steps": args.steps,
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "cells": cells}


def line(cell: dict) -> str:
    plain = float(np.median(cell["us"]["plain"]))
    parts = [f"T={cell['tokens']} lead={cell['lead']}: plain {plain:.0f} us"]
    for variant, ratios in cell["ratios"].items():
        over = sum(r > 1.0 for r in ratios)
        parts.append(f"{variant} {np.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, "
                     f"{over}/{len(ratios)} over)")
    wrong = [v for v, ok in cell["rows_exact"].items() if not ok]
    return "; ".join(parts) + (f"; ROWS DIFFER: {', '.join(wrong)}" if wrong else "")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=4.0)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--lead", type=int, nargs="+", default=[0, 4, 12])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or min(args.tokens) < 1 or min(args.lead) < 0:
        parser.error("--rounds, --steps and --tokens must be >= 1, --lead >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("described_cost.py times CUDA graphs: it needs a GPU")
    report = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if all(all(c["rows_exact"].values()) for c in report["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
