"""CPU-backend lookup latency and throughput, end to end through a real daemon process.

    python benchmarks/cpu_lookup.py [--vocab 100000] [--iters 200] [--out benchmarks/results]

Writes a synthetic checkpoint (V4.1 shape: 2 layers x 24 heads x 256, buckets of ~`--vocab`
rows), starts `engramd serve --backend cpu` on it, and times `client.lookup(ids).result()` from
this process for T in {1, 16, 256, 4096} tokens with fresh random IDs every iteration (drawn
before timing). Reports p50/p99 latency and rows/s (rows = T x 2 layers x 24 heads).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engramd.client import EngramClient
from engramd.server.synthetic import write_synthetic_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, running_daemon  # noqa: E402
from common.tables import INSTANCE, v41_geometry  # noqa: E402

TOKENS = (1, 16, 256, 4096)


def time_lookups(client: EngramClient, rows: list[int], tokens: int, iters: int, rng) -> dict:
    heads = client.geometry.heads
    batches = [torch.from_numpy(np.stack([rng.integers(0, r, size=(tokens, heads)) for r in rows], axis=1))
               for _ in range(iters + 5)]
    for ids in batches[:5]:
        client.lookup(ids).result()
    lat = []
    for ids in batches[5:]:
        start = time.perf_counter()
        client.lookup(ids).result()
        lat.append(time.perf_counter() - start)
    lat_us = np.array(lat) * 1e6
    n_rows = tokens * len(rows) * heads
    return {"tokens": tokens, "rows_per_lookup": n_rows, "iters": iters,
            "p50_us": float(np.percentile(lat_us, 50)), "p99_us": float(np.percentile(lat_us, 99)),
            "rows_per_s": float(n_rows / np.median(lat))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=100_000, help="base bucket size (V4.1: 16,000,000)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    geometry = v41_geometry(args.vocab)
    with bench_folders(show_log=False) as (work, shm):
        print(f"writing {geometry.total_bytes / 1e9:.2f} GB synthetic checkpoint", file=sys.stderr)
        write_synthetic_checkpoint(geometry, work / "ckpt", seed=1)
        with running_daemon(work, ["--tables", str(work / "ckpt"), "--shm-dir", str(shm),
                                   "--instance", INSTANCE, "--backend", "cpu",
                                   "--workers", str(args.workers)]) as socket:
            rng = np.random.default_rng(0)
            with EngramClient(socket, max_tokens=max(TOKENS), slots=2, timeout=120) as client:
                results = [time_lookups(client, list(geometry.rows), t,
                                        args.iters if t < 4096 else args.iters // 4, rng)
                           for t in TOKENS]

    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
            "python": platform.python_version(), "torch": torch.__version__,
            "table_gb": round(geometry.total_bytes / 1e9, 3), "workers": args.workers,
            "command": "python benchmarks/cpu_lookup.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_lookup.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    lines = [f"# CPU backend lookup, end to end ({meta['date']})", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; table {meta['table_gb']} GB; "
             f"{args.workers} gather workers.", f"Command: `{meta['command']}`", "",
             "| T tokens | rows/lookup | p50 us | p99 us | rows/s |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['rows_per_lookup']} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | "
              f"{r['rows_per_s'] / 1e6:.2f} M |" for r in results]
    (out / "cpu_lookup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
