"""What spoils a capture in CUDA's default mode beside a mapped client with a hot-row cache?

tests/gpu/test_captures_in_cudas_default_mode_beside_the_clients_threads fails on an H200: the
engine's capture (global mode, held open until the client's cache keeper has refreshed) is
invalidated, while the same test without the cache passes, and capture_probe.py found every call
of a keeper's refresh harmless on its own (relaxed, 10 trials each). This runs that test's loop
against a real daemon in variants that take one suspect away each, a process per variant:

    control      the test's loop: lookups of hot IDs, then a capture of a captured lookup held
                 open until the keeper has refreshed
    no_lookups   no lookups between captures (the keeper refreshes with nothing to admit)
    gc_off       the cycle collector run before, and off during, each capture (finalisers of
                 the lookups' garbage would run on the capturing thread)
    no_probes    the keeper's grace without the captured lookups' descriptor probes
    no_streams   the keeper's grace without an event on the client's gather stream
    keeper_off   the keeper stopped before the loop (its cache stays; the capture is held 0.3 s)
    after_restart     first, in the same process, what test_captured_gpu.py's restart test does
                 (a captured lookup replayed while its daemon is killed and another starts on
                 other tables, until the client maps them; that client then closed), then the
                 control against a fresh daemon. In the GPU suite the control's test failed
                 only after that test (on an H100: alone and after the first test it passed)
    after_restart_gc  the same, the cycle collector run between the two

In each, the keeper's steps, the capturing thread's, and every cycle collection are traced with
the capture's status (cudaStreamIsCapturing on the capturing stream) before and after: the first
step after which it reads "invalidated" names the call. Each capture notes the threads alive.

    python benchmarks/experiments/capture_beside_keeper.py [--variants NAME ...] [--captures 6]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capture_state import capture_status, thread_capture_mode  # noqa: E402  (this folder)
from common.daemon import bench_folders, running_daemon, start_daemon, stop_process  # noqa: E402

from engramd.client import EngramClient, ReplayFailedError  # noqa: E402

VARIANTS = ("control", "no_lookups", "gc_off", "no_probes", "no_streams", "keeper_off",
            "after_restart", "after_restart_gc")
DAEMON_FLAGS = ["--tables", "demo", "--backend", "cuda", "--hot-cache-gib", "0.25",
                "--hot-cache-refresh-ms", "5"]
MAX_TOKENS = 256
REFRESH_WAIT_S = 10.0  # a capture held open longer than this for a refresh gives up waiting
RIDE_S = 90.0  # the restart prelude's replays give up waiting for the new tables after this
CHILD_TIMEOUT_S = 240.0


class Tracer:
    """Steps with the status of the capture in progress after each (None: no capture)."""

    def __init__(self):
        self.stream: torch.cuda.Stream | None = None  # the capturing stream, while it captures
        self.steps: list[tuple[float, str, str, str]] = []
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self.wall_start = time.strftime("%H:%M:%S") + f".{int(time.time() * 1e3) % 1000:03d}"  # stderr's clock

    def status(self) -> str:
        stream = self.stream
        return "-" if stream is None else capture_status(stream)

    def note(self, step: str) -> None:
        with self._lock:
            self.steps.append((round((time.perf_counter() - self._start) * 1e3, 2),
                               threading.current_thread().name, step, self.status()))

    def wrap(self, owner: object, name: str) -> None:
        """Trace owner.name's calls (before and after)."""
        inner = getattr(owner, name)

        def traced(*args, **kwargs):
            self.note(f"{name} <")
            try:
                return inner(*args, **kwargs)
            finally:
                self.note(f"{name} >")
        setattr(owner, name, traced)

    def watch_collections(self) -> None:
        """Note every cycle collection, with the capture's status before and after."""
        gc.callbacks.append(lambda phase, info: self.note(f"gc {phase} gen {info['generation']}"))

    def first_invalidated(self) -> list | None:
        return next((list(s) for s in self.steps if s[3] == "Invalidated"), None)


class LogRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}"[:300])


def ride_through_a_restart(work: Path, shm: Path) -> dict:
    """test_captured_gpu.py's restart test, in short: a captured lookup (captured in
    "thread_local" mode) replayed while its daemon is killed and another starts on other tables,
    until the client maps those; then the client closed and the daemon stopped. As in the test,
    what it made is left to the cycle collector (the replay error it kept holds this frame)."""
    from engramd.server.synthetic import write_synthetic_checkpoint

    flags = ["--backend", "cuda", "--hot-cache-gib", "0.25", "--hot-cache-refresh-ms", "5",
             "--shm-dir", str(shm)]
    first, socket = start_daemon(work, ["--tables", "demo", *flags], timeout=120)
    outcome = {"replays": 0, "failed_replays": 0, "remapped": False}
    client, second = None, None
    try:
        client = EngramClient(socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS,
                              reconnect_timeout=120)
        geometry = client.geometry
        buffer = torch.zeros((MAX_TOKENS, geometry.n_layers, geometry.heads), dtype=torch.int64, device="cuda")
        captured = client.capturable_lookup(buffer)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            captured.record(48)
        old_tables = client._mapped_path.tables
        first.kill()
        first.wait()
        other = write_synthetic_checkpoint(geometry, work / "other", seed=5)
        second, _ = start_daemon(work, ["--tables", str(other), *flags], timeout=120)
        deadline = time.monotonic() + RIDE_S
        while time.monotonic() < deadline and not outcome["remapped"]:
            graph.replay()
            torch.cuda.synchronize()
            outcome["replays"] += 1
            try:
                captured.check()
            except ReplayFailedError as exc:
                outcome["failed_replays"] += 1
                # Kept, as the test's pytest.raises keeps it: its traceback holds this frame, so
                # the graph, the captured lookup and the client go with a cycle collection.
                failed = exc  # noqa: F841
            outcome["remapped"] = client._mapped_path.tables is not old_tables
        outcome["main_thread_mode_remapped"] = thread_capture_mode()
        for _ in range(20):  # replays of the new tables, as the test's
            graph.replay()
        torch.cuda.synchronize()
        # As the test ends: the counts settled (the replay that adopted the new tables is a
        # poisoned one), then check() raises for it, and the error is kept.
        captured.counts()
        torch.cuda.synchronize()
        outcome["counts"] = captured.counts()
        try:
            captured.check()
        except ReplayFailedError as exc:
            outcome["failed_replays"] += 1
            failed = exc  # noqa: F841
    finally:
        if client is not None:
            client.close()
        for daemon in (first, second):
            if daemon is not None and daemon.poll() is None:
                outcome["daemon_exit"] = stop_process(daemon, 60)
    return outcome


def run_variant(variant: str, captures: int) -> dict:
    torch.cuda.set_device(0)
    records = LogRecords()
    logging.getLogger("engramd").addHandler(records)
    rng = np.random.default_rng(43)
    results = []
    prelude = None
    if variant.startswith("after_restart"):
        with bench_folders(show_log=False) as (work, shm):
            prelude = ride_through_a_restart(work, shm)
        prelude["main_thread_mode_after"] = thread_capture_mode()
        if variant == "after_restart_gc":
            prelude["collected"] = gc.collect()
            prelude["main_thread_mode_after_gc"] = thread_capture_mode()
    with bench_folders(show_log=False) as (work, shm), \
            running_daemon(work, [*DAEMON_FLAGS, "--shm-dir", str(shm)], timeout=120) as socket, \
            EngramClient(socket, device="cuda", mode="mapped", max_tokens=MAX_TOKENS) as client:
        geometry = client.geometry
        keeper = client._mapped_path.tables.keeper
        assert keeper is not None, "the daemon gave the client no hot-row cache"
        tracer = Tracer()
        tracer.watch_collections()
        for name in ("_read_counts", "_candidates", "_change", "_grace", "_age_if_due",
                     "_record", "_wait_for"):
            tracer.wrap(keeper, name)
        if variant == "no_probes":
            keeper.gather_probes = list
        if variant == "no_streams":
            keeper.gather_streams = list
        if variant == "keeper_off":
            keeper.close()
        buffer = torch.full((MAX_TOKENS, geometry.n_layers, geometry.heads), -1, dtype=torch.int64,
                            device="cuda")
        captured = client.capturable_lookup(buffer)
        rows_per_layer = [sum(primes) for primes in geometry.primes]
        hot = np.stack([rng.integers(0, r, size=(64, geometry.heads)) for r in rows_per_layer], axis=1)
        for n in range(captures):
            if variant != "no_lookups":
                for _ in range(4):
                    client.lookup(torch.from_numpy(hot).cuda()).result()
            if variant == "gc_off":
                gc.collect()
                gc.disable()
            graph = torch.cuda.CUDAGraph()
            refreshes = keeper.stats.refreshes
            stream = torch.cuda.Stream()
            error = None
            tracer.note(f"capture {n} begins; main thread's mode {thread_capture_mode()}; threads: "
                        + ", ".join(sorted(t.name for t in threading.enumerate())))
            try:
                with torch.cuda.graph(graph, stream=stream):  # capture_error_mode="global"
                    tracer.stream = stream
                    tracer.note("record <")
                    captured.record(16)
                    tracer.note("record >")
                    deadline = time.monotonic() + (0.3 if variant == "keeper_off" else REFRESH_WAIT_S)
                    while time.monotonic() < deadline and (
                            variant == "keeper_off" or keeper.stats.refreshes <= refreshes):
                        time.sleep(0.001)
                    tracer.note("capture ends")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            finally:
                tracer.stream = None
                if variant == "gc_off":
                    gc.enable()
            try:
                torch.cuda.synchronize()
            except Exception as exc:
                error = error or f"after: {exc}".splitlines()[0][:200]
            results.append({"capture": n, "error": error, "refreshes_during": keeper.stats.refreshes - refreshes,
                            "first_invalidated": tracer.first_invalidated()})
            if error:
                break  # torch keeps a failed capture's state: later captures say nothing
        steps = tracer.steps[-80:]
        wall_start = tracer.wall_start
    logging.getLogger("engramd").removeHandler(records)
    return {"variant": variant, "prelude": prelude, "wall_start": wall_start, "captures": results, "failed": any(r["error"] for r in results),
            "admitted": keeper.stats.admitted, "log": records.records[:10], "last_steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--captures", type=int, default=6)
    parser.add_argument("--out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("capture_beside_keeper needs a GPU")
    if args.child:
        print(json.dumps(run_variant(args.variants[0], args.captures)), flush=True)
        return
    rows = []
    for variant in args.variants:
        command = [sys.executable, __file__, "--child", "--variants", variant, "--captures", str(args.captures)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if lines else {
                "variant": variant, "child_failed": f"exit {done.returncode}"}
            # CUDA's warnings (a graph's reset that failed, and when) are on the child's stderr.
            row["stderr_tail"] = done.stderr.strip()[-2000:]
        except subprocess.TimeoutExpired:
            row = {"variant": variant, "child_failed": f"no answer within {CHILD_TIMEOUT_S:.0f} s"}
        summary = {k: row.get(k) for k in ("variant", "failed", "admitted", "prelude", "child_failed")}
        summary["captures"] = [(c["capture"], c["error"], c["refreshes_during"], c["first_invalidated"])
                               for c in row.get("captures", [])]
        print(json.dumps(summary), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
