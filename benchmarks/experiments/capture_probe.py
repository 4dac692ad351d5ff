"""Which of a client's background CUDA calls spoil an engine's graph capture in CUDA's default mode?

vLLM and SGLang capture with `torch.cuda.graph(...)` in its default mode, "global": a possibly
unsafe CUDA call from any other thread in that mode is refused and invalidates the capture. A
client's own threads (the hot-row cache's keeper, the heartbeat, the captured lookups' upkeep)
enter relaxed mode first (client/shared/cuda.py: enter_thread), which lets such calls through;
calls that are illegal during any capture (a synchronize of the whole device) still spoil it.
tests/gpu/test_captured_gpu.py's capture in the default mode, held open while the keeper
refreshes, failed on an H200 (its first run): this probe names the call.

For each operation below, TRIALS times: the main thread begins a capture in global mode on a
stream of its own and launches a kernel in it; a worker thread then runs the operation, while
the capture is open; the main thread launches a second kernel and ends the capture, then
replays the graph and checks what it wrote. Reported per operation: captures that failed, the
first error, and errors of the operation itself. The worker enters relaxed mode as the client's
threads do; `--worker-mode global` leaves it in the default mode (the control: there, every
possibly unsafe call must spoil the capture, else the probe sees nothing).

    python benchmarks/experiments/capture_probe.py [--trials 10] [--worker-mode relaxed|global]
        [--ops NAME ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from engramd.client.shared import cuda
from engramd.client.shared.host_pin import HostRegistration
from engramd.kernels import descriptor as desc
from engramd.kernels import hot_cache

ROW_BYTES, ROWS, LAYERS, HEADS = 264, 1 << 16, 2, 8
OP_DEADLINE_S = 30.0  # an operation still running then is reported as hung
GRAPHS = 64  # graphs for graph_destroyed to let go, one a call: enough for 2 + --trials calls


class Fixture:
    """What the operations work on, made once on the main thread before any capture."""

    def __init__(self, device: torch.device):
        from engramd.client.shared.cache_keeper import CacheKeeper

        self.device = device
        self.stream = cuda.new_stream(device.index)  # the worker's own, as the keeper's
        self.side = cuda.new_stream(device.index)  # a gather stream the keeper's grace waits on
        self.small = torch.arange(16, device=device)
        self.pinned = torch.zeros(16, dtype=torch.int64).pin_memory()
        self.tables = [torch.randint(0, 255, (ROWS, ROW_BYTES), dtype=torch.uint8, device=device)
                       for _ in range(LAYERS)]
        nothing = desc.Contents(((0, 0, 0, 0),) * LAYERS)
        self.descriptor = desc.TableDescriptor(nothing, device, stream=cuda.new_stream(device.index))
        self.keeper = CacheKeeper.over(self.tables, 8 << 20, lambda: [self.side], interval=1.0,
                                       gather_probes=lambda: [self.descriptor.quiet()])
        self.rng = torch.Generator().manual_seed(7)
        self.graphs = [self._graph() for _ in range(GRAPHS)]
        torch.cuda.synchronize(device)

    def _graph(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.small.add_(0)
        return graph

    def hot_ids(self) -> torch.Tensor:
        """IDs [N, layers, heads], each row four times: enough for the keeper to admit it."""
        ids = torch.randint(0, ROWS, (64, LAYERS, HEADS), generator=self.rng)  # on the host, as a trace's
        return ids.repeat(4, 1, 1)


def operations(f: Fixture) -> dict[str, Callable[[], object]]:
    """What the client's threads do while an engine may capture, one call (or step) each."""
    def on_own():  # the worker's own stream, as the keeper's
        return torch.cuda.stream(f.stream)

    def event_query():
        event = torch.cuda.Event()
        event.record(f.stream)
        while not event.query():
            time.sleep(0.0005)

    def event_synchronize():
        event = torch.cuda.Event()
        event.record(f.stream)
        event.synchronize()

    def item():
        with on_own():
            return int(f.small.sum().item())

    def tolist():
        with on_own():
            return f.small.tolist()

    sizes = itertools.count(64 << 20, 2 << 20)

    def new_allocation():  # each larger than any block the caching allocator holds: cudaMalloc
        with on_own():
            return torch.empty(next(sizes), dtype=torch.uint8, device=f.device)

    def pin_memory():
        return torch.zeros(4099, dtype=torch.uint8).pin_memory()

    def copy_to_pinned():
        with on_own():
            f.pinned.copy_(f.small, non_blocking=True)
        f.stream.synchronize()

    def unique():
        with on_own():
            return torch.unique(torch.randint(0, 100, (4096,), device=f.device)).numel()

    def stream_from_pool():
        return cuda.new_stream(f.device.index)

    def descriptor_snapshot():
        return f.descriptor.snapshot(wait=True)

    def keeper_warm():
        return f.keeper.warm(f.hot_ids())

    def keeper_refresh():
        return f.keeper.refresh()

    def device_synchronize():  # illegal during any capture: the positive control in relaxed mode
        torch.cuda.synchronize(f.device)

    def empty_cache():  # cudaFree of cached blocks
        torch.empty(5 << 20, dtype=torch.uint8, device=f.device)
        torch.cuda.empty_cache()

    def graph_destroyed():  # a finalizer the garbage collector may run on any thread
        f.graphs.pop()  # captured before any of the probe's captures

    def host_unregistered():  # a mapping let go (a reload's old tables, a closed client)
        page = mmap.mmap(-1, 1 << 21)
        view = ctypes.c_char.from_buffer(page)
        address = ctypes.addressof(view)
        del view  # the mapping may close once nothing points into it
        HostRegistration([(address, 1 << 21)], workers=1, device=f.device.index).close()
        page.close()

    def fresh_thread_keeper_warm():  # a thread's first CUDA calls, as a new keeper's
        errors: list[BaseException] = []

        def run():
            try:
                cuda.enter_thread(f.device.index)
                f.keeper.warm(f.hot_ids())
            except BaseException as exc:
                errors.append(exc)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    return {op.__name__: op for op in (
        event_query, event_synchronize, item, tolist, new_allocation, pin_memory, copy_to_pinned,
        unique, stream_from_pool, descriptor_snapshot, keeper_warm, keeper_refresh,
        graph_destroyed, host_unregistered, fresh_thread_keeper_warm, device_synchronize,
        empty_cache)}


class Worker:
    """A thread that runs one operation at a time, in relaxed mode as the client's threads."""

    def __init__(self, device: torch.device, relaxed: bool):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(device, relaxed), daemon=True)
        self._thread.start()

    def _run(self, device: torch.device, relaxed: bool) -> None:
        if relaxed:
            cuda.enter_thread(device.index)
        else:
            cuda.make_current(device.index)
        while (job := self._jobs.get()) is not None:
            op, done = job
            try:
                op()
                done.put(None)
            except Exception as exc:
                done.put(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])

    def run(self, op: Callable[[], object]) -> str | None:
        """The operation's own error, or None; 'hung' past OP_DEADLINE_S."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((op, done))
        try:
            return done.get(timeout=OP_DEADLINE_S)
        except queue.Empty:
            return "hung"

    def stop(self) -> None:
        self._jobs.put(None)


def one_capture(worker: Worker, op: Callable[[], object], device: torch.device) -> dict:
    """Capture (global mode) a kernel, the operation on the worker, a second kernel; replay."""
    x = torch.zeros(1024, device=device)
    graph = torch.cuda.CUDAGraph()
    op_error, capture_error = None, None
    try:
        with torch.cuda.graph(graph):  # capture_error_mode="global", the default
            x.add_(1)
            op_error = worker.run(op)
            x.mul_(3)
    except Exception as exc:
        capture_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    replayed = None
    if capture_error is None:
        x.zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        replayed = bool((x == 3).all())
    try:
        torch.cuda.synchronize(device)  # a spoilt capture can leave an error behind: clear it
    except Exception as exc:
        capture_error = capture_error or f"after: {type(exc).__name__}: {exc}".splitlines()[0][:300]
    return {"op_error": op_error, "capture_error": capture_error, "replayed_right": replayed}


def probe(names: list[str], trials: int, relaxed: bool, device: torch.device) -> list[dict]:
    fixture = Fixture(device)
    ops = operations(fixture)
    unknown = sorted(set(names) - set(ops))
    if unknown:
        sys.exit(f"unknown operations {unknown}; known: {sorted(ops)}")
    worker = Worker(device, relaxed)
    rows = []
    for name in names or list(ops):
        for _ in range(2):  # untimed first calls: compile and load what the operation uses
            worker.run(ops[name])
        torch.cuda.synchronize(device)
        results = []
        for _ in range(trials):
            try:
                results.append(one_capture(worker, ops[name], device))
            except Exception:
                results.append({"op_error": None, "capture_error": traceback.format_exc(limit=2)[-300:],
                                "replayed_right": None})
        failed = [r for r in results if r["capture_error"]]
        row = {"op": name, "worker_mode": "relaxed" if relaxed else "global", "trials": trials,
               "captures_failed": len(failed),
               "first_capture_error": failed[0]["capture_error"] if failed else None,
               "op_errors": sum(1 for r in results if r["op_error"]),
               "first_op_error": next((r["op_error"] for r in results if r["op_error"]), None),
               "replays_wrong": sum(1 for r in results if r["replayed_right"] is False)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    worker.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--worker-mode", choices=["relaxed", "global"], default="relaxed")
    parser.add_argument("--ops", nargs="*", default=[], help="operations to probe (default: all)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()
    if not 1 <= args.trials <= GRAPHS - 2:
        parser.error(f"--trials must be 1..{GRAPHS - 2}")
    if not torch.cuda.is_available():
        sys.exit("capture_probe needs a GPU")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    rows = probe(args.ops, args.trials, args.worker_mode == "relaxed", device)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "worker_mode": args.worker_mode, "hot_cache_ways": hot_cache.WAYS, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
