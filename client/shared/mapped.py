"""Mapped mode: the client maps the daemon's tables read-only and gathers on its own.

Where the daemon's gathers cannot overlap the model's kernels (no MPS server shared on the GPU),
a client does what an in-process engine does, on the daemon's one copy of the tables: it gets
read-only descriptors of the table files over the handle socket (client/shared/handles.py), maps them,
and runs the same gather (the Triton kernel on its GPU, the reference on the CPU) into slots of
its own memory. The daemon keeps the tables, their lifetime, health and metrics.

On a GPU the client also keeps a hot-row cache of its own in HBM (a CacheKeeper over the
mapping, `MappedTables.keeper`), as the daemon does per GPU for its served lookups: a gather in another process cannot safely read the
daemon's cache, and write access to it would let one client change every client's rows.

What this is not: the client's lookup logic (client.py holds it, for both modes).
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engramd.client.errors import InternalError
from engramd.client.geometry import ShardView, TableGeometry
from engramd.client.shared import cuda
from engramd.client.shared.cache_keeper import CacheKeeper
from engramd.client.shared.handles import TableGrant
from engramd.client.shared.slab import SlabLayout, SlotViews


class MappedTables:
    """Read-only mappings of the daemon's tables; on a GPU, registered for UVA reads."""

    def __init__(self, grants: list[TableGrant], geometry: TableGeometry, device: torch.device,
                 populate: bool = False):
        """`populate`: fault every page in now (MAP_POPULATE), not in the first gathers."""
        self.device = device
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self._maps: list[mmap.mmap] = []
        self._registration: Any = None
        self.rows: list[np.ndarray] = []
        # A GPU client's hot-row cache over these tables, and its keeper (set by the client).
        self.keeper: CacheKeeper | None = None
        self._check(grants, geometry)
        try:  # the caller closes the descriptors: the mappings keep the files
            for grant in grants:
                self._maps.append(mmap.mmap(grant.fd, grant.file_bytes, flags, mmap.PROT_READ))
            # numpy views: a read-only mapping exports a read-only buffer, which numpy takes as is.
            self.rows = [np.frombuffer(m, dtype=np.uint8, count=g.rows * g.row_bytes,
                                       offset=g.data_offset).reshape(g.rows, g.row_bytes)
                         for m, g in zip(self._maps, grants, strict=True)]
            if device.type == "cuda":
                self._register(grants)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check(grants: list[TableGrant], geometry: TableGeometry) -> None:
        got = [(g.rows, g.row_bytes) for g in grants]
        want = [(rows, geometry.row_bytes) for rows in geometry.rows]
        if got != want:
            raise InternalError(f"the daemon granted tables of {got} (rows, row bytes); its "
                                f"geometry says {want}")
        for g in grants:
            if g.data_offset % mmap.PAGESIZE or g.data_offset + g.rows * g.row_bytes > g.file_bytes:
                raise InternalError(f"table of layer {g.layer_id}: rows at {g.data_offset} do not "
                                    f"fit a {g.file_bytes}-byte file")

    def _register(self, grants: list[TableGrant]) -> None:
        from engramd.client.shared.cuda import CudaError
        from engramd.client.shared.host_pin import HostRegistration, read_only_supported

        if not read_only_supported():  # the granted descriptors are read-only: so is our mapping
            raise CudaError("mapped mode needs read-only host registration, which this GPU or "
                            "driver does not offer (cudaDevAttrHostRegisterReadOnlySupported); "
                            "register in served mode")
        # Through mappings of its own, in 2 MiB pages where the daemon's pin collapsed them
        # (client/shared/huge_pages.py: a client never collapses); CPU reads go through self.rows.
        self._registration = HostRegistration.of_files(
            [(g.fd, g.data_offset, a.nbytes) for g, a in zip(grants, self.rows, strict=True)],
            read_only=True, device=self.device.index)

    def cpu_tensors(self) -> list[torch.Tensor]:
        """uint8 [rows, row_bytes] CPU tensors over the mappings (never written)."""
        with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is meant to be
            warnings.simplefilter("ignore", UserWarning)
            return [torch.from_numpy(a) for a in self.rows]

    def layer_tables(self) -> list[Any]:
        """The kernel's view: device-visible addresses of the registered rows (UVA); on the CPU
        (the Triton interpreter), the mapping's own."""
        from engramd.kernels.gather_triton import LayerTable

        addresses = (self._registration.addresses if self._registration is not None
                     else [a.ctypes.data for a in self.rows])
        return [LayerTable(address, a.shape[0], a.shape[1], owner=self)
                for address, a in zip(addresses, self.rows, strict=True)]

    def device_rows(self) -> list[torch.Tensor]:
        """uint8 [rows, row_bytes] tensors on the GPU over the registered rows (reads go over UVA)."""
        return cuda.row_views(self._registration.addresses, [a.shape for a in self.rows], self.device)

    def close(self, synchronize: bool = True) -> None:
        """Unmap, after the cache's keeper has stopped (it reads the rows). A GPU client
        synchronises its device first (gathers may still read the rows), unless `synchronize`
        is false: the caller knows that they are done."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.close()
        registration, self._registration = self._registration, None
        try:
            if registration is not None:
                if synchronize:
                    torch.cuda.synchronize(self.device)
                registration.close()
        finally:
            self.rows = []
            for m in self._maps:
                try:
                    m.close()
                except BufferError:
                    pass  # a tensor over it is still alive; the mapping goes with it
            self._maps = []


def close_in_background(tables: MappedTables) -> threading.Thread:
    """Unmap tables nothing reads any more on a thread of its own: when the last mapping of a
    replaced table goes, the kernel frees its pages then and there (~0.4 s per GiB measured on a
    2-CPU VM), and a GPU unregisters them; neither may stall a lookup."""
    def close() -> None:
        if tables.device.type == "cuda":
            cuda.enter_thread(tables.device.index)  # else the unregister lands on device 0
        tables.close(synchronize=False)

    thread = threading.Thread(target=close, name="engramd-unmap", daemon=True)
    thread.start()
    return thread


class PendingMapping:
    """A reload's tables, fetched and mapped on a thread of its own while lookups go on over the
    old mapping: registering V4.1's 189 GiB for a GPU takes seconds, which no lookup() may wait."""

    def __init__(self, fetch: Callable[[], tuple[str, int, list[TableGrant]]], geometry: TableGeometry,
                 device: torch.device):
        self.version: str | None = None
        self.seq = 0
        self.tables: MappedTables | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fetch, geometry, device),
                                        name="engramd-remap", daemon=True)
        self._thread.start()

    def _run(self, fetch: Callable[[], tuple[str, int, list[TableGrant]]], geometry: TableGeometry,
             device: torch.device) -> None:
        try:
            if device.type == "cuda":
                cuda.enter_thread(device.index)  # else the registration lands on device 0
            version, seq, grants = fetch()
            try:
                # A GPU reads through the registration's own mapping: populate only the CPU's.
                self.tables = MappedTables(grants, geometry, device, populate=device.type == "cpu")
            finally:
                for grant in grants:  # the mappings keep the files
                    os.close(grant.fd)
            self.version, self.seq = version, seq
        except BaseException as exc:  # told to the lookup that takes it
            self.error = exc

    def ready(self) -> bool:
        return not self._thread.is_alive()

    def discard(self) -> None:
        """Not taken (the client closes or re-registers): wait for it, then unmap."""
        self._thread.join()
        tables, self.tables = self.tables, None
        if tables is not None:
            tables.close(synchronize=False)  # nothing gathered from it


class LocalSlots:
    """A mapped client's own slot memory, laid out like a slab (client/shared/slab.py) so that results
    are the same [n_layers, T, local_heads, head_dim] views in both modes."""

    def __init__(self, layout: SlabLayout, device: torch.device):
        self.layout = layout
        self.views = SlotViews(layout, torch.zeros(layout.size, dtype=torch.uint8, device=device))

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        return self.views.rows(slot, tokens)

    def slot_rows(self, slot: int) -> torch.Tensor:
        return self.views.slot_rows(slot)

    def close(self) -> None:
        self.views.close()


def mapped_gather(shard: ShardView, tables: MappedTables, device: torch.device, sort_min_tokens: int,
                  default_fraction: float = 1.0, counter: torch.Tensor | None = None):
    """The gather a mapped client runs: fn(ids, out, stream, sm_fraction=None) -> out_of_range
    (CPU) or None. On a GPU it follows the daemon's policy: sorted reads from `sort_min_tokens`
    tokens on, and a persistent grid on `default_fraction` of the SMs (leaving the model's
    kernels room), unless the call names a fraction of its own; it reads through the tables'
    hot-row cache where they have one (`tables.keeper`), and counts out-of-range IDs into
    `counter` (default: a new one), its `out_of_range`."""
    if device.type == "cpu":
        from engramd.kernels.gather_ref import gather

        cpu_tables = tables.cpu_tensors()

        def gather_cpu(ids: torch.Tensor, out: torch.Tensor, stream: Any,
                       sm_fraction: float | None = None) -> int:
            return gather(cpu_tables, ids, shard, out=out)[1]

        return gather_cpu
    from engramd.kernels.gather_triton import GatherPlan, SlotGather, grid_programs

    plan = GatherPlan(tables.layer_tables(), shard, device)
    cache = tables.keeper.cache if tables.keeper is not None else None
    # Exactly what gather_gpu launches: bf16 rows, always counted, through this cache. The grid
    # is a launch argument, but it picks a sorted lookup's block size (sorted_block_rows), which
    # is one: warm_up compiles both sizes, so no fraction of a lookup's own compiles in the hot path.
    with torch.cuda.device(device):  # Triton launches on the thread's device, not the tensors'
        plan.warm_up(caches=(cache,), sort=(False, True) if sort_min_tokens else (False,),
                     dedupe=(False,), packed=(False,), counted=(True,))
    counter = counter if counter is not None else torch.zeros(1, dtype=torch.int64, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    default_programs = grid_programs(sms, default_fraction)
    # Unsorted lookups of contiguous, 16-byte aligned IDs (what the kernel the direct launch
    # reuses was specialised for; slot rows always are) take the served hot path's direct
    # launch of the same kernel: no argument binding, no stream context, less host time before
    # the model's next kernel is queued. Sorted ones, and any other IDs, the plan's checked call.
    direct = SlotGather(plan, counter, cache, default_programs)

    def gather_gpu(ids: torch.Tensor, out: torch.Tensor, stream: Any,
                   sm_fraction: float | None = None) -> None:
        programs = default_programs if sm_fraction is None else grid_programs(sms, sm_fraction)
        if 0 < sort_min_tokens <= ids.shape[0]:
            plan(ids, out, stream=stream, out_of_range=counter, num_programs=programs, sort=True,
                 cache=cache)
        elif (ids.is_contiguous() and ids.data_ptr() % 16 == 0
              and torch.cuda.current_device() == device.index):  # the launch's context
            direct(ids, out, stream, programs)
        else:
            plan(ids, out, stream=stream, out_of_range=counter, num_programs=programs, cache=cache)

    gather_gpu.out_of_range = counter  # type: ignore[attr-defined]
    return gather_gpu


@dataclass
class DeferredGather:
    """A mapped GPU lookup's gather before it is queued (EngramClient's gather_at): its IDs
    (held, so the caller may drop its own reference), the slot rows it fills, the events on
    the streams whose earlier work comes first, and its share of the SMs."""

    ids: torch.Tensor
    out: torch.Tensor
    after: list[torch.cuda.Event]
    sm_fraction: float | None


class DeviceCounterReader:
    """A device counter's value as of its last finished copy to the host, so that a background
    thread (or the daemon's request loop) can report it without ever waiting for the device:
    a copy can wait behind the streams that count into it, or behind a dead client's work."""

    def __init__(self, counter: torch.Tensor, stream: torch.cuda.Stream | None = None):
        self.counter = counter
        # device="cpu" whatever the caller's default device: engines build their modules, and
        # so this client, under `with torch.device("cuda")` (vLLM does).
        self._host = torch.zeros(1, dtype=counter.dtype, device="cpu").pin_memory()
        self._stream = stream if stream is not None else cuda.owned_stream(self, counter.device.index)
        self._copied: torch.cuda.Event | None = None
        self._value = 0

    def read(self, again: bool = True) -> int:
        """The last finished copy's value; `again`: queue the next copy if none is in flight."""
        if self._copied is not None and self._copied.query():
            self._value = int(self._host[0])
            self._copied = None
        if self._copied is None and again:  # the next reading starts now and is taken next time
            with torch.cuda.stream(self._stream):
                self._host.copy_(self.counter, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
        return self._value
