"""A mapped GPU lookup that a CUDA graph can record and replay: no host work per step.

Engines replay their decode steps as CUDA graphs. A lookup that the graph records must make no
host decision at replay: its IDs are read from a buffer the engine owns (written before each
replay, or by kernels inside the graph), its rows go to a slot of the client's at a fixed
address, and its tables are reached through a descriptor block (kernels/descriptor.py) that
this module keeps pointing at what the client maps. A reload, a daemon restart or a standby
takeover therefore needs no new capture: the client publishes the new tables into the
descriptor, the replay after next reads them, and the old mapping is kept until no replay can
read it (MappedPath.free_old_mappings asks `reads`). While the client has nothing mapped (its
daemon went away and it registers again with other tables) and for good after a change the
graph cannot follow (another geometry, a served registration), replays write NaN rows and
`check()` raises ReplayFailedError: never another batch's rows, never a read of unmapped memory.

What this is not: the mapping and its gathers outside graphs (client/mapped_path.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from engramd.client.errors import BadIdsError, BadRequestError, ReplayFailedError
from engramd.client.rejoin import Stopped
from engramd.client.shared import cuda
from engramd.kernels import descriptor as desc

if TYPE_CHECKING:
    from engramd.client.client import EngramClient
    from engramd.client.geometry import ShardView, TableGeometry
    from engramd.client.mapped_path import MappedPath
    from engramd.client.shared.mapped import MappedTables

log = logging.getLogger("engramd.client")
UPKEEP_S = 0.1  # how often the upkeep thread looks at the daemon's news
# After this long with no replay since new tables were selected, an idle engine's descriptor is
# caught up without one (its replays adopt them within milliseconds otherwise).
CATCH_UP_S = 1.0
# Triton specialises a pointer argument on its divisibility by this many bytes.
ALIGN = 16


class CapturedLookup:
    """A lookup of `ids[:T]` into slot `slot`'s rows, recorded with record(T) inside a graph
    capture (any T up to the buffer's), replayed with the graph. Keep it as long as the graphs
    that recorded it: they read its descriptor block."""

    def __init__(self, path: MappedPath, mapped: MappedTables, ids: torch.Tensor, slot: int,
                 rows: Callable[[int, int], torch.Tensor], geometry: TableGeometry, shard: ShardView,
                 policy: dict[str, Any], sm_fraction: float | None):
        """Over the client's `mapped` tables of `geometry` (`shard` of them), by the daemon's
        gather `policy`; `rows(slot, tokens)` is the client's slot rows view."""
        # Imported here, as everywhere in the client, so that a CPU client never loads Triton
        # (and tests can put the interpreter's copy in its place).
        from engramd.kernels.gather_triton import GatherPlan, grid_programs

        self._path = path
        self.ids = ids
        self.slot = slot
        self.device = ids.device
        self.geometry, self.shard = geometry, shard
        self._rows = rows
        # The slot's memory, held: replays write it for as long as this object lives, whatever
        # becomes of the client's slots (a detached descriptor stops the writes: lose()).
        self._slot_memory = rows(slot, ids.shape[0])
        # The kernel's variant (row size, alignment) and the sort's keys; the tables it reads are
        # the descriptor's.
        self._plan = GatherPlan(mapped.layer_tables(), shard, self.device)
        # The descriptors' writes and copies: a stream of their own, kept while the descriptor
        # lives (the cache keeper's probes may hold it past this lookup).
        self._stream = cuda.new_stream(self.device.index) if self.device.type == "cuda" else None
        self.descriptor = desc.TableDescriptor(self._contents(mapped), self.device, owner=mapped,
                                               stream=self._stream)
        if self._stream is not None:
            cuda.give_back_when_gone(self.descriptor, self._stream)
        self._sort_from = int(policy.get("sort_min_tokens", 0))
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 2  # the interpreter's
        self._programs = grid_programs(sms, sm_fraction if sm_fraction is not None
                                       else float(policy.get("sm_fraction", 1.0)))
        self._unmapped: str | None = None  # why its tables are unmapped now (until mapped again)
        self._lost: str | None = None  # why the graph can never follow again
        self._reported = 0  # poisoned steps already raised by check()
        self._abandoned = 0  # steps left open already logged by check()
        self._step_at = 0  # the layer the next record() of the step under way starts at
        # On the CPU (the Triton interpreter) a launch runs on its caller's thread: settle()
        # waits for it, as a device synchronise waits for a replay on the GPU.
        self._launching = threading.Lock()
        self.settle()  # the slot's last lookup() may still have readers: the warm-up writes it
        self._warm_up()

    def _contents(self, mapped: MappedTables) -> desc.Contents:
        tables = mapped.layer_tables()
        cache = mapped.keeper.cache if mapped.keeper is not None else None
        return desc.Contents.of([t.address for t in tables], [t.rows for t in tables],
                                self.shard.row_ranges, cache)

    def _warm_up(self) -> None:
        """Compile and load the variants record() launches, now: a capture cannot load a module.
        On the engine's own IDs buffer (its alignment is part of the variant) and a descriptor of
        their own, which owns no rows (nothing is read; this one's counts stay the replays').
        Each variant at the fewest tokens that launch it (the warm-up stays short, under the
        interpreter above all): _warm_up_sizes."""
        nothing = desc.Contents(((0, 0, 0, 0),) * self.geometry.n_layers)
        scratch = desc.TableDescriptor(nothing, self.device, stream=self._stream)
        launches = self._warm_up_sizes()
        # Triton launches on the thread's device, not the tensors': this client's, then.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            for tokens, sort, width in launches:
                self._plan(self.ids[:tokens], self.rows(tokens), sort=sort, descriptor=scratch,
                           num_programs=self._programs, layers=range(width),
                           block_rows=self._block_rows(tokens, sort, width))
        self.settle()

    def _warm_up_sizes(self) -> list[tuple[int, bool, int]]:
        """(tokens, sorted, layers) for each variant record() can launch, at the fewest tokens
        and layers that take it, over launches of any number of layers: each block size
        unsorted and, where the policy sorts, sorted (captured_block_rows; the kernel's sorted
        variant runs at any size); on a GPU also each power of two of the sort's keys from
        `sort_min_tokens` on, and the most tokens: torch's sort kernels change with the size."""
        fewest: dict[tuple[str, int], tuple[int, bool, int]] = {}
        most = self.ids.shape[0]
        sorts = 0 < self._sort_from <= most
        sort_sizes = sorts and self._sort_kernels_vary()
        widths = range(1, self.geometry.n_layers + 1)
        for tokens in range(1, most + 1):
            for width in widths:
                for sort in (False, True) if sorts else (False,):
                    fewest.setdefault((f"blocks, sorted={sort}", self._block_rows(tokens, sort, width)),
                                      (tokens, sort, width))
                if sort_sizes and tokens >= self._sort_from:
                    fewest.setdefault(("sort keys, bits", (self._items(tokens, width) - 1).bit_length()),
                                      (tokens, True, width))
        sizes = set(fewest.values()) | ({(most, True, w) for w in widths} if sort_sizes else set())
        return sorted(sizes)

    def _sort_kernels_vary(self) -> bool:
        """Whether a sort of other size may launch a kernel not yet loaded: torch's CUDA sorts.
        (The interpreter's warm-up of a sort of many tokens would take minutes, for nothing.)"""
        return self.device.type == "cuda"

    def _items(self, tokens: int, layers: int) -> int:
        """The work items (rows) of a launch of `tokens` over `layers` layers, as the kernel
        counts them."""
        return tokens * layers * self._plan.shard.local_heads

    def _block_rows(self, tokens: int, sort: bool, layers: int) -> int:
        """The block size of a launch of `tokens` over `layers` layers (captured_block_rows)."""
        from engramd.kernels.gather_triton import captured_block_rows

        return captured_block_rows(self._items(tokens, layers), self._programs, sort)

    # -- what the engine calls ------------------------------------------------------------------

    def rows(self, tokens: int) -> torch.Tensor:
        """The slot's rows a record(tokens) writes: bf16 [n_layers, tokens, local_heads, head_dim]."""
        return self._rows(self.slot, tokens)

    def record(self, tokens: int, stream: torch.cuda.Stream | None = None,
               ids: torch.Tensor | None = None, layers: range | None = None) -> torch.Tensor:
        """Queue the lookup of `ids[:tokens]` on `stream` (default: the current one), inside a
        graph capture or not, and return its rows (rows(tokens)). Nothing in it waits for the
        host or decides from the IDs: sorted reads, where the daemon's policy asks for them from
        this many tokens on, are sorted on the device.

        `layers`: look up only these layers (a range of step 1; default all), so that a step's
        lookup can be split into launches whose readers each wait for their own: a step records
        its launches in layer order, on one stream, the last one ending at the last layer (which
        closes the step: the tables switch between steps, never inside one). Rows of the other
        layers are left as they are.

        `ids`: the step's IDs where the engine holds them, read in place of the buffer's (which
        saves the engine its copies into the buffer): `[tokens, n_layers, heads]`, as the buffer
        holds them (why_not_in_place says what differs). In a graph, memory written before the
        lookup at every replay, at the address it had in the capture: a tensor the graph itself
        writes (its pool keeps the address), or a static input written before each replay."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= self.ids.shape[0]:
            raise BadRequestError(f"tokens {tokens!r}: this captured lookup's IDs buffer holds "
                                  f"1..{self.ids.shape[0]}")
        span = self._launch_layers(layers)
        if ids is not None:
            why = self.why_not_in_place(ids)
            if why is None and ids.shape[0] != tokens:
                why = f"{ids.shape[0]} tokens of IDs for a lookup of {tokens}"
            if why is not None:
                raise BadRequestError(f"IDs to read in place: {why}")
        if self._lost is not None:
            raise ReplayFailedError(self._lost, 0)
        if stream is None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
        rows = self._launch(tokens, stream, ids, span)
        self._step_at = 0 if span.stop == self.geometry.n_layers else span.stop
        return rows

    def _launch_layers(self, layers: range | None) -> range:
        """record()'s layers, checked: a range of step 1 within the tables' layers that starts
        a step, or goes on with the step under way where its last launch ended. A step may
        begin over one left open (a capture that failed midway recorded nothing that replays);
        what replays a step left open shows in check()."""
        from engramd.kernels.gather_triton import layer_range_problem

        n_layers = self.geometry.n_layers
        span = range(n_layers) if layers is None else layers
        problem = layer_range_problem(span, n_layers)
        if problem is not None:
            raise BadRequestError(f"layers {layers!r}: {problem}")
        if span.start not in (0, self._step_at):
            where = (f"this step's last launch ended at layer {self._step_at}" if self._step_at
                     else "no step is under way")
            raise BadRequestError(f"layers {layers!r}: a step's launches go in layer order from "
                                  f"layer 0, the last ending at layer {n_layers}; {where}")
        return span

    def why_not_in_place(self, ids: torch.Tensor) -> str | None:
        """Why record() cannot read `ids` in place of the buffer, or None where it can: they must
        be a [T, n_layers, heads] tensor, T up to the buffer's, of the buffer's dtype and
        device, contiguous, and aligned to 16 bytes where the buffer is (and only there): the
        kernel's variants, warmed on the buffer, differ in that alignment, and a capture cannot
        load another."""
        buffer = self.ids
        if not isinstance(ids, torch.Tensor):
            return f"a {type(ids).__name__}, not a tensor"
        if ids.dtype != buffer.dtype or ids.device != buffer.device:
            return f"{ids.dtype} on {ids.device}; the buffer is {buffer.dtype} on {buffer.device}"
        if ids.dim() != 3 or tuple(ids.shape[1:]) != tuple(buffer.shape[1:]) \
                or not 1 <= ids.shape[0] <= buffer.shape[0]:
            return (f"shape {list(ids.shape)}; the buffer holds [1..{buffer.shape[0]}, "
                    f"{buffer.shape[1]}, {buffer.shape[2]}]")
        if not ids.is_contiguous():
            return f"strides {list(ids.stride())}, not contiguous"
        aligned, buffer_aligned = ids.data_ptr() % ALIGN == 0, buffer.data_ptr() % ALIGN == 0
        if aligned != buffer_aligned:
            return (f"address {ids.data_ptr():#x} is{'' if aligned else ' not'} {ALIGN}-byte "
                    f"aligned and the buffer's ({buffer.data_ptr():#x}) is{'' if buffer_aligned else ' not'}")
        return None

    def _launch(self, tokens: int, stream: torch.cuda.Stream | None,
                ids: torch.Tensor | None = None, layers: range | None = None) -> torch.Tensor:
        """The launch a graph records, and replays (default: of every layer, from the buffer)."""
        layers = range(self.geometry.n_layers) if layers is None else layers
        out = self.rows(tokens)
        sort = 0 < self._sort_from <= tokens
        with self._launching if self.device.type == "cpu" else nullcontext():
            self._plan(self.ids[:tokens] if ids is None else ids, out, stream=stream, sort=sort,
                       descriptor=self.descriptor, num_programs=self._programs, layers=layers,
                       block_rows=self._block_rows(tokens, sort, len(layers)))
        return out

    def settle(self) -> None:
        """Wait until every launch that has begun has ended (a GPU: the whole device's work)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            with self._launching:
                pass

    def check(self) -> None:
        """Raise ReplayFailedError if replays wrote NaN rows since the last check, or if the graph
        can no longer follow the client's tables. Off the critical path: it reads the counts of
        the last finished copy (one replay or so behind), never waits for the device."""
        words = self.descriptor.snapshot()
        # BEGUN counts the programs of the launch under way (at most one grid) and is reset when
        # it ends; past two grids, launches overlapped and its count never closes one again.
        if words[desc.BEGUN] > 2 * self._programs and self._lost is None:
            self.lose("replays of this captured lookup ran at once (two streams?): its descriptor "
                      "no longer switches tables; capture it again, replaying one graph at a time")
        abandoned = words[desc.ABANDONED]
        if abandoned > self._abandoned:
            log.warning("%d steps of a captured lookup were left open: a graph recorded launches "
                        "of it that do not end at the last layer; such a step is counted nowhere "
                        "(but for its out-of-range IDs) and keeps the tables from switching "
                        "until a step ends again",
                        abandoned - self._abandoned)
            self._abandoned = abandoned
        poisoned = words[desc.POISONED_LAUNCHES]
        failed, self._reported = poisoned - self._reported, max(poisoned, self._reported)
        if failed > 0:
            raise ReplayFailedError(f"{failed} replays of a captured lookup wrote NaN rows: "
                                    f"{self._lost or self._unmapped or 'its tables were unmapped'}",
                                    failed)
        if self._lost is not None:
            raise ReplayFailedError(self._lost, 0)

    def counts(self) -> dict[str, int]:
        """Replays ended, of them poisoned, out-of-range IDs (those of a step left open too),
        steps left open (a graph that recorded only some of a step's launches): as of the last
        finished copy."""
        words = self.descriptor.snapshot()
        return {"replays": words[desc.LAUNCHES], "poisoned": words[desc.POISONED_LAUNCHES],
                "out_of_range": words[desc.OUT_OF_RANGE], "abandoned": words[desc.ABANDONED]}

    def close(self) -> None:
        """Give the slot back; later replays read and write nothing (the block lives on with this
        object, so a graph that still replays touches no freed memory), and check() raises."""
        self._path.forget_captured(self)

    # -- what the client's mapped path calls ---------------------------------------------------

    def follow(self, mapped: MappedTables, geometry: TableGeometry, shard: ShardView) -> None:
        """The client maps `mapped` now, of `geometry` (`shard` of it): replays read it from the
        launch after next, if the graph can follow (same geometry and shard, aligned rows), else
        they stay poisoned for good."""
        if geometry != self.geometry or shard != self.shard:
            self.lose("the daemon's tables have another geometry or shard than when this lookup was "
                      "captured: capture it again from a client of the new tables")
            return
        if self._plan.aligned and any(t.address % 8 for t in mapped.layer_tables()):  # pages: never
            self.lose("the remapped tables are not 8-byte aligned, which the captured kernel assumes")
            return
        if self._lost is None:
            self._unmapped = None
            self.descriptor.publish(self._contents(mapped), mapped)

    def unmapping(self, why: str) -> None:
        """The client's tables go: poison now (the caller settles before it unmaps)."""
        if not self.descriptor.poisoned:
            self.descriptor.poison()
        self._unmapped = self._unmapped or why

    def lose(self, why: str, detach: bool = False) -> None:
        """The graph can never follow the client's tables again: replays write NaN rows, or with
        `detach` (the slot is no longer the lookup's: closed, or the client gone) nothing.
        Settles: what the tables and the slot were may go as soon as this returns."""
        self.descriptor.poison(detach)
        self._lost = self._lost or why
        self.settle()

    def advance(self) -> None:
        """Publish what waits for the last contents' adoption, if a replay adopted them, and
        catch an idle engine's descriptor up (settled: the replaced tables may go)."""
        self.descriptor.advance()
        if self.descriptor.catch_up(CATCH_UP_S):
            self.settle()

    @property
    def waiting(self) -> bool:
        """Contents wait to be published (the last ones not yet adopted by a replay)."""
        return self.descriptor.pending

    @property
    def live(self) -> bool:
        """The graph can still follow the client (not closed, not lost for good)."""
        return self._lost is None

    def reads(self, mapped: Any) -> bool:
        """Whether a replay may still read `mapped` (MappedPath keeps it mapped until not)."""
        return self.descriptor.reads(mapped)


class Captures:
    """A client's side of its captured lookups: the slots they write, which lookup() does not
    take, and the upkeep thread, started with the first."""

    def __init__(self, client: EngramClient):
        self._client = client
        self._upkeep: Upkeep | None = None
        self._last_error: str | None = None  # the upkeep's, told once until it changes

    def make(self, ids: torch.Tensor, slot: int | None, sm_fraction: float | None) -> CapturedLookup:
        """EngramClient.capturable_lookup past its check of the mode (tests make one for a
        mapped CPU client, the kernel under the Triton interpreter)."""
        from engramd.client.checks import check_slot, check_sm_fraction

        client = self._client
        with client._tables_lock:
            client._open_connection()  # closed, or no daemon: DaemonUnavailableError
            ids = check_ids_buffer(ids, client.geometry, client.max_tokens, client.device)
            named = check_slot(slot, client.slots)
            index = self._free_slot() if named is None else named
            if index in self.slots:
                raise BadRequestError(f"slot {index} already belongs to a captured lookup")
            path = client._mapped_path
            path.queue_gather()  # a lookup of that slot's: before the capture's warm-up settles
            client._pending.pop(index, None)
            captured = path.capture(ids, index, check_sm_fraction(sm_fraction))
            if self._upkeep is None:
                self._upkeep = Upkeep(self._keep_up, client.device)
            return captured

    @property
    def slots(self) -> set[int]:
        """The slots captured lookups write (closed ones gave theirs back)."""
        return {captured.slot for captured in self._client._mapped_path.captured}

    def _free_slot(self) -> int:
        """The last slot no captured lookup has."""
        for slot in reversed(range(self._client.slots)):
            if slot not in self.slots:
                return slot
        raise BadRequestError(f"all {self._client.slots} slots belong to captured lookups: "
                              f"register with more")

    def _keep_up(self, pause: Callable[[float], bool]) -> None:
        """Upkeep thread: the client's _keep_up while no lookup() or close() holds it and a
        captured lookup is live. An error is logged and tried again at the next turn, as the
        next lookup() would: a reconnect that found no daemon too (meanwhile the replays write
        NaN: the client has no tables mapped). The same error again is not logged again."""
        client = self._client
        if not client._tables_lock.acquire(blocking=False):
            return
        try:
            if client._closed or not any(c.live for c in client._mapped_path.captured):
                return
            # Once a reconnect found no daemon, one attempt a turn: the lock is let go between
            # them, so stats() and health() say at once that there is none.
            client._keep_up(pause, patient=False)
            self._last_error = None
        except Stopped:  # close(): not a loss
            raise
        except Exception as exc:
            if str(exc) != self._last_error:
                log.warning("captured lookups' upkeep: %s (trying again)", exc, exc_info=True)
            self._last_error = str(exc)
        finally:
            client._tables_lock.release()

    def stop(self) -> None:
        """close(): before the client's lock, which the thread may hold in a reconnect."""
        if self._upkeep is not None:
            self._upkeep.stop()


class Upkeep:
    """For an engine whose lookups are all captured, and so never calls lookup(): a thread that
    does, every UPKEEP_S, what a lookup does first (`keep_up`: the client's _keep_up, when no
    lookup holds the client), so that a daemon's death, a restart on other tables or a reload
    reach the captured lookups without one. Ends at stop(), which also ends a reconnect in
    flight between two attempts (`keep_up(pause)`)."""

    def __init__(self, keep_up: Callable[[Callable[[float], bool]], None], device: torch.device):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(keep_up, device),
                                        name="engramd-captured-upkeep", daemon=True)
        self._thread.start()

    def _run(self, keep_up: Callable[[Callable[[float], bool]], None], device: torch.device) -> None:
        if device.type == "cuda":
            cuda.enter_thread(device.index)  # a reconnect maps tables and builds gathers here
        while not self._stop.wait(UPKEEP_S):
            try:
                keep_up(self._stop.wait)
            except Stopped:
                return

    def stop(self) -> None:
        """Without a timeout: between two reconnect attempts the thread sees the stop at once,
        and an attempt lasts at most rejoin.LONGEST_ATTEMPT_S."""
        self._stop.set()
        self._thread.join()


def check_ids_buffer(ids: Any, geometry: Any, max_tokens: int, device: torch.device) -> torch.Tensor:
    """A captured lookup's IDs buffer: [T_max, n_layers, heads] int32/int64, contiguous, on the
    client's GPU, T_max within the client's max_tokens."""
    if not isinstance(ids, torch.Tensor):
        raise BadIdsError(f"the IDs buffer must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise BadIdsError(f"the IDs buffer must be int32 or int64, got {ids.dtype}")
    expected = (geometry.n_layers, geometry.heads)
    if ids.dim() != 3 or tuple(ids.shape[1:]) != expected or not 1 <= ids.shape[0] <= max_tokens:
        raise BadIdsError(f"the IDs buffer must have shape [T, {expected[0]}, {expected[1]}] with "
                          f"1 <= T <= {max_tokens}, got {list(ids.shape)}")
    if ids.device != device:
        raise BadIdsError(f"the IDs buffer is on {ids.device}; the captured gather reads it on {device}")
    if not ids.is_contiguous():
        raise BadIdsError("the IDs buffer must be contiguous (a graph reads it at fixed addresses)")
    return ids.detach()
