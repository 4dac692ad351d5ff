"""What a completion counter's placement costs: device memory vs pinned host memory.

    python benchmarks/counter_placement.py [--iters 5000] [--out DIR]

Served lookups wait and write 32-bit counters with stream memory operations; the counters sit
in pinned host memory (client/host_counters.py) so that the CPU can release a wait no GPU queue
will. This probe measures, in one process on GPU 0, for a counter in device memory and for one
in a registered memfd page (as HostCounters maps it):

- enqueue: host time of one cuStreamWriteValue32 and of one cuStreamWaitValue32 (the wait
  already satisfied), p50 / p99 over `--iters` calls each;
- hand-over: stream A waits for a value, stream B writes it, both enqueued back to back; host
  time until A has passed the wait (stream.synchronize), p50 / p99.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from engramd.client import cuda
from engramd.client.host_counters import HostCounters
from engramd.client.slab import SlabLayout


def timed(fn, iters: int) -> dict[str, float]:
    took = np.empty(iters)
    for i in range(iters):
        start = time.perf_counter()
        fn(i)
        took[i] = time.perf_counter() - start
    return {"p50_us": round(float(np.percentile(took, 50)) * 1e6, 2),
            "p99_us": round(float(np.percentile(took, 99)) * 1e6, 2)}


def probe(address: int, iters: int) -> dict[str, dict[str, float]]:
    ops = cuda.StreamOps()
    pointer = ops.pointer(address)
    a, b = cuda.new_stream(0), cuda.new_stream(0)
    try:
        for _ in range(100):  # first calls load what they need
            ops.write_u32(a.cuda_stream, pointer, 0)
            ops.wait_u32(a.cuda_stream, pointer, 0)
        a.synchronize()
        write = timed(lambda i: ops.write_u32(a.cuda_stream, pointer, 0), iters)
        a.synchronize()
        wait = timed(lambda i: ops.wait_u32(a.cuda_stream, pointer, 0), iters)
        a.synchronize()

        def hand_over(i: int) -> None:
            ops.wait_u32(a.cuda_stream, pointer, i + 1)
            ops.write_u32(b.cuda_stream, pointer, i + 1)
            a.synchronize()

        ops.write_u32(b.cuda_stream, pointer, 0)
        b.synchronize()
        handed = timed(hand_over, iters)
    finally:
        torch.cuda.synchronize()
        cuda.STREAMS.give(a)
        cuda.STREAMS.give(b)
    return {"write_enqueue": write, "wait_enqueue": wait, "hand_over": handed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.cuda.init()
    device = torch.zeros(16, dtype=torch.int32, device="cuda")
    counters = HostCounters.create(SlabLayout(1, 1, 1, 1, 1, 1), "engramd-probe-counters", 0)
    try:
        results = {"device memory": probe(device.data_ptr(), args.iters),
                   "pinned host memory (memfd)": probe(counters.address(0, 0), args.iters)}
    finally:
        counters.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "counter_placement.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'placement':28} {'what':15} {'p50 us':>8} {'p99 us':>8}")
    for placement, rows in results.items():
        for what, row in rows.items():
            print(f"{placement:28} {what:15} {row['p50_us']:8.2f} {row['p99_us']:8.2f}")


if __name__ == "__main__":
    main()
