"""The mapped path of a client: this process gathers the rows from its own mapping of the
daemon's tables, into slots of its own.

What the path holds: the mapping and the gather over it (on a GPU, a side stream and a hot-row
cache of its own, client/shared/cache_keeper.py), the lookup whose gather waits to be queued
(gather_at), a reload's tables while they are mapped, the replaced mappings until their last
gathers ran and no captured lookup can read them (client/captured.py), and the counts the daemon
is told. The mapping, the plan and the gather themselves are client/shared/mapped.py's; the
registration, the lease and the rejoin after a daemon restart are the client's (client/session.py,
client/rejoin.py), which calls in here and whose `_tables_lock` orders this path's work between
the lookup thread, the watch thread and the captured lookups' upkeep thread.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from engramd.client.captured import CapturedLookup
from engramd.client.errors import DaemonUnavailableError, EngramError, InternalError
from engramd.client.future import ClientPath, LookupFuture
from engramd.client.shared.cache_keeper import CacheKeeper, WarmUpTrace
from engramd.client.shared.handles import (
    HANDLE_TIMEOUT_S,
    Attachment,
    fetch_tables,
    handle_socket_path,
)
from engramd.client.shared.mapped import (
    DeferredGather,
    DeviceCounterReader,
    MappedTables,
    PendingMapping,
    close_in_background,
    mapped_gather,
)
from engramd.kernels import descriptor as desc

if TYPE_CHECKING:
    from engramd.client.client import EngramClient

log = logging.getLogger("engramd.client")


def cache_budget(policy: dict[str, Any], cap: int | None) -> int:
    """Bytes of a mapped GPU client's own hot-row cache: the daemon's size, capped by the
    client's (an older daemon sends none: no cache)."""
    offered = policy.get("cache_bytes", 0)
    offered = offered if type(offered) is int and offered > 0 else 0
    return offered if cap is None else min(offered, cap)


class MappedPath(ClientPath):
    """A mapped client's lookups and what they gather from. Built once per client; what it
    maps changes with the registrations and reloads (map_tables, follow, unmap)."""

    def __init__(self, client: EngramClient):
        super().__init__(client)
        self.tables: MappedTables | None = None
        self.gather: Any = None  # the gather this process runs
        self.side: torch.cuda.Stream | None = None  # GPU: the gathers run on it
        self.unqueued: LookupFuture | None = None  # GPU: the lookup whose gather waits
        self.out_of_range: DeviceCounterReader | None = None  # GPU: their device count
        # Replaced mappings (with what their last gathers need) until those have run.
        self.old_mappings: list[tuple[MappedTables, Any, Any]] = []
        self.remapping: PendingMapping | None = None  # a reload's tables, being mapped
        self.idle_follow_failed: int | None = None  # the tables seq the watch thread gave up on
        # Lookups graphs recorded (client/captured.py), which follow what this path maps. A
        # tuple, replaced whole: a cache keeper's thread reads it.
        self.captured: tuple[CapturedLookup, ...] = ()
        # What closed captured lookups looked up: the counts the daemon is told never go back.
        self._closed_counts = {"lookups": 0, "rows": 0, "out_of_range": 0}
        self.reset_counts()

    def reset_counts(self) -> None:
        """A new registration: its counts begin at zero."""
        self.counts = {"lookups": 0, "rows": 0, "out_of_range": 0}  # since the mapping
        # The counts when the registration began (the captured lookups' go on across
        # registrations); the daemon is told those since then.
        self.counts_base = self._captured_counts()

    def map_tables(self, attachment: Attachment) -> None:
        """Mapped mode: the tables' descriptors, mapped read-only, and on a GPU the side stream
        the gathers run on and the hot-row cache they read through."""
        self.tables = MappedTables(attachment.tables, self._client.geometry, self.device)
        if attachment.version is not None:  # a reload between register and attach: these
            self._client._read_tables(attachment.version, attachment.tables_seq)
        try:
            if self.device.type == "cuda":
                from engramd.client.shared import cuda

                self.side = cuda.new_stream(self.device.index)
            self.gather = self._gather_over(self.tables, attachment.warm_fd)
        except BaseException:  # the mapping, its cache's keeper and the stream go with it
            self.unmap()
            raise
        if self.device.type == "cuda":
            # The plan's and cache's device arrays were made on this thread's stream; the
            # gathers run on ours.
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            self.out_of_range = DeviceCounterReader(self.gather.out_of_range)
        self._follow_captured()

    def _gather_over(self, mapped: MappedTables, warm_fd: int | None = None,
                     counter: torch.Tensor | None = None):
        """The gather over `mapped`, by the daemon's policy (mapped_gather), through a hot-row
        cache of its own on a GPU (_start_cache)."""
        if self.side is not None:
            self._start_cache(mapped, warm_fd)
        policy = self._client._gather_policy
        return mapped_gather(self._client.shard, mapped, self.device, int(policy.get("sort_min_tokens", 0)),
                             float(policy.get("sm_fraction", 1.0)), counter=counter)

    def _start_cache(self, mapped: MappedTables, warm_fd: int | None) -> None:
        """A GPU client's own hot-row cache over `mapped` and its keeper (client/shared/cache_keeper.py,
        whose grace waits out the gathers on our side stream), of the size the daemon says
        capped by `hot_cache_gib` (none for 0). The keeper's thread warms it from the daemon's
        trace when it passed one (this shard's heads: the others' rows are never read here),
        while lookups already run: reading and counting the trace is no part of the attach. A
        cache that cannot be made only costs hits: the client gathers without one."""
        budget = cache_budget(self._client._gather_policy, self._client._cache_cap)
        if budget <= 0:
            return
        side = self.side
        try:
            with torch.cuda.device(self.device):
                keeper = CacheKeeper.over(mapped.device_rows(), budget, lambda: [side],
                                          float(self._client._gather_policy.get("cache_refresh_s", 0.05)),
                                          lambda: [c.descriptor.quiet() for c in self.captured])
        except Exception as exc:  # e.g. too small a budget (CacheConfigError), or out of memory
            log.warning("client %s gathers without a hot-row cache: %s", self._client.client_id, exc)
            return
        warm_up = None
        try:  # a descriptor of the keeper's own: the attachment's is closed once it is done
            if warm_fd is not None:
                warm_up = WarmUpTrace(os.dup(warm_fd), self._client.geometry.n_layers, self._client.geometry.heads,
                                      slice(self._client.shard.head_start, self._client.shard.head_end))
        except OSError as exc:
            log.warning("client %s: its hot-row cache starts cold: %s", self._client.client_id, exc)
        mapped.keeper = keeper.start(warm_up)
        log.info("client %s: hot-row cache of %d rows%s", self._client.client_id, keeper.cache.layout.slots,
                 ", warming on its keeper's thread" if warm_up is not None else "")

    def follow(self, news: tuple[str, int] | None) -> None:
        """Before a lookup, `news` the tables the daemon switched to (if any): map them on a
        thread of their own (PendingMapping), and once they are mapped gather from them; until
        then the old mapping serves."""
        client = self._client
        pending = self.remapping
        if pending is None and news is not None:
            path, client_id, token = handle_socket_path(client.socket_path), client.client_id, client._token
            timeout = max(client.timeout, HANDLE_TIMEOUT_S)
            self.remapping = PendingMapping(lambda: fetch_tables(path, client_id, token, timeout),
                                            client.geometry, self.device)
        elif pending is not None and pending.ready():
            self.remapping = None
            self._take_mapping(pending)

    def follow_while_idle(self) -> None:
        """Watch thread: a mapped client that no lookup is using follows a reload here (maps
        the new tables, takes them, unmaps the old ones), so an idle engine lets the old
        tables' memory go within a heartbeat or two instead of at its next lookup."""
        if self._client.mode != "mapped" or self._client.pin_tables:
            return
        if not self._client._tables_lock.acquire(blocking=False):
            return  # a lookup or close() is running: lookups follow the tables themselves
        news = None
        try:
            if self._client._conn is None or self.gather is None:  # closed, or still being built
                return
            news = self._client._tables_news()
            if news is not None and news[1] == self.idle_follow_failed:
                return  # it failed here once: the next lookup tries again, and raises
            if news is None and self.remapping is None and not self.old_mappings \
                    and not any(c.waiting for c in self.captured):
                return
            # On our side stream: the new plan's construction is ordered before our gathers and
            # waits for none of the engine's work.
            on_gpu = self.side is not None
            with torch.cuda.device(self.device) if on_gpu else nullcontext(), \
                    torch.cuda.stream(self.side) if on_gpu else nullcontext():
                self._client._follow_tables()
        except Exception as exc:
            self.idle_follow_failed = news[1] if news is not None else None
            log.warning("client %s could not follow the reload while idle: %s", self._client.client_id, exc)
        finally:
            self._client._tables_lock.release()

    def _take_mapping(self, pending: PendingMapping) -> None:
        """Gather from the reload's tables from this lookup on; the old mapping goes once the
        gathers on it are done."""
        # A lookup made before the switch reads the tables of its time; queued first, so that
        # its wait() need not take the lock this thread holds while the new gather is built.
        self.queue_gather()
        if pending.error is not None:  # the news goes: the next heartbeat's reply tries again
            self._client._conn.tables_notice = self._client._heard_tables = None
            log.warning("client %d could not map the reloaded tables: %s", self._client.client_id, pending.error)
            return
        try:  # a new cache too (the old one holds rows of the old tables); counts go on where they were
            gather = self._gather_over(pending.tables, counter=getattr(self.gather, "out_of_range", None))
        except BaseException:
            pending.discard()
            raise
        if self.side is not None:  # the new plan's device arrays came from this thread's stream
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        old, old_gather = self.tables, self.gather
        self.tables, self.gather = pending.tables, gather
        del gather
        self._follow_captured()
        if old.keeper is not None:
            old.keeper.stop()  # nothing will read its cache once the gathers queued on it are done
        done = None  # CPU gathers ran inside their lookup() calls
        if self.device.type == "cuda":  # gathers on the old mapping may still run: after them
            done = torch.cuda.Event()
            done.record(self.side)
            # Its plan's device arrays too: freed now, the allocator could hand them out under
            # the queued gathers. (A CPU gather's views of the old mapping, by contrast, must go
            # now: while one lives, the unmap would run here when it goes, 0.3 s a GiB.)
            self.old_mappings.append((old, done, old_gather))
        else:
            self.old_mappings.append((old, done, None))
        del old_gather
        log.info("client %d maps tables %s now (were %s)", self._client.client_id, pending.version, self._client.tables_id)
        self._client._read_tables(pending.version, pending.seq)
        self.free_old_mappings()

    def free_old_mappings(self, wait: bool = False) -> None:
        """Unmap replaced mappings whose last gathers are done and that no captured lookup can
        read any more, in the background (`wait`: all, synchronising first, and waiting for the
        unmaps; captured lookups were poisoned first, unmap)."""
        for captured in self.captured:
            captured.advance()  # what a replay has adopted since: the old contents may go
        kept, closing = [], []
        for mapped, done, gather in self.old_mappings:
            if wait and done is not None:
                done.synchronize()
            if (done is None or done.query()) and not any(c.reads(mapped) for c in self.captured):
                closing.append(close_in_background(mapped))  # `gather` goes with this entry
            else:
                kept.append((mapped, done, gather))
        self.old_mappings = kept
        for thread in closing if wait else ():
            thread.join()

    def unmap(self) -> None:
        """Mapped mode: let go of the tables and of everything built on them; captured lookups
        are poisoned first, and the device synchronised, so no replay reads what goes."""
        if self.captured:
            for captured in self.captured:
                captured.unmapping("the client's tables were unmapped: its daemon went away or "
                                   "it registered again")
            for captured in self.captured:
                captured.settle()
        mapped, side = self.tables, self.side
        self.tables, self.gather, self.side, self.out_of_range = None, None, None, None
        self.unqueued = None  # its wait() raises: the rows would come from a mapping now gone
        pending, self.remapping = self.remapping, None
        if pending is not None:
            pending.discard()
        self.free_old_mappings(wait=True)
        if mapped is not None:
            mapped.close()
        if side is not None:
            from engramd.client.shared import cuda

            torch.cuda.synchronize(self.device)  # our gathers ran on it
            cuda.STREAMS.give(side)

    # -- lookups graphs record (client/captured.py) ----------------------------------------------

    def capture(self, ids: torch.Tensor, slot: int, sm_fraction: float | None) -> CapturedLookup:
        """A captured lookup over the mapping of now, which follows this path's from now on."""
        client = self._client
        captured = CapturedLookup(self, self.tables, ids, slot, client._slab.rows, client.geometry,
                                  client.shard, client._gather_policy, sm_fraction)
        self.captured = (*self.captured, captured)
        return captured

    def forget_captured(self, captured: CapturedLookup) -> None:
        """A captured lookup closes: it reads nothing from now on, and its slot is free."""
        with self._client._tables_lock:
            captured.lose("this captured lookup was closed", detach=True)  # settled: final counts
            final = _counts_of(captured, wait=True)
            self._closed_counts = {name: value + final[name] for name, value in self._closed_counts.items()}
            self.captured = tuple(c for c in self.captured if c is not captured)  # its slot too

    def lose_captured(self, why: str, detach: bool = False) -> None:
        """No graph can follow the client any more (it is served now; `detach`: its slots go,
        the client closes)."""
        for captured in self.captured:
            captured.lose(why, detach)

    def _follow_captured(self) -> None:
        for captured in self.captured:
            captured.follow(self.tables, self._client.geometry, self._client.shard)

    def lookup(self, ids: torch.Tensor, stream: torch.cuda.Stream | None,
                       slot: int | None, sm_fraction: float | None) -> LookupFuture:
        """Mapped mode: this process gathers from its mapping of the daemon's tables. On a GPU
        the gather runs on a side stream after `stream`'s earlier work (the IDs' producers) and
        after the previous readers of the slot; wait() makes a stream wait for its event."""
        slot = self._client._take_turn(slot)
        tokens = ids.shape[0]
        out = self._client._slab.rows(slot, tokens)
        future = LookupFuture(self, 0, slot, next(self._client._seqs), tokens, acked=False)
        if self.device.type == "cpu":
            self._client._pending.pop(slot, None)
            future.out_of_range = self.gather(ids.to("cpu"), out, None)
            self.counts["out_of_range"] += future.out_of_range
        else:
            future.deferred = self._gather_inputs(ids, out, slot, stream, sm_fraction)
            future.event = torch.cuda.Event()
            self.unqueued = future
            if self._client.gather_at == "lookup":
                self.queue_gather()
        self.counts["lookups"] += 1
        self.counts["rows"] += tokens * self._client.geometry.n_layers * self._client.shard.owned_heads
        return self._client._track(future)

    def _gather_inputs(self, ids: torch.Tensor, out: torch.Tensor, slot: int,
                       stream: torch.cuda.Stream | None, sm_fraction: float | None) -> DeferredGather:
        """What a mapped GPU lookup's gather needs, its dependencies taken now: events on the
        streams whose work so far must come first, `stream`'s (the IDs' producers) and the
        slot's previous readers'. The gather itself is queued later (queue_gather)."""
        stream = stream or torch.cuda.current_stream(self.device.index)
        if ids.device != self.device:
            with torch.cuda.stream(stream):  # recorded in `stream`'s order below
                ids = ids.to(self.device, non_blocking=True)
        previous = self._client._pending.pop(slot, None)
        streams = [stream, *(c for c in (previous.consumers if previous is not None else ())
                             if c != stream)]  # `stream`'s reads are covered by its own event
        after = []
        for waited in streams:
            event = torch.cuda.Event()
            event.record(waited)
            after.append(event)
        # Held until the gather is queued, so the caller may drop the IDs once lookup() returns.
        return DeferredGather(ids, out, after, sm_fraction)

    def queue_gather(self) -> None:
        """Queue the gather of the lookup that waits for it (if any) on the side stream, on the
        mapping of this moment. Callers hold _tables_lock."""
        future, self.unqueued = self.unqueued, None
        if future is None:
            return
        work, side = future.deferred, self.side
        try:
            for event in work.after:
                side.wait_event(event)
            work.ids.record_stream(side)  # the allocator keeps the IDs until the gather read them
            self.gather(work.ids, work.out, side, work.sm_fraction)
            future.event.record(side)
        except BaseException as exc:  # e.g. out of memory for a sort: that lookup's wait() says so
            future._error = exc if isinstance(exc, EngramError) else InternalError(
                f"the gather of a lookup of {future.tokens} tokens failed: {exc}")
            if not isinstance(exc, Exception):
                raise
        finally:
            # Last: a wait() on another thread that finds it None without the lock finds the
            # event recorded or the error set.
            future.deferred = None

    def queued(self, future: LookupFuture) -> None:
        """Before a stream waits for a mapped lookup's event: its gather is queued (now, if it
        was waiting for this), or the lookup's error is raised (its gather failed, or was
        dropped with its mapping)."""
        if future.deferred is not None:
            with self._client._tables_lock:
                if self.unqueued is future:
                    self.queue_gather()
        if future.deferred is not None:
            raise DaemonUnavailableError(
                "this lookup's gather was dropped with the tables mapping it was to read (the "
                "client closed while its daemon was gone): look it up again")
        if future._error is not None:
            raise future._error

    def stream_wait(self, future: LookupFuture, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait for the gather of `future` (on the side stream)."""
        self.queued(future)
        stream.wait_event(future.event)
        if stream not in future.consumers:
            future.consumers.append(stream)

    def rows_written(self, future: LookupFuture) -> bool:
        """Whether `future`'s rows are known written, without waiting (LookupFuture.ok)."""
        if future.slots_epoch != self.slots_epoch or self._client._slab is None:
            return False
        if future.event is not None:  # GPU: the gather's event, once it is queued
            return future.deferred is None and future.event.query()
        return future.done()  # CPU: gathered in lookup()

    def poll_failure(self, future: LookupFuture) -> None:
        if self.device.type == "cuda":
            self._client._take_in()  # the daemon's notices (a mapped lookup has no reply)

    def mapped_counts(self, queue_copy: bool = True) -> dict[str, int]:
        """Counts since the mapping was made (GPU out-of-range IDs as the device counter read by
        the last finished copy, `queue_copy`: the next one queued; never a host sync of the
        model's work)."""
        counts = dict(self.counts)
        reader = self.out_of_range  # None once unmapped (close or reconnect on another thread)
        if self.device.type == "cuda" and reader is not None:
            counts["out_of_range"] = reader.read(again=queue_copy)
        return self._with_captured(counts)

    def _captured_counts(self, wait: bool = False) -> dict[str, int]:
        """What the captured lookups' replays looked up, since each was made (their descriptors'
        counts, as of the last finished copy; `wait`: now). Poisoned replays looked nothing up."""
        counts = dict(self._closed_counts)
        for captured in self.captured:
            for name, value in _counts_of(captured, wait).items():
                counts[name] += value
        return counts

    def _with_captured(self, counts: dict[str, int], wait: bool = False) -> dict[str, int]:
        captured = self._captured_counts(wait)
        return {name: value + captured[name] for name, value in counts.items()}

    def since_registered(self, counts: dict[str, int]) -> dict[str, int]:
        return {name: value - self.counts_base.get(name, 0) for name, value in counts.items()}

    def final_counts(self) -> dict[str, int]:
        """Mapped clients at release, the device idle: exact counts, the last word on them."""
        counts = dict(self.counts)
        if self.device.type == "cuda" and self.gather is not None:  # None: mapping failed half-way
            torch.cuda.synchronize(self.device)  # the side stream's gathers count into it
            counts["out_of_range"] = int(self.gather.out_of_range.item())
        return self.since_registered(self._with_captured(counts, wait=True))


def _counts_of(captured: CapturedLookup, wait: bool = False) -> dict[str, int]:
    """A captured lookup's replays' counts, as a mapped client counts its lookups: poisoned
    replays looked nothing up."""
    words = captured.descriptor.snapshot(wait)
    return {"lookups": words[desc.LAUNCHES] - words[desc.POISONED_LAUNCHES],
            "rows": words[desc.ROWS], "out_of_range": words[desc.OUT_OF_RANGE]}
