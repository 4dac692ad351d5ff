"""Which CUDA calls the daemon makes wait for the whole device, and stop its other threads meanwhile?

A daemon stream may wait (cuStreamWaitValue32) on a host counter that only a CPU store releases:
a dead client's IDS_READY, stored by its slab's release. A call that waits for the device while
such a wait is pending returns only after the store; if it also blocks the other threads' CUDA
calls, the thread that must enqueue what comes before the release is stuck behind it, and the
daemon hangs (server/quiet_gate.py). For each call below, in a thread of its own, with one stream
of this process waiting on an unwritten host counter, this probe reports:
  - `returned_while_waiting`: whether the call came back within HOLD_S while the wait was pending
    (if not, the daemon must make it through its quiet gate);
  - `launch_ms_meanwhile`: how long a small kernel launch and an event query took on this thread
    meanwhile (long or none: the driver kept other threads out);
  - `s`: the call's time, and `after_release`: whether it returned once the counter was stored.
Every step has a deadline; a hang is reported, not waited out.

    python benchmarks/experiments/sync_probe.py [--device 0] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import threading
import time
from collections.abc import Callable

import torch

from engramd.client.shared import cuda
from engramd.client.shared.host_pin import HostRegistration

HOLD_S = 1.0  # how long a call may take, with the wait pending, to count as not waiting for it
DEADLINE_S = 10.0  # after the release: a call still not back is reported as hung
PAGE = mmap.PAGESIZE


class HostPage:
    """One page of pinned host memory, its first word a counter the streams wait on."""

    def __init__(self, index: int):
        self.map = mmap.mmap(-1, PAGE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.word = ctypes.c_uint32.from_address(self.address)
        self.registration = HostRegistration([(self.address, PAGE)], workers=1, device=index)


def candidates(index: int) -> dict[str, Callable[[], Callable[[], None]]]:
    """Each: set-up made before the wait is armed, returning the call to probe."""

    def unregister():
        page = HostPage(index)
        return page.registration.unregister

    def register():
        buf = mmap.mmap(-1, PAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        return lambda: HostRegistration([(address, PAGE)], workers=1, device=index)

    def pinned_alloc():  # torch's host allocator, a size it has not cached
        return lambda: torch.empty(3 * PAGE + 17, dtype=torch.uint8, pin_memory=True)

    def vmm_create():
        return lambda: cuda.DeviceAllocation.create(index, 2 << 20)

    def vmm_free():
        allocation = cuda.DeviceAllocation.create(index, 2 << 20)
        return allocation.close

    def device_alloc():  # past torch's cache: a cudaMalloc
        return lambda: torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{index}")

    def stream_sync_other():  # another, idle stream
        other = cuda.new_stream(index)
        return other.synchronize

    return {"cudaHostUnregister": unregister, "cudaHostRegister": register,
            "pinned host alloc (torch)": pinned_alloc, "cuMemCreate+Map (VMM)": vmm_create,
            "cuMemUnmap+Release (VMM)": vmm_free, "cudaMalloc (torch, 1 GiB)": device_alloc,
            "idle stream synchronize": stream_sync_other}


def in_thread(fn: Callable[[], object], index: int) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        cuda.make_current(index)
        start = time.perf_counter()
        try:
            fn()
            result["ok"] = True
        except Exception as exc:  # reported, the probe goes on
            result["error"] = repr(exc)
        result["s"] = round(time.perf_counter() - start, 4)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def launch_ms(index: int, stream: torch.cuda.Stream) -> float | None:
    """A small kernel launched and its event queried on this thread, within HOLD_S; None if not."""
    done: list[float] = []

    def launch() -> None:
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            torch.ones(16, device=f"cuda:{index}").add_(1)
            event = torch.cuda.Event()
            event.record(stream)
        event.query()
        done.append((time.perf_counter() - start) * 1e3)

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    thread.join(HOLD_S)
    return round(done[0], 3) if done else None


def probe(name: str, make: Callable[[], Callable[[], None]], index: int, counter: HostPage,
          seq: int, waiter: torch.cuda.Stream, other: torch.cuda.Stream, ops: cuda.StreamOps) -> dict:
    call = make()
    ops.wait_u32(waiter.cuda_stream, ops.pointer(counter.address), seq)
    armed = torch.cuda.Event()
    armed.record(waiter)
    report: dict = {"call": name, "wait_pending": not armed.query()}
    thread, result = in_thread(call, index)
    thread.join(HOLD_S)
    report["returned_while_waiting"] = not thread.is_alive()
    report["launch_ms_meanwhile"] = launch_ms(index, other)
    counter.word.value = seq  # the release: a CPU store, as a slab's
    thread.join(DEADLINE_S)
    report["after_release"] = not thread.is_alive()
    report.update(result)
    waiter.synchronize()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the reports here as JSON too")
    args = parser.parse_args()
    index = args.device
    torch.cuda.set_device(index)
    cuda.make_current(index)
    torch.ones(1, device=f"cuda:{index}").add_(1)  # kernels loaded before any wait
    counter = HostPage(index)
    waiter, other, ops = cuda.new_stream(index), cuda.new_stream(index), cuda.StreamOps()
    reports = []
    for seq, (name, make) in enumerate(candidates(index).items(), start=1):
        report = probe(name, make, index, counter, seq, waiter, other, ops)
        reports.append(report)
        print(json.dumps(report), flush=True)
        if not report["after_release"]:
            break  # a call still in the driver: what follows would measure it, not itself
    print("| call | returned while a stream waited | launch meanwhile (ms) | time (s) |")
    print("|---|---|---:|---:|")
    for r in reports:
        print(f"| {r['call']} | {r['returned_while_waiting']} | {r['launch_ms_meanwhile']} | {r.get('s')} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(index), "hold_s": HOLD_S,
                       "reports": reports}, f, indent=1)
    os._exit(0)  # a thread may still be stuck in the driver


if __name__ == "__main__":
    main()
