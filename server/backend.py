"""What a device backend provides to the client registry: slabs, and gathers into them.

A backend knows how to allocate a client's slab on the client's device and how to run a lookup
into one of its slots; it knows nothing of sockets or of client bookkeeping (that is the registry's).
Two implementations: `cpu_backend` (memfd slabs, plain-torch reference gather) and
`cuda_backend` (VMM device slabs passed as descriptors, Triton gather on pinned host tables).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from engramd.client.geometry import ShardView
from engramd.client.shared.mps import MpsState
from engramd.client.shared.slab import SlabLayout
from engramd.server.job_context import JobContext


class Slab(Protocol):
    layout: SlabLayout

    def wire(self) -> dict[str, Any]:
        """What the client needs to map the slab's descriptor (sent in the attach reply)."""

    def descriptors(self) -> list[int]:
        """New file descriptors for its client (the slab's memory, then any others its wire()
        counts in "fds"); the caller closes them."""

    def ids_handed_over(self, slot: int, seq: int) -> bool:
        """Whether the client has handed over the IDs of lookup `seq` in `slot` (a GPU slab's
        IDS_READY has reached it; a CPU slab's lookups come with their IDs: always)."""

    def close(self) -> None:
        """Free the slab, once every lookup of its client has been handed to the backend (its
        memory goes when the gathers queued on it have run)."""


@dataclass
class LookupJob:
    """One lookup: gather the IDs of `slot` (or `inline_ids`) into that slot's rows block."""

    client_id: int
    slab: Slab
    shard: ShardView
    slot: int
    seq: int
    tokens: int
    ids_dtype: str = "int64"  # of the IDs in the slot ("int32" | "int64")
    inline_ids: np.ndarray | None = None  # [T, L, H] of ids_dtype, when sent inline
    skip: bool = False  # a refused lookup: only release the slot's completion counter
    out_of_range: int = 0
    error: BaseException | None = None
    context: JobContext = field(default_factory=JobContext)  # reply routing and times, carried along


Completion = Callable[[LookupJob], None]


class Backend(Protocol):
    name: str
    # True when jobs of one client run in submission order (one queue per device): several
    # lookups may then be in flight on one slot, and a refused one must still release its waiters.
    orders_slots: bool
    # True when each job carries its own out-of-range count (CPU); a GPU counts on the device,
    # read by out_of_range() at most once per heartbeat, never per lookup.
    counts_per_job: bool

    def check_device(self, device: str) -> Any:
        """Raise BadRequestError unless this backend serves `device` ("cpu", "cuda:GPU-<uuid>")."""

    def allocate_slab(self, device: str, layout: SlabLayout, client_id: int, shard: ShardView) -> Slab: ...

    def submit(self, job: LookupJob, done: Completion) -> None:
        """Start the lookup; call `done(job)` exactly once from any thread, errors in `job.error`."""

    pinned_bytes: int  # host table bytes registered with a device (CPU: 0)

    def drop_queued(self, client_id: int) -> int:
        """A retired client's work that no gather has begun is dropped, and the lookups it
        belonged to complete as skipped and silent (no reply, not counted; nobody reads their
        rows): one with nothing running at once (`done` may be called on the calling thread),
        one with a piece running when that piece ends. Its slab is freed then, and the workers
        go to live clients. Returns how many lookups it cut short, wholly or in part. A GPU
        backend returns 0: its queued jobs each release their slot's counter in order, which
        a dropped job would skip."""

    @property
    def gathering(self) -> bool:
        """Whether gathers run on threads of this process now (the CPU backend's): they need
        the GIL between their torch calls, so the request loop makes room for them (Daemon._drain_socket)."""

    def gathers_done(self) -> Callable[[], bool]:
        """A probe: whether every lookup enqueued until now has written its rows. A stopping
        daemon keeps its loop (signals, leases) until it passes, before it closes its leases: a
        client whose lease closes fails the lookups whose rows it has not seen yet
        (client/failures.py)."""

    def stop(self) -> None:
        """Enqueue what is queued, then take no more jobs: after it, no gather is added to a
        slab, so the slabs can be freed (ClientRegistry.close) before close()."""

    def mps_states(self) -> dict[str, MpsState]:
        """Per GPU UUID, whether the daemon's work there goes through an MPS server (CPU: {})."""

    def cache_stats(self) -> dict[str, Any]:
        """Per GPU UUID, the hot-row cache's counters (CPU, or no cache: {})."""

    def out_of_range(self, slabs: list[Any]) -> int:
        """Out-of-range IDs counted on devices, not per job (CPU: 0, jobs carry their counts):
        by these live slabs and every slab already freed."""

    def overdue_lookups(self, limit_s: float) -> list[LookupJob]:
        """Enqueued lookups still waiting on the device for their client's IDs `limit_s` after
        they were enqueued, each returned once (CPU: none, its lookups carry their IDs)."""

    def check_gather(self, ids: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(where, rows) of a full-shard lookup of `ids` on each device, for the self-check."""

    def deferred(self) -> list[str]:
        """What a GPU backend holds back until its GPUs are quiet (server/quiet_gate.py), by
        name (CPU: none)."""

    def unpin(self, registration: Any, let_go: Callable[[], None]) -> None:
        """Unregister tables this backend never served (a reload's that failed or was cancelled;
        None: nothing pinned), then `let_go()` of them: at once, or for a GPU once the daemon has
        nothing queued there (server/quiet_gate.py)."""

    def close(self) -> None:
        """After stop() and the slabs' release: let go of the devices and the tables."""
