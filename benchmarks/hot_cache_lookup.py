"""Dedupe + HBM hot-row cache against the in-process baseline, on real-text and uniform traces (H200).

    python benchmarks/hot_cache_lookup.py --traces .traces [--table-gib 33] [--cache-gib 4] [--out DIR]

One host table of at least 32 GiB with the V4.1 row layout (2 layers x 24 heads x 264 B rows,
synthetic random bytes; common/tables.py), filled once in /dev/shm and shared by every
column. Traces (benchmarks/traces.py): the four texts of the corpus, tokenized, cut into shuffled
documents and hashed for this geometry, walked in order T tokens at a time. Every token is looked
up once: the first half of the trace warms the cache up, the second half (documents never seen
before) is what the rows/s and hit rates report. Uniform traces: fresh random IDs per batch.

Columns, each sample host wall time from submit to `stream.synchronize()`:
  baseline        the Triton gather+dequant kernel in-process on the pinned table (engines today)
  inproc_sorted   the same, rows read in sorted order from 1,024 tokens on
  inproc_dedupe   the same, each distinct row read once
  inproc_cache    sorted, with a hot-row cache and its keeper thread in-process
  inproc_both     dedupe + cache in-process
  engramd_plain   engramd (daemon + this process as client), default config without the cache
  engramd_cache   engramd's default config with a --cache-gib cache, a fresh daemon for each T
(The daemon's defaults: sorted reads from 1,024 tokens, no dedupe, gather on half the SMs.)
Also reported: the highest hit rate any cache could reach on the measured half (rows already seen
earlier in the trace), and the trace's distinct-row share per batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, running_daemon  # noqa: E402
from common.report import machine  # noqa: E402
from common.tables import INSTANCE, geometry_for, random_tables, reattach_flags  # noqa: E402
from traces import TextTrace, uniform_batches  # noqa: E402

from engramd.client import EngramClient  # noqa: E402
from engramd.client.shared.cache_keeper import CacheKeeper  # noqa: E402
from engramd.kernels import hot_cache  # noqa: E402
from engramd.kernels.gather_triton import GatherPlan  # noqa: E402
from engramd.server.cuda_backend import PinnedTables  # noqa: E402

TOKENS = (256, 4096, 16384)
SORT_MIN_TOKENS = 1024  # the daemon's default sort_min_tokens
IN_PROCESS = (  # (column, dedupe, cache, sorted reads from SORT_MIN_TOKENS on)
    ("baseline", False, False, False), ("inproc_sorted", False, False, True),
    ("inproc_dedupe", True, False, False), ("inproc_cache", False, True, True),
    ("inproc_both", True, True, False))
COLUMNS = [c[0] for c in IN_PROCESS] + ["engramd_plain", "engramd_cache"]
SETTLE_S = 0.2  # > the daemon's refresh interval, so its counters are current
UNIFORM_BATCHES = 40


def summarize(column: str, trace: str, tokens: int, rows_per_batch: int, seconds: list[float],
              **extra) -> dict:
    lat = np.array(seconds) * 1e6
    total_rows = rows_per_batch * len(seconds)
    row = {"column": column, "trace": trace, "tokens": tokens, "batches": len(seconds),
           "p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99)),
           "rows_per_s": float(total_rows / (lat.sum() / 1e6)), **extra}
    print(json.dumps(row), flush=True)
    return row


def run_batches(fn, batches, measure_from: int, counters=None) -> tuple[list[float], dict]:
    """Run every batch (syncing after each); times of batches[measure_from:] and the hit rate
    over them from `counters()` -> (reads, hits) taken at the boundary and at the end."""
    stream = torch.cuda.current_stream()
    times = []
    for i, ids in enumerate(batches):
        if i == measure_from and counters is not None:
            before = counters()
        start = time.perf_counter()
        fn(ids)
        stream.synchronize()
        if i >= measure_from:
            times.append(time.perf_counter() - start)
    if counters is None:
        return times, {}
    reads, hits = (a - b for a, b in zip(counters(), before, strict=True))
    return times, {"hit_rate_measured": hits / reads if reads else 0.0, "reads_measured": reads}


def seen_before_share(trace_rows: torch.Tensor, measure_from_token: int) -> float:
    """Share of the measured lookups whose (layer, row) occurred earlier: any cache's ceiling."""
    n, layers, heads = trace_rows.shape
    layer = torch.arange(layers, device=trace_rows.device).view(1, -1, 1).expand(n, layers, heads)
    keys = hot_cache.row_keys(layer.reshape(-1), trace_rows.reshape(-1))
    order = torch.sort(keys, stable=True).indices
    ordered = keys[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    is_first = torch.empty_like(first)
    is_first[order] = first
    measured = is_first.view(n, -1)[measure_from_token:]
    return float(1.0 - measured.float().mean())


def in_process_columns(geometry, tables, trace: TextTrace, cache_bytes: int, columns: list[str],
                       results: list) -> None:
    device = torch.device("cuda", 0)
    pinned = PinnedTables(tables)
    try:
        plan = GatherPlan(pinned.layer_tables(), geometry.shard(0, 1), device)
        views = pinned.row_views(device)
        for tokens in TOKENS:
            out = torch.empty(plan.output_shape(tokens), dtype=torch.bfloat16, device=device)
            rows = tokens * geometry.n_layers * geometry.heads
            for column, dedupe, cached, sorted_reads in IN_PROCESS:
                if column not in columns:
                    continue
                for name, batches, warm in trace_sets(geometry, trace, tokens):
                    cache, keeper = None, None
                    if cached:
                        layout = hot_cache.CacheLayout.from_budget(cache_bytes, geometry.row_bytes)
                        cache = hot_cache.HotCache(layout, geometry.n_layers, device)
                        keeper = CacheKeeper(cache, views, lambda: [torch.cuda.current_stream()]).start()
                    sort = sorted_reads and tokens >= SORT_MIN_TOKENS
                    plan.warm_up(caches=[cache], dedupe=[dedupe], sort=[sort])

                    def lookup(ids, out=out, cache=cache, dedupe=dedupe, sort=sort):
                        plan(ids, out, cache=cache, dedupe=dedupe, sort=sort)

                    counters = (lambda c=cache: c.counters.sum(dim=1).tolist()) if cached else None
                    times, extra = run_batches(lookup, batches, warm, counters)
                    check_last(plan, batches[-1], out)
                    if keeper is not None:
                        keeper.close()
                        extra |= cache_summary(keeper.stats.snapshot(geometry.row_bytes))
                        del cache
                    results.append(summarize(column, name, tokens, rows, times, **extra))
        torch.cuda.synchronize()
    finally:
        pinned.close()


def check_last(plan: GatherPlan, ids: torch.Tensor, out: torch.Tensor) -> None:
    """The last batch's rows must equal a plain gather's (a wrong cache row fails the run)."""
    want = plan(ids)
    if not torch.equal(want.view(torch.int16), out.view(torch.int16)):
        bad = int((want.view(torch.int16) != out.view(torch.int16)).sum())
        raise SystemExit(f"rows differ from the plain gather in {bad} values")


def trace_sets(geometry, trace: TextTrace, tokens: int):
    """(name, batches, index of the first measured batch) for the text and the uniform trace."""
    text = list(trace.batches(tokens, drop_last=True))
    uniform = uniform_batches(geometry, tokens, UNIFORM_BATCHES + 5, device="cuda", seed=tokens)
    return [("text", text, len(text) // 2), ("uniform", uniform, 5)]


def cache_summary(stats: dict) -> dict:
    reads, hits = sum(stats["reads"]), sum(stats["hits"])
    return {"hit_rate_all": hits / reads if reads else 0.0,
            "hit_rate_per_layer": [round(h, 4) for h in stats["hit_rate"]],
            "admitted": stats["admitted"], "refreshes": stats["refreshes"],
            "refresh_ms_last": stats["refresh_ms"]}


def engramd_column(column: str, geometry, trace: TextTrace, tokens: int, socket: Path,
                   results: list) -> None:
    with EngramClient(socket, device="cuda", max_tokens=tokens, slots=2, timeout=120) as client:
        stream = torch.cuda.current_stream()
        rows = tokens * geometry.n_layers * geometry.heads

        def counters() -> tuple[int, int]:
            time.sleep(SETTLE_S)
            caches = client.stats().get("hot_cache", {})
            return (sum(sum(c["reads"]) for c in caches.values()),
                    sum(sum(c["hits"]) for c in caches.values()))

        for name, batches, warm in trace_sets(geometry, trace, tokens):
            times, extra = run_batches(lambda ids: client.lookup(ids, stream).wait(stream), batches,
                                       warm, counters if column != "engramd_plain" else None)
            results.append(summarize(column, name, tokens, rows, times, **extra))


def write_report(path: Path) -> Path:
    """hot_cache_lookup.md beside a results JSON: rows/s per column and T, x the baseline."""
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["results"]
    base = {(r["trace"], r["tokens"]): r["rows_per_s"] for r in rows if r["column"] == "baseline"}
    lines = [f"# Hot-row cache, sorted reads and dedupe vs the in-process baseline ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}; table {meta['table_gib']} GiB (V4.1 rows), "
             f"cache {meta['cache_gib']} GiB; trace {meta['trace_tokens']:,} tokens of real text, "
             f"measured from token {meta['measured_from_token']:,} on (documents never seen before); "
             f"`{meta['command']}`", "",
             f"Share of measured lookups whose row occurred earlier in the trace (the hit rate of an "
             f"unbounded cache): {meta['seen_before_share_measured']:.3f}.", "",
             "| trace | T | column | p50 us | M rows/s | x baseline | hit rate (measured half) |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["trace"], r["tokens"], COLUMNS.index(r["column"]))):
        hit = r.get("hit_rate_measured")
        lines.append(f"| {r['trace']} | {r['tokens']} | {r['column']} | {r['p50_us']:,.0f} | "
                     f"{r['rows_per_s'] / 1e6:.1f} | {r['rows_per_s'] / base[(r['trace'], r['tokens'])]:.2f} | "
                     f"{'' if hit is None else f'{hit:.3f}'} |")
    out = path.with_suffix(".md")
    out.write_text("\n".join(lines) + "\n")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", metavar="JSON", help="only write the .md table of a results file")
    parser.add_argument("--traces", default=".traces")
    parser.add_argument("--table-gib", type=float, default=33.0)
    parser.add_argument("--cache-gib", type=float, default=4.0)
    parser.add_argument("--columns", nargs="+", choices=COLUMNS, default=COLUMNS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.report:
        print(write_report(Path(args.report)))
        return 0
    geometry = geometry_for(args.table_gib)
    trace = TextTrace.load(Path(args.traces), geometry, device="cuda")
    ceiling = seen_before_share(trace.rows, len(trace) // 2)
    print(f"trace: {len(trace)} tokens; rows seen earlier in the measured half: {ceiling:.3f}", flush=True)
    results: list[dict] = []
    with bench_folders() as (work, shm):
        with random_tables(geometry, work / "ckpt", shm, INSTANCE) as tables:
            in_process_columns(geometry, tables, trace, int(args.cache_gib * 2**30), args.columns,
                               results)
        daemons = {"engramd_plain": ["--hot-cache-gib", "0"],
                   "engramd_cache": ["--hot-cache-gib", str(args.cache_gib)]}
        for column, flags in ((c, f) for c, f in daemons.items() if c in args.columns):
            for tokens in TOKENS:  # a fresh daemon (cold cache) for every batch size
                with running_daemon(work, [
                        *reattach_flags(work / "ckpt", shm, INSTANCE), "--backend", "cuda",
                        "--max-tokens", str(max(TOKENS)), "--metrics-address", "127.0.0.1:0",
                        "--dedupe-min-tokens", "0", *flags], timeout=300) as socket:
                    engramd_column(column, geometry, trace, tokens, socket, results)
    stats = {str(t): trace.stats(t).to_dict() for t in TOKENS}
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "table_gib": round(geometry.total_bytes / 2**30, 2), "cache_gib": args.cache_gib,
            "trace_tokens": len(trace), "measured_from_token": len(trace) // 2,
            "seen_before_share_measured": ceiling, "trace_stats": stats,
            "machine": machine(),
            "command": "python benchmarks/hot_cache_lookup.py " + " ".join(
                "DIR" if a.startswith("/") else a for a in sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hot_cache_lookup.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    write_report(out / "hot_cache_lookup.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
