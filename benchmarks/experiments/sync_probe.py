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
With `--peer`, the waiting stream is another process's instead (this one's streams idle): under
MPS, where every client's work shares one server, whether a call waits for other processes.
Every step has a deadline; a hang is reported, not waited out.

    python benchmarks/experiments/sync_probe.py [--device 0] [--peer] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
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
    """One page of a memfd (shared with a peer process by its descriptor), its first word a
    counter the streams wait on; registered for the GPU unless `pinned` is false."""

    def __init__(self, index: int, fd: int | None = None, pinned: bool = True):
        if fd is None:
            fd = os.memfd_create("engramd-sync-probe")
            os.ftruncate(fd, PAGE)
        self.fd = fd
        self.map = mmap.mmap(fd, PAGE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.word = ctypes.c_uint32.from_address(self.address)
        if pinned:
            self.registration = HostRegistration([(self.address, PAGE)], workers=1, device=index)


class LocalWait:
    """A stream of this process waiting on the counter; released by a CPU store."""

    def __init__(self, index: int):
        self.counter = HostPage(index)
        self.stream, self.ops = cuda.new_stream(index), cuda.StreamOps()

    def arm(self, seq: int) -> bool:
        self.ops.wait_u32(self.stream.cuda_stream, self.ops.pointer(self.counter.address), seq)
        armed = torch.cuda.Event()
        armed.record(self.stream)
        return not armed.query()

    def release(self, seq: int) -> None:
        self.counter.word.value = seq  # a CPU store, as a slab's release

    def settle(self) -> None:
        self.stream.synchronize()


class PeerWait:
    """Another process's stream waiting on a counter both map (this script, --peer-fd)."""

    def __init__(self, index: int):
        self.counter = HostPage(index, pinned=False)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--device", str(index), "--peer-fd", str(self.counter.fd)],
            pass_fds=(self.counter.fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _say(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def arm(self, seq: int) -> bool:
        return self._say(f"arm {seq}") == "pending"

    def release(self, seq: int) -> None:
        self.counter.word.value = seq

    def settle(self) -> None:
        assert self._say("settle") == "settled"


def peer(index: int, fd: int) -> None:
    """The peer: arm a wait for each `arm N` read, report whether it is pending, and on
    `settle` synchronise its stream."""
    torch.cuda.set_device(index)
    cuda.make_current(index)
    counter, stream, ops = HostPage(index, fd), cuda.new_stream(index), cuda.StreamOps()
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "arm":
            ops.wait_u32(stream.cuda_stream, ops.pointer(counter.address), int(rest[0]))
            armed = torch.cuda.Event()
            armed.record(stream)
            print("pending" if not armed.query() else "passed", flush=True)
        else:
            stream.synchronize()
            print("settled", flush=True)


def candidates(index: int) -> dict[str, Callable[[], Callable[[], None]]]:
    """Each: set-up made before the wait is armed, returning the call to probe."""

    # Each call holds what it registers or unregisters (a default argument): a mapping freed
    # under its registration would make the call fail, not wait.
    def unregister():
        page = HostPage(index)
        return lambda page=page: page.registration.unregister()

    def register():
        page = HostPage(index, pinned=False)
        return lambda page=page: HostRegistration([(page.address, PAGE)], workers=1, device=index)

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


def probe(name: str, make: Callable[[], Callable[[], None]], index: int, wait: LocalWait | PeerWait,
          seq: int, other: torch.cuda.Stream) -> dict:
    call = make()
    report: dict = {"call": name, "wait_pending": wait.arm(seq)}
    thread, result = in_thread(call, index)
    thread.join(HOLD_S)
    report["returned_while_waiting"] = not thread.is_alive()
    report["launch_ms_meanwhile"] = launch_ms(index, other)
    wait.release(seq)
    thread.join(DEADLINE_S)
    report["after_release"] = not thread.is_alive()
    report.update(result)
    wait.settle()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--peer", action="store_true", help="the waiting stream is another process's")
    parser.add_argument("--peer-fd", type=int, default=None, help=argparse.SUPPRESS)  # the peer itself
    parser.add_argument("--out", default=None, help="write the reports here as JSON too")
    args = parser.parse_args()
    index = args.device
    if args.peer_fd is not None:
        peer(index, args.peer_fd)
        return
    torch.cuda.set_device(index)
    cuda.make_current(index)
    torch.ones(1, device=f"cuda:{index}").add_(1)  # kernels loaded before any wait
    wait = PeerWait(index) if args.peer else LocalWait(index)
    other = cuda.new_stream(index)
    reports = []
    for seq, (name, make) in enumerate(candidates(index).items(), start=1):
        report = probe(name, make, index, wait, seq, other)
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
                       "waiting": "another process" if args.peer else "this process",
                       "reports": reports}, f, indent=1)
    os._exit(0)  # a thread may still be stuck in the driver


if __name__ == "__main__":
    main()
