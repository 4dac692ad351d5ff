"""CPU backend: anonymous shared-memory (memfd) slabs and the plain-torch reference gather on
worker threads, which take lookups in pieces, client after client (server/fair_queue.py).

It makes the whole service runnable where there is no GPU (CI, laptops) and is the second
implementation the CUDA backend is tested against. Completion is the reply message: the client
reads its rows from the slab once the daemon has answered.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engramd.client.errors import BadRequestError, ResourceError
from engramd.client.geometry import ShardView, TableGeometry
from engramd.client.shared.ids import ID_DTYPES
from engramd.client.shared.slab import SlabLayout
from engramd.kernels.gather_ref import gather
from engramd.server.backend import Completion, LookupJob
from engramd.server.fair_queue import FairQueue
from engramd.server.table_loader import unpin_then

if TYPE_CHECKING:
    from engramd.server.table_file import HostTable

log = logging.getLogger("engramd.cpu")


def slab_name(client_id: int) -> str:
    """The memfd's name (it shows in /proc/<pid>/fd and maps; it is no path anyone can open)."""
    return f"engramd-slab-c{client_id}"


class MemfdSlab:
    """A slab in anonymous shared memory (memfd): no name in any folder, passed to its client as
    a descriptor over the handle socket. Sealed against resizing, so a client holding the
    descriptor cannot shrink it under the daemon's gathers (which would fault the daemon)."""

    def __init__(self, name: str, layout: SlabLayout):
        self.layout = layout
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ResourceError(f"cannot create slab {name}: {exc.strerror}") from None
        try:
            os.ftruncate(fd, layout.size)
            # Reserve the pages now: too little memory must fail here, not with SIGBUS inside a
            # gather.
            os.posix_fallocate(fd, 0, layout.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(fd, layout.size, mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            raise ResourceError(f"cannot allocate slab {name} of {layout.size} bytes: {exc.strerror}") from None
        self._fd = fd
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)

    def ids(self, slot: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        return self.layout.ids_view(self.buffer, slot, tokens, dtype)

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        return self.layout.rows_view(self.buffer, slot, tokens)

    def wire(self) -> dict[str, Any]:
        return {"kind": "memfd", "layout": self.layout.to_wire()}

    def ids_handed_over(self, slot: int, seq: int) -> bool:
        return True  # they sit in the slab (or come inline) before the request is sent

    def descriptors(self) -> list[int]:
        """A new descriptor of the slab for its client (the caller closes it once sent)."""
        return [os.dup(self._fd)]

    def close(self) -> None:
        """Let go of the slab. The mapping is not closed here: torch views of it do not pin it
        (closing it would leave them dangling), they hold a reference, so it is unmapped when
        the last of them goes, at once when there is none."""
        if self._map is None:
            return
        os.close(self._fd)
        self.buffer, self._map = None, None


# Lookups longer than WHOLE_TOKENS are gathered in pieces of PIECE_TOKENS tokens, client after
# client (server/fair_queue.py): another client's lookup waits at most for the pieces running.
# Shorter ones go whole: split across both workers, a 64-token lookup took ~1.4x as long idle
# (their torch calls contend for the GIL and the CPUs), see benchmarks/results/floods.md.
PIECE_TOKENS = 32
WHOLE_TOKENS = 128


class _TableSet:
    """The tables lookups read, and how many lookups read them: a reload's replaced set is let
    go of (`retired`) once the last lookup that took it has finished."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.readers = 0
        self.retired: Callable[[], None] | None = None  # set once replaced


@dataclass
class _Lookup:
    """One job on its way through the workers: its private IDs, its tables and the pieces left."""

    job: LookupJob
    done: Completion
    ids: torch.Tensor
    tables: _TableSet
    left: int
    lock: threading.Lock = field(default_factory=threading.Lock)


class CpuBackend:
    name = "cpu"
    orders_slots = False
    counts_per_job = True
    pinned_bytes = 0  # the host tables are read where they are

    def __init__(self, tables: list[torch.Tensor], geometry: TableGeometry, workers: int):
        self._tables = _TableSet(tables)
        self._readers_lock = threading.Lock()
        self._in_flight = 0  # lookups queued or gathering, under _readers_lock
        self.geometry = geometry
        self._queue = FairQueue()
        self._workers = [threading.Thread(target=self._work, name=f"engramd-gather{i}", daemon=True)
                         for i in range(workers)]
        for worker in self._workers:
            worker.start()

    @property
    def tables(self) -> list[torch.Tensor]:
        return self._tables.tensors

    def replace_tables(self, tables: list[HostTable], registration: Any,
                       retired: Callable[[], None]) -> None:
        """Lookups submitted from now on read `tables`; `retired()` is called (from any thread)
        once no lookup reads the tables they replace. `registration`: None (nothing is pinned)."""
        old, self._tables = self._tables, _TableSet([t.tensor for t in tables])
        with self._readers_lock:
            old.retired = retired
            idle = old.readers == 0
        if idle:
            old.tensors = []
            retired()

    def check_device(self, device: str) -> None:
        if device != "cpu":
            raise BadRequestError(f"device {device!r} not served: this daemon runs the cpu backend")

    def allocate_slab(self, device: str, layout: SlabLayout, client_id: int, shard: ShardView) -> MemfdSlab:
        self.check_device(device)
        return MemfdSlab(slab_name(client_id), layout)

    def submit(self, job: LookupJob, done: Completion) -> None:
        try:
            pieces = self._pieces(job, done)
            if pieces:
                job.context.submitted = time.perf_counter()
                try:
                    self._queue.put(job.client_id, pieces)
                except BaseException:
                    self._let_go(pieces[0][0].tables)  # no piece of it will run
                    raise
                return
        except BaseException as exc:  # the job must complete all the same, or its slot never frees
            log.exception("cannot queue the gather of client %d slot %d", job.client_id, job.slot)
            job.error = exc
        job.context.enqueued = time.perf_counter()
        done(job)

    def drop_queued(self, client_id: int) -> int:
        pieces_left: dict[int, tuple[_Lookup, int]] = {}
        for lookup, _, _ in self._queue.drop(client_id):
            _, dropped = pieces_left.get(id(lookup), (lookup, 0))
            pieces_left[id(lookup)] = (lookup, dropped + 1)
        for lookup, dropped in pieces_left.values():
            with lookup.lock:  # another of its pieces may be running now
                lookup.job.skip = True  # no reply and no count: its client is gone
                lookup.job.context.silent = True
                lookup.left -= dropped
                finished = lookup.left == 0
            if finished:
                self._finish(lookup)
        return len(pieces_left)

    def _pieces(self, job: LookupJob, done: Completion) -> list[tuple[_Lookup, int, int]]:
        # The gather reads its IDs more than once (masks, then indices), so it reads a private
        # copy: the slab is the client's to write at any time.
        if job.inline_ids is not None:
            ids = torch.from_numpy(job.inline_ids.copy())
        else:
            ids = job.slab.ids(job.slot, job.tokens, ID_DTYPES[job.ids_dtype]).clone()
        piece = max(1, job.tokens) if job.tokens <= WHOLE_TOKENS else PIECE_TOKENS
        starts = range(0, job.tokens, piece)
        if not starts:
            return []
        lookup = _Lookup(job, done, ids, self._tables, left=len(starts))
        with self._readers_lock:
            lookup.tables.readers += 1
            self._in_flight += 1
        return [(lookup, t, min(t + piece, job.tokens)) for t in starts]

    def _work(self) -> None:
        while (piece := self._queue.get()) is not None:
            self._run_piece(*piece)

    def _run_piece(self, lookup: _Lookup, start: int, stop: int) -> None:
        job, bad, error = lookup.job, 0, None
        began = time.perf_counter()  # the lookup's `started`: its first piece's start
        try:
            rows = job.slab.rows(job.slot, job.tokens)[:, start:stop]
            _, bad = gather(lookup.tables.tensors, lookup.ids[start:stop], job.shard, out=rows)
        except BaseException as exc:  # reported to the client; the worker must survive
            log.exception("gather failed for client %d slot %d", job.client_id, job.slot)
            error = exc
        with lookup.lock:  # its pieces may run on several workers at once
            context = job.context
            context.started = began if context.started is None else min(context.started, began)
            job.out_of_range += bad
            job.error = job.error or error
            lookup.left -= 1
            finished = lookup.left == 0
        if finished:
            self._finish(lookup)

    def _finish(self, lookup: _Lookup) -> None:
        self._let_go(lookup.tables)
        lookup.job.context.enqueued = time.perf_counter()  # on the CPU: the rows are written
        lookup.done(lookup.job)

    def _let_go(self, tables: _TableSet) -> None:
        """A lookup that read `tables` is done: the last one of a replaced set retires it."""
        with self._readers_lock:
            tables.readers -= 1
            self._in_flight -= 1
            retired = tables.retired if tables.readers == 0 else None
        if retired is not None:
            tables.tensors = []  # no reader left: the views go before the tables are unmapped
            retired()

    @property
    def gathering(self) -> bool:
        return self._in_flight > 0

    def gathers_done(self) -> Callable[[], bool]:
        return lambda: True  # a job's rows are written before it completes, and stopping waits for those

    def mps_states(self) -> dict:
        return {}  # no GPU, so nothing to share

    def cache_stats(self) -> dict:
        return {}  # no hot-row cache on the CPU

    def overdue_lookups(self, limit_s: float) -> list:
        return []  # its lookups carry their IDs: none waits for them

    def out_of_range(self, slabs: list) -> int:
        return 0  # every job counts its own (job.out_of_range)

    def check_gather(self, ids: torch.Tensor):
        """(where, rows) of a full-shard lookup of `ids`, for the start-up self-check."""
        yield "cpu", gather(self.tables, ids, self.geometry.shard(0, 1))[0]

    def deferred(self) -> list[str]:
        return []

    def unpin(self, registration: Any, let_go: Callable[[], None]) -> None:
        unpin_then(registration, let_go)  # None here: nothing is pinned for a device

    def stop(self) -> None:
        """Finish what is queued, then stop the workers (again: nothing more)."""
        self._queue.close()
        for worker in self._workers:
            worker.join()

    def close(self) -> None:
        self.stop()  # where nothing had to happen between the two
        self._tables = _TableSet([])  # drop the table views so the host tables can be unmapped
