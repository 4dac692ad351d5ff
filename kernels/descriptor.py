"""The descriptor a captured gather reads its tables through, and how it switches tables between
two replays of a CUDA graph.

A CUDA graph bakes a kernel's arguments in when it is captured. A mapped client's tables change
under a live graph (a reload, a restarted daemon with other files), so a captured gather takes
no table address as an argument: it takes this block, one int64 tensor on the device, and reads
the tables' addresses (and the hot-row cache's) from it at every replay. The client rewrites the
block; the graph is never captured again.

The block holds two buffers, each a whole account of what a gather reads. Every program of a
launch reads the buffer that ACTIVE names. The owner writes the other buffer, then names it in
SELECT; the last program of a launch to end copies SELECT to ACTIVE, if that launch closes its
step. A step is one launch, or several that gather its layers in order (a layer each, say, so
that each layer's reader waits for its own rows only); the one ending at the last layer closes
it. So tables switch between two steps, never inside one, and the buffer that was active is
free once the owner has seen ACTIVE == SELECT. That holds while the launches of one descriptor
run one after another, as the replays of graphs on one stream do (two at once would also race on
the one slot they write). An engine that replays nothing would hold the replaced tables for as
long as it idles: after a while with no launch and no step open (catch_up), the owner writes the
new contents over the active buffer too.

What the graph cannot follow (the tables unmapped, another geometry) poisons it: POISONED set in
both buffers at once. A program that reads the flag reads no ID, table or cache, and writes NaN
rows; its step counts in POISONED_LAUNCHES, which the owner reports. A program that began
before the flag landed may still read the old tables (so one launch may be part rows, part NaN),
and the owner synchronises the device before it frees them. A descriptor whose rows' memory is
no longer its owner's (the lookup closed, its client gone) is detached: POISONED = DETACHED, and
its launches write nothing at all.

    word  0  SELECT             the buffer the owner wants read (0 or 1); the owner writes it
    word  1  ACTIVE             the buffer launches read; the last program of a closing launch
                                writes it
    word  2  BEGUN              programs of the launch under way that have begun (0 between launches)
    word  3  ARRIVED            programs of the launch under way that have ended
    word  4  LAUNCHES           steps ended (launches that closed one)
    word  5  POISONED_LAUNCHES  steps of which a launch wrote NaN rows
    word  6  OUT_OF_RANGE       owned IDs outside the tables, counted
    word  7  SAW_POISON         a program of the launch under way read POISONED
    word  8  ROWS               rows the steps that were not poisoned looked up (tokens x layers
                                x owned heads), as a client counts them for its daemon
    word  9  STEP_ROWS          rows the launches of the open step looked up so far
    word 10  STEP_OPEN          1 while a step's launch has ended and its closing one has not
    word 11  STEP_POISONED      a launch of the open step read POISONED
    word 12  ABANDONED          steps left open: a launch from layer 0 found one (its replays
                                and rows are counted nowhere; a graph recorded a partial step)
    buffer b at CONTROL_WORDS + b * buffer_words(n_layers):
             POISONED, HAS_CACHE, n_layers x LAYER_FIELDS, the hot-row cache's META_FIELDS
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engramd.kernels.hot_cache import META_FIELDS, HotCache

CONTROL_WORDS = 16  # a 128-byte line: the buffers start past it
(SELECT, ACTIVE, BEGUN, ARRIVED, LAUNCHES, POISONED_LAUNCHES, OUT_OF_RANGE, SAW_POISON, ROWS,
 STEP_ROWS, STEP_OPEN, STEP_POISONED, ABANDONED) = range(13)
HEADER_WORDS = 2
POISONED, HAS_CACHE = range(HEADER_WORDS)
DETACHED = 2  # the POISONED word's value for a descriptor whose launches write nothing
# A layer's row, in the plan's metadata as in a buffer: its table's address and rows, and the
# rows [row_lo, row_hi) the shard owns.
LAYER_FIELDS = ("address", "rows", "row_lo", "row_hi")
CACHE_WORDS = len(META_FIELDS)
# A program of a gather runs for milliseconds: one counted in BEGUN that has not ended after this
# long means the counts no longer close launches (launches of one descriptor overlapped), and a
# Quiet gives up waiting rather than stop the cache keeper's refreshes for good.
WEDGED_S = 10.0
# A buffer's cache fields when it has no cache: never dereferenced (HAS_CACHE masks every access),
# but sizes that keep the kernel's index arithmetic defined.
NO_CACHE = tuple(1 if name in ("sets", "sketch_bits") else 0 for name in META_FIELDS)


def buffer_words(n_layers: int) -> int:
    """int64 words of one buffer, rounded up to 64 bytes (the kernel computes the same)."""
    return (HEADER_WORDS + n_layers * len(LAYER_FIELDS) + CACHE_WORDS + 7) // 8 * 8


@dataclass(frozen=True)
class Contents:
    """What one buffer says: per layer (address, rows, row_lo, row_hi), the cache's fields."""

    layers: tuple[tuple[int, int, int, int], ...]
    cache: tuple[int, ...] | None = None

    @classmethod
    def of(cls, addresses: Sequence[int], rows: Sequence[int], row_ranges: Sequence[tuple[int, int]],
           cache: HotCache | None = None) -> Contents:
        layers = tuple((int(a), int(r), int(lo), int(hi))
                       for a, r, (lo, hi) in zip(addresses, rows, row_ranges, strict=True))
        return cls(layers, tuple(cache.meta_words) if cache is not None else None)

    def words(self) -> list[int]:
        """The buffer's words, padded to buffer_words."""
        body = [0, int(self.cache is not None)]
        for layer in self.layers:
            body.extend(layer)
        body.extend(self.cache if self.cache is not None else NO_CACHE)
        return body + [0] * (buffer_words(len(self.layers)) - len(body))


class TableDescriptor:
    """One descriptor block on a device, and its owner's side of the protocol above.

    `publish` asks for new contents (they take effect at the step after next, once the ones
    before have been adopted); `poison` stops every launch from reading tables at once; `reads`
    says whether a launch may still read what some contents described (their `owner`, kept by
    the caller until it may not); `snapshot` reads the control words. Not thread-safe on its
    own: the caller serialises publish, advance and poison; snapshots lock."""

    def __init__(self, contents: Contents, device: torch.device, owner: Any = None,
                 stream: torch.cuda.Stream | None = None):
        if device.type == "cuda" and stream is None:
            # Not one of torch's pooled streams: an engine's graph capture may be using it, and
            # the writes and copies here must be neither recorded into it nor behind its work.
            raise ValueError("a descriptor on a GPU needs a stream of its owner's own")
        self.n_layers = len(contents.layers)
        self.device = device
        self._width = buffer_words(self.n_layers)
        self.block = torch.zeros(CONTROL_WORDS + 2 * self._width, dtype=torch.int64, device=device)
        self._stream = stream if device.type == "cuda" else None
        if self._stream is not None:  # the block's zeros were queued on the caller's stream
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._lock = threading.Lock()  # snapshots come from the owner's threads and a cache keeper's
        self._host = torch.zeros(CONTROL_WORDS, dtype=torch.int64, device="cpu",
                                 pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None
        self._last = [0] * CONTROL_WORDS  # the control words as of the last finished copy
        self.select = 0
        self._owners: list[Any] = [owner, owner]  # what each buffer's launches read
        self._pending: tuple[Contents, Any] | None = None
        # The words SELECT's buffer holds, and when they were selected (None: caught up with).
        self._selected: tuple[list[int], float] | None = None
        self.poisoned = False
        for buffer in (0, 1):
            self._write(self._buffer(buffer), contents.words())

    @property
    def pending(self) -> bool:
        """Contents wait to be written: the last ones were not adopted yet."""
        return self._pending is not None

    @property
    def out_of_range(self) -> Tensor:
        """The kernel's out-of-range counter: one int64 word of the block."""
        return self.block[OUT_OF_RANGE:OUT_OF_RANGE + 1]

    def publish(self, contents: Contents, owner: Any) -> None:
        """Launches are to read `contents` (owned by `owner`) from the step after next; a
        poisoned descriptor comes back to life with them."""
        if len(contents.layers) != self.n_layers:
            raise ValueError(f"{len(contents.layers)} layers for a descriptor of {self.n_layers}")
        self._pending = (contents, owner)
        self.poisoned = False
        self.advance()

    def advance(self, wait: bool = False) -> bool:
        """Write the pending contents if the last ones were adopted (else try again later: no
        launch has ended since); true when nothing is pending any more. `wait`: read the
        control words now, not as of the last finished copy."""
        if self._pending is None:
            return True
        if not self.adopted(wait):
            return False
        contents, owner = self._pending
        other, words = 1 - self.select, contents.words()
        self._write(self._buffer(other), words)
        self._write(SELECT, [other])
        self.select, self._owners[other], self._pending = other, owner, None
        self._selected = (words, time.monotonic())
        return True

    def catch_up(self, idle_s: float) -> bool:
        """If the selected contents wait for a step that has not come in `idle_s` (an engine
        that replays adopts them within a step or two) and no launch or step is under way (a
        step left open, its closing launch never launched, keeps them waiting), write them over
        the active buffer too, so that what it described may go with no launch; True when it
        did: the caller settles before it frees that. A launch that begins during the rewrite
        may read some layers of each (both stay mapped until the settle); the active buffer's
        cache is off while its words change, and its header is written last."""
        if self._selected is None or time.monotonic() - self._selected[1] < idle_s:
            return False
        words = self.snapshot(wait=True)
        if words[ACTIVE] == self.select or words[BEGUN] != 0 or words[STEP_OPEN] != 0:
            self._selected = None if words[ACTIVE] == self.select else self._selected
            return False  # adopted already, or a launch or step under way adopts them
        selected, active = self._selected[0], self._buffer(1 - self.select)
        self._write(active + HAS_CACHE, [0])
        self._write(active + HEADER_WORDS, selected[HEADER_WORDS:])
        self._write(active, selected[:HEADER_WORDS])
        self._owners[1 - self.select] = self._owners[self.select]
        self._selected = None
        return True

    def adopted(self, wait: bool = False) -> bool:
        """Whether a step has closed on the buffer SELECT names (every later one reads it)."""
        words = self.snapshot(wait)
        return words[SELECT] == self.select and words[ACTIVE] == self.select

    def poison(self, detach: bool = False) -> None:
        """From now on launches read nothing and write NaN rows (`detach`: nothing at all),
        until contents are published. The caller synchronises the device before it frees what
        the tables (`detach`: the rows) were: a program that began before the flag landed may
        still read (write) them."""
        self._pending, self._selected = None, None
        self.poisoned = True
        for buffer in (0, 1):
            self._write(self._buffer(buffer) + POISONED, [DETACHED if detach else 1])
        self._owners = [None, None]

    def reads(self, owner: Any) -> bool:
        """Whether a launch may still read what `owner`'s contents described."""
        if owner is None:
            return False
        readers = [self._owners[self.select]] if self.adopted() else self._owners
        return any(r is owner for r in readers)

    def snapshot(self, wait: bool = False) -> list[int]:
        """The control words: on a GPU as of the last finished copy (the next one queued, on a
        stream of the descriptor's own, never behind the engine's work), or copied now (`wait`)."""
        if self._stream is None:
            return self.block[:CONTROL_WORDS].tolist()
        with self._lock:
            if self._copied is not None and (wait or self._copied.query()):
                self._copied.synchronize()
                self._last, self._copied = self._host.tolist(), None
            if self._copied is None:
                with torch.cuda.stream(self._stream):
                    self._host.copy_(self.block[:CONTROL_WORDS], non_blocking=True)
                    self._copied = torch.cuda.Event()
                    self._copied.record(self._stream)
            if wait:
                self._copied.synchronize()
                self._last, self._copied = self._host.tolist(), None
            return list(self._last)

    def quiet(self) -> Quiet:
        """A probe whose query() is true once every program that had begun by now has ended."""
        return Quiet(self)

    def _buffer(self, index: int) -> int:
        return CONTROL_WORDS + index * self._width

    def _write(self, at: int, words: list[int]) -> None:
        """Write `words` at word `at`, landed when this returns (a GPU: from a stream of our
        own, so behind none of the engine's work)."""
        values = torch.tensor(words, dtype=torch.int64, device="cpu")
        if self._stream is None:
            self.block[at:at + len(words)] = values
            return
        with self._lock, torch.cuda.stream(self._stream):
            self.block[at:at + len(words)].copy_(values.pin_memory(), non_blocking=True)
            self._stream.synchronize()


class Quiet:
    """The hot-row cache keeper's grace over a descriptor's launches (client/shared/cache_keeper.py).

    Made after the keeper's change to the cache landed: a program that begins after that reads
    the change; one that had begun shows in BEGUN, and has ended once BEGUN is seen at 0 (no
    launch under way) or LAUNCHES moves past its step (counted as the step's last launch ends,
    after every earlier one), or, the counts wedged, after WEDGED_S."""

    def __init__(self, descriptor: TableDescriptor, wedged_s: float = WEDGED_S):
        self._descriptor = descriptor
        self._give_up = time.monotonic() + wedged_s
        words = descriptor.snapshot(wait=True)
        self._launches = words[LAUNCHES]
        self._done = words[BEGUN] == 0

    def query(self) -> bool:
        if not self._done:
            words = self._descriptor.snapshot(wait=True)
            self._done = (words[BEGUN] == 0 or words[LAUNCHES] > self._launches
                          or time.monotonic() > self._give_up)
        return self._done
