"""CUDA backend: pinned host tables, per-client device slabs, one gather worker per GPU.

The host tables (shared-memory files) are registered once with cudaHostRegister (Portable|Mapped|
ReadOnly, in parts of at most 64 GiB, client/shared/host_pin.py), usually before torch is even imported
(table_loader.TablePreload); with unified addressing the device address of a registered byte is
its host address, so one host copy serves every GPU of the node. Each client gets one slab on its
GPU (found by UUID), allocated with CUDA's virtual memory API and passed to the client as a file
descriptor over the handle socket, and its own daemon stream (server/cuda_slab.py, with the
slab's release when it is freed), so a client that stalls its stream stalls no other client's
stream, except one that shares its hardware queue (streams beyond CUDA_DEVICE_MAX_CONNECTIONS, and every stream under MPS, share
queues: client/shared/host_counters.py). A slot then holds at most one such wait (the registry refuses
a slot's next lookup until the last one's IDs are handed over), and one that lasts past
ids_wait_s is reported.

Completion is stream-ordered through 32-bit counters per slot, in pinned host memory shared with
the client (client/shared/host_counters.py says why not in the slab):

    client stream:  copy IDs -> slot ; write IDS_READY = seq
    daemon stream:  wait IDS_READY >= seq ; gather kernel -> slot rows ; write ROWS_DONE = seq
    consumer stream:                                   wait ROWS_DONE >= seq ; read rows

Why counters and not interprocess events: an IPC event wait binds to the last record enqueued at
the time of the wait call, so the client could only enqueue its wait after the daemon's reply
(a host round trip on the critical path). A counter wait is order-independent: the client
enqueues it at once and the daemon may enqueue its write before or after. Measured by
benchmarks/experiments/completion_mechanisms.py (results under benchmarks/results/).

Each GPU also has a hot-row cache in HBM (kernels/hot_cache.py) that the gathers probe, kept
filled by a CacheKeeper thread (client/shared/cache_keeper.py), and lookups of at least
`dedupe_min_tokens` tokens read each distinct row once. The persistent gather grid may be capped
to a fraction of the SMs, so that prefetched lookups leave the model's kernels room.

The daemon's progress never depends on a client's host once a request is sent, and every kernel
is loaded and warmed at start (CUDA_MODULE_LOADING=EAGER is set before CUDA initialises), because
a lazily loaded kernel launched while a stream waits on another process blocks the host.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engramd.client.errors import BadRequestError
from engramd.client.geometry import ShardView, TableGeometry
from engramd.client.shared import cuda
from engramd.client.shared.cache_keeper import CacheKeeper
from engramd.client.shared.cuda import CudaError
from engramd.client.shared.host_pin import HostRegistration
from engramd.client.shared.ids import ID_DTYPES
from engramd.client.shared.mps import MpsState, mps_state
from engramd.client.shared.slab import BF16_NAN, SlabLayout
from engramd.kernels.gather_triton import GatherPlan, LayerTable, grid_programs
from engramd.kernels.hot_cache import HotCache
from engramd.server.backend import Completion, LookupJob
from engramd.server.config import DaemonConfig, from_setting, gib, ms, options_from
from engramd.server.cuda_slab import CudaSlab
from engramd.server.cuda_switch import TableSwitch, switch_tables
from engramd.server.quiet_gate import QuietGate
from engramd.server.table_file import HostTable
from engramd.server.table_registration import register_for_gpus

log = logging.getLogger("engramd.cuda")

# Fault injection for tests: a GPU-side delay (ms) before every gather, so that a test can show the
# client enqueues its consumer work and returns before the rows exist. Never set in production.
GATHER_DELAY_ENV = "ENGRAMD_DEBUG_GATHER_DELAY_MS"
GATHER_DELAY_MS = float(os.environ.get(GATHER_DELAY_ENV, "0") or 0)
SETTLE_POLL_S = 0.001  # a stopping backend's look at its freed slabs' releases
_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep counts GPU clock cycles (~2 GHz on H100/H200)


@dataclass(frozen=True)
class GatherOptions:
    """How lookups are served on every GPU: each field but `warm_ids` one setting's value
    (server/config.py says why each is what it is). Built by `GatherOptions.from_config`;
    defaults are the settings'."""

    cache_bytes: int = from_setting("hot_cache_gib", gib)  # 0: no hot-row cache
    cache_refresh_s: float = from_setting("hot_cache_refresh_ms", ms)
    dedupe_min_tokens: int = from_setting("dedupe_min_tokens")  # 0: never
    sort_min_tokens: int = from_setting("sort_min_tokens")  # 0: never
    sm_fraction: float = from_setting("gather_sm_fraction")  # of each GPU's SMs the gather grid may use
    warm_ids: torch.Tensor | None = field(default=None, compare=False)  # [N, L, H] to warm caches

    @classmethod
    def from_config(cls, config: DaemonConfig, warm_ids: torch.Tensor | None = None) -> GatherOptions:
        return options_from(cls, config, warm_ids=warm_ids)

    def dedupe(self, tokens: int) -> bool:
        return 0 < self.dedupe_min_tokens <= tokens

    def sort(self, tokens: int) -> bool:
        return 0 < self.sort_min_tokens <= tokens

    def launched_variants(self, cache: HotCache | None) -> dict[str, Any]:
        """GatherPlan.warm_up's arguments for exactly the kernel variants _gather launches: BF16
        rows, always counted, on this cache, sorted and deduplicated where these options may."""
        return {"caches": [cache], "packed": (False,), "counted": (True,),
                "dedupe": (False, True) if self.dedupe_min_tokens else (False,),
                "sort": (False, True) if self.sort_min_tokens else (False,)}


class PinnedTables:
    """The host tables registered for the GPUs (table_registration.py); unregistered on close."""

    def __init__(self, tables: list[HostTable], registration: HostRegistration | None = None):
        self.tables = tables
        self._registration = registration if registration is not None else register_for_gpus(tables)

    def layer_tables(self) -> list[LayerTable]:
        """The kernel's view: each table at its registered address (its HugeView, not the
        store's own mapping: the same pages, mapped by PMDs where they could be)."""
        return [LayerTable(address, t.rows, t.row_bytes, owner=self)
                for address, t in zip(self._registration.addresses, self.tables, strict=True)]

    def row_views(self, device: torch.device) -> list[torch.Tensor]:
        """uint8 [rows, row_bytes] CUDA tensors over the registered tables (reads go over UVA)."""
        return cuda.row_views(self._registration.addresses,
                              [(t.rows, t.row_bytes) for t in self.tables], device)

    def unregister(self) -> None:
        """Unregister the tables for the GPUs (it waits for the device: the quiet gate makes it
        while serving); close() unmaps them."""
        self._registration.unregister()

    def close(self) -> None:
        try:
            self._registration.close()
        except CudaError as exc:  # stopping goes on: the process is about to let go of them anyway
            log.error("%s", exc)


class GpuState:
    """What the lookups of one GPU share: its cache and keeper, and the streams they run on."""

    def __init__(self, index: int, pinned: PinnedTables, layer_tables: list[LayerTable],
                 geometry: TableGeometry, options: GatherOptions):
        self.index = index
        self.device = torch.device("cuda", index)
        self.options = options
        self.slabs: set[CudaSlab] = set()  # live ones; the keeper's grace waits on their streams
        # Held while a lookup is enqueued (and tried for a counter copy): the quiet gate holds it
        # for a call that waits for the whole device (server/quiet_gate.py), so that no new
        # wait for a client is queued meanwhile, and only once the daemon's streams are idle.
        # No other holder waits for the device: the gather worker needs it to enqueue the
        # lookups whose release a dead client's wait may need.
        self.enqueue_lock = threading.Lock()
        self.gate: QuietGate | None = None  # the backend's, once every GPU is set up
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        self.programs = grid_programs(sms, options.sm_fraction)
        self.cache: HotCache | None = None
        self.keeper: CacheKeeper | None = None
        # Reads the device's out-of-range counters; copies only, so a read never waits on a gather.
        self.count_stream = cuda.new_stream(index)
        self._freed_lock = threading.Lock()
        self._freed_out_of_range = 0  # counted by slabs already freed
        self._draining: set[CudaSlab] = set()  # closed, their gathers maybe still running
        self.stuck: set[CudaSlab] = set()  # freed slabs whose daemon stream never drained
        # Prepared by a reload (cuda_switch.prepare_switch), not yet taken by the worker.
        self.pending_switches: list[TableSwitch] = []
        self.geometry = geometry
        with torch.cuda.device(index):
            self.cache, self.keeper = self.new_cache(pinned)
            if self.keeper is not None and options.warm_ids is not None:
                admitted = self.keeper.warm(options.warm_ids)
                log.info("GPU %d: %d rows admitted from the warm-up trace", index, admitted)
            plan = GatherPlan(layer_tables, geometry.shard(0, 1), self.device)
            plan.warm_up(**options.launched_variants(self.cache))
            torch.cuda.synchronize(index)
        self.warm_plan = plan

    def new_cache(self, pinned: PinnedTables) -> tuple[HotCache | None, CacheKeeper | None]:
        """An empty hot-row cache over these tables, and its keeper (not started); none without
        a cache budget."""
        if not self.options.cache_bytes:
            return None, None
        with torch.cuda.device(self.index):
            keeper = CacheKeeper.over(pinned.row_views(self.device), self.options.cache_bytes,
                                      self.gather_streams, self.options.cache_refresh_s)
        layout = keeper.cache.layout
        log.info("GPU %d: hot-row cache of %d rows (%.2f GiB)", self.index, layout.slots,
                 layout.nbytes / 2**30)
        return keeper.cache, keeper

    def gather_streams(self) -> list[torch.cuda.Stream]:
        return [slab.stream for slab in list(self.slabs)]

    def serving_cache(self) -> HotCache | None:
        """The cache a slab allocated now gathers through: its lookups run after every switch
        prepared so far, so the newest one's."""
        return self.pending_switches[-1].cache if self.pending_switches else self.cache

    def draining_slabs(self) -> list[CudaSlab]:
        """Freed slabs whose last gathers may still run."""
        with self._freed_lock:
            return list(self._draining)

    def freeing(self) -> bool:
        """Whether a freed slab's release still runs and has not given up (stuck)."""
        with self._freed_lock:
            return bool(self._draining - self.stuck)

    def count_freed(self, slab: CudaSlab) -> None:
        """Take a freed slab's final count (its free thread, once its gathers have run): a
        synchronous read, ordered after every copy out_of_range queued, none queued after it."""
        with self._freed_lock:
            slab.count_final = True
        # Not under enqueue_lock: this waits for the copy, and a thread that waits for the
        # device must hold nothing the gather worker needs.
        with torch.cuda.device(self.index), torch.cuda.stream(self.count_stream):
            value = int(slab.out_of_range.item())
        with self._freed_lock:
            self._freed_out_of_range += value
            self._draining.discard(slab)

    def out_of_range(self, slabs: list[CudaSlab]) -> int:
        """Out-of-range IDs counted so far by these live slabs, the draining and the freed ones,
        each live or draining one as of its last finished copy (the request loop never waits on
        the device: a copy can wait behind work a killed client left on a shared MPS server)."""
        # No new copy while the quiet gate holds the GPU (the last finished one is read).
        copy = self.enqueue_lock.acquire(blocking=False)
        try:
            with self._freed_lock, torch.cuda.device(self.index):
                return self._freed_out_of_range + sum(
                    s.count_reader.read(again=copy and not s.count_final)
                    for s in {*slabs, *self._draining})
        finally:
            if copy:
                self.enqueue_lock.release()

    def quiet(self) -> bool:
        """Whether every daemon stream of this GPU (live, draining and stuck slabs', the counter
        copies', the cache's) has run all it holds: then nothing of the daemon's is left there."""
        with self._freed_lock:
            slabs = {*self.slabs, *self._draining, *self.stuck}
        streams = [slab.stream for slab in slabs] + [self.count_stream]
        if self.keeper is not None and self.keeper.stream is not None:
            streams.append(self.keeper.stream)
        with torch.cuda.device(self.index):
            return all(stream.query() for stream in streams)

    def make_current(self) -> None:
        cuda.make_current(self.index)

    def when_quiet(self, what: str, call: Callable[[], None], then: Callable[[], None]) -> None:
        """Make `call`, which waits for the whole device (cudaHostUnregister), once every GPU is
        quiet (server/quiet_gate.py), then `then` unless it failed: every GPU, since what it
        unregisters is mapped for all (Portable)."""
        assert self.gate is not None, "the backend sets the gate up before any slab"
        self.gate.defer(what, call, then=then)

    def add_slab(self, slab: CudaSlab) -> None:
        with self._freed_lock:
            self.slabs.add(slab)

    def retire_slab(self, slab: CudaSlab) -> None:
        """A closed slab whose gathers may still run: from the live ones to the draining ones in
        one step (quiet() must see it in one or the other), its count kept until final."""
        with self._freed_lock:
            self.slabs.discard(slab)
            self._draining.add(slab)

    def start(self) -> None:
        if self.keeper is not None:
            self.keeper.start()

    def cache_stats(self) -> dict[str, Any] | None:
        if self.keeper is None:
            return None
        return self.keeper.report()

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()


class GpuWorker:
    """One thread per GPU that enqueues the gathers of that GPU's clients, in arrival order
    (and a reload's switch of tables, in its place among them)."""

    def __init__(self, device_index: int):
        self.device_index = device_index
        self._jobs: queue.SimpleQueue[tuple[LookupJob, Completion] | Callable[[], None] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=f"engramd-gpu{device_index}", daemon=True)
        self._thread.start()

    def submit(self, job: LookupJob, done: Completion) -> None:
        self._jobs.put((job, done))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the worker, after the jobs submitted before it and before those after."""
        self._jobs.put(fn)

    def _run(self) -> None:
        torch.cuda.set_device(self.device_index)
        while (item := self._jobs.get()) is not None:
            if callable(item):
                item()
            else:
                run_job(*item)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def run_job(job: LookupJob, done: Completion) -> None:
    try:
        with job.slab.gpu.enqueue_lock:
            enqueue_lookup(job)
    except BaseException as exc:  # reported to the client; the dispatcher keeps serving
        log.exception("enqueue failed for client %d slot %d", job.client_id, job.slot)
        job.error = exc
    job.context.enqueued = time.perf_counter()
    done(job)


def enqueue_lookup(job: LookupJob) -> None:
    """Daemon stream: wait for the client's IDs, gather into the slot, mark the rows done."""
    slab: CudaSlab = job.slab
    slot, seq, raw = job.slot, job.seq, slab.raw_stream
    slab.ops.wait_u32(raw, slab.ids_ready[slot], seq)
    served = False
    try:
        if GATHER_DELAY_MS:
            with torch.cuda.stream(slab.stream):
                torch.cuda._sleep(int(GATHER_DELAY_MS * _CYCLES_PER_MS))
        if not job.skip:
            _gather(slab, slot, job.tokens, ID_DTYPES[job.ids_dtype])
            served = True
    finally:  # whatever happened, the client's streams must not wait for ROWS_DONE forever
        if not served:
            _invalidate_rows(slab, slot, job.tokens)
            slab.ops.write_u32(raw, slab.failed[slot], seq)
        slab.ops.write_u32(raw, slab.rows_done[slot], seq)
        slab.last_job[slot] = job
    job.out_of_range = 0  # counted on the GPU (slab.out_of_range); never synchronised per lookup


def _invalidate_rows(slab: CudaSlab, slot: int, tokens: int) -> None:
    """NaN over the rows of a lookup that is not served, on the daemon stream before its
    ROWS_DONE: a consumer whose wait() returned before the refusal reached its client reads NaN,
    never the slot's previous rows (client/failures.py). The client's release fills the same
    way. Best effort: where the stream itself is broken (the failure that got us here), the
    FAILED mark and the error reply remain."""
    try:
        slab.ops.fill_layers(slab.raw_stream, slab.rows(slot, tokens), BF16_NAN)
    except Exception:
        log.exception("could not fill the rows of a refused lookup (slot %d) with NaN", slot)


def _gather(slab: CudaSlab, slot: int, tokens: int, dtype: torch.dtype) -> None:
    gpu = slab.gpu
    ids, rows = slab.ids(slot, tokens, dtype), slab.rows(slot, tokens)
    options = gpu.options
    if options.dedupe(tokens) or options.sort(tokens):  # large lookups: host cost is noise here
        slab.plan(ids, rows, stream=slab.stream, out_of_range=slab.out_of_range, cache=gpu.cache,
                  dedupe=options.dedupe(tokens), sort=options.sort(tokens), num_programs=gpu.programs)
    else:
        slab.gather(ids, rows, slab.stream)


class CudaBackend:
    name = "cuda"
    orders_slots = True
    counts_per_job = False  # out-of-range IDs are counted on the device (GpuState.out_of_range)
    gathering = False  # its gathers run on the GPU; a dispatch thread only enqueues them

    def __init__(self, tables: list[HostTable], geometry: TableGeometry, inline: bool = False,
                 options: GatherOptions | None = None, registration: HostRegistration | None = None):
        if not torch.cuda.is_available():
            raise CudaError("no CUDA device is visible")
        self.geometry = geometry
        self.inline = inline
        self.options = options or GatherOptions()
        self.pinned = PinnedTables(tables, registration)  # the tables' pin is ours from here
        self.pinned_bytes = sum(t.nbytes for t in tables)
        self.layer_tables = self.pinned.layer_tables()
        self.uuids = {cuda.device_uuid(i): i for i in range(torch.cuda.device_count())}
        self.ops = cuda.StreamOps()
        self.mps = {uuid: mps_state(index) for uuid, index in self.uuids.items()}
        for uuid, state in self.mps.items():
            log.info("GPU %s: MPS %s", uuid, f"on (server {state.server})" if state.enabled else "off")
        self.workers = {i: GpuWorker(i) for i in self.uuids.values()}
        self._stopped = False
        # Every kernel variant is compiled and loaded on every GPU before any client can wait on us.
        self.gpus = {i: GpuState(i, self.pinned, self.layer_tables, geometry, self.options)
                     for i in self.uuids.values()}
        self.gate = QuietGate(self.gpus)
        for gpu in self.gpus.values():
            gpu.gate = self.gate
        if GATHER_DELAY_MS:
            for index in self.gpus:
                with torch.cuda.device(index):
                    torch.cuda._sleep(1)
        for gpu in self.gpus.values():
            gpu.start()
        log.info("gather kernels warmed on %d GPU(s): %s", len(self.workers), ", ".join(self.uuids))

    def replace_tables(self, tables: list[HostTable], registration: HostRegistration,
                       retired: Callable[[], None]) -> None:
        """A reload: lookups submitted from now on read `tables` (pinned by `registration`, ours
        from here), through a new, empty hot-row cache per GPU; once no gather can read the old
        tables they are unregistered, when every GPU is quiet (server/quiet_gate.py), and then
        `retired()` is called (from another thread).

        Each GPU's worker switches in its place among the lookups (inline dispatch: at once),
        so the slabs' daemon streams see the old tables up to one lookup and the new ones
        after it; the old tables and caches are let go once every stream has passed that point
        (server/cuda_switch.py).
        """
        switch_tables(self, PinnedTables(tables, registration), retired)

    def check_device(self, device: str) -> int:
        """The local index of a client's GPU ("cuda:GPU-<uuid>"); BadRequestError if not ours."""
        prefix = "cuda:"
        if not device.startswith(prefix):
            raise BadRequestError(f"device {device!r}: this daemon serves CUDA clients as 'cuda:GPU-<uuid>'")
        uuid = device[len(prefix):]
        if uuid not in self.uuids:
            raise BadRequestError(f"GPU {uuid} is not visible to the daemon (it sees {sorted(self.uuids)})")
        return self.uuids[uuid]

    def allocate_slab(self, device: str, layout: SlabLayout, client_id: int, shard: ShardView) -> CudaSlab:
        index = self.check_device(device)
        uuid = device.removeprefix("cuda:")
        return CudaSlab(index, uuid, layout, self.layer_tables, shard, self.gpus[index], self.ops)

    def check_gather(self, ids: torch.Tensor):
        """(where, rows) of a full-shard lookup of `ids` on every GPU, for the start-up self-check."""
        for uuid, index in self.uuids.items():
            gpu = self.gpus[index]
            with torch.cuda.device(index):
                counter = torch.zeros(1, dtype=torch.int64, device=gpu.device)  # a served variant
                rows = gpu.warm_plan(ids.to(gpu.device), cache=gpu.cache, num_programs=gpu.programs,
                                     out_of_range=counter)
                yield f"GPU {uuid}", rows.cpu()

    def gathers_done(self) -> Callable[[], bool]:
        """Whether every live slab's daemon stream is past what is enqueued on it now (a
        stopping daemon's loop has handed every job to its stream: in_flight counts jobs until
        enqueued). A slab freed meanwhile still passes: its release satisfies its waits."""
        done = []
        for gpu in self.gpus.values():
            with torch.cuda.device(gpu.index):
                for slab in list(gpu.slabs):
                    event = torch.cuda.Event()
                    event.record(slab.stream)
                    done.append(event)
        return lambda: all(event.query() for event in done)

    def deferred(self) -> list[str]:
        return self.gate.waiting()

    def unpin(self, registration: HostRegistration | None, let_go: Callable[[], None]) -> None:
        if registration is None:
            let_go()
            return
        self.gate.defer("the unregister of tables never served", registration.unregister,
                        then=registration.close, after=let_go)

    def mps_states(self) -> dict[str, MpsState]:
        return self.mps

    def overdue_lookups(self, limit_s: float) -> list[LookupJob]:
        now = time.perf_counter()  # the clock of job.context.enqueued
        return [job for gpu in self.gpus.values() for slab in list(gpu.slabs)
                for job in slab.overdue_ids(limit_s, now)]

    def cache_stats(self) -> dict[str, Any]:
        """Per GPU (by UUID): the hot-row cache's hit rates, admissions and size."""
        return {uuid: self.gpus[index].cache_stats() for uuid, index in self.uuids.items()
                if self.gpus[index].cache is not None}

    def out_of_range(self, slabs: list[CudaSlab]) -> int:
        """Out-of-range IDs counted on the GPUs so far: by these live slabs, and by every slab
        already freed (read by its free thread once its gathers had run)."""
        return sum(gpu.out_of_range([s for s in slabs if s.ptr and s.gpu is gpu])
                   for gpu in self.gpus.values())

    def submit(self, job: LookupJob, done: Completion) -> None:
        if self.inline:  # enqueueing is asynchronous, so the request loop may do it itself
            # Launches go to the current device's context, set every time: whatever else the loop
            # did since (made a slab, switched tables) may have left it on another GPU.
            torch.cuda.set_device(job.slab.device_index)
            run_job(job, done)
        else:
            self.workers[job.slab.device_index].submit(job, done)

    def drop_queued(self, client_id: int) -> int:
        return 0  # its jobs are enqueued in order, each releasing its slot's counter: none is skipped

    def stop(self) -> None:
        """The workers enqueue what they hold and end; the cache keepers stop."""
        if self._stopped:
            return
        self._stopped = True
        for gpu in self.gpus.values():
            gpu.close()
        for worker in self.workers.values():
            worker.close()

    def _await_freed_slabs(self) -> None:
        """Until every freed slab's release has drained its daemon stream, or given up on it
        (GpuState.stuck, after RELEASE_DEADLINE_S)."""
        while any(gpu.freeing() for gpu in self.gpus.values()):
            time.sleep(SETTLE_POLL_S)

    def close(self) -> None:
        """After the slabs were freed (ClientRegistry.close): once their releases have drained
        their daemon streams, synchronise the GPUs and unpin the tables. A synchronize before
        that could wait forever on a gather waiting for IDs a live client never writes."""
        self.stop()
        self._await_freed_slabs()
        stuck = sum(len(gpu.stuck) for gpu in self.gpus.values())
        if stuck:  # a synchronize would wait for them forever, and they may still read the tables
            self.gate.close(run_rest=False)
            log.error("%d freed slab(s) never drained: the GPUs are not synchronised and the tables "
                      "stay registered (the exit lets go of both)", stuck)
            return
        for index in self.workers:
            torch.cuda.synchronize(index)
        self.gate.close(run_rest=True)
        self.layer_tables = []
        self.pinned.close()
