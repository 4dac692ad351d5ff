"""A client's slab on its GPU (CUDA backend): its device memory, completion counters, daemon
stream and gather plans, and their release when the slab is freed.

The memory is one allocation of CUDA's virtual memory API, passed to the client as a file
descriptor over the handle socket together with a block of completion counters in pinned host
memory (client/shared/host_counters.py says why not in the slab). Each slab has its own daemon
stream, so a client that stalls its stream stalls no other client's stream, except one that
shares its hardware queue.

Freeing a slab is the delicate part, and why the slab is a module of its own: the daemon stream
may wait for IDs a dead client never wrote, and the client's streams (under MPS, every client's)
for rows the daemon never wrote. The release satisfies those waits with CPU stores, which no GPU
queue can hold up, until the stream has drained, on a thread of its own so that a slow client
never stalls the loop (`CudaSlab._release_waits`). The counter block's unregister, which waits for
the whole device, goes through the quiet gate (server/quiet_gate.py).

Not what every slab of a GPU shares (cuda_backend.GpuState: its cache, the freed slabs' counts),
nor the enqueueing of a lookup on the slab's stream (cuda_backend.enqueue_lookup).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from engramd.client.errors import ResourceError
from engramd.client.geometry import ShardView
from engramd.client.shared import cuda
from engramd.client.shared.cuda import CudaError, check
from engramd.client.shared.host_counters import HostCounters
from engramd.client.shared.mapped import DeviceCounterReader
from engramd.client.shared.slab import (
    FAILED,
    IDS_READY,
    ROWS_DONE,
    SlabLayout,
    SlotViews,
    wait_passes,
)
from engramd.kernels.gather_triton import GatherPlan, LayerTable, SlotGather
from engramd.kernels.hot_cache import HotCache
from engramd.server.backend import LookupJob

if TYPE_CHECKING:
    from engramd.server.cuda_backend import GpuState

log = logging.getLogger("engramd.cuda")

# A freed slab's release (CudaSlab._release_waits): CPU stores, repeated, pausing 0.1 ms doubling
# to 10 ms, until its daemon stream drains; past the deadline that is logged and it goes on once a
# second.
RELEASE_FIRST_PAUSE_S, RELEASE_MAX_PAUSE_S, RELEASE_DEADLINE_S = 1e-4, 1e-2, 60.0
RELEASE_STUCK_PAUSE_S = 1.0  # past the deadline


class CudaSlab:
    """A client's slab on its GPU: device memory shareable as a descriptor, its daemon stream
    and plan."""

    def __init__(self, device_index: int, uuid: str, layout: SlabLayout, plan_tables: list[LayerTable],
                 shard: ShardView, gpu: GpuState, ops: cuda.StreamOps):
        self.gpu = gpu
        self.ops = ops
        self.device_index = device_index
        self.uuid = uuid
        self.layout = layout
        try:
            self.memory = cuda.DeviceAllocation.create(device_index, layout.size)
        except CudaError as exc:
            raise ResourceError(f"cannot allocate a {layout.size}-byte slab on {uuid}: {exc}") from None
        self.ptr = self.memory.ptr
        try:
            self.counters = HostCounters.create(layout, "engramd-counters", device_index)
            self._build(plan_tables, shard)
        except BaseException as exc:
            stream = getattr(self, "stream", None)
            if stream is not None:  # the memset on it is all that touched the slab
                stream.synchronize()
                cuda.STREAMS.give(stream)
            self.memory.close()
            counters = getattr(self, "counters", None)
            if counters is not None:  # its unregister waits for the whole device: deferred
                counters.close_descriptor()
                gpu.when_quiet("the counter block of a slab not made", counters.unregister,
                               then=counters.close)
            if isinstance(exc, (CudaError, torch.cuda.OutOfMemoryError, OSError)):
                raise ResourceError(f"cannot set up a slab on {uuid}: {exc}") from None
            raise
        # What every lookup passes to CUDA, built once: the stream's handle, the counters'.
        self.raw_stream = self.stream.cuda_stream
        self.ids_ready = [ops.pointer(self.counters.address(s, IDS_READY)) for s in range(layout.slots)]
        self.rows_done = [ops.pointer(self.counters.address(s, ROWS_DONE)) for s in range(layout.slots)]
        self.failed = [ops.pointer(self.counters.address(s, FAILED)) for s in range(layout.slots)]
        self.last_job: dict[int, LookupJob] = {}  # slot -> the last lookup enqueued on it
        gpu.add_slab(self)

    def _build(self, plan_tables: list[LayerTable], shard: ShardView) -> None:
        """The daemon stream, the zeroed slab, the slot views and the gather plan."""
        gpu, layout, index = self.gpu, self.layout, self.device_index
        with torch.cuda.device(index):
            self.stream = cuda.new_stream(index)
            # On the slab's own stream: a plain cudaMemset runs on the legacy default stream and
            # would wait for every blocking stream of the process.
            check("cudaMemsetAsync", cuda.cudart.cudaMemsetAsync(self.ptr, 0, layout.size,
                                                                 self.stream.cuda_stream))
            self.stream.synchronize()
            device = torch.device("cuda", index)
            self.views = SlotViews(layout, cuda.tensor_view(self.ptr, layout.size, device))
            self.shard = shard
            self.out_of_range = torch.zeros(1, dtype=torch.int64, device=device)
            # Read as last copied to the host (GpuState.out_of_range): stats never wait on the GPU.
            self.count_reader = DeviceCounterReader(self.out_of_range, gpu.count_stream)
            self.count_final = False  # its free thread reads the final value: no more copies
            self.plan, self.gather = self.gathers(plan_tables, gpu.serving_cache())

    def gathers(self, plan_tables: list[LayerTable], cache: HotCache | None) -> tuple[GatherPlan, SlotGather]:
        """The slab's plan and plain gather over these tables and cache (a reload builds new
        ones, which the worker takes between two lookups: cuda_switch.switch_gpu)."""
        with torch.cuda.device(self.device_index):
            plan = GatherPlan(plan_tables, self.shard, torch.device("cuda", self.device_index))
            gather = SlotGather(plan, self.out_of_range, cache, self.gpu.programs)
            # The plan's device tables were written on this thread's stream; the gathers read
            # them on the slab's, which does not wait for it.
            torch.cuda.current_stream().synchronize()
        return plan, gather

    def ids(self, slot: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        return self.views.ids(slot, tokens, dtype)

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        return self.views.rows(slot, tokens)

    def ids_handed_over(self, slot: int, seq: int) -> bool:
        return wait_passes(self.counters.load(slot, IDS_READY), seq)

    def wire(self) -> dict[str, Any]:
        return {"kind": "cuda_vmm", "device_uuid": self.uuid, "bytes": self.memory.size,
                "layout": self.layout.to_wire(), "fds": 2}

    def descriptors(self) -> list[int]:
        """New descriptors of the slab's device memory and of its counter block, for its client
        (closed once sent)."""
        memory = self.memory.descriptor()
        try:
            return [memory, self.counters.descriptor()]
        except BaseException:
            os.close(memory)
            raise

    def close(self) -> None:
        """Free the slab in the background once its daemon stream has drained.

        The store calls this only after every lookup of the client has been enqueued, so the
        worker no longer touches the slab. Freeing runs on its own thread: a slow client must
        not stall the loop.
        """
        if not self.ptr:
            return
        ptr, self.ptr = self.ptr, 0
        self.gpu.retire_slab(self)
        threading.Thread(target=self._free, args=(ptr,), name="engramd-free", daemon=True).start()

    def _free(self, ptr: int) -> None:  # the client's own mapping keeps the memory until it lets go
        try:
            with torch.cuda.device(self.device_index):
                cuda.make_current(self.device_index)  # a thread of its own: driver calls follow
                self._release_waits()
                self.gpu.count_freed(self)  # its count is final now: every gather has run
                self.views.close()
                self.memory.close()
                cuda.STREAMS.give(self.stream)  # idle: drained in _release_waits
            # cudaHostUnregister waits for the whole device: made once the daemon has nothing
            # queued on the GPUs (server/quiet_gate.py says why); unmapped after it.
            self.counters.close_descriptor()
            self.gpu.when_quiet(f"the counter block of a freed slab on {self.uuid}",
                                self.counters.unregister, then=self.counters.close)
        except Exception:
            log.exception("freeing the slab on %s failed", self.uuid)
            self.gpu.stuck.add(self)  # its stream's state unknown: close() leaves the GPU alone

    def _release_waits(self) -> None:
        """Satisfy every wait on the slab's counters that its client may never satisfy, until
        the daemon stream has drained: CPU stores into the counter block, which no GPU queue
        can hold up.

        The daemon stream may wait for IDS_READY of a client that died before its stream wrote
        it: each slot's is set to its last enqueued seq (the gathers then read stale IDs into a
        slab nobody reads). The client's streams may wait for ROWS_DONE of a lookup whose
        request died with it in its socket's queue (in a shared MPS server a dead client's
        waiting work can hold up every other client's): each ROWS_DONE is set past every seq
        the client can have used (client/shared/slab.py release_value: waits compare cyclically), and
        the lookups it did not write fail on the client's side (client/failures.py). A
        dead client's stream may still run after its process is gone (an MPS server tears the
        client's context down later) and write an older IDS_READY over the release, and the
        daemon stream's last gathers write older ROWS_DONEs: so the stores are repeated until
        the daemon stream is done, and ROWS_DONE once more after it. Past RELEASE_DEADLINE_S
        that is logged, the slab is counted as stuck (close() then leaves the GPU alone) and
        the release goes on once a second."""
        last = max((job.seq for job in self.last_job.values()), default=0)
        drained = torch.cuda.Event()
        drained.record(self.stream)
        deadline: float | None = time.monotonic() + RELEASE_DEADLINE_S  # None once past it
        pause = RELEASE_FIRST_PAUSE_S
        longest = RELEASE_MAX_PAUSE_S
        while True:
            self._store_release(last)
            if drained.query():
                break
            if deadline is not None and time.monotonic() > deadline:
                log.error("slab of a client on %s: its daemon stream has not drained %.0f s after "
                          "the release; the slab stays allocated and the release goes on",
                          self.uuid, RELEASE_DEADLINE_S)
                self.gpu.stuck.add(self)
                deadline, pause = None, RELEASE_STUCK_PAUSE_S
                longest = RELEASE_STUCK_PAUSE_S
            time.sleep(pause)
            pause = min(pause * 2, longest)
        self._store_release(last)  # after the last gather's ROWS_DONE: nothing lowers it again
        self.gpu.stuck.discard(self)

    def overdue_ids(self, limit_s: float, now: float) -> list[LookupJob]:
        """The slots' last lookups whose IDs the client's stream has not handed over (IDS_READY)
        `limit_s` after they were enqueued, each returned once (a slot holds one such lookup:
        lookup_checks.check_ids_handed_over).

        Only reported, never released: a release would let the gather overwrite the slot's
        rows under readers of its previous lookup, queued behind the same stall."""
        overdue = []
        for slot, job in list(self.last_job.items()):
            enqueued = job.context.enqueued
            if (job.context.overdue or enqueued is None or now - enqueued < limit_s
                    or self.ids_handed_over(slot, job.seq)):
                continue
            job.context.overdue = True
            overdue.append(job)
        return overdue

    def _store_release(self, last: int) -> None:
        """One round of the release; HostCounters.release keeps what the gathers had reached,
        so the client can still tell which of its lookups were served (slab.rows_written)."""
        for slot, job in self.last_job.items():
            self.counters.store(slot, IDS_READY, job.seq)
        for slot in range(self.layout.slots):
            self.counters.release(slot, last)
