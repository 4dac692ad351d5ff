"""Keeps one device's hot-row cache holding the rows its lookups use most.

The daemon keeps one per GPU for its served lookups (server/cuda_backend.py); a mapped GPU
client keeps one of its own for its gathers (client/shared/mapped.py). A thread per cache refreshes it
(kernels/hot_cache.py) every `interval` seconds when the gathers have logged new candidates.
Gathers read keys and rows while the keeper changes them, so a way changes in four steps, each
on the keeper's own stream:

    1. invalidate: the chosen ways' keys become EMPTY        (gathers now miss there: correct)
    2. grace:      an event on every stream that runs gathers on this device, and a probe of
                   every captured lookup's descriptor (kernels/descriptor.py: graphs replay on
                   streams the keeper does not know); wait for all (every gather that could
                   have seen an old key has finished)
    3. fill:       copy the new rows from the host tables into those ways' pool slots
    4. publish:    write the new keys                         (the rows are there before the keys)

No gather ever waits for the keeper, and the keeper never waits on a client: a stream held up by
a slow client (or, in a mapped client, by its own engine) only delays step 2 of this refresh,
during which those ways simply miss. Gathers read keys and rows at L2 (coherent across the
device), so a gather that sees a key of step 4 sees the rows of step 3. The sketch is halved after every `age_rows` counted reads, so that rows that
were hot long ago can be displaced, and at most `max_admissions` ways change per refresh.

On a CPU device (tests, with the Triton interpreter) there are no streams: the same steps run in
order on the calling thread.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engramd.client.errors import ConfigError
from engramd.client.shared import cuda
from engramd.kernels import hot_cache
from engramd.kernels.hot_cache import AdmissionPlan, Admissions, HotCache

log = logging.getLogger("engramd.cache")

GRACE_WARN_S = 5.0
GRACE_FIRST_PAUSE_S, GRACE_MAX_PAUSE_S = 0.0005, 0.005  # between polls of a gather stream's event
# Log entries a refresh weighs at most, the newest: its choice takes memory per entry (entries
# x WAYS keys and estimates), and a row that stays hot is logged again at its next misses.
MAX_REFRESH_ENTRIES = 1 << 18


def load_warm_ids(path: str | int, n_layers: int, heads: int) -> Tensor:
    """The row IDs of a warm-up trace file (.npy, integers [N, n_layers, heads]) as a CPU tensor.
    `path` may be an open descriptor of the file (a mapped client's, passed by the daemon): it is
    read through a mapping of its own, not reopened and not at the descriptor's file offset,
    which every descriptor the daemon passed of the file shares; it stays the caller's."""
    return torch.from_numpy(np.ascontiguousarray(warm_ids_array(path, n_layers, heads), dtype=np.int64))


def warm_ids_array(path: str | int, n_layers: int, heads: int) -> np.ndarray:
    """The warm-up trace as load_warm_ids reads it, checked but not converted (from a path, a
    read-only mapping: checking a file reads none of its rows); ConfigError naming what is wrong."""
    try:
        if isinstance(path, int):
            with mmap.mmap(path, 0, prot=mmap.PROT_READ) as file:
                ids = np.load(file, allow_pickle=False)  # read (copied) out of the mapping
        else:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO's open waits for a writer
                raise ValueError("not a regular file")
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"hot_cache_warm_file {path}: cannot read it as .npy ({exc})") from None
    if ids.dtype.kind not in "iu" or ids.ndim != 3 or ids.shape[1:] != (n_layers, heads):
        raise ConfigError(f"hot_cache_warm_file {path}: expected integer row IDs [N, {n_layers}, "
                          f"{heads}], got {ids.dtype} {list(ids.shape)}")
    return ids


class WarmUpTrace:
    """A warm-up trace for a keeper's thread to read (CacheKeeper.start): a descriptor of the file
    of its own (the keeper closes it), and the heads of it to count."""

    def __init__(self, fd: int, n_layers: int, heads: int, head_slice: slice):
        self._fd: int | None = fd
        self.n_layers, self.heads, self.head_slice = n_layers, heads, head_slice

    def read(self) -> Tensor:
        return load_warm_ids(self._fd, self.n_layers, self.heads)[:, :, self.head_slice]

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


@dataclass
class KeeperStats:
    refreshes: int = 0
    admitted: int = 0
    agings: int = 0
    reads: list[int] = field(default_factory=list)  # per layer, rows the gathers read
    hits: list[int] = field(default_factory=list)  # per layer, of them from the cache
    refresh_ms: float = 0.0  # the last refresh, steps 1-4
    # All refreshes: wall time, and the keeper thread's CPU time in them. Near equal, the
    # refreshes spin in their waits for the device; far apart, they sleep in them.
    refresh_ms_total: float = 0.0
    refresh_cpu_ms_total: float = 0.0

    def snapshot(self, row_bytes: int) -> dict:
        return {"refreshes": self.refreshes, "admitted": self.admitted, "agings": self.agings,
                "reads": list(self.reads), "hits": list(self.hits),
                "hit_rate": [h / r if r else 0.0 for h, r in zip(self.hits, self.reads, strict=True)],
                "bytes_saved": sum(self.hits) * row_bytes, "refresh_ms": round(self.refresh_ms, 3),
                "refresh_ms_total": round(self.refresh_ms_total, 3),
                "refresh_cpu_ms_total": round(self.refresh_cpu_ms_total, 3)}


class CacheKeeper:
    """Refreshes `cache` from `tables` (uint8 [rows, row_bytes] views readable on its device)."""

    def __init__(self, cache: HotCache, tables: Sequence[Tensor],
                 gather_streams: Callable[[], list[torch.cuda.Stream]],
                 interval: float = 0.05, margin: int = 1, age_rows: int | None = None,
                 gather_probes: Callable[[], list[Any]] = list):
        """`gather_probes`: objects whose query() is true once the gathers that had begun when
        they were made have ended (descriptor.Quiet), beside the streams' events."""
        self.cache = cache
        self.tables = list(tables)
        self.table_rows = torch.tensor([t.shape[0] for t in tables], dtype=torch.int64,
                                       device=cache.device)
        self.gather_streams = gather_streams
        self.gather_probes = gather_probes
        self.interval = interval
        self.margin = margin
        # Halving once per sketch width of reads keeps a counter's noise (other keys' reads) near
        # one, far below the admission bar, whatever the traffic.
        self.age_rows = age_rows if age_rows is not None else 1 << cache.layout.sketch_bits
        # Admissions per refresh at most: each costs a host read, and a burst of them would
        # compete with the gathers' own reads (a cold cache fills in 128 refreshes).
        self.max_admissions = max(1024, cache.layout.slots // 128)
        self.stats = KeeperStats(reads=[0] * cache.n_layers, hits=[0] * cache.n_layers)
        self._logged = 0  # log entries taken so far
        self._reads_at_aging = 0
        # Never one of torch's pooled streams, which an engine's graph capture may be using.
        self._stream = cuda.owned_stream(self, cache.device.index) if cache.device.type == "cuda" else None
        if self._stream is not None:  # the cache's arrays were filled on the creator's stream
            self._stream.wait_stream(torch.cuda.current_stream(cache.device))
        # Where every refresh reads the counters and the log's cursor (_read_counts).
        self._counts = torch.zeros(cache.counters.numel() + 1, dtype=torch.int64, device="cpu")
        if self._stream is not None:
            self._counts = self._counts.pin_memory()
        self._host_fields = torch.empty(0, dtype=torch.int64)  # _staging's, grown to need
        self._stop = threading.Event()
        self._warming = False  # a warm-up trace is being read and counted on the thread
        self._lock = threading.Lock()  # one refresh at a time (thread, or a caller of refresh())
        self._thread: threading.Thread | None = None

    @classmethod
    def over(cls, tables: Sequence[Tensor], budget_bytes: int,
             gather_streams: Callable[[], list[torch.cuda.Stream]], interval: float,
             gather_probes: Callable[[], list[Any]] = list) -> CacheKeeper:
        """The keeper of a new, empty cache of `budget_bytes` over `tables` (one per layer), on
        their device; not started. CacheConfigError for a budget too small for one set."""
        layout = hot_cache.CacheLayout.from_budget(budget_bytes, tables[0].shape[1])
        return cls(HotCache(layout, len(tables), tables[0].device), tables, gather_streams,
                   interval=interval, gather_probes=gather_probes)

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream the refreshes run on (None on the CPU)."""
        return self._stream

    def report(self) -> dict:
        """The stats snapshot, with the cache's size (`engramd stats`, hot_cache_stats())."""
        layout = self.cache.layout
        return self.stats.snapshot(layout.row_bytes) | {"slots": layout.slots, "bytes": layout.nbytes,
                                                        "warming": self._warming}

    def start(self, warm_up: WarmUpTrace | None = None) -> CacheKeeper:
        """Run the refreshes on a thread of their own; `warm_up`, if given (the keeper takes it
        over), is read and warmed there before the first refresh, so that the caller need not
        wait for the trace to be read and counted (report()'s "warming" says until when). Its
        errors are logged: the cache then starts cold."""
        self._warming = warm_up is not None
        self._thread = threading.Thread(target=self._run, args=(warm_up,),
                                        name=f"engramd-cache-{self.cache.device}", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._warming, self._thread = False, None
            if warm_up is not None:
                warm_up.close()
            raise
        return self

    def stop(self) -> None:
        """Ask the thread to stop (a refresh in progress finishes or gives up); close() waits."""
        self._stop.set()

    def close(self) -> None:
        """Stop, and wait for the thread and for the work it queued on its stream."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._stream is not None:
            self._stream.synchronize()

    def _run(self, warm_up: WarmUpTrace | None) -> None:
        if self._stream is not None:
            cuda.enter_thread(self.cache.device.index)
        if warm_up is not None:
            self._warm_from(warm_up)
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except Exception:  # the cache only ever loses hits; serving goes on
                log.exception("refreshing the hot-row cache on %s failed", self.cache.device)

    def refresh(self) -> int:
        """One refresh cycle; returns how many ways got a new row.

        Its choice runs on the device in shapes the host knows (no unique, nonzero or boolean
        indexing), and the host waits for it once, asleep: each of those operations would wait
        for the device spinning a core, behind whatever the device runs (under MPS an engine's
        whole step), several times a refresh."""
        with self._lock, self._on_stream():
            started, cpu_started = time.perf_counter(), time.thread_time()
            entries, eligible = self._candidates(self._read_counts())
            admitted = 0
            if entries.numel():
                plan = hot_cache.plan_admissions(self.cache, entries, eligible, self.margin,
                                                 limit=self.max_admissions)
                chosen = self._to_host(plan).compact()
                if len(chosen) and self._change(chosen):
                    admitted = len(chosen)
            self._age_if_due()
            self.stats.refreshes += 1
            self.stats.admitted += admitted
            self.stats.refresh_ms = (time.perf_counter() - started) * 1e3
            self.stats.refresh_ms_total += self.stats.refresh_ms
            self.stats.refresh_cpu_ms_total += (time.thread_time() - cpu_started) * 1e3
            return admitted

    def warm(self, row_ids: Tensor) -> int:
        """Count a trace of row IDs [N, n_layers, heads] into the sketch and admit what it makes
        hot (call before serving, or any time: the refresh protocol applies). Returns admissions.

        DEAD and out-of-table IDs are skipped. The counts age like the kernel's.
        """
        if row_ids.dim() != 3 or row_ids.shape[1] != self.cache.n_layers:
            raise ValueError(f"warm-up IDs must be [N, {self.cache.n_layers}, heads], got "
                             f"{tuple(row_ids.shape)}")
        with self._lock, self._on_stream():
            ids = row_ids.to(self.cache.device, torch.int64)
            layers = torch.arange(ids.shape[1], device=ids.device).view(1, -1, 1).expand_as(ids)
            keys = hot_cache.row_keys(layers, ids).reshape(-1)
            keys = keys[hot_cache.valid_keys(keys, self.table_rows)]
            bits = self.cache.layout.sketch_bits
            ones = torch.ones_like(keys, dtype=torch.int32)
            for depth in range(hot_cache.SKETCH_DEPTH):
                self.cache.sketch[depth].index_add_(0, hot_cache.sketch_index(keys, depth, bits), ones)
            distinct, candidate = self._distinct(keys)
            chosen = self._choose_by_sets(distinct[candidate])
            # In parts of a refresh's size: each part's rows are copied through a buffer of
            # their own, and read from host memory beside any gathers already running.
            admitted = 0
            for start in range(0, len(chosen), self.max_admissions):
                ways = chosen.part(slice(start, start + self.max_admissions))
                if not self._change(ways):
                    break  # stopping
                admitted += len(ways)
                self.stats.admitted += len(ways)
            return admitted

    def _choose_by_sets(self, candidates: Tensor) -> Admissions:
        """choose_admissions of `candidates` (no limit) in host memory, over at most
        MAX_REFRESH_ENTRIES of them at a time (a set with more is a part of its own), which
        bounds its memory: each part ends where a set does, and each set's choice is its own,
        so the parts choose what the whole would."""
        sets = hot_cache.set_index(candidates, self.cache.layout.sets)
        order = torch.argsort(sets, stable=True)
        candidates, sets = candidates[order], sets[order]
        parts, start = [torch.empty((3, 0), dtype=torch.int64)], 0
        while start < len(sets):
            end = min(start + MAX_REFRESH_ENTRIES, len(sets))
            if end < len(sets):  # back to the start of the set the cut falls in, or past one too big
                end = int(torch.searchsorted(sets, sets[end]))
                if end <= start:
                    end = int(torch.searchsorted(sets, sets[start], right=True))
            part = hot_cache.choose_admissions(self.cache, candidates[start:end], self.margin)
            parts.append(torch.stack([part.sets, part.ways, part.keys]).cpu())
            start = end
        return Admissions(*torch.cat(parts, dim=1))

    def _warm_from(self, warm_up: WarmUpTrace) -> None:
        try:
            if self._stop.is_set():  # stopped before it began: the trace is not worth reading
                return
            admitted = self.warm(warm_up.read())
            log.info("hot-row cache on %s: %d of %d rows admitted from the warm-up trace",
                     self.cache.device, admitted, self.cache.layout.slots)
        except Exception as exc:  # a trace that cannot be read, or no memory to count it
            log.warning("hot-row cache on %s starts cold: %s", self.cache.device, exc)
        finally:
            warm_up.close()
            self._warming = False

    def _candidates(self, cursor: int) -> tuple[Tensor, Tensor]:
        """_distinct of the log's entries up to `cursor` (its newest MAX_REFRESH_ENTRIES). The
        log's cursors are the host's, so no shape here waits for the device."""
        entries = self.cache.logged_since(max(self._logged, cursor - MAX_REFRESH_ENTRIES), cursor)
        self._logged = cursor
        return self._distinct(entries)

    def _distinct(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        """`keys` sorted (those not of these tables as EMPTY_KEY), and which are candidates: a
        real key, the first of its run, not resident. Fixed shapes: no wait for the device."""
        valid = hot_cache.valid_keys(keys, self.table_rows)
        keys = torch.where(valid, keys, hot_cache.EMPTY_KEY).sort().values
        first = torch.ones_like(keys, dtype=torch.bool)
        first[1:] = keys[1:] != keys[:-1]
        return keys, first & (keys >= 0) & ~self.cache.resident(keys)

    def _to_host(self, plan: AdmissionPlan) -> AdmissionPlan:
        """The plan in host memory, after one wait for the device, asleep."""
        fields = torch.stack([plan.sets, plan.ways, plan.keys, plan.won.to(torch.int64)])
        host = self._staging(fields.shape[1])
        host.copy_(fields, non_blocking=True)
        self._wait_for(self._record(self._stream))
        sets, ways, keys, won = host.clone()
        return AdmissionPlan(sets, ways, keys, won.bool())

    def _to_device(self, chosen: Admissions) -> Admissions:
        """Host admissions on the cache's device, in the keeper's stream order (no wait)."""
        host = self._staging(len(chosen))
        host[0], host[1], host[2] = chosen.sets, chosen.ways, chosen.keys
        sets, ways, keys = host[:3].to(self.cache.device, non_blocking=True)
        return Admissions(sets, ways, keys)

    def _staging(self, columns: int) -> Tensor:
        """int64 [4, columns], contiguous (a strided copy would go through pageable memory), of
        host memory pinned for a GPU, for the copies of one step; each copy through it is
        waited for before the next fills it."""
        if self._host_fields.numel() < 4 * columns:
            self._host_fields = torch.empty(4 * columns, dtype=torch.int64,
                                            pin_memory=self._stream is not None)
        return self._host_fields[:4 * columns].view(4, columns)

    def _change(self, chosen: Admissions) -> bool:
        """Refill the ways of `chosen` (host tensors) by the four steps above."""
        cache = self.cache
        # By layer, so that each table's rows are one slice of the device's copy.
        layers = hot_cache.key_layers(chosen.keys)
        order = torch.argsort(layers, stable=True)
        ends = torch.bincount(layers, minlength=len(self.tables)).cumsum(0).tolist()
        ways = self._to_device(chosen.part(order))
        keys = cache.keys.view(-1)  # by slot, and a scalar fill: no value copied from the host
        keys.index_fill_(0, ways.slots, hot_cache.EMPTY_KEY)
        self._wait_for(self._record(self._stream))
        if not self._grace():
            return False  # closing: those ways stay empty, which is safe
        slots, rows = ways.slots, hot_cache.key_rows(ways.keys)
        start = 0
        for table, end in zip(self.tables, ends, strict=True):
            if end > start:
                cache.pool.index_copy_(0, slots[start:end], table.index_select(0, rows[start:end]))
            start = end
        keys.index_copy_(0, ways.slots, ways.keys)
        self._wait_for(self._record(self._stream))
        return True

    def _grace(self) -> bool:
        """Wait until every gather enqueued so far on this device has finished."""
        if self._stream is None:
            return True
        events = [self._record(stream) for stream in self.gather_streams()] + self.gather_probes()
        started = time.monotonic()
        warned = False
        pause = GRACE_FIRST_PAUSE_S
        for event in events:
            while not event.query():
                if self._stop.is_set():
                    return False
                if not warned and time.monotonic() - started > GRACE_WARN_S:
                    log.warning("cache refresh on %s waits > %.0f s for a gather stream (a client "
                                "stream held up?)", self.cache.device, GRACE_WARN_S)
                    warned = True
                time.sleep(pause)
                # A gather stream may wait on a whole model step (a mapped client's side stream
                # waits on its engine): polling less often then leaves the GIL to the engine.
                pause = min(pause * 2, GRACE_MAX_PAUSE_S)
        return True

    def _read_counts(self) -> int:
        """Take the gathers' reads and hits per layer into the stats; return the log's cursor.

        One copy of both into pinned memory and one wait, asleep: .tolist() and .item() would
        each spin a core until their copy ends (CUDA's default for a host that waits), every
        refresh, whatever the traffic. (Under MPS a keeper used 0.4-0.9 s of CPU in 3.1 s of
        uniform lookups before this, and still 0.6-1.0 s after it: benchmarks/results/h100/
        2026-12-06-f/ and -g/. Where the rest goes, the refresh totals in the stats tell.)"""
        counters, host = self.cache.counters, self._counts
        host[:counters.numel()].copy_(counters.view(-1), non_blocking=True)
        host[counters.numel():].copy_(self.cache.cursor, non_blocking=True)
        self._wait_for(self._record(self._stream))
        *counts, cursor = host.tolist()
        layers = self.cache.n_layers
        self.stats.reads, self.stats.hits = counts[:layers], counts[layers:]
        return cursor

    def _age_if_due(self) -> None:
        total = sum(self.stats.reads)
        if total - self._reads_at_aging >= self.age_rows:
            self.cache.age()
            self._reads_at_aging = total
            self.stats.agings += 1

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    @staticmethod
    def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event(blocking=True)  # its synchronize() sleeps instead of spinning
        event.record(stream)
        return event

    @staticmethod
    def _wait_for(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()
