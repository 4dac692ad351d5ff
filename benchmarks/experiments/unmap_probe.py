"""Does freeing VMM device memory wait for other streams of the process, and does it block other
threads meanwhile?

The daemon frees a dead client's slab while other slabs' streams may still wait on counters
(stream waits on IDS_READY) that only a later retirement releases. This probe puts one stream
into such a wait, then, in a second thread, unmaps and releases an unrelated allocation, and
reports:
  - whether that free returned while the wait was still pending (if not, it synchronises the
    device and a pending wait on a dead client's counter would hold it);
  - whether this thread ran Python meanwhile (the binding released the GIL) and could enqueue
    the write that releases the wait (the driver let other threads in).
Every step has a deadline; a hang is reported, not waited out.

    python benchmarks/experiments/unmap_probe.py [--device 0]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

from engramd.client.shared import cuda

DEADLINE_S = 5.0


def timed_in_thread(fn, name: str) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            fn()
            result["ok"] = True
        except Exception as exc:  # reported, the probe goes on
            result["error"] = repr(exc)
        result["s"] = round(time.perf_counter() - start, 4)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    index = args.device
    torch.cuda.set_device(index)
    cuda.make_current(index)
    flag = torch.zeros(1, dtype=torch.int32, device=f"cuda:{index}")
    waiter, releaser = cuda.new_stream(index), cuda.new_stream(index)
    victim = cuda.DeviceAllocation.create(index, 64 << 20)
    cuda.stream_wait_u32(waiter.cuda_stream, flag.data_ptr(), 1)
    after_wait = torch.cuda.Event()
    after_wait.record(waiter)
    report: dict = {"wait_pending_before": not after_wait.query()}

    def free_victim() -> None:
        cuda.make_current(index)
        victim.close()

    freer, freed = timed_in_thread(free_victim, "freer")
    ticks, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:  # Python runs here only if the freer let go of the GIL
        ticks += 1
        time.sleep(0.001)
    report["python_ticks_during_free_1s"] = ticks
    report["free_returned_while_waiting"] = not freer.is_alive()
    release, released = timed_in_thread(
        lambda: cuda.stream_write_u32(releaser.cuda_stream, flag.data_ptr(), 1), "releaser")
    release.join(DEADLINE_S)
    report["release_enqueued"] = not release.is_alive()
    report["release"] = released
    freer.join(DEADLINE_S)
    report["free_returned_after_release"] = not freer.is_alive()
    report["free"] = freed
    print(json.dumps(report, indent=1), flush=True)
    os._exit(0)  # a thread may still be stuck in the driver


if __name__ == "__main__":
    main()
