"""Where a CPU lookup's time goes: the service in-process against the same lookup over the socket.

    python benchmarks/service_overhead.py [--iters 500] [--out benchmarks/results]

Both run the daemon's own code on the demo tables (CPU backend, one worker): once driven from
this process through server/inprocess.py (validation, slots, the backend's gather, accounting;
no ZeroMQ, no second process), once through a real daemon process and EngramClient. The
difference is what the transport costs a lookup: sockets, encoding, the loop, the other
process's scheduling.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engramd.client import EngramClient
from engramd.server.config import build_config
from engramd.server.inprocess import InProcessService

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, running_daemon  # noqa: E402
from common.report import run_header  # noqa: E402
from common.tables import cpu_demo_flags  # noqa: E402

TOKENS = (1, 16, 256)


def draw(rng: np.random.Generator, tokens: int, rows: tuple[int, ...], heads: int) -> np.ndarray:
    return np.stack([rng.integers(0, n, size=(tokens, heads)) for n in rows], axis=1)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = np.sort(np.array(samples) * 1e6)
    return {"p50_us": round(float(np.percentile(ordered, 50)), 1),
            "p99_us": round(float(np.percentile(ordered, 99)), 1)}


def time_lookups(lookup, batches: list[np.ndarray]) -> list[float]:
    seconds = []
    for ids in batches:
        start = time.perf_counter()
        lookup(ids)
        seconds.append(time.perf_counter() - start)
    return seconds[len(seconds) // 10:]  # the first tenth warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with bench_folders() as (work, shm):
        flags = cpu_demo_flags(work, shm)
        tables = flags[flags.index("--tables") + 1]
        config = build_config({"tables": tables, "shm_dir": str(shm / "inproc"), "instance": "svc",
                               "backend": "cpu", "workers": 1, "self_check": False}, "bench")
        (shm / "inproc").mkdir()
        with InProcessService(config) as served:
            geometry = served.loaded.geometry
            rng = np.random.default_rng(0)
            client = served.client(max_tokens=max(TOKENS), slots=2)
            for tokens in TOKENS:
                batches = [draw(rng, tokens, geometry.rows, geometry.heads) for _ in range(args.iters)]
                timed = time_lookups(lambda ids: client.lookup(ids, copy=False), batches)  # a view, as result()
                results.setdefault(str(tokens), {})["in_process"] = percentiles(timed)
        with running_daemon(work, [*flags, "--workers", "1"]) as socket:
            with EngramClient(socket, max_tokens=max(TOKENS), slots=2, timeout=120) as client:
                for tokens in TOKENS:
                    batches = [torch.from_numpy(draw(rng, tokens, geometry.rows, geometry.heads))
                               for _ in range(args.iters)]
                    results[str(tokens)]["socket"] = percentiles(
                        time_lookups(lambda ids: client.lookup(ids).result(), batches))
    write(args, results)


def write(args: argparse.Namespace, results: dict[str, dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    header = run_header()
    (args.out / "service_overhead.json").write_text(json.dumps({**header, "results": results}, indent=1))
    lines = ["# A CPU lookup in-process and over the socket", "",
             f"`{header['command']}` on {header['machine']}, {header['date']}", "",
             "| T tokens | in-process p50 / p99 us | over the socket p50 / p99 us | transport p50 us |",
             "|---:|---:|---:|---:|"]
    for tokens, r in results.items():
        inproc, sock = r["in_process"], r["socket"]
        lines.append(f"| {tokens} | {inproc['p50_us']:,} / {inproc['p99_us']:,} | "
                     f"{sock['p50_us']:,} / {sock['p99_us']:,} | {sock['p50_us'] - inproc['p50_us']:,.1f} |")
    (args.out / "service_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
