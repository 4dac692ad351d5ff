"""One replica process of benchmarks/node_run.py: a client on one GPU, driven by the parent.

    CUDA_VISIBLE_DEVICES=GPU-<uuid> python benchmarks/node_client.py --reply-fd FD [--device cuda]

The parent starts one of these per GPU (and one per TP rank), each with CUDA_VISIBLE_DEVICES set
to its GPU's UUID, so every one of them sees its GPU as cuda:0 while the daemon sees all GPUs by
their own indices; only the UUID names the same GPU on both sides. The parent writes one JSON
command a line to stdin and reads one JSON reply a line from FD (stdout and stderr stay free for
logs). A failed command is answered with its error and traceback, never by a silent exit; stdin
closing (the parent died) ends the process.

    hello            pid, devices this process sees, the UUID of its device 0
    connect          register with the daemon (socket, tp_rank, tp_size, max_tokens, slots)
    lookup           look up saved ID tensors, save CPU copies of the rows for the parent to check
    draw             pre-draw the timing pool of hash IDs on the device
    time_engramd     at a given wall-clock time, loop lookups through the daemon for N seconds
    disconnect       release the registration
    map_tables       map the table files, pin them, build the in-process gather plan, and check
                     that it returns the same rows as the daemon did for the first saved lookup
    time_in_process  the same loop, same IDs, with the in-process plan
    unmap            unpin and unmap
    exit

What this is not: a model runner (no consumer kernels behind the waits) or a general tool.
`--device cpu` runs the same commands against a CPU daemon, with the CPU reference kernel as the
"in-process" gather: a smoke test of the orchestration whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engramd.client import EngramClient
from engramd.client.geometry import TableGeometry
from engramd.kernels import gather_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.rows import bitwise_mismatches  # noqa: E402
from common.tables import MappedTable, pin_as_reader  # noqa: E402

WARM_LOOKUPS = 3  # untimed lookups before each timed loop (first use of each slot)


def wait_until(wall_time: float) -> float:
    """Sleep until `wall_time` (time.time()); returns how late we were (s, 0 if early)."""
    late = time.time() - wall_time
    if late < 0:
        time.sleep(-late)
    return max(late, 0.0)


class Replica:
    """The state of this process across commands: client, IDs, in-process tables."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.client: EngramClient | None = None
        self.stream: torch.cuda.Stream | None = None
        self.geometry: TableGeometry | None = None
        self.pool: list[torch.Tensor] = []
        self.first: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, daemon rows) on CPU
        self.mapped: list[MappedTable] = []
        self.pinned = None
        self.plan: Callable[[torch.Tensor], torch.Tensor] | None = None

    # -- commands ---------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        reply: dict[str, Any] = {"pid": os.getpid(), "device": str(self.device),
                                 "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        if self.cuda:
            from engramd.client.shared.cuda import device_uuid

            torch.cuda.set_device(self.device)
            reply.update(device_count=torch.cuda.device_count(), uuid=device_uuid(0),
                         name=torch.cuda.get_device_name(0))
        return reply

    def connect(self, socket: str, tp_rank: int, tp_size: int, max_tokens: int, slots: int,
                name: str, mode: str = "auto") -> dict[str, Any]:
        self.client = EngramClient(socket, device=self.device, tp_rank=tp_rank, tp_size=tp_size,
                                   max_tokens=max_tokens, slots=slots, timeout=60, name=name,
                                   mode=mode)
        self.geometry = self.client.geometry
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
        shard = self.client.shard
        return {"client_id": self.client.client_id, "mode": self.client.mode,
                "rows": list(self.geometry.rows),
                "head_start": shard.head_start, "head_end": shard.head_end,
                "local_heads": shard.local_heads}

    def lookup(self, ids_paths: list[str], rows_paths: list[str]) -> dict[str, Any]:
        """Each saved ID tensor through the daemon; rows copied to CPU and saved."""
        in_slab, devices = [], []
        for ids_path, rows_path in zip(ids_paths, rows_paths, strict=True):
            ids = torch.load(ids_path, weights_only=True)
            rows = self._lookup_once(ids.to(self.device))
            in_slab.append(self._in_slab(rows))
            devices.append(str(rows.device))
            rows = rows.cpu().clone()
            torch.save(rows, rows_path)
            if self.first is None:
                self.first = (ids, rows)
        return {"in_slab": in_slab, "devices": devices}

    def draw(self, tokens: int, count: int, seed: int) -> dict[str, Any]:
        """`count` batches of hash IDs the way hashing makes them: head h's ID in bucket h."""
        geometry = self.geometry
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        offsets = torch.tensor(geometry.offsets, dtype=torch.int64, device=self.device)
        sizes = torch.tensor(geometry.primes, dtype=torch.float64, device=self.device)
        shape = (tokens, geometry.n_layers, geometry.heads)
        self.pool = [offsets + (torch.rand(shape, generator=gen, dtype=torch.float64,
                                           device=self.device) * sizes).long()
                     for _ in range(count)]
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return {"batches": count, "bytes": sum(t.numel() * t.element_size() for t in self.pool)}

    def time_engramd(self, seconds: float, start_at: float, depth: int) -> dict[str, Any]:
        client, stream = self.client, self.stream

        def submit(ids: torch.Tensor) -> None:
            future = client.lookup(ids, stream)
            if self.cuda:
                future.wait(stream)  # rows ready on our stream; no host round trip
            else:
                future.result()

        heads = client.shard.local_heads
        return self._timed(submit, seconds, start_at, depth, heads)

    def disconnect(self) -> dict[str, Any]:
        if self.client is not None:
            self.client.close()
            self.client = None
        return {}

    def map_tables(self, tables: list[dict[str, Any]]) -> dict[str, Any]:
        started = time.monotonic()
        self.mapped = [MappedTable(t["path"], t["data_offset"], t["rows"], t["row_bytes"])
                       for t in tables]
        shard = self.geometry.shard(0, 1)
        if self.cuda:
            from engramd.kernels.gather_triton import GatherPlan
            self.pinned = pin_as_reader(self.mapped)
            plan = GatherPlan(self.pinned.layer_tables(), shard, self.device)
            plan.warm_up()  # kernels load per process: warming on one stream serves all
            torch.cuda.synchronize(self.device)
            out = torch.empty(plan.output_shape(self.pool[0].shape[0]), dtype=torch.bfloat16,
                              device=self.device)

            def run(ids: torch.Tensor) -> torch.Tensor:
                target = out if ids.shape[0] == out.shape[1] else None
                return plan(ids, target, stream=self.stream)

            self.plan = run
        else:
            tensors = [torch.from_numpy(t.array) for t in self.mapped]
            self.plan = lambda ids: gather_ref.gather(tensors, ids, shard)[0]
        ready_s = time.monotonic() - started
        mismatches, first_wrong = self._check_plan()
        return {"pin_and_warm_s": ready_s, "mismatches_vs_daemon": mismatches,
                "first_wrong": first_wrong}

    def time_in_process(self, seconds: float, start_at: float, depth: int) -> dict[str, Any]:
        return self._timed(self.plan, seconds, start_at, depth, self.geometry.heads)

    def unmap(self) -> dict[str, Any]:
        self.plan = None
        if not self.mapped:
            return {}
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no gather may still read the pages
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None
        for table in self.mapped:
            table.close()
        self.mapped = []
        return {}

    def close(self) -> None:
        self.disconnect()
        self.unmap()

    # -- helpers ----------------------------------------------------------------------------

    def _lookup_once(self, ids: torch.Tensor) -> torch.Tensor:
        future = self.client.lookup(ids, self.stream)
        if not self.cuda:
            return future.result()
        rows = future.wait(self.stream)
        self.stream.synchronize()  # nothing of ours waits on the daemon once this returns
        return rows

    def _in_slab(self, rows: torch.Tensor) -> bool:
        """The rows are a view of the slot memory (the daemon's slab served, the client's own
        mapped), not a copy (reads the client's internals)."""
        slab = self.client._slab
        if self.client.mode == "mapped":
            base = slab.views.buffer.data_ptr()
        else:
            base = slab.ptr if self.cuda else slab.buffer.data_ptr()
        last = rows[(-1,) * rows.dim()]  # the rows are strided by layer (client/shared/slab.py)
        end = last.data_ptr() + last.element_size()
        return base <= rows.data_ptr() and end <= base + self.client.layout.size

    def _check_plan(self) -> tuple[int, list]:
        """The in-process plan must return what the daemon returned for the same IDs."""
        ids, daemon_rows = self.first
        rows = self.plan(ids.to(self.device))
        if self.cuda:
            self.stream.synchronize()
        return bitwise_mismatches(rows.cpu(), daemon_rows)

    def _timed(self, submit: Callable[[torch.Tensor], Any], seconds: float, start_at: float,
               depth: int, heads: int) -> dict[str, Any]:
        """Lookups over the pool until `seconds` have passed; at most `depth` in flight."""
        pool = self.pool
        for ids in pool[:WARM_LOOKUPS]:
            submit(ids)
        self._sync()
        late_s = wait_until(start_at)
        in_flight: collections.deque = collections.deque()
        count = 0
        wall_start = time.time()
        started = time.perf_counter()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            if len(in_flight) >= depth:
                in_flight.popleft().synchronize()
            submit(pool[count % len(pool)])
            if self.cuda:
                done = torch.cuda.Event()
                done.record(self.stream)
                in_flight.append(done)
            count += 1
        self._sync()
        elapsed = time.perf_counter() - started
        tokens, layers = pool[0].shape[0], pool[0].shape[1]
        rows = count * tokens * layers * heads
        return {"lookups": count, "rows": rows, "seconds": elapsed, "rows_per_s": rows / elapsed,
                "us_per_lookup": elapsed / max(count, 1) * 1e6, "wall_start": wall_start,
                "wall_end": wall_start + elapsed, "late_start_s": late_s,
                "pool_batches": len(pool)}

    def _sync(self) -> None:
        if self.cuda:
            self.stream.synchronize()


def serve(replica: Replica, replies) -> None:
    """Answer commands from stdin until `exit` or end of input."""
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.pop("op")
        if op == "exit":
            _reply(replies, {"ok": True, "op": op})
            return
        try:
            handler = getattr(replica, op, None)
            if op.startswith("_") or op == "close" or handler is None:
                raise ValueError(f"unknown command {op!r}")
            result = handler(**command)
            _reply(replies, {"ok": True, "op": op, **result})
        except Exception as exc:  # the parent decides; it needs the cause, not our exit code
            _reply(replies, {"ok": False, "op": op, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()})


def _reply(replies, message: dict[str, Any]) -> None:
    replies.write(json.dumps(message) + "\n")
    replies.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reply-fd", type=int, required=True, help="file descriptor for replies")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    replica = Replica("cuda:0" if args.device == "cuda" else "cpu")
    with os.fdopen(args.reply_fd, "w") as replies:
        try:
            serve(replica, replies)
        finally:
            replica.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
