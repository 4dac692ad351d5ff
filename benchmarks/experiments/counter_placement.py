"""What a completion counter's placement costs: device memory vs pinned host memory.

    python benchmarks/experiments/counter_placement.py [--iters 5000] [--out DIR]

Served lookups wait and write 32-bit counters with stream memory operations; the counters sit
in pinned host memory (client/shared/host_counters.py) so that the CPU can release a wait no GPU queue
will. This probe measures, in one process on GPU 0, for a counter in each placement:

- device memory (torch's allocator);
- a registered memfd page, as HostCounters maps it (what served lookups use);
- cudaHostAlloc'd memory (torch's pinned allocator; not shareable, for comparison);
- a VMM allocation on host NUMA node 0 (cuMemCreate, shareable as a descriptor);

these timings, p50 / p99 over `--iters` calls each:

- write / wait enqueue: host time of one cuStreamWriteValue32, of one cuStreamWaitValue32 (the
  wait already satisfied);
- hand-over: stream A waits for a value, stream B writes it, both enqueued back to back; host
  time until A has passed the wait (stream.synchronize);
- round trip: a served lookup's shape. Stream A writes IDS; stream B waits for it, runs a small
  kernel and writes DONE; A waits for DONE; host time of the enqueues and until A is done.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from engramd.client.shared import cuda
from engramd.client.shared.host_counters import HostCounters
from engramd.client.shared.slab import SlabLayout

cu = cuda.cu


def timed(fn: Callable[[int], None], iters: int) -> dict[str, float]:
    took = np.empty(iters)
    for i in range(iters):
        start = time.perf_counter()
        fn(i)
        took[i] = time.perf_counter() - start
    return {"p50_us": round(float(np.percentile(took, 50)) * 1e6, 2),
            "p99_us": round(float(np.percentile(took, 99)) * 1e6, 2)}


def probe(address: int, iters: int) -> dict[str, dict[str, float]]:
    ops = cuda.StreamOps()
    ids, done = ops.pointer(address), ops.pointer(address + 64)
    a, b = cuda.new_stream(0), cuda.new_stream(0)
    work = torch.zeros(4096, device="cuda")
    try:
        for _ in range(100):  # first calls load what they need
            ops.write_u32(a.cuda_stream, ids, 0)
            ops.wait_u32(a.cuda_stream, ids, 0)
        a.synchronize()
        write = timed(lambda i: ops.write_u32(a.cuda_stream, ids, 0), iters)
        a.synchronize()
        wait = timed(lambda i: ops.wait_u32(a.cuda_stream, ids, 0), iters)
        a.synchronize()

        def hand_over(i: int) -> None:
            ops.wait_u32(a.cuda_stream, ids, i + 1)
            ops.write_u32(b.cuda_stream, ids, i + 1)
            a.synchronize()

        handed = timed(hand_over, iters)
        ops.write_u32(a.cuda_stream, ids, 0)
        ops.write_u32(a.cuda_stream, done, 0)
        a.synchronize()

        def round_trip(i: int) -> None:
            ops.write_u32(a.cuda_stream, ids, i + 1)
            ops.wait_u32(b.cuda_stream, ids, i + 1)
            with torch.cuda.stream(b):
                work.add_(1.0)
            ops.write_u32(b.cuda_stream, done, i + 1)
            ops.wait_u32(a.cuda_stream, done, i + 1)
            a.synchronize()

        trip = timed(round_trip, iters)
    finally:
        torch.cuda.synchronize()
        cuda.STREAMS.give(a)
        cuda.STREAMS.give(b)
    return {"write_enqueue": write, "wait_enqueue": wait, "hand_over": handed, "round_trip": trip}


@contextmanager
def device_memory() -> Iterator[int]:
    block = torch.zeros(64, dtype=torch.int32, device="cuda")
    yield block.data_ptr()


@contextmanager
def memfd_page() -> Iterator[int]:
    counters = HostCounters.create(SlabLayout(1, 1, 1, 1, 1, 1), "engramd-probe-counters", 0)
    try:
        yield counters.base
    finally:
        counters.close()


@contextmanager
def host_alloc() -> Iterator[int]:
    block = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    yield block.data_ptr()


@contextmanager
def vmm_host_numa() -> Iterator[int]:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = 0
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    size = int(cuda.check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
    handle = cuda.check("cuMemCreate", cu.cuMemCreate(size, prop, 0))
    ptr = mapped = 0
    try:
        ptr = int(cuda.check("cuMemAddressReserve", cu.cuMemAddressReserve(size, size, 0, 0)))
        cuda.check("cuMemMap", cu.cuMemMap(ptr, size, 0, handle, 0))
        mapped = ptr
        gpu, cpu = cu.CUmemAccessDesc(), cu.CUmemAccessDesc()
        gpu.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        gpu.location.id = 0
        cpu.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
        cpu.location.id = 0
        for desc in (gpu, cpu):
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        cuda.check("cuMemSetAccess", cu.cuMemSetAccess(ptr, size, [gpu, cpu], 2))
        yield ptr
    finally:
        torch.cuda.synchronize()
        if mapped:
            cuda.check("cuMemUnmap", cu.cuMemUnmap(mapped, size))
        cuda.check("cuMemRelease", cu.cuMemRelease(handle))
        if ptr:
            cuda.check("cuMemAddressFree", cu.cuMemAddressFree(ptr, size))


PLACEMENTS = {
    "device memory": device_memory,
    "registered memfd page": memfd_page,
    "cudaHostAlloc": host_alloc,
    "VMM host NUMA": vmm_host_numa,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.cuda.init()
    cuda.make_current(0)
    results: dict[str, object] = {}
    for name, placement in PLACEMENTS.items():
        try:
            with placement() as address:
                results[name] = probe(address, args.iters)
        except Exception as exc:  # a placement this machine lacks is reported, the rest still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "counter_placement.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'placement':24} {'what':15} {'p50 us':>8} {'p99 us':>8}")
    for name, rows in results.items():
        if "error" in rows:
            print(f"{name:24} {rows['error']}")
            continue
        for what, row in rows.items():
            print(f"{name:24} {what:15} {row['p50_us']:8.2f} {row['p99_us']:8.2f}")


if __name__ == "__main__":
    main()
