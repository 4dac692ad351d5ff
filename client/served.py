"""The served paths of a client: the daemon gathers into a slab the client maps.

The slab views (a GPU slab with its counter block, a CPU memfd); the served GPU lookups
(ServedGpu): the hot path that hands IDs over on the caller's stream, the lookups whose rows are
not known written yet, the daemon's late error replies, and the release of every stream wait once
the daemon is gone (its NaN over rows that will never come: client/failures.py); the served CPU
lookups (ServedCpu), whose IDs go inline and whose rows come with the reply. Not here: the
registration and the reconnects (client/client.py) and the lease's watch (client/watchdog.py),
which call in here, and the mapped path (client/mapped_path.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from engramd.client.errors import EngramError, InternalError, ReplyTimeoutError
from engramd.client.future import ClientPath, LookupFuture
from engramd.client.shared.connection import Connection
from engramd.client.shared.handles import Attachment
from engramd.client.shared.ids import dtype_name
from engramd.client.shared.shared_mapping import SharedMapping
from engramd.client.shared.slab import (
    BF16_NAN,
    DONE_AT_RELEASE,
    FAILED,
    IDS_READY,
    ROWS_DONE,
    SlabLayout,
    SlotViews,
    rows_written,
    wait_passes,
)

if TYPE_CHECKING:
    from engramd.client.client import EngramClient

log = logging.getLogger("engramd.client")

RELEASE_DEADLINE_S = 0.5  # for the NaN over rows the daemon did not write (invalidate)
# How long a served GPU client that heard "stopping" waits for the rows its daemon still writes
# before it fails the rest (await_stopping_daemon); the daemon's drain takes at most 30 s.
STOPPING_SETTLE_S, SETTLE_POLL_S = 5.0, 0.001
# How long the watchdog keeps storing the release after its daemon died: the dead process's last
# gathers can still run for a moment and write older ROWS_DONEs over it (as the daemon's own
# release repeats its stores: server/cuda_slab.py).
RELEASE_REPEAT_S, RELEASE_REPEAT_PAUSE_S = 2.0, 0.01
RECENT_LOOKUPS = 64  # served GPU lookups remembered by rid for their late error replies


class MemfdSlabView:
    """The client's mapping of a CPU-backend slab (a memfd passed over the handle socket)."""

    def __init__(self, fd: int, layout: SlabLayout):
        self.layout = layout
        try:
            self._mapping = SharedMapping(fd, layout.size)
        except (ValueError, OSError) as exc:  # a short descriptor, or no room to map it
            raise InternalError(f"slab: {exc}") from None
        self.buffer = self._mapping.buffer

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        return self.layout.rows_view(self.buffer, slot, tokens)

    def slot_rows(self, slot: int) -> torch.Tensor:
        return self.layout.slot_rows(self.buffer, slot)

    def rebind(self, attachment: Attachment) -> None:
        """A new daemon's slab of the same layout, at this one's address (see KeptRows.keep)."""
        try:
            self._mapping.remap(attachment.slab_fd)
        except (ValueError, OSError) as exc:
            raise InternalError(f"slab: {exc}") from None

    def close(self) -> None:
        # Row views the caller still holds keep the mapping: it is unmapped when the last of
        # them goes, not under them.
        self.buffer = None
        self._mapping.close()


class CudaSlabView:
    """The client's mapping of a GPU slab (device memory passed as a descriptor) and of its
    counter block (pinned host memory, another descriptor), opened once."""

    def __init__(self, attachment: Attachment, layout: SlabLayout, device: torch.device):
        from engramd.client.shared import cuda

        self.layout = layout
        self.device = device
        self.memory = cuda.DeviceAllocation.from_descriptor(attachment.slab_fd, int(attachment.slab["bytes"]),
                                                            device.index)
        self.ptr = self.memory.ptr
        self.counters = None
        try:
            with torch.cuda.device(device):
                self.views = SlotViews(layout, cuda.tensor_view(self.ptr, layout.size, device))
            self.ops = cuda.StreamOps()
            self._map_counters(attachment)
            # Where the watchdog invalidates rows the daemon will not write (invalidate()).
            self.release_stream = cuda.new_stream(device.index)
        except BaseException:  # what was mapped goes with it
            if self.counters is not None:
                self.counters.close()
            self.memory.close()
            raise
        self.ids_address = [self.ptr + layout.ids_offset(s) for s in range(layout.slots)]

    def _map_counters(self, attachment: Attachment) -> None:
        """Map the attachment's counter block (closing the one mapped before, which nothing uses
        any more), and make the handles of its words that the hot path passes to CUDA."""
        from engramd.client.shared.host_counters import HostCounters

        if attachment.counters_fd is None:
            raise InternalError("the daemon passed a GPU slab without its counter block")
        try:
            counters = HostCounters(attachment.counters_fd, self.layout, self.device.index)
        except (ValueError, OSError) as exc:
            raise InternalError(f"slab counters: {exc}") from None
        old, self.counters = self.counters, counters
        if old is not None:
            old.close()
        slots = range(self.layout.slots)
        self.ids_ready = [self.ops.pointer(counters.address(s, IDS_READY)) for s in slots]
        self.rows_done = [self.ops.pointer(counters.address(s, ROWS_DONE)) for s in slots]

    def rebind(self, attachment: Attachment) -> None:
        """A new daemon's slab of the same layout, at this one's address (see KeptRows.keep): the
        views and streams built on the address stay valid; the counters are the new slab's."""
        if int(attachment.slab["bytes"]) != self.memory.size:
            raise InternalError(f"the daemon's new slab has {attachment.slab['bytes']} bytes, the "
                                f"client's {self.memory.size}")
        torch.cuda.synchronize(self.device)  # nothing of ours still reads or writes the old one
        self.memory.replace_from_descriptor(attachment.slab_fd)
        self._map_counters(attachment)

    def invalidate(self, slot: int, tokens: int, after: torch.cuda.Event) -> torch.cuda.Event:
        """NaN over the first `tokens` tokens of the slot's rows, which the daemon will not
        write, on the release stream once `after` (the lookup's submission: its stream has
        passed the slot's previous readers) has passed; returns an event that passes once it is
        done. Its waits are released after it (fail()), so they read NaN, not the slot's
        previous rows (client/failures.py). A driver memset: no kernel module is loaded while
        this process's streams wait on a dead one."""
        self.release_stream.wait_event(after)
        self.ops.fill_layers(self.release_stream.cuda_stream, self.views.rows(slot, tokens), BF16_NAN)
        done = torch.cuda.Event()
        done.record(self.release_stream)
        return done

    def fail(self, slot: int, seq: int) -> None:
        """Mark the slot's lookup `seq` not served (FAILED, as the daemon's refusal does) and
        pass the waits for it, and for no later lookup of the slot (CPU stores)."""
        self.counters.store(slot, FAILED, seq)
        if not wait_passes(self.counters.load(slot, ROWS_DONE), seq):
            self.counters.store(slot, ROWS_DONE, seq)

    def release(self, slot: int, last_seq: int) -> None:
        """Pass every wait of ours on the slot's rows (a CPU store, which no GPU queue holds up:
        client/shared/host_counters.py)."""
        self.counters.release(slot, last_seq)

    def written(self, slot: int, seq: int, last_seq: int) -> bool:
        """Whether the slot's counters show `seq`'s rows written (slab.rows_written)."""
        load = self.counters.load
        return rows_written(load(slot, ROWS_DONE), load(slot, FAILED), load(slot, DONE_AT_RELEASE),
                            seq, last_seq)

    def failed_seq(self, slot: int) -> int:
        """The slot's FAILED word: the last of its lookups marked not served (written before
        that lookup's ROWS_DONE, by the daemon's refusal or the client's release)."""
        return self.counters.load(slot, FAILED)

    def ids(self, slot: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        return self.views.ids(slot, tokens, dtype)

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        return self.views.rows(slot, tokens)

    def slot_rows(self, slot: int) -> torch.Tensor:
        return self.views.slot_rows(slot)

    def close(self) -> None:
        from engramd.client.shared import cuda

        torch.cuda.synchronize(self.device)
        cuda.STREAMS.give(self.release_stream)  # idle: synchronised above
        self.views.close()
        self.memory.close()
        self.counters.close()


class ServedGpu(ClientPath):
    """A served GPU client's lookups: handed to the daemon through the slab's counters, their
    rows awaited in stream order, released by the client when the daemon cannot.

    The slot memory, the connection, the lookups by slot and the daemon's death (`_dead`, set by
    the watchdog thread) are the client's, which outlive a registration; the lookups not known
    written and the last ones sent are this path's, begun again at each registration (reset)."""

    def __init__(self, client: EngramClient):
        super().__init__(client)
        # One failure of lookups at a time (invalidate): the watchdog's, and a lookup's that
        # found the daemon gone. Two at once could release a slot's waits (fail() of a later
        # lookup) before an earlier lookup of that slot has its NaN, or queue one's fill on the
        # release stream behind a wait that needs the other's.
        self._invalidating = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """A new registration: no lookups sent yet."""
        # Lookups sent whose rows are not known written, every slot's (a slot's previous lookup
        # may still be gathering when its next one replaces it in the client's _pending).
        self.unsettled: list[LookupFuture] = []
        # The last lookups sent, by rid, so that an error reply that comes after a later lookup
        # took a lookup's place in _pending still fails it (take_errors).
        self.recent: OrderedDict[int, LookupFuture] = OrderedDict()
        self.last_seq = 0  # the seq of the last lookup sent (rows_written)

    def lookup(self, ids: torch.Tensor, stream: torch.cuda.Stream, slot: int | None) -> LookupFuture:
        """The served hot path: a handful of calls on handles built at registration."""
        slab = self._client._slab
        raw = stream.cuda_stream
        # May time out: then the turn stays where it was.
        self._after_previous_use(self._client._next_slot if slot is None else slot, stream, raw)
        slot = self._client._take_turn(slot)
        seq = next(self._client._seqs)
        tokens = ids.shape[0]
        # One copy, no conversion kernel: the slot keeps the caller's dtype.
        if ids.is_cuda and ids.device == self._client.device and ids.is_contiguous():
            ids.record_stream(stream)  # the caller may drop them before `stream` has copied them
            slab.ops.copy(raw, slab.ids_address[slot], ids.data_ptr(), ids.numel() * ids.element_size())
        else:
            with torch.cuda.stream(stream):
                slab.ids(slot, tokens, ids.dtype).copy_(ids, non_blocking=True)
        slab.ops.write_u32(raw, slab.ids_ready[slot], seq)
        submitted = torch.cuda.Event()
        submitted.record(stream)
        self.last_seq = seq
        rid = self._client._conn.send("lookup", None, client_id=self._client.client_id, slot=slot, seq=seq,
                              ids_dtype=dtype_name(ids.dtype),
                              ids_shape=[tokens, ids.shape[1], ids.shape[2]], inline=False,
                              ack=False)
        future = self._client._track(LookupFuture(self, rid, slot, seq, tokens, acked=False))
        future.submitted = submitted
        self._remember(future)
        self.unsettled = [*self.settle(), future]  # one reference swap: the watchdog may read it
        if self._client._dead is not None:  # the watchdog released the waits, maybe before it saw this one:
            self.invalidate(self.unsettled)  # every one, in seq order, after the watchdog's
        return future

    def _after_previous_use(self, slot: int, stream: torch.cuda.Stream, raw: int) -> None:
        """`stream` must not touch the slot before its previous lookup and readers are done, and
        this thread runs at most `slots` lookups ahead of its GPU (see _await_submitted)."""
        previous = self._client._pending.get(slot)
        if previous is None:
            return
        self._await_submitted(slot, previous)
        self._client._slab.ops.wait_u32(raw, self._client._slab.rows_done[slot], previous.seq)
        for consumer in previous.consumers:
            if consumer != stream:
                stream.wait_stream(consumer)

    def _await_submitted(self, slot: int, previous: LookupFuture) -> None:
        """Block until this GPU has handed the slot's previous IDs to the daemon.

        Without it a loop of lookup().wait() runs ahead of the GPU without bound: every request
        becomes a gather the daemon has queued on a wait for IDs, thousands per client, and a
        client killed then leaves all of them for the daemon to release. Engines run at most a
        step or two ahead, so this rarely waits. Bounded by the client's timeout: a stream held
        up for that long is a fault to report, not to wait out."""
        event = previous.submitted
        if event is None or event.query():
            return
        deadline, pause = time.monotonic() + self._client.timeout, 20e-6
        while not event.query():
            self._client._check_alive()
            if time.monotonic() > deadline:
                raise ReplyTimeoutError(f"slot {slot}: lookup {previous.seq} was not handed to the "
                                        f"daemon within {self._client.timeout:.1f} s (is its stream held up?)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _remember(self, future: LookupFuture) -> None:
        self.recent[future.rid] = future
        while len(self.recent) > RECENT_LOOKUPS:
            self.recent.popitem(last=False)

    def settle(self) -> list[LookupFuture]:
        """The served lookups whose rows are still not known written (host reads of counters).
        One the daemon marked not served (FAILED) is failed here, for the next call to report:
        its error reply may come after a later lookup took its place in _pending."""
        slab, last, unsettled = self._client._slab, self.last_seq, []
        for future in self.unsettled:
            if (future.slots_epoch != self._client._slots_epoch or future._error is not None
                    or slab.written(future.slot, future.seq, last)):
                continue  # another registration's, reported by its own wait, or done
            if self.daemon_failed(future):
                self._client._failed.add(future, "the daemon did not serve it")
            else:
                unsettled.append(future)
        return unsettled

    def stream_wait(self, future: LookupFuture, stream: torch.cuda.Stream) -> None:
        slab = self._client._slab
        slab.ops.wait_u32(stream.cuda_stream, slab.rows_done[future.slot], future.seq)
        if stream not in future.consumers:
            future.consumers.append(stream)

    def rows_written(self, future: LookupFuture) -> bool:
        """Whether `future`'s rows are known written, without waiting (LookupFuture.ok)."""
        slab = self._client._slab
        if future.slots_epoch != self._client._slots_epoch or not isinstance(slab, CudaSlabView):
            return False
        return slab.written(future.slot, future.seq, self.last_seq)

    def poll_failure(self, future: LookupFuture) -> None:
        self._client._take_in()  # error replies the daemon sent since
        if future._error is None and self.daemon_failed(future):  # its reply may be late
            self._client._failed.add(future, "the daemon did not serve it")

    def before_wait(self, future: LookupFuture) -> None:
        """Error replies and the daemon's death come in here."""
        self._client._take_in()
        future._raise_failure()
        self._client._check_alive()

    def after_sync(self, future: LookupFuture) -> None:
        """result(), its stream synchronised: error replies and the daemon's death come in here."""
        client = self._client
        client._take_in()
        client._check_alive()
        if future._error is None and self.daemon_failed(future):
            future._error = self.error_of(future)
        if future._error is None and not self.rows_written(future):
            # Released by the daemon's free of the slab (it retired us) before our watchdog
            # saw the lease close: the counters say these rows were never written.
            client._failed.add(future, "its wait was released without its rows")

    def daemon_failed(self, future: LookupFuture) -> bool:
        """Served GPU lookups: did the daemon mark this lookup as not served (FAILED, written
        before its ROWS_DONE, names it)?"""
        if (future.event is not None or not isinstance(self._client._slab, CudaSlabView)
                or future.slots_epoch != self._client._slots_epoch):
            return False
        return self._client._slab.failed_seq(future.slot) == future.seq & 0xFFFFFFFF

    def error_of(self, future: LookupFuture) -> EngramError:
        """The daemon's error reply for a lookup it marked failed (it sends one for each)."""
        try:
            self._client._conn.wait(future.rid, min(self._client.timeout, 5.0), f"the error of lookup {future.rid}")
        except EngramError as exc:
            return exc
        return InternalError(f"the daemon marked lookup {future.rid} (slot {future.slot}) as not "
                             "served but sent no error for it")

    def take_errors(self, conn: Connection) -> None:
        """Error replies to GPU lookups that `conn` holds (kept on their futures, raised by
        their wait()/result(); failed for the next call to report where a wait already
        returned)."""
        for future in {*self._client._pending.values(), *self.unsettled}:
            if future._error is None and conn.has_reply(future.rid):
                try:
                    conn.wait(future.rid, 0, "lookup")
                except EngramError as exc:
                    future._error = exc
                    if future.consumers:  # its wait() returned: the engine hears of it next call
                        self._client._failed.add(future, f"refused by the daemon: {exc.message}")
        for rid, error in conn.take_stale_errors():  # their slots were reused meanwhile
            future = self.recent.get(rid)
            if future is None:
                log.warning("lookup (rid %d) failed after its slot was reused: %s", rid, error)
            elif future._error is None:
                future._error = error
                self._client._failed.add(future, f"refused by the daemon: {error.message}")

    def await_stopping_daemon(self) -> None:
        """A daemon that said it is stopping still writes the rows of every lookup it took, and
        only then closes its leases (Daemon._drained): wait for those rows, while the
        lease is open and at most STOPPING_SETTLE_S, so that the release that follows fails
        only the lookups it refused or never got, not rows on their way."""
        if self._client._dead is not None or self._client._conn is None or self._client._conn.notice != "stopping":
            return
        deadline = time.monotonic() + STOPPING_SETTLE_S
        while (self.unsettled and self._client._watchdog.lease_gone() is None
               and time.monotonic() < deadline):
            time.sleep(SETTLE_POLL_S)
            self.unsettled = self.settle()

    def release_waits(self) -> None:
        """From the watchdog, once the lease closed (`_dead` set first): satisfy every stream
        wait on the daemon's counters, the lookups whose rows were not written failed first.
        close() stops the watchdog before it unmaps the slab, so the slab seen here is mapped."""
        self.invalidate(self.unsettled)

    def invalidate(self, futures: list[LookupFuture]) -> None:
        """Fail each of `futures` whose rows the daemon did not write, then release every wait
        on the slab's counters (the watchdog, once the lease closed; the lookup thread, for one
        sent after the watchdog's scan; a disconnect). In seq order, each lookup's rows are
        filled with NaN once its own stream has handed its IDs over (after the slot's previous
        readers, which must not read NaN), and its waits, and no later lookup's of the slot,
        are released when the fill is done or RELEASE_DEADLINE_S has passed: a later lookup's
        submission can wait for that release. Any error on the way still releases every slot
        in the end: nothing hangs (client/failures.py)."""
        with self._invalidating:
            slab, last = self._client._slab, self.last_seq
            if not isinstance(slab, CudaSlabView):
                return  # not mapped yet: nothing waits on it
            try:
                for future in sorted(futures, key=lambda f: f.seq):
                    if (future.slots_epoch != self._client._slots_epoch
                            or slab.written(future.slot, future.seq, last)):
                        continue
                    if future._error is not None:
                        # Refused: it raises its own error, but the daemon's NaN over its rows
                        # follows the reply, and the daemon may have died in between.
                        if slab.failed_seq(future.slot) != future.seq & 0xFFFFFFFF:
                            self._fill_then_fail(slab, future)
                    elif self._client._failed.add(future, self._client._dead or "the daemon's lease closed"):
                        self._fill_then_fail(slab, future)
            finally:
                for slot in range(slab.layout.slots):
                    slab.release(slot, last)

    @staticmethod
    def _fill_then_fail(slab: CudaSlabView, future: LookupFuture) -> None:
        filled = None
        try:
            filled = slab.invalidate(future.slot, future.tokens, future.submitted)
            deadline = time.monotonic() + RELEASE_DEADLINE_S
            while not filled.query() and time.monotonic() < deadline:
                time.sleep(0.001)
        except Exception as exc:  # a CUDA error here must not keep the waits from their release
            log.error("lookup seq %d: its rows could not be filled with NaN: %s", future.seq, exc)
        if filled is not None and not filled.query():
            log.error("lookup seq %d: its rows were not filled with NaN within %.1f s; its waits "
                      "are released with them as they are (it is failed all the same)",
                      future.seq, RELEASE_DEADLINE_S)
        slab.fail(future.slot, future.seq)

    def keep_releasing(self, closing: threading.Event) -> None:
        """From the watchdog, after its release: store it again for RELEASE_REPEAT_S, over what
        the dead daemon's last gathers write, until the client closes or re-registers."""
        slab, last = self._client._slab, self.last_seq
        deadline = time.monotonic() + RELEASE_REPEAT_S
        while isinstance(slab, CudaSlabView) and time.monotonic() < deadline:
            if closing.wait(RELEASE_REPEAT_PAUSE_S) or self._client._slab is not slab:
                return
            for slot in range(slab.layout.slots):
                slab.release(slot, last)

    def warm_up(self) -> None:
        """Load the kernels a lookup launches now, not while a stream waits on the daemon.

        With CUDA's lazy module loading, the first launch of a kernel blocks the host while any
        stream of the process waits on another process. Model runners must warm their own
        consumer kernels the same way (or run with CUDA_MODULE_LOADING=EAGER).
        """
        for dtype in (torch.int64, torch.int32):
            probe = torch.full((1, self._client.layout.n_layers, self._client.layout.heads), -1, dtype=dtype,
                               device=self._client.device)
            self._client._slab.ids(0, 1, dtype).copy_(probe)
        torch.cuda.synchronize(self._client.device)


class ServedCpu(ClientPath):
    """A served CPU client's lookups: the IDs go inline with the request, the daemon writes the
    rows into the memfd slab and replies; a slot is reused once its previous reply is in."""

    def lookup(self, ids: torch.Tensor, slot: int | None) -> LookupFuture:
        client = self._client
        slot = self._claim_slot(slot)
        # A copy of our own: the frame is sent from this memory after lookup() returns (ZeroMQ
        # copies none over its copy threshold), and the caller may refill its IDs at once.
        ids = ids.to("cpu", memory_format=torch.contiguous_format, copy=True)
        seq = next(client._seqs)
        rid = client._conn.send(
            "lookup", [memoryview(ids.numpy()).cast("B")], client_id=client.client_id, slot=slot,
            seq=seq, ids_dtype=dtype_name(ids.dtype),
            ids_shape=list(ids.shape), inline=True)
        return client._track(LookupFuture(self, rid, slot, seq, ids.shape[0]))

    def _claim_slot(self, slot: int | None) -> int:
        client = self._client
        slot = client._take_turn(slot)
        previous = client._pending.get(slot)
        if previous is not None:
            try:
                previous._collect(client.timeout)  # the slot is reused only once it is done
            except ReplyTimeoutError as exc:  # the daemon may still write it: the slot is not free
                raise ReplyTimeoutError(
                    f"slot {slot} still waits for lookup seq {previous.seq}, which the daemon has "
                    f"not answered ({exc.message}); this lookup was not sent: try again, or raise "
                    "the client's timeout") from None
            except EngramError:
                pass  # that lookup's owner sees its error; the slot is free either way
            client._pending.pop(slot, None)
        return slot

    def rows_written(self, future: LookupFuture) -> bool:
        """Whether `future`'s rows are known written, without waiting (LookupFuture.ok)."""
        if future.slots_epoch != self.slots_epoch or self._client._slab is None:
            return False
        return future.done()  # the reply, rows included

    def reply_ready(self, future: LookupFuture) -> bool:
        return self._client._conn.poll_reply(future.rid)

    def wait_reply(self, future: LookupFuture, timeout: float | None) -> Any:
        """The lookup's reply, waited for up to `timeout` (None: the client's timeout; a daemon
        that is alive but silent, e.g. stopped, never closes the lease)."""
        timeout = self._client.timeout if timeout is None else timeout
        return self._client._conn.wait(future.rid, timeout, f"lookup of {future.tokens} tokens")
