"""Gather rate by host memory and grid: 4 KiB pages, 2 MiB folios, an engine's own pinned copy.

    python benchmarks/experiments/gather_pages.py [--table-gib 16] [--iterations 60] [--out DIR]
    python benchmarks/experiments/gather_pages.py --memories folios --grids 132:8 66:32 --lookups 4096s 1024s

The daemon's pin makes its /dev/shm tables 2 MiB folios (client/shared/huge_pages.py), which pinned
5x faster than 4 KiB pages. Does the GPU read rows over UVA faster from them too (the sorted
gather's gain, gather_layouts.md, says address translation limits it)? And which persistent grid
does a lookup need to read at the full rate when it runs alone (sm_cap.md: half the SMs read 3%
slower than all of them, which is what a mapped client's gather of 4,096 tokens lost against the
in-process one in model_step.md)? One V4.1-shaped table (--table-gib of random rows in /dev/shm,
as the daemon stores it: common/tables.py), read from three memories in turn:
  4k      the files as filled (4 KiB pages), registered read-only through views of their own
  folios  the same files after the daemon's collapse, registered read-only by a reader (as a
          mapped client or the daemon after its pin)
  copy    the rows copied into cudaHostAlloc memory: an engine that holds its own pinned tables
For each: GatherPlan lookups of fresh IDs (uniform in each head's bucket, drawn before timing)
of T in {16, 256, 4096} tokens unsorted and 4,096 sorted (--lookups: T, and s for sorted), at
each (programs, rows per block) of --grids (default: all SMs with 8 rows, half of them with 8,
16 and 32), and once more at half the SMs with the out-of-range counter a mapped client passes
(8 rows; --memories picks some of the memories, the collapse before `folios` always runs). CUDA
events around each lookup, alone on the GPU; p50 over --iterations. Every memory's rows are first
checked bit for bit against gather_ref (sorted and unsorted); the script stops if one differs.
Writes DIR/gather_pages.json and .md.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from engramd.client.shared.host_pin import HostRegistration
from engramd.kernels import gather_ref
from engramd.kernels.gather_triton import GatherPlan, LayerTable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common.daemon import bench_folders  # noqa: E402
from common.ids import bucket_ids  # noqa: E402
from common.report import machine, write_report  # noqa: E402
from common.rows import assert_exact, poisoned  # noqa: E402
from common.tables import INSTANCE, MappedTable, fill_tables, geometry_for  # noqa: E402
from common.timing import Clock, timed_steps  # noqa: E402

LOOKUPS = ("16", "256", "4096", "4096s")  # T, and s: sorted
MEMORIES = ("4k", "folios", "copy")
WARM = 3
COPY_CHUNK = 256 << 20


def default_grids(sms: int) -> list[tuple[int, int]]:
    """(programs, rows per block): all SMs, then half of them with 1x, 2x, 4x the rows."""
    half = max(1, sms // 2)
    return [(sms, 8), (half, 8), (half, 16), (half, 32)]


def parse_grid(text: str) -> tuple[int, int]:
    programs, _, rows = text.partition(":")
    return int(programs), int(rows)


def parse_lookup(text: str) -> tuple[int, bool]:
    return int(text.rstrip("s")), text.endswith("s")


def pmd_mapped_bytes() -> int:
    """ShmemPmdMapped of this process, all mappings: tmpfs memory mapped by 2 MiB entries."""
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"ShmemPmdMapped:\s+(\d+) kB", text)[1]) << 10


@contextmanager
def registered_files(tables: list[MappedTable], collapse: bool) -> Iterator[list[LayerTable]]:
    """The files registered read-only through views of their own (collapsing them first if
    `collapse`, as the daemon's pin does); yields the kernel's tables."""
    registration = HostRegistration.of_files([(t.fd, t.data_offset, t.nbytes) for t in tables],
                                             read_only=True, collapse=collapse)
    try:
        yield [LayerTable(a, t.rows, t.row_bytes, owner=registration)
               for a, t in zip(registration.addresses, tables, strict=True)]
    finally:
        torch.cuda.synchronize()
        registration.close()


@contextmanager
def pinned_copy(tables: list[MappedTable]) -> Iterator[list[LayerTable]]:
    """The rows copied into cudaHostAlloc memory (mapped, portable), one block per layer."""
    from engramd.client.shared.cuda import check, cudart

    flags = cudart.cudaHostAllocPortable | cudart.cudaHostAllocMapped
    blocks: list[int] = []
    try:
        for t in tables:
            blocks.append(int(check("cudaHostAlloc", cudart.cudaHostAlloc(t.nbytes, flags))))
            source = t.array.reshape(-1)
            for start in range(0, t.nbytes, COPY_CHUNK):
                end = min(t.nbytes, start + COPY_CHUNK)
                ctypes.memmove(blocks[-1] + start, source[start:end].ctypes.data, end - start)
        yield [LayerTable(b, t.rows, t.row_bytes, owner=blocks)
               for b, t in zip(blocks, tables, strict=True)]
    finally:
        torch.cuda.synchronize()
        for block in blocks:
            check("cudaFreeHost", cudart.cudaFreeHost(block))


def check_rows(plan: GatherPlan, tables: list[MappedTable], pools: dict[int, list], memory: str,
               shard) -> None:
    """One batch unsorted (T=256) and one sorted (T=4,096, 5% DEAD) against gather_ref."""
    reference = [torch.from_numpy(t.array) for t in tables]
    for tokens, ordered in ((256, False), (4096, True)):
        ids = pools[tokens][0].clone()
        ids[torch.rand(ids.shape, device=ids.device) < 0.05] = -1
        got = plan(ids, poisoned(plan.output_shape(tokens), ids.device), sort=ordered)
        want, _ = gather_ref.gather(reference, ids.cpu(), shard)
        assert_exact(got.cpu(), want, f"{memory}: T={tokens}{' sorted' if ordered else ''}")


def time_memory(memory: str, layer_tables: list[LayerTable], tables: list[MappedTable],
                pools: dict[int, list], shard, args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    plan = GatherPlan(layer_tables, shard, device)
    check_rows(plan, tables, pools, memory, shard)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    clock = Clock(device)
    points = []
    grids = [parse_grid(g) for g in args.grids] if args.grids else default_grids(sms)
    for tokens, ordered in map(parse_lookup, args.lookups):
        pool, out = pools[tokens], torch.empty(plan.output_shape(tokens), dtype=torch.bfloat16,
                                               device=device)
        runs = [(p, b, None) for p, b in grids] + [(max(1, sms // 2), 8, counter)]
        for programs, block_rows, count in runs:
            def step(k: int, pool=pool, out=out, ordered=ordered, programs=programs,
                     block_rows=block_rows, count=count) -> None:
                plan(pool[k % len(pool)], out, sort=ordered, num_programs=programs,
                     block_rows=block_rows, out_of_range=count)

            seconds = timed_steps(clock, step, args.iterations, WARM)
            p50 = float(np.percentile(seconds, 50))
            rows = tokens * plan.n_layers * shard.local_heads
            point = {"memory": memory, "tokens": tokens, "sorted": ordered, "programs": programs,
                     "block_rows": block_rows, "counted": count is not None,
                     "p50_us": round(p50 * 1e6, 1),
                     "p10_us": round(float(np.percentile(seconds, 10)) * 1e6, 1),
                     "p90_us": round(float(np.percentile(seconds, 90)) * 1e6, 1),
                     "mrows_s": round(rows / p50 / 1e6, 2)}
            print(point, flush=True)
            points.append(point)
    return points


def measure(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    geometry = geometry_for(args.table_gib)
    shard = geometry.shard(0, 1)
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = sorted({parse_lookup(lookup)[0] for lookup in args.lookups} | {256, 4096})
    pools = {t: bucket_ids(geometry, t, args.iterations + WARM, device, gen) for t in tokens}
    points, memories = [], {}
    with bench_folders(show_log=False) as (work, shm):
        specs = fill_tables(geometry, work / "ckpt", shm, INSTANCE)
        tables = [MappedTable(**s) for s in specs]
        try:
            cases = (("4k", lambda: registered_files(tables, collapse=False)),
                     ("collapse", lambda: registered_files(tables, collapse=True)),
                     ("folios", lambda: registered_files(tables, collapse=False)),
                     ("copy", lambda: pinned_copy(tables)))
            for memory, open_memory in cases:
                if memory not in args.memories and not (memory == "collapse"
                                                        and "folios" in args.memories):
                    continue
                before, at = pmd_mapped_bytes(), time.perf_counter()
                with open_memory() as layer_tables:
                    memories[memory] = {"open_s": round(time.perf_counter() - at, 3),
                                        "pmd_mapped_gib": round((pmd_mapped_bytes() - before)
                                                                / 2**30, 2)}
                    print(memory, memories[memory], flush=True)
                    if memory != "collapse":  # the collapse only makes the folios
                        points += time_memory(memory, layer_tables, tables, pools, shard, args)
        finally:
            for t in tables:
                t.close()
    return {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "table_gib": round(geometry.total_bytes / 2**30, 3), "iterations": args.iterations,
            "command": "python benchmarks/experiments/gather_pages.py " + " ".join(sys.argv[1:]),
            "memories": memories, "points": points,
            "seconds": round(time.monotonic() - started, 1)}


def markdown(report: dict) -> str:
    lines = [f"# Gather rate by host memory and grid ({report['date']})", "",
             f"{report['gpu']}, {report['machine']}, torch {report['torch']}; "
             f"{report['table_gib']} GiB of V4.1-width rows; p50 of {report['iterations']} "
             f"lookups of fresh IDs each, alone on the GPU. Command: `{report['command']}`.", "",
             "| memory | opened in s | ShmemPmdMapped GiB |", "|---|---:|---:|"]
    lines += [f"| {m} | {v['open_s']} | {v['pmd_mapped_gib']} |"
              for m, v in report["memories"].items()]
    lines += ["", "| memory | T | sorted | programs | rows/block | counted | p50 us | p10-p90 us "
              "| M rows/s |", "|---|---:|---|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {p['memory']} | {p['tokens']} | {'yes' if p['sorted'] else 'no'} | "
              f"{p['programs']} | {p['block_rows']} | {'yes' if p['counted'] else 'no'} | "
              f"{p['p50_us']} | {p['p10_us']}-{p['p90_us']} | {p['mrows_s']} |"
              for p in report["points"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=16.0)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--memories", nargs="+", choices=MEMORIES, default=list(MEMORIES))
    parser.add_argument("--grids", nargs="+", metavar="PROGRAMS:ROWS",
                        help="grids to time (default: all SMs:8, half:8, half:16, half:32)")
    parser.add_argument("--lookups", nargs="+", default=list(LOOKUPS),
                        help="T of each lookup timed, with s for sorted (default: %(default)s)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    report = measure(args)
    write_report(Path(args.out), report, "gather_pages.json", "gather_pages.md", markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
