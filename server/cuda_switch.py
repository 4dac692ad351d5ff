"""A reload on the CUDA backend: every GPU switches to the new tables between two lookups.

A reload's tables arrive pinned (server/reload.py); here each GPU gets what its lookups need
over them, built on the loop's thread before anything changes (`prepare_switch`: a new, empty
hot-row cache and keeper, since the old cache holds the old tables' rows, and each live slab's
gather plan). Then each GPU's worker takes its switch in its place among the lookups
(`switch_gpu`), so the slabs' daemon streams see the old tables up to one lookup and the new
ones after it. What the switches replaced, and the old tables' pin, are let go on a thread of
their own once every stream has passed that point (`_retire_tables`).

Not the serving itself (cuda_backend.py), nor the reload's load or the daemon's side of the
switch (reload.py, reload_control.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engramd.client.shared import cuda
from engramd.client.shared.cache_keeper import CacheKeeper
from engramd.kernels.gather_triton import GatherPlan, LayerTable, SlotGather
from engramd.kernels.hot_cache import HotCache
from engramd.server.cuda_slab import RELEASE_DEADLINE_S

if TYPE_CHECKING:
    from engramd.server.cuda_backend import CudaBackend, GpuState, PinnedTables
    from engramd.server.cuda_slab import CudaSlab
    from engramd.server.quiet_gate import QuietGate

log = logging.getLogger("engramd.cuda")


@dataclass
class TableSwitch:
    """What a GPU serves after a reload (prepare_switch, then switch_gpu)."""

    cache: HotCache | None
    keeper: CacheKeeper | None
    gathers: dict[CudaSlab, tuple[GatherPlan, SlotGather]]
    warm_plan: GatherPlan
    replaced: list[Any] = field(default_factory=list)  # what it replaced, kept until retired


def switch_tables(backend: CudaBackend, pinned: PinnedTables, retired: Callable[[], None]) -> None:
    """Lookups submitted from now on read the `pinned` tables (CudaBackend.replace_tables says
    how); `retired()` is called from another thread once no gather can read the old ones."""
    layer_tables = pinned.layer_tables()
    switches: dict[int, TableSwitch] = {}
    try:  # nothing changes until every GPU's switch is ready
        for index, gpu in backend.gpus.items():
            switches[index] = prepare_switch(gpu, pinned, layer_tables)
    except BaseException:
        for index, switch in switches.items():
            drop_switch(backend.gpus[index], switch)
        raise
    old_pinned, backend.pinned, backend.layer_tables = backend.pinned, pinned, layer_tables
    passed: list[torch.cuda.Event] = []
    left = threading.Semaphore(0)

    def switch_on(index: int) -> Callable[[], None]:
        def run() -> None:
            try:
                passed.extend(switch_gpu(backend.gpus[index], switches[index]))
            finally:
                left.release()
        return run

    for index in backend.gpus:
        if backend.inline:
            switch_on(index)()
        else:
            backend.workers[index].call(switch_on(index))
    threading.Thread(target=_retire_tables, args=(old_pinned, switches, left, passed, retired, backend.gate),
                     name="engramd-retire-tables", daemon=True).start()


def prepare_switch(gpu: GpuState, pinned: PinnedTables, layer_tables: list[LayerTable]) -> TableSwitch:
    """A reload's new tables for this GPU, built on the loop's thread (allocations, no
    waits): a new empty cache and keeper (the old cache holds rows of the old tables), and
    each live slab's gathers over them. The worker takes them with switch_gpu()."""
    cache, keeper = gpu.new_cache(pinned)
    gathers = {slab: slab.gathers(layer_tables, cache) for slab in list(gpu.slabs)}
    with torch.cuda.device(gpu.index):
        warm_plan = GatherPlan(layer_tables, gpu.geometry.shard(0, 1), gpu.device)
        torch.cuda.current_stream().synchronize()  # the new cache's and plans' device arrays
    switch = TableSwitch(cache, keeper, gathers, warm_plan)
    gpu.pending_switches.append(switch)
    return switch


def drop_switch(gpu: GpuState, switch: TableSwitch) -> None:
    """A prepared switch that will not happen (another GPU's could not be prepared)."""
    gpu.pending_switches.remove(switch)


def switch_gpu(gpu: GpuState, switch: TableSwitch) -> list[torch.cuda.Event]:
    """On the thread that enqueues this GPU's gathers, between two lookups: every gather
    enqueued from now on reads the new tables and cache. Returns an event per slab stream,
    recorded after its last gather on the old ones."""
    old_keeper = gpu.keeper
    # What gathers enqueued until now use stays alive until they have run (_retire_tables
    # holds the switch): freed now, the allocator could hand their memory out under them.
    switch.replaced = [gpu.cache, old_keeper, gpu.warm_plan]
    gpu.cache, gpu.keeper, gpu.warm_plan = switch.cache, switch.keeper, switch.warm_plan
    gpu.pending_switches.remove(switch)
    for slab in list(gpu.slabs):
        if slab in switch.gathers:  # slabs made since prepare_switch have the new ones
            switch.replaced.append((slab.plan, slab.gather))
            slab.plan, slab.gather = switch.gathers[slab]
    draining = gpu.draining_slabs()  # freed slabs whose last gathers may still run read them too
    done = []
    for slab in {*gpu.slabs, *draining}:
        event = torch.cuda.Event()
        event.record(slab.stream)
        done.append(event)
    if old_keeper is not None:
        old_keeper.stop()  # joined by _retire_tables: a refresh may wait on a stream
    if gpu.keeper is not None:
        gpu.keeper.start()
    return done


def _retire_tables(old: PinnedTables, switches: dict[int, TableSwitch],
                   switched: threading.Semaphore, passed: list[torch.cuda.Event],
                   retired: Callable[[], None], gate: QuietGate) -> None:
    """Once every GPU has switched and every slab stream has passed its switch: free what
    the switches replaced, then, once every GPU is quiet (the gate), unregister the old tables
    and call `retired()`. A stream held up by a client holds them up too."""
    for _ in switches:
        switched.acquire()
    cuda.make_current(next(iter(switches)))
    started, warned = time.monotonic(), False
    for event in passed:
        while not event.query():
            if not warned and time.monotonic() - started > RELEASE_DEADLINE_S:
                log.warning("the tables a reload replaced stay registered: a daemon stream "
                            "has not passed the switch in %.0f s (a client stream held up?)",
                            RELEASE_DEADLINE_S)
                warned = True
            time.sleep(0.001)
    for switch in switches.values():
        for replaced in switch.replaced:
            if isinstance(replaced, CacheKeeper):
                replaced.close()  # its last writes into the old cache are done
        switch.replaced.clear()

    def unmap() -> None:  # without the GPUs' locks: unmapping hundreds of GiB takes a while
        old.close()
        log.info("the replaced tables are unregistered")

    # cudaHostUnregister waits for the whole device: made once the daemon has nothing queued on
    # any GPU (server/quiet_gate.py says why); the store lets go of the tables after it.
    gate.defer("the replaced tables' unregister", old.unregister, then=unmap, after=retired)
