"""Layout of a client's slab: the memory the daemon owns and the client reads its rows from.

One slab per served client (a memfd on the CPU backend, one VMM allocation on the client's GPU on
the CUDA backend), passed to the client as a descriptor. Both sides compute the layout from the same numbers with
this module; the daemon also sends it in the register reply and the client checks they agree::

    ids_offset(s)       hash IDs  int32|int64 [T, n_layers, heads]             one block per slot
    rows_offset(s)      rows      bf16  [n_layers, max_tokens, local_heads, head_dim]  per slot

A GPU slab's completion counters (u32 ids_ready, rows_done, failed, done_at_release per slot, 64 B
apart) live in a block of pinned host memory of their own (client/shared/host_counters.py), passed as a
second descriptor: the CPU can then release a wait that no GPU queue will.

Every block starts on a 4 KiB boundary; the slab size is a multiple of 2 MiB (the granularity
of VMM device allocations). Rows of a lookup of T tokens occupy the first T tokens of each
layer's part of the slot's rows block: each layer's rows `[T, local_heads, head_dim]` are
contiguous and start at the same address whatever T, so a caller can keep a persistent view of
one layer's rows of a slot (a captured CUDA graph reads them at a fixed address).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

SLAB_GRANULARITY = 2 << 20
BLOCK_ALIGN = 4096
COUNTER_STRIDE = 64
IDS_ITEMSIZE = 8  # room for int64; a lookup's IDs sit in the caller's dtype (int32 or int64)
ROW_ITEMSIZE = 2  # bf16
# Counter words inside a slot's 64-byte line of the counter block (u32 each). FAILED holds the seq of the
# slot's last lookup the daemon could not serve (refused, or its gather failed to enqueue): it is
# written before that lookup's ROWS_DONE, so a reader that has seen ROWS_DONE sees it too.
# DONE_AT_RELEASE keeps what ROWS_DONE had reached when a release overwrote it (release()), so
# that whether a lookup's rows were written can still be told after it (rows_written).
IDS_READY, ROWS_DONE, FAILED, DONE_AT_RELEASE = 0, 1, 2, 3
BF16_NAN = 0x7FC0  # the rows of a lookup that was not served (client/failures.py)
# Stream waits on a counter compare cyclically: a wait for `seq` passes once
# (int32)(counter - seq) >= 0, so seqs may wrap past 2^32. A counter set RELEASE_AHEAD past the
# last seq passes every wait for a seq within 2^30 of it, behind or ahead (release_value).
RELEASE_AHEAD = 1 << 30


def wait_passes(counter: int, seq: int) -> bool:
    """What the device decides for a wait on `seq` when the counter holds `counter` (u32s)."""
    return (counter - seq) & 0xFFFFFFFF < 1 << 31


def release_value(last_seq: int) -> int:
    """The counter value that releases every wait a client can have made around `last_seq`
    (lookups it sent but the daemon never got, as well as done ones): the largest u32 would not,
    it is behind every seq below 2^31."""
    return (last_seq + RELEASE_AHEAD) & 0xFFFFFFFF


def is_release(counter: int, last_seq: int) -> bool:
    """Whether a ROWS_DONE value is a release (release_value of a seq near `last_seq`, by either
    side), not a seq a gather wrote: releases run RELEASE_AHEAD ahead of every seq issued."""
    return wait_passes(counter, last_seq + RELEASE_AHEAD // 2)


def rows_written(rows_done: int, failed: int, done_at_release: int, seq: int, last_seq: int) -> bool:
    """Whether a slot's counters show the rows of lookup `seq` written by its gather: the seq the
    gathers reached (ROWS_DONE, or DONE_AT_RELEASE once a release overwrote it) has passed `seq`,
    and the daemon did not mark `seq` failed. `last_seq`: the last seq the client issued. A
    slot's gathers run in seq order, so a later seq reached means this one was written."""
    reached = done_at_release if is_release(rows_done, last_seq) else rows_done
    return wait_passes(reached, seq) and failed != seq & 0xFFFFFFFF


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True)
class SlabLayout:
    slots: int
    max_tokens: int
    n_layers: int
    heads: int
    local_heads: int
    head_dim: int

    @property
    def ids_elems(self) -> int:
        return self.max_tokens * self.n_layers * self.heads

    @property
    def rows_elems(self) -> int:
        return self.n_layers * self.max_tokens * self.local_heads * self.head_dim

    @property
    def ids_block(self) -> int:
        return _align(self.ids_elems * IDS_ITEMSIZE, BLOCK_ALIGN)

    @property
    def rows_block(self) -> int:
        return _align(self.rows_elems * ROW_ITEMSIZE, BLOCK_ALIGN)

    @property
    def counters_bytes(self) -> int:
        """The size of the slab's counter block (a block of its own, not part of the slab)."""
        return _align(self.slots * COUNTER_STRIDE, BLOCK_ALIGN)

    def counter_offset(self, slot: int, word: int) -> int:
        """Where a slot's counter word is in the counter block."""
        return slot * COUNTER_STRIDE + 4 * word

    def ids_offset(self, slot: int) -> int:
        return slot * self.ids_block

    def rows_offset(self, slot: int) -> int:
        return self.slots * self.ids_block + slot * self.rows_block

    @property
    def size(self) -> int:
        return _align(self.slots * (self.ids_block + self.rows_block), SLAB_GRANULARITY)

    def ids_view(self, buffer: torch.Tensor, slot: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """The slot's IDs `[T, n_layers, heads]` of `dtype` inside a uint8 view of the slab."""
        start = self.ids_offset(slot)
        n = tokens * self.n_layers * self.heads * dtype.itemsize
        return buffer[start:start + n].view(dtype).view(tokens, self.n_layers, self.heads)

    def rows_view(self, buffer: torch.Tensor, slot: int, tokens: int) -> torch.Tensor:
        """The slot's rows of a T-token lookup `[n_layers, T, local_heads, head_dim]` bf16 (each
        layer contiguous; the layers `max_tokens` tokens apart)."""
        return self.slot_rows(buffer, slot)[:, :tokens]

    def slot_rows(self, buffer: torch.Tensor, slot: int) -> torch.Tensor:
        """The slot's whole rows block `[n_layers, max_tokens, local_heads, head_dim]` bf16."""
        start = self.rows_offset(slot)
        return buffer[start:start + self.rows_elems * ROW_ITEMSIZE].view(torch.bfloat16).view(
            self.n_layers, self.max_tokens, self.local_heads, self.head_dim)

    def to_wire(self) -> dict[str, Any]:
        return {**asdict(self), "size": self.size}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> SlabLayout:
        layout = cls(**{k: int(data[k]) for k in
                        ("slots", "max_tokens", "n_layers", "heads", "local_heads", "head_dim")})
        if int(data.get("size", layout.size)) != layout.size:
            raise ValueError(f"slab size {data['size']} disagrees with the layout's {layout.size}")
        return layout


class SlotViews:
    """Tensor views of one slab's slots, made once per (slot, tokens[, dtype]) and then reused.

    Slicing and viewing a slab costs several microseconds per lookup; decode steps repeat a few
    token counts, so both sides of the hot path keep the views they made. A view handed out is
    shared by every lookup of that slot and size: callers may read and write its data, never
    change its shape in place.
    """

    MAX_VIEWS = 4096  # per slab; past it the cache starts over (token counts are few in practice)

    def __init__(self, layout: SlabLayout, buffer: torch.Tensor):
        self.layout = layout
        self.buffer = buffer
        self._rows: dict[tuple[int, int], torch.Tensor] = {}
        self._ids: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        view = self._rows.get((slot, tokens))
        if view is None:
            view = self._remember(self._rows, (slot, tokens),
                                  self.layout.rows_view(self.buffer, slot, tokens))
        return view

    def slot_rows(self, slot: int) -> torch.Tensor:
        return self.rows(slot, self.layout.max_tokens)

    def ids(self, slot: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        view = self._ids.get((slot, tokens, dtype))
        if view is None:
            view = self._remember(self._ids, (slot, tokens, dtype),
                                  self.layout.ids_view(self.buffer, slot, tokens, dtype))
        return view

    def _remember(self, cache: dict, key: tuple, view: torch.Tensor) -> torch.Tensor:
        if len(cache) >= self.MAX_VIEWS:
            cache.clear()
        cache[key] = view
        return view

    def close(self) -> None:
        self._rows.clear()
        self._ids.clear()
        del self.buffer
