"""The engramd client library: register with the daemon, send hash IDs, get BF16 rows back.

    from engramd.client import EngramClient
    with EngramClient("/run/engramd/engramd.sock", device="cuda", tp_rank=0, tp_size=1) as client:
        future = client.lookup(hash_ids)      # returns at once
        rows = future.wait()                  # GPU: the current stream waits; no host sync
        rows = future.result()                # blocking form (CPU and GPU)

Rows live in one of the client's `slots` of the daemon's slab (anonymous shared memory on the CPU
backend, device memory on the GPU backend, either passed as a file descriptor over the handle
socket); in mapped mode, in this process's own slots. A result is a view of that
memory, valid until `slots` further lookups have been submitted on this client (`copy=True` keeps
a private copy). Slots are reused round-robin and never overwritten while a consumer may still
read them: on the CPU the previous lookup's reply is awaited; on the GPU the new IDs are written
only after the consumer streams of the previous use have passed that point (stream order).

GPU path, per lookup (see server/cuda_backend.py for the daemon's half):
    caller stream:    [wait for the slot's previous consumers] copy IDs -> slot; IDS_READY = seq
    LOOKUP message -> daemon (no reply awaited)
    wait(stream):     stream waits ROWS_DONE >= seq
Mapped GPU path (this process gathers from its mapping of the daemon's tables, on a side stream):
    lookup():         events on the caller stream (the IDs' producers) and on the streams that
                      read the slot's previous rows
    first wait():     side stream waits for them, gather -> slot, event; stream waits for that
The gather is queued at the first wait (gather_at="wait", the default) or at whatever comes
first of the next lookup, a reload's switch of mappings and close(): behind the kernels the
engine queued since the lookup. Queued in front of them, it would hold SMs that the next one
needs, and its launch's host time would come before theirs.
If the daemon dies (or retires the registration: either way its end of the lease closes), a
watchdog thread (client/watchdog.py) satisfies every pending wait (CPU stores into the slab's
counters, which live in pinned host memory: client/shared/host_counters.py) within WATCHDOG_S (plus
RELEASE_DEADLINE_S for each lookup it fails), so no stream of this process hangs. A lookup whose rows the daemon had not
written is failed first: its rows are filled with NaN before its waits are released, and the next lookup(), wait() or result()
raises LookupFailedError naming it (client/failures.py); then calls raise DaemonUnavailableError
until a lookup() re-registers (each waits up to reconnect_timeout for the daemon to be back). A mapped client's
lookups go on from its mapping instead, while a thread registers with the restarted daemon (client/rejoin.py).
Threads of one process may share a client; a child made by fork() makes its own (client/process.py).
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engramd.client import process
from engramd.client.captured import CapturedLookup, Captures
from engramd.client.checks import check_ids, check_int, check_seconds, check_slot, check_sm_fraction
from engramd.client.errors import (
    BadRequestError,
    CaptureUnsupportedError,
    CudaUnavailableError,
    DaemonUnavailableError,
    EngramError,
    TablesChangedError,
)
from engramd.client.failures import FailedLookups
from engramd.client.future import LookupFuture
from engramd.client.geometry import ShardView, TableGeometry
from engramd.client.kept_rows import KeptRows
from engramd.client.mapped_path import MappedPath
from engramd.client.rejoin import RideThrough
from engramd.client.served import CudaSlabView, MemfdSlabView, ServedCpu, ServedGpu
from engramd.client.session import Session
from engramd.client.shared.connection import Connection, default_socket_path
from engramd.client.shared.mapped import LocalSlots, MappedTables
from engramd.client.shared.slab import SlabLayout
from engramd.client.watchdog import Watchdog

log = logging.getLogger("engramd.client")

MODES = ("auto", "served", "mapped")
GATHER_AT = ("wait", "lookup")  # when a mapped GPU client queues a lookup's gather
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RECONNECT_S = 60.0  # how long lookup() waits for a restarted daemon before giving up

def check_cache_cap(gib: Any) -> int | None:
    """`hot_cache_gib` as a byte cap (None: none), or a BadRequestError naming the value."""
    if gib is None:
        return None
    if isinstance(gib, bool) or not isinstance(gib, numbers.Real) or not 0 <= gib < 1 << 20:
        raise BadRequestError(f"hot_cache_gib must be a number of GiB >= 0 (0: no cache), got {gib!r}")
    return int(gib * 2**30)


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:  # a name torch does not know ("tpu"), or no name
        raise BadRequestError(f"device {device!r}: engramd serves 'cpu' and 'cuda' clients "
                              f"({exc})") from None
    if device.type == "cuda":
        _require_cuda(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise BadRequestError(f"device {device}: engramd serves 'cpu' and 'cuda' clients")
    return device


def _require_cuda(device: torch.device) -> None:
    """CudaUnavailableError, before the daemon is contacted, where this process cannot use
    `device`: the driver first (no driver, no GPU), then torch (a CPU build, or one built for a
    newer CUDA than the driver's: the slab and lookups are its tensors)."""
    from engramd.client.shared import cuda

    cuda.require_device(device.index)
    if not torch.cuda.is_available():
        raise CudaUnavailableError(
            f"device {str(device)!r}: torch {torch.__version__} cannot use CUDA here "
            "(torch.cuda.is_available() is false: a CPU build, or built for a newer CUDA than "
            "this driver); install a CUDA build of torch, or use device='cpu'")


class EngramClient:
    # What each registration sets (client/session.py: Session.connect and Session.adopt), read
    # by every path.
    geometry: TableGeometry
    shard: ShardView
    layout: SlabLayout
    epoch: str
    _token: str
    _gather_policy: dict[str, Any]
    _seqs: Iterator[int]

    def __init__(self, socket_path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                 tp_rank: int = 0, tp_size: int = 1, max_tokens: int = 1024, slots: int = 2,
                 timeout: float = DEFAULT_TIMEOUT_S, name: str = "",
                 reconnect_timeout: float = DEFAULT_RECONNECT_S, mode: str = "auto",
                 pin_tables: bool = False, hot_cache_gib: float | None = None,
                 gather_at: str = "wait"):
        """`pin_tables`: rows only ever from the tables the daemon serves at the first
        registration; once it serves others (a reload, or a restart on another checkpoint),
        lookups raise TablesChangedError. Without it the client follows a reload (see
        tables_id).

        `hot_cache_gib`: at most this much of the GPU's memory for a mapped client's own
        hot-row cache (None: what the daemon's mapped_hot_cache_gib says; 0: no cache).

        `gather_at`: when a mapped GPU client queues a lookup's gather. "wait" (the default): at
        the lookup's first wait() or result(), or at the next lookup, whichever comes first,
        behind the kernels the engine queued in between. "lookup": in lookup() itself, for an
        engine whose GPU would otherwise idle between the two (a step bound by its host).
        Served and CPU clients gather as they always do."""
        if mode not in MODES:
            raise BadRequestError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if gather_at not in GATHER_AT:
            raise BadRequestError(f"gather_at {gather_at!r}: expected one of {', '.join(GATHER_AT)}")
        self.gather_at = gather_at
        self._cache_cap = check_cache_cap(hot_cache_gib)
        self.socket_path = Path(socket_path or default_socket_path())
        self.device = _resolve_device(device)
        self.requested_mode = mode
        self.mode: str | None = None  # what the daemon granted: "served" or "mapped"
        self.pin_tables = pin_tables
        self.tables_id: str | None = None  # the tables this client's lookups read (see lookup)
        self.tables_generation = 0  # bumped each time they change
        self._tables_seq = 0  # their seq in this daemon (client/shared/messages.py: tables_seq)
        self._tables_lost: str | None = None  # pinned: why lookups are refused
        self._heard_tables: tuple[str, int] | None = None  # (tables, seq) a heartbeat reply named
        # Held by lookup() and close(); the watch thread follows a reload only while it is free.
        self._tables_lock = threading.RLock()
        self.timeout = check_seconds("timeout", timeout)
        self.reconnect_timeout = check_seconds("reconnect_timeout", reconnect_timeout, zero=True,
                                               endless=True)
        # What registering asks for (the daemon checks the ranges and says which is wrong).
        self._asked = (check_int("tp_rank", tp_rank), check_int("tp_size", tp_size),
                       check_int("max_tokens", max_tokens), check_int("slots", slots), name)
        self._born = process.generation()  # a forked child's copy refuses (client/process.py)
        self._closed = False  # close(): for good (a failed re-registration is tried again)
        self._conn: Connection | None = None
        self._slab: MemfdSlabView | CudaSlabView | LocalSlots | None = None
        self._rows = KeptRows()  # the slot memory that outlives a registration (client/kept_rows.py)
        self.registrations = 0  # how many times this client has registered
        self._slots_epoch = 0  # registrations that took the slots over (lookups made before are lost)
        self._session = Session(self)  # registering, and again after a restart (client/session.py)
        self._ride = RideThrough(self)  # mapped: registering with a restarted daemon (client/rejoin.py)
        self._mapped_path = MappedPath(self)  # mapped: the mapping and its gathers (client/mapped_path.py)
        self._watchdog = Watchdog(self)  # the lease and the heartbeat thread (client/watchdog.py)
        self._dead: str | None = None
        self._pending: dict[int, LookupFuture] = {}
        self._captures = Captures(self)  # captured lookups' slots and upkeep (client/captured.py)
        self._failed = FailedLookups()  # served GPU: lookups the daemon did not serve, unreported
        self._served = ServedGpu(self)  # served GPU: its lookups' bookkeeping (client/served.py)
        self._served_cpu = ServedCpu(self)  # served CPU: inline lookups (client/served.py)
        self.client_id: int | None = None
        self.mps: dict[str, Any] | None = None
        self._warned_mps = False
        try:
            with self._tables_lock:  # the watch thread starts before the mapping is complete
                self._session.connect()
        except BaseException:
            self.close()
            raise

    # -- reloads ----------------------------------------------------------------------------------

    def _read_tables(self, tables: str | None, seq: int) -> None:
        """From now on this client's lookups read `tables` (the daemon's id of them, `seq` its
        count of switches when it served them)."""
        if tables != self.tables_id and self.tables_id is not None:
            self.tables_generation += 1
        self.tables_id, self._tables_seq = tables, seq

    def _tables_news(self) -> tuple[str, int] | None:
        """(tables, seq) the daemon serves, when it switched to them after the ones this client
        reads: from a notice (in order with the replies) or a heartbeat reply, whichever is
        later. Older news (a reply read late, from before a switch) is none."""
        news = [n for n in (self._conn.tables_notice, self._heard_tables) if n is not None and (
            n[1] > self._tables_seq
            or n[1] == self._tables_seq == 0 and n[0] != self.tables_id)]  # a daemon without seqs
        return max(news, key=lambda n: n[1]) if news else None

    def _follow_tables(self) -> None:
        """Before a lookup: if a reload replaced the tables, read the new ones (mapped: once
        they are mapped, on a thread of their own, MappedPath.follow; until then the old mapping
        serves), or, pinned, refuse."""
        self._mapped_path.free_old_mappings()
        news = self._tables_news() if self._tables_lost is None else None
        if news is not None and self.pin_tables:
            self._tables_lost = (f"this client pinned tables {self.tables_id}; the daemon serves "
                                 f"{news[0]} now (a reload): look up from a new client")
        if self._tables_lost is not None:
            raise TablesChangedError(self._tables_lost)
        if self.mode == "mapped":
            self._mapped_path.follow(news)
        elif news is not None:  # the daemon serves them to every lookup it takes from now
            self._read_tables(*news)

    def hot_cache_stats(self) -> dict[str, Any] | None:
        """A mapped GPU client's own hot-row cache: rows read per layer and of them hits,
        admissions, refreshes, size (None without one: served lookups read the daemon's cache,
        in stats()["hot_cache"])."""
        process.check_made_here(self._born, "this client")
        with self._tables_lock:
            tables = self._mapped_path.tables
            keeper = tables.keeper if tables is not None else None
            return keeper.report() if keeper is not None else None

    @property
    def mapped_tables(self) -> MappedTables | None:
        """Mapped clients: the mapping of the daemon's tables their lookups gather from now
        (None: served, or nothing mapped); a reload's or a restart's tables replace it."""
        return self._mapped_path.tables

    @property
    def counts(self) -> dict[str, int]:
        """Mapped clients: lookups, rows and out-of-range IDs since the mapping was made."""
        return self._mapped_path.counts

    @property
    def rows_generation(self) -> int:
        """Bumped when the slots' rows move (see slot_rows)."""
        return self._rows.generation

    @rows_generation.setter
    def rows_generation(self, value: int) -> None:
        self._rows.generation = value

    @property
    def max_tokens(self) -> int:
        return self.layout.max_tokens

    @property
    def slots(self) -> int:
        return self.layout.slots

    def slot_rows(self, slot: int) -> torch.Tensor:
        """The whole rows block of `slot`: `[n_layers, max_tokens, local_heads, head_dim]` bf16.

        A lookup of T tokens into the slot fills `[:, :T]` of it (its result is that view). The
        block stays at one address for the client's life, across daemon restarts, while the
        daemon keeps the client's mode and layout. If it does not, the rows move: that is
        logged, `rows_generation` goes up, later results are views of a new block, and views of
        the old one stay readable (stale) until close(). Read it only in the order wait() gives."""
        process.check_made_here(self._born, "this client")
        if self._slab is None:
            raise DaemonUnavailableError("client is closed or not registered")
        index = check_slot(slot, self.slots)
        if index is None:
            raise BadRequestError("slot_rows needs a slot number")
        return self._slab.slot_rows(index)

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, hash_ids: torch.Tensor, stream: torch.cuda.Stream | None = None,
               slot: int | None = None, sm_fraction: float | None = None) -> LookupFuture:
        """Submit `[T, n_layers, heads]` int32/int64 row IDs (-1 = DEAD); returns at once.

        GPU clients: the IDs may be produced by earlier work on `stream` (default: the current
        stream). A served client copies them into the slot on it; a mapped one reads them where
        they are when its gather runs (gather_at): the caller may drop them after lookup(), but
        not overwrite them before the wait.
        `slot`: the slot whose rows the lookup fills (default: the next one in turn), for a
        caller that keeps views of a slot's rows (slot_rows).
        `sm_fraction` (0 < f <= 1): the share of the GPU's SMs that a mapped client's gather
        may take, for this lookup (default: the daemon's `gather_sm_fraction`). A model that
        reads the rows right after this lookup waits for the whole gather: 1.0 shortens it.
        One that runs many kernels before reading them leaves those kernels SMs with the
        default. Any share runs one program at least. Served lookups keep the daemon's grid,
        and a CPU client has none: both check the value and ignore it.
        """
        process.check_made_here(self._born, "this client")
        fraction = check_sm_fraction(sm_fraction)
        with self._tables_lock:
            return self._lookup(hash_ids, stream, slot, fraction)

    def _lookup(self, hash_ids: torch.Tensor, stream: torch.cuda.Stream | None,
                slot: int | None, sm_fraction: float | None) -> LookupFuture:
        if self._closed:
            raise DaemonUnavailableError("client is closed")
        self._failed.raise_unreported()  # before anything else: the engine must hear of them
        if self.mode == "mapped":
            self._mapped_path.queue_gather()  # lookups reach the side stream in the order they were made
        self._keep_up()
        ids = check_ids(hash_ids, self.geometry, self.max_tokens)
        slot = check_slot(slot, self.slots)  # after a re-registration: its slots
        if self.mode == "mapped":
            return self._mapped_path.lookup(ids, stream, slot, sm_fraction)
        if self.device.type == "cuda":
            return self._served.lookup(ids, stream or torch.cuda.current_stream(self.device.index), slot)
        return self._served_cpu.lookup(ids, slot)

    def _keep_up(self, pause: Callable[[float], bool | None] = time.sleep, patient: bool = True) -> None:
        """Before a lookup, and on the captured lookups' upkeep thread between replays
        (client/captured.py): read the daemon's news, ride through or reconnect after its death
        or after a reconnect that found no daemon (`pause`: Session.reconnect's; not `patient`:
        one attempt only once one found none), follow a reload. Callers hold _tables_lock; the
        client is open."""
        if self.mode == "mapped":
            self._ride.close_replaced()  # a rejoin's (only a mapped client rejoins)
        self._take_in()
        if self._conn is None:  # a reconnect found no daemon
            self._session.reconnect(pause, once=not patient)
        elif self._daemon_gone() and not self._ride.riding_through():
            self._session.reconnect(pause)
        self._follow_tables()

    def _track(self, future: LookupFuture) -> LookupFuture:
        self._pending[future.slot] = future
        return future

    def _take_in(self) -> None:
        """Read what the daemon sent, without waiting: notices, and error replies to GPU lookups
        (kept on their futures, raised by their wait()/result())."""
        conn = self._conn
        if conn is None:
            return
        conn.collect()
        if self.device.type != "cuda" or not conn.has_replies():
            return
        self._served.take_errors(conn)

    def _take_turn(self, slot: int | None) -> int:
        """The slot a lookup fills: `slot` if named (the turn stays where it is), else the next
        in turn; never one a captured lookup writes."""
        if slot is not None:
            if slot in self._captures.slots:
                raise BadRequestError(f"slot {slot} belongs to a captured lookup (capturable_lookup)")
            return slot
        captured = self._captures.slots
        for _ in range(self.slots):
            slot, self._next_slot = self._next_slot, (self._next_slot + 1) % self.slots
            if slot not in captured:
                return slot
        raise BadRequestError(f"all {self.slots} slots belong to captured lookups: register with more")

    def capturable_lookup(self, ids: torch.Tensor, slot: int | None = None,
                          sm_fraction: float | None = None) -> CapturedLookup:
        """A lookup a CUDA graph can record (client/captured.py): `ids`, [T_max, n_layers, heads]
        int32/int64 on this client's GPU, is the buffer the engine writes each step's IDs into;
        the rows go to `slot` (default: the last one no captured lookup has), which lookup()
        no longer takes. Record it with `record(T)` inside the capture, `check()` it off the
        critical path; it follows reloads and daemon restarts without a new capture. Only a
        mapped GPU client can make one (CaptureUnsupportedError otherwise)."""
        if self.device.type != "cuda" or self.mode != "mapped":
            raise CaptureUnsupportedError(
                f"a {self.device.type} client in {self.mode} mode cannot record its lookups in a "
                f"CUDA graph: only a mapped GPU client gathers on the engine's stream with no "
                f"host work per step (served lookups are the daemon's work, a CPU client has no "
                f"graphs)")
        process.check_made_here(self._born, "this client")
        return self._captures.make(ids, slot, sm_fraction)

    # -- daemon death ---------------------------------------------------------------------------

    def _daemon_gone(self) -> bool:
        """The daemon of our registration died, retired us, or said it is stopping (a reconnect
        may help). Reads only what _take_in() has collected, and the lease without waiting."""
        if self._conn is None:
            return False
        # GPU clients: the watchdog thread watches the lease and sets _dead, off the lookup path.
        cpu_watch = self.device.type == "cpu" and self._watchdog.lease is not None
        return (self._dead is not None or self._conn.notice == "stopping"
                or (cpu_watch and self._watchdog.lease_gone() is not None))

    def _check_alive(self) -> None:
        self._open_connection()
        if self._daemon_gone():
            raise DaemonUnavailableError(
                self._dead or "the daemon is stopping or has exited; results of in-flight "
                "lookups are invalid (the next lookup() re-registers with a restarted daemon)")

    # -- other operations -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        process.check_made_here(self._born, "this client")
        with self._tables_lock:  # the connection is shared with the captured lookups' upkeep
            return self._open_connection().call("stats", self.timeout).body.encode()

    def health(self) -> dict[str, Any]:
        process.check_made_here(self._born, "this client")
        with self._tables_lock:
            return self._open_connection().call("health", self.timeout).body.encode()

    def _open_connection(self) -> Connection:
        """The registration's connection, or DaemonUnavailableError: closed, or registered with
        no daemon since a reconnect found none (the next lookup() tries again)."""
        if self._closed:
            raise DaemonUnavailableError("client is closed")
        if self._conn is None:
            raise DaemonUnavailableError(
                "not registered: no daemon answered when this client last tried to re-register; "
                f"the next lookup() tries again (for up to {self.reconnect_timeout:g} s)")
        return self._conn

    def close(self) -> None:
        """Release the registration and the slab mapping, waiting about `timeout` at most for
        lookups in flight and the release. Safe to call twice. In a child made by fork() it
        does nothing: what the client holds is its parent's."""
        self._closed = True
        if not process.made_here(self._born):
            return
        self._ride.stop()  # before the lock, which its thread may be waiting for
        self._captures.stop()  # likewise
        with self._tables_lock:
            self._ride.close_replaced()
            self._mapped_path.lose_captured("the client closed", detach=True)  # before the slots go
            self._close()

    def _close(self) -> None:
        self._take_in()
        if self._conn is not None and self.client_id is not None and not self._daemon_gone():
            deadline = time.monotonic() + self.timeout  # one for all: a silent daemon answers none
            for future in list(self._pending.values()):
                try:
                    future._collect(max(0.0, deadline - time.monotonic()))
                except EngramError:
                    pass
            counts = None
            mapped = self._mapped_path
            if mapped.tables is not None:  # synchronises first: our gathers write our slots
                mapped.queue_gather()  # every lookup is gathered, its out-of-range IDs counted
                counts = mapped.final_counts()
                mapped.unmap()
            if isinstance(self._slab, CudaSlabView):
                # Our streams may wait on the daemon's counters: if it dies during this sync, the
                # watchdog (still running) releases them. Then it stops, before the unmap.
                torch.cuda.synchronize(self.device)
            self._watchdog.stop()  # releasing closes the lease: that is no death to report
            slab, self._slab = self._slab, None
            if slab is not None:
                slab.close()
            try:
                left = max(0.1, min(deadline - time.monotonic(), 5.0))
                self._conn.call("release", left, client_id=self.client_id, counts=counts)
            except EngramError:
                pass  # the daemon is gone or already forgot us: nothing left to release
        try:
            self._session.disconnect()
        finally:
            self._rows.close()  # a re-registration that never came

    def __enter__(self) -> EngramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

