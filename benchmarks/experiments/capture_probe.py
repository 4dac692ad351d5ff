"""Which of a client's background CUDA calls spoil an engine's graph capture in CUDA's default mode?

vLLM and SGLang capture with `torch.cuda.graph(...)` in its default mode, "global": a possibly
unsafe CUDA call from any other thread in that mode is refused and invalidates the capture. A
client's own threads (the hot-row cache's keeper, the heartbeat, the captured lookups' upkeep)
enter relaxed mode first (client/shared/cuda.py: enter_thread), which lets such calls through;
calls that are illegal during any capture (a synchronize of the whole device) still spoil it.
tests/gpu/test_captured_gpu.py's capture in the default mode, held open while the keeper
refreshes, failed on an H200 (its first run): this probe names the call.

For each operation below, in a process of its own, up to TRIALS times: the main thread begins
a capture in global mode and launches a kernel in it; a worker thread then runs the operation
while the capture is open; the main thread launches a second kernel and ends the capture, then
replays the graph and checks what it wrote. The first capture that fails ends the operation's
trials (torch leaves a failed capture's state behind: later captures in that process would not
say anything of the operation). Reported per operation: the trial whose capture failed (none:
every one held), its error, and errors of the operation itself.

The worker enters relaxed mode as the client's threads do; `--worker-mode global` leaves it in
the default mode: the control, in which a possibly unsafe call must spoil the capture, else the
probe cannot see it. Three operations call through threads or guards of their own that are
relaxed whatever the worker is (host_unregistered's registering threads, graph_destroyed's
torch guard), or that follow the worker's mode (fresh_thread_keeper_warm). keeper_refresh finds
no logged candidates (nothing gathers here): it makes a refresh's reads and its aging;
keeper_warm makes the rest of a refresh's calls (invalidate, grace, fill, publish). What the
capturing thread itself does (a captured lookup's record()) is not probed here: captures in
"thread_local" mode, where only that thread counts, hold (tests/gpu/test_captured_gpu.py).

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
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engramd.client.shared import cuda
from engramd.client.shared.host_pin import HostRegistration
from engramd.kernels import descriptor as desc

ROW_BYTES, ROWS, LAYERS, HEADS = 264, 1 << 16, 2, 8
OP_DEADLINE_S = 30.0  # an operation still running then is reported as hung
GRAPHS = 64  # graphs for graph_destroyed to let go, one a call: enough for 2 + --trials calls
CHILD_TIMEOUT_S = 120.0  # an operation's process: imports, the fixture and its trials
OPERATIONS = (
    "event_query", "event_synchronize", "item", "tolist", "new_allocation", "pin_memory",
    "copy_to_pinned", "unique", "stream_from_pool", "descriptor_snapshot", "keeper_warm",
    "keeper_refresh", "graph_destroyed", "host_unregistered", "fresh_thread_keeper_warm",
    "device_synchronize", "empty_cache")


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
        self.kept: list[object] = []  # what an operation could not let go during a capture
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


def operations(f: Fixture, relaxed: bool = True) -> dict[str, Callable[[], object]]:
    """What the client's threads do while an engine may capture, one call (or step) each;
    `relaxed`: the worker's mode, which a thread an operation starts takes too."""
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
        registration = HostRegistration([(address, 1 << 21)], workers=1, device=f.device.index)
        try:
            registration.close()
        except BaseException:
            f.kept.append((registration, page))  # still registered: never unmapped under it
            raise
        page.close()

    def fresh_thread_keeper_warm():  # a thread's first CUDA calls, as a new keeper's
        errors: list[BaseException] = []

        def run():
            try:
                (cuda.enter_thread if relaxed else cuda.make_current)(f.device.index)
                f.keeper.warm(f.hot_ids())
            except BaseException as exc:
                errors.append(exc)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    ops = {op.__name__: op for op in (
        event_query, event_synchronize, item, tolist, new_allocation, pin_memory, copy_to_pinned,
        unique, stream_from_pool, descriptor_snapshot, keeper_warm, keeper_refresh,
        graph_destroyed, host_unregistered, fresh_thread_keeper_warm, device_synchronize,
        empty_cache)}
    assert tuple(ops) == OPERATIONS, "OPERATIONS names the operations, in order"
    return ops


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


def probe_one(name: str, trials: int, relaxed: bool, device: torch.device) -> dict:
    """In this process: `name`'s trials, up to the first capture that fails."""
    fixture = Fixture(device)
    op = operations(fixture, relaxed)[name]
    worker = Worker(device, relaxed)
    first_calls = [worker.run(op) for _ in range(2)]  # untimed: compile and load what it uses
    torch.cuda.synchronize(device)
    results = []
    for _ in range(trials):
        results.append(one_capture(worker, op, device))
        if results[-1]["capture_error"] or results[-1]["op_error"] == "hung":
            break
    worker.stop()
    failed = next((n for n, r in enumerate(results, start=1) if r["capture_error"]), None)
    return {"op": name, "worker_mode": "relaxed" if relaxed else "global", "trials": len(results),
            "failed_at_trial": failed,
            "capture_error": results[failed - 1]["capture_error"] if failed else None,
            "op_errors": sum(1 for r in results if r["op_error"]),
            "first_op_error": next((r["op_error"] for r in results if r["op_error"]), None),
            "first_calls_errors": [e for e in first_calls if e],
            "replays_wrong": sum(1 for r in results if r["replayed_right"] is False)}


def probe(names: list[str], trials: int, worker_mode: str, device_index: int) -> list[dict]:
    """Each operation in a child process (this script with --child); its row, or what ended it."""
    rows = []
    for name in names:
        command = [sys.executable, __file__, "--child", "--ops", name, "--trials", str(trials),
                   "--worker-mode", worker_mode, "--device", str(device_index)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "op": name, "worker_mode": worker_mode,
                "child_failed": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}
        except subprocess.TimeoutExpired:
            row = {"op": name, "worker_mode": worker_mode,
                   "child_failed": f"no answer within {CHILD_TIMEOUT_S:.0f} s (hung)"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--worker-mode", choices=["relaxed", "global"], default="relaxed")
    parser.add_argument("--ops", nargs="*", default=[], help="operations to probe (default: all)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.trials <= GRAPHS - 2:
        parser.error(f"--trials must be 1..{GRAPHS - 2}")
    unknown = sorted(set(args.ops) - set(OPERATIONS))
    if unknown:
        parser.error(f"unknown operations {unknown}; known: {list(OPERATIONS)}")
    if not torch.cuda.is_available():
        sys.exit("capture_probe needs a GPU")
    if args.child:
        device = torch.device("cuda", args.device)
        torch.cuda.set_device(device)
        print(json.dumps(probe_one(args.ops[0], args.trials, args.worker_mode == "relaxed", device)),
              flush=True)
        return
    rows = probe(args.ops or list(OPERATIONS), args.trials, args.worker_mode, args.device)
    report = {"device": torch.cuda.get_device_name(args.device), "torch": torch.__version__,
              "worker_mode": args.worker_mode, "trials": args.trials, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
