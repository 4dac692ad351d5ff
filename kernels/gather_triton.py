"""Gather + dequantize of Engram table rows on the GPU: a persistent Triton kernel.

One op, in three layers: `_gather_kernel` (the @triton.jit kernel), `GatherPlan` (what one shard's
lookups on one device need, validated and staged once, plus the launcher that checks every call's
tensors and sizes the grid), and `gather` (a one-shot convenience that builds a plan and runs it).
The plain-torch reference, which this kernel must match bit for bit, is `gather_ref`.

The kernel reads rows through raw addresses: a table is a CUDA tensor, a pinned host tensor, or any
host memory registered with CUDA and reached through unified virtual addressing (the daemon's case:
it passes `LayerTable(address, rows, row_bytes)`). Per layer, a small int64 device tensor holds
(address, rows, first owned row, end of owned rows); offsets are int64, since 384 M rows x 264 B
passes 2^31. The grid is persistent: `num_programs` programs (default: one per SM) walk the work
items (layer, token, local head) in blocks of `block_rows`, so a lookup can leave SMs to the model.
A lookup a CUDA graph records reads the tables through a descriptor block instead of the plan's
metadata (kernels/descriptor.py), so that its client can switch tables under the live graph.

Dequantization is done on integer bit patterns rather than with float8/float arithmetic: the result
is the correctly rounded BF16 value of float32(e4m3) * 2^(s - 127), exactly what the reference
computes (see gather_ref's docstring), whatever the compiler's denormal mode, on GPUs without FP8
conversion instructions, and in Triton's CPU interpreter alike. NaN inputs give 0x7FC0.

This module imports without Triton (the CPU backend never launches it); calling into it then
raises TritonUnavailableError. It does not own table memory, pin or register anything, or
synchronise: work is queued on the current (or given) stream and the caller orders around it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from engramd.kernels import descriptor as desc
from engramd.kernels import hot_cache
from engramd.kernels.contract import DEAD_ID, Shard
from engramd.kernels.gather_ref import head_dim_for
from engramd.kernels.hot_cache import HotCache

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; GatherPlan raises on use
    triton = None
    tl = None

DEFAULT_BLOCK_ROWS = 8
WIDE_BLOCK_ROWS = 32  # sorted lookups with many rows per program: sorted_block_rows
WIDE_FROM_ROWS = 2048  # rows per program from which a sorted lookup takes WIDE_BLOCK_ROWS
DEFAULT_NUM_WARPS = 4
# A layer's row of the plan's metadata (_stage_meta), as in a descriptor's buffer.
_META_COLUMNS = len(desc.LAYER_FIELDS)
_TABLE_ADDRESS, _TABLE_ROWS, _ROW_LO, _ROW_HI = range(_META_COLUMNS)
_NAN_BITS = 0x7FC0  # BF16 quiet NaN: the rows of a poisoned descriptor
_ID_DTYPES = (torch.int32, torch.int64)
_MAX_ITEMS = 2**31 - 1  # work-item indices are int32 inside the kernel


class TritonUnavailableError(RuntimeError):
    """Triton is not installed, so the GPU gather cannot run."""


if triton is not None:

    # Only builtins and kernels of this module are called from the kernel: triton.language's own
    # jitted helpers (tl.cdiv, tl.sum) stay compiled when triton was imported before
    # TRITON_INTERPRET was set, and the interpreter cannot call them.

    _DEAD = tl.constexpr(DEAD_ID)  # a kernel may read module globals only as constexpr
    _META_WIDTH = tl.constexpr(_META_COLUMNS)
    _ADDRESS, _ROWS = tl.constexpr(_TABLE_ADDRESS), tl.constexpr(_TABLE_ROWS)
    _LO, _HI = tl.constexpr(_ROW_LO), tl.constexpr(_ROW_HI)
    # A descriptor block's words (kernels/descriptor.py).
    (_D_SELECT, _D_ACTIVE, _D_BEGUN, _D_ARRIVED, _D_LAUNCHES, _D_POISONED_LAUNCHES,
     _D_SAW_POISON, _D_ROWS, _D_STEP_ROWS, _D_STEP_OPEN, _D_STEP_POISONED,
     _D_ABANDONED) = (tl.constexpr(w) for w in (
        desc.SELECT, desc.ACTIVE, desc.BEGUN, desc.ARRIVED, desc.LAUNCHES, desc.POISONED_LAUNCHES,
        desc.SAW_POISON, desc.ROWS, desc.STEP_ROWS, desc.STEP_OPEN, desc.STEP_POISONED,
        desc.ABANDONED))
    _D_CONTROL, _D_HEADER = tl.constexpr(desc.CONTROL_WORDS), tl.constexpr(desc.HEADER_WORDS)
    _D_POISONED, _D_HAS_CACHE = tl.constexpr(desc.POISONED), tl.constexpr(desc.HAS_CACHE)
    _DETACHED = tl.constexpr(desc.DETACHED)
    _D_CACHE_WORDS = tl.constexpr(desc.CACHE_WORDS)
    _NAN = tl.constexpr(_NAN_BITS)
    # The hot-row cache's metadata, one int64 each, in kernels/hot_cache.META_FIELDS order.
    (_C_KEYS, _C_POOL, _C_SETS, _C_SKETCH, _C_LOG, _C_CURSOR, _C_COUNTERS, _C_LOG_MASK, _C_ADMIT_MIN,
     _C_SKETCH_BITS) = (tl.constexpr(hot_cache.META_FIELDS.index(name)) for name in (
        "keys", "pool", "sets", "sketch", "log", "cursor", "counters", "log_mask", "admit_min",
        "sketch_bits"))

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _bf16_bits(w, s):
        """E4M3 bytes `w` and UE8M0 bytes `s` (int32, 0..255) -> BF16 bit patterns (int32).

        |x| = M * 2^(q - 10) with M = 8 + mantissa for normals, M = mantissa for subnormals, and
        q = max(exponent field, 1). M converts to float32 exactly; adding (q - 10) to its exponent
        field gives |x| as float32 bits, always a normal number. The scale then only moves the
        exponent, into float32's subnormal range when it falls below 1 (a right shift that drops
        no bits: at most 10 places for a 4-bit significand) and to inf at 255. Rounding to BF16 is
        round-half-to-even on the low 16 bits.
        """
        exponent = (w >> 3) & 0xF
        mantissa = w & 0x7
        big_m = tl.where(exponent > 0, mantissa + 8, mantissa)
        q = tl.maximum(exponent, 1)
        x_bits = big_m.to(tl.float32).to(tl.int32, bitcast=True) + ((q - 10) << 23)
        product_exp = (x_bits >> 23) + s - 127
        normal = x_bits + ((s - 127) << 23)
        shift = tl.minimum(tl.maximum(1 - product_exp, 0), 31)
        subnormal = ((x_bits & 0x7FFFFF) | 0x800000) >> shift
        f = tl.where(product_exp >= 1, normal, subnormal)
        f = tl.where(product_exp >= 255, 0x7F800000, f)
        f = tl.where(big_m == 0, 0, f)
        rounded = (f + 0x7FFF + ((f >> 16) & 1)) >> 16
        bits = rounded | ((w >> 7) << 15)
        is_nan = ((exponent == 15) & (mantissa == 7)) | (s == 255)
        return tl.where(is_nan, 0x7FC0, bits)

    @triton.jit
    def _max(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _load(ptr, mask, L2_ONLY: tl.constexpr):
        # Cache rows change under running gathers (client/shared/cache_keeper.py), so with a cache
        # every row and key is read at L2, which is coherent, never from an SM's L1.
        if L2_ONLY:
            return tl.load(ptr, mask=mask, other=0, cache_modifier=".cg")
        else:
            return tl.load(ptr, mask=mask, other=0)

    @triton.jit
    def _cache_slot(cache_ptr, key, hit, WAYS: tl.constexpr, SET_MUL: tl.constexpr):
        """Pool slot of each key in the hot-row cache, -1 on a miss (or where not `hit`).

        cache_ptr: the cache's metadata (the _C_* offsets); hashing as hot_cache.set_index.
        """
        sets = tl.load(cache_ptr + _C_SETS)
        set_i = (((key * SET_MUL) >> 32) & 0xFFFFFFFF) * sets >> 32
        ways = tl.arange(0, WAYS)
        keys = tl.load(cache_ptr + _C_KEYS).to(tl.pointer_type(tl.int64))
        resident = tl.load(keys + set_i[:, None] * WAYS + ways[None, :], mask=hit[:, None],
                           other=-1, cache_modifier=".cg")
        match = (resident == key[:, None]) & hit[:, None]
        way = tl.reduce(tl.where(match, ways[None, :], -1), 1, _max)
        return tl.where(way >= 0, set_i * WAYS + way, -1)

    @triton.jit
    def _count_and_log(cache_ptr, key, layer, counted, cached, n_layers,
                       SKETCH_MUL0: tl.constexpr, SKETCH_MUL1: tl.constexpr):
        """Count the `counted` keys in the sketch, log their repeated misses, add the counters."""
        # Count-min sketch (hashing as hot_cache.sketch_index): the old counts are the estimate
        # before this lookup.
        bits = tl.load(cache_ptr + _C_SKETCH_BITS)
        sketch = tl.load(cache_ptr + _C_SKETCH).to(tl.pointer_type(tl.int32))
        index0 = ((key * SKETCH_MUL0) >> (64 - bits)) & ((1 << bits) - 1)
        index1 = ((key * SKETCH_MUL1) >> (64 - bits)) & ((1 << bits) - 1)
        old0 = tl.atomic_add(sketch + index0, 1, mask=counted)
        old1 = tl.atomic_add(sketch + (1 << bits) + index1, 1, mask=counted)
        estimate = tl.minimum(old0, old1)
        # Misses seen before go to the candidate log: one cursor atomic per block.
        logged = counted & ~cached & (estimate >= tl.load(cache_ptr + _C_ADMIT_MIN))
        n_logged = tl.reduce(logged.to(tl.int64), 0, _add)
        cursor = tl.load(cache_ptr + _C_CURSOR).to(tl.pointer_type(tl.int64))
        start = tl.atomic_add(cursor, n_logged, mask=n_logged > 0)
        position = start + tl.associative_scan(logged.to(tl.int64), 0, _add) - 1
        log = tl.load(cache_ptr + _C_LOG).to(tl.pointer_type(tl.int64))
        tl.store(log + (position & tl.load(cache_ptr + _C_LOG_MASK)), key, mask=logged)
        # counters[0][layer] = rows read, counters[1][layer] = of them from the cache
        counters = tl.load(cache_ptr + _C_COUNTERS).to(tl.pointer_type(tl.int64))
        for lay in range(0, n_layers):
            mine = counted & (layer == lay)
            reads = tl.reduce(mine.to(tl.int64), 0, _add)
            tl.atomic_add(counters + lay, reads, mask=reads > 0)
            hits = tl.reduce((mine & cached).to(tl.int64), 0, _add)
            tl.atomic_add(counters + n_layers + lay, hits, mask=hits > 0)

    # Integer arguments that change from call to call are not specialised on (value 1,
    # divisibility by 16), so a lookup of a new size never compiles a new variant in the hot
    # path: the variants are exactly the constexpr combinations that warm_up() compiles.
    @triton.jit(do_not_specialize=[
        "n_items", "tokens", "local_heads", "owned_heads", "head_start",
        "ids_stride_t", "ids_stride_l", "ids_stride_h", "out_rows_l", "out_rows_t", "n_layers",
        "first_layer", "closes",
    ])
    def _gather_kernel(
        ids_ptr, meta_ptr, out_ptr, bad_ptr, cache_ptr, lead_ptr, order_ptr,
        n_items, tokens, local_heads, owned_heads, head_start,
        ids_stride_t, ids_stride_l, ids_stride_h,
        out_rows_l, out_rows_t, n_layers, first_layer, closes,
        HEAD_DIM: tl.constexpr, ROW_BYTES: tl.constexpr,
        WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        PACKED: tl.constexpr, ALIGNED: tl.constexpr, COUNT_BAD: tl.constexpr,
        CACHED: tl.constexpr, LEADERS_ONLY: tl.constexpr, ORDERED: tl.constexpr, WAYS: tl.constexpr,
        KEY_SHIFT: tl.constexpr, SET_MUL: tl.constexpr,
        SKETCH_MUL0: tl.constexpr, SKETCH_MUL1: tl.constexpr, DESCRIBED: tl.constexpr,
    ):
        """Each program takes blocks pid, pid + grid, ... of BLOCK_ROWS work items.

        Item i is (layer, token, local head j) in that nesting order, so a block's rows land
        next to each other in the output; its layer counts from `first_layer` (a launch may
        gather some of the plan's layers: n_items / (tokens x local_heads) of them). Every
        output row of every item is written: the row when the ID is owned, zeros otherwise, so
        the output needs no clearing beforehand.
        With LEADERS_ONLY, only items that lead their run of equal rows (lead_ptr[i] == i) are
        done; _fanout_kernel then copies each leader's output to its followers. With ORDERED,
        the k-th item done is order_ptr[k] (items sorted by row: neighbouring reads then share
        address translations, see benchmarks/results/h200/gather_layouts.md).

        With DESCRIBED, meta_ptr is a descriptor block (kernels/descriptor.py): the tables and the
        cache are those of the buffer it names active (cache_ptr is unused), a poisoned buffer
        gives NaN rows and reads nothing, a detached one writes nothing either, and the last
        program to end adopts the buffer the owner selected for the next launch, if the launch
        `closes` its step (the last of a step gathered in several launches, a layer each).
        """
        cols = tl.arange(0, BLOCK_W)
        col_ok = cols < WIDTH
        per_layer = tokens * local_heads
        n_blocks = (n_items + BLOCK_ROWS - 1) // BLOCK_ROWS
        if DESCRIBED:
            tl.atomic_add(meta_ptr + _D_BEGUN, 1)
            width = (_D_HEADER + n_layers * _META_WIDTH + _D_CACHE_WORDS + 7) // 8 * 8
            buffer = meta_ptr + _D_CONTROL + tl.load(meta_ptr + _D_ACTIVE) * width
            # At L2: the owner writes these words from the host while launches run.
            poison_word = tl.load(buffer + _D_POISONED, cache_modifier=".cg")
            cache_word = tl.load(buffer + _D_HAS_CACHE, cache_modifier=".cg")
            layer_meta = buffer + _D_HEADER
            cache_ptr = layer_meta + n_layers * _META_WIDTH
        else:
            layer_meta = meta_ptr
        for block in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            item = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            live = item < n_items
            if ORDERED:
                item = tl.load(order_ptr + item, mask=live, other=0)
            if LEADERS_ONLY:
                live = live & (tl.load(lead_ptr + item, mask=live, other=-1) == item)
            layer, token, j = _decode(item, per_layer, local_heads)
            layer += first_layer
            owned = live & (j < owned_heads)
            if DESCRIBED:
                # The flags as blocks (Triton's interpreter cannot AND a scalar into a mask): a
                # poisoned buffer reads nothing and writes NaN rows, a detached one writes nothing.
                zeros = item.to(tl.int64) * 0
                poisoned = (zeros + poison_word) != 0
                owned = owned & ((zeros + poison_word) == 0)
                writes = live & ((zeros + poison_word) != _DETACHED)
            id_offset = (token.to(tl.int64) * ids_stride_t + layer.to(tl.int64) * ids_stride_l
                         + (head_start + j).to(tl.int64) * ids_stride_h)
            row = tl.load(ids_ptr + id_offset, mask=owned, other=_DEAD).to(tl.int64)
            meta = layer_meta + layer * _META_WIDTH
            base = tl.load(meta + _ADDRESS, mask=live, other=0)
            hit = (owned & (row >= tl.load(meta + _LO, mask=live, other=0))
                   & (row < tl.load(meta + _HI, mask=live, other=0)))
            if COUNT_BAD:
                rows = tl.load(meta + _ROWS, mask=live, other=0)
                bad = owned & (row != _DEAD) & ((row < 0) | (row >= rows))
                n_bad = tl.reduce(bad.to(tl.int64), 0, _add)
                tl.atomic_add(bad_ptr, n_bad, mask=n_bad > 0)
            address = base + row * ROW_BYTES
            if CACHED:
                key = (layer.to(tl.int64) << KEY_SHIFT) | row
                counted = hit
                if DESCRIBED:
                    counted = hit & ((zeros + cache_word) != 0)
                slot = _cache_slot(cache_ptr, key, counted, WAYS, SET_MUL)
                address = tl.where(slot >= 0, tl.load(cache_ptr + _C_POOL) + slot * ROW_BYTES, address)
            src = address.to(tl.pointer_type(tl.uint8))
            if ALIGNED:
                src = tl.multiple_of(src, 8)
            load_mask = hit[:, None] & col_ok[None, :]
            # Output strides come in rows, so every row start is a known multiple of WIDTH
            # and the stores vectorise.
            out_offset = _out_row(layer, token, j, out_rows_l, out_rows_t) * WIDTH
            dst = out_ptr + out_offset[:, None] + cols[None, :]
            store_mask = live[:, None] & col_ok[None, :]
            if DESCRIBED:
                store_mask = writes[:, None] & col_ok[None, :]
            raw = _load(src[:, None] + cols[None, :], load_mask, CACHED)
            if not PACKED:
                if ALIGNED and ROW_BYTES - HEAD_DIM == 8:
                    # The 8 scale bytes are one aligned little-endian word: one load per row
                    # instead of one byte load per value.
                    word = _load((src + HEAD_DIM).to(tl.pointer_type(tl.int64)), hit, CACHED)
                    shift = ((cols // 32) * 8).to(tl.int64)
                    scale = (word[:, None] >> shift[None, :]) & 0xFF
                else:
                    scale = _load(src[:, None] + HEAD_DIM + cols[None, :] // 32, load_mask, CACHED)
            if CACHED:
                # After the row loads are issued: the bookkeeping overlaps their latency.
                _count_and_log(cache_ptr, key, layer, counted, slot >= 0, n_layers,
                               SKETCH_MUL0, SKETCH_MUL1)
            if PACKED:
                tl.store(dst, raw, mask=store_mask)
            else:
                bits = _bf16_bits(raw.to(tl.int32), scale.to(tl.int32))
                bits = tl.where(load_mask, bits, 0)
                if DESCRIBED:
                    bits = tl.where(poisoned[:, None], _NAN, bits)
                tl.store(dst, bits.to(tl.int16), mask=store_mask)
        if DESCRIBED:
            rows_read = (n_items // local_heads).to(tl.int64) * owned_heads
            _end_described_launch(meta_ptr, poison_word != 0, rows_read, first_layer == 0, closes)

    @triton.jit
    def _end_described_launch(block, poisoned, rows_read, opens, closes):
        """A program of a described launch ends; the last one ends the launch: BEGUN reset first
        (a reader that sees it 0 knows that no program of this launch still reads), and the
        launch's rows and poison folded into its step's. A launch that `opens` a step (from
        layer 0) starts the step's afresh, and counts in ABANDONED a step it finds open (its
        closing launch never ran: its rows and poison are not the new step's). A launch that
        `closes` its step then counts the step (poisoned or not: its rows only if no launch of
        it was) and adopts the buffer the next step reads (SELECT -> ACTIVE), so that a step's
        launches all read one buffer; one that does not leaves the step open."""
        if poisoned:
            tl.atomic_xchg(block + _D_SAW_POISON, 1)
        if tl.atomic_add(block + _D_ARRIVED, 1) == tl.num_programs(0) - 1:
            tl.store(block + _D_ARRIVED, 0)
            tl.store(block + _D_BEGUN, 0)
            launch_poisoned = tl.atomic_xchg(block + _D_SAW_POISON, 0)
            if opens:
                tl.store(block + _D_ABANDONED, tl.load(block + _D_ABANDONED) + tl.load(block + _D_STEP_OPEN))
            step_rows = tl.where(opens, 0, tl.load(block + _D_STEP_ROWS)) + rows_read
            step_poisoned = tl.where(opens, 0, tl.load(block + _D_STEP_POISONED)) | launch_poisoned
            if closes != 0:
                tl.store(block + _D_ROWS, tl.load(block + _D_ROWS) + tl.where(step_poisoned != 0, 0, step_rows))
                tl.store(block + _D_POISONED_LAUNCHES, tl.load(block + _D_POISONED_LAUNCHES) + step_poisoned)
                tl.store(block + _D_LAUNCHES, tl.load(block + _D_LAUNCHES) + 1)
                tl.store(block + _D_STEP_ROWS, 0)
                tl.store(block + _D_STEP_POISONED, 0)
                tl.store(block + _D_STEP_OPEN, 0)
                tl.store(block + _D_ACTIVE, tl.load(block + _D_SELECT, volatile=True))
            else:
                tl.store(block + _D_STEP_ROWS, step_rows)
                tl.store(block + _D_STEP_POISONED, step_poisoned)
                tl.store(block + _D_STEP_OPEN, 1)

    @triton.jit(do_not_specialize=["n_items", "tokens", "local_heads", "out_rows_l", "out_rows_t"])
    def _fanout_kernel(
        lead_ptr, out_ptr, n_items, tokens, local_heads, out_rows_l, out_rows_t,
        WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    ):
        """Copy each leader's output row to the items that follow it (lead_ptr[i] != i)."""
        cols = tl.arange(0, BLOCK_W)
        col_ok = cols < WIDTH
        per_layer = tokens * local_heads
        n_blocks = (n_items + BLOCK_ROWS - 1) // BLOCK_ROWS
        for block in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            item = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            leader = tl.load(lead_ptr + item, mask=item < n_items, other=0).to(tl.int32)
            follows = (item < n_items) & (leader != item)
            mask = follows[:, None] & col_ok[None, :]
            lead_layer, lead_token, lead_j = _decode(leader, per_layer, local_heads)
            layer, token, j = _decode(item, per_layer, local_heads)
            src = _out_row(lead_layer, lead_token, lead_j, out_rows_l, out_rows_t) * WIDTH
            dst = _out_row(layer, token, j, out_rows_l, out_rows_t) * WIDTH
            values = tl.load(out_ptr + src[:, None] + cols[None, :], mask=mask, other=0)
            tl.store(out_ptr + dst[:, None] + cols[None, :], values, mask=mask)

    @triton.jit
    def _decode(item, per_layer, local_heads):
        """Work item -> (layer, token, local head j): the nesting every kernel here walks."""
        layer = item // per_layer
        token = (item - layer * per_layer) // local_heads
        return layer, token, item - layer * per_layer - token * local_heads

    @triton.jit
    def _out_row(layer, token, j, out_rows_l, out_rows_t):
        """Index, in rows, of item (layer, token, j)'s row in an output with these row strides."""
        return layer.to(tl.int64) * out_rows_l + token.to(tl.int64) * out_rows_t + j.to(tl.int64)


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the CPU interpreter (TRITON_INTERPRET=1) when the kernel is defined.
    return triton is not None and type(_gather_kernel).__name__ == "InterpretedFunction"


def _require_triton() -> None:
    if triton is None:
        raise TritonUnavailableError(
            "engramd.kernels.gather_triton needs Triton (pip install triton); "
            "without a GPU use engramd.kernels.gather_ref"
        )


@dataclass(frozen=True)
class LayerTable:
    """One layer's table as the kernel reads it: a device-visible address of packed rows.

    `owner` is whatever keeps that memory alive (a tensor, a registration); a plan holds it for
    as long as the plan lives. Rows are contiguous: row r starts at address + r * row_bytes.
    """

    address: int
    rows: int
    row_bytes: int
    owner: object = field(default=None, compare=False, repr=False)

    @classmethod
    def from_tensor(cls, table: Tensor, name: str = "table") -> LayerTable:
        """A uint8 [rows, row_bytes] tensor: CUDA memory, or pinned host memory (read via UVA)."""
        if not isinstance(table, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
        if table.dtype != torch.uint8 or table.dim() != 2:
            raise TypeError(
                f"{name} must be uint8 [rows, row_bytes], got {table.dtype} {tuple(table.shape)}"
            )
        if table.shape[0] and (table.stride(1) != 1 or table.stride(0) != table.shape[1]):
            raise ValueError(f"{name} must be contiguous, got strides {table.stride()}")
        return cls(table.data_ptr(), table.shape[0], table.shape[1], owner=table)


def _as_layer_table(table: object, name: str, device: torch.device) -> LayerTable:
    if isinstance(table, LayerTable):
        return table
    if not isinstance(table, Tensor) and hasattr(table, "__cuda_array_interface__"):
        table = torch.as_tensor(table, device=device)
    layer_table = LayerTable.from_tensor(table, name)
    _check_table_device(table, name, device)
    return layer_table


def _check_table_device(table: Tensor, name: str, device: torch.device) -> None:
    if _kernel_is_interpreted():
        if table.device.type != "cpu":
            raise ValueError(f"{name} is on {table.device}; the Triton interpreter reads CPU memory")
    elif table.device.type == "cpu":
        # Pinned host memory has one address for host and device under UVA.
        if not table.is_pinned():
            raise ValueError(f"{name} is in pageable host memory; pin it or move it to {device}")
    elif table.device != device:
        raise ValueError(f"{name} is on {table.device} but the plan runs on {device}")


class GatherPlan:
    """Everything one shard's lookups on one device need, validated and staged once.

    Build it when a client registers (tables, its shard, its GPU) and call it per lookup; a call
    only validates the tensors it is given and queues one kernel launch, with no host-device
    synchronisation. The plan keeps the table owners alive; the caller keeps the memory valid.
    """

    def __init__(
        self,
        tables: Sequence[Tensor | LayerTable],
        shard: Shard,
        device: torch.device | str | None = None,
    ) -> None:
        _require_triton()
        self.device = _plan_device(device)
        if isinstance(tables, Tensor) or len(tables) != len(shard.row_ranges):
            raise ValueError(
                f"expected one table per layer ({len(shard.row_ranges)} from the shard's row "
                f"ranges), got {'a single tensor' if isinstance(tables, Tensor) else len(tables)}"
            )
        self.tables = tuple(
            _as_layer_table(t, f"tables[{i}]", self.device) for i, t in enumerate(tables)
        )
        self.shard = shard
        self.row_bytes = _common_row_bytes(self.tables)
        self.head_dim = head_dim_for(self.row_bytes)
        self.aligned = self.row_bytes % 8 == 0 and all(t.address % 8 == 0 for t in self.tables)
        self.meta = _stage_meta(self.tables, shard, self.device)
        # [L, 1, 1] row bounds of the shard and the table, for dedupe keys
        bounds = self.meta.view(-1, _META_COLUMNS)
        lo, hi = bounds[:, 2], torch.minimum(bounds[:, 3], bounds[:, 1])
        self.row_bounds = (lo.view(-1, 1, 1), hi.view(-1, 1, 1))

    @property
    def n_layers(self) -> int:
        return len(self.tables)

    def warm_up(self, stream: torch.cuda.Stream | None = None,
                caches: Sequence[HotCache | None] = (None,),
                dedupe: Sequence[bool] = (False, True),
                sort: Sequence[bool] = (False, True),
                packed: Sequence[bool] = (False, True),
                counted: Sequence[bool] = (False, True)) -> None:
        """Compile and load every kernel variant this plan can launch with the default blocks.

        `caches`, `dedupe`, `sort`, `packed` and `counted` (whether an `out_of_range` counter is
        passed) are the values it will be called with: each variant compiles for a second or so,
        and loads from Triton's cache in tens of ms, so a caller warms only those it launches. A
        cache variant warms up on the real cache (DEAD IDs read, count and log nothing).

        A first launch loads the module lazily, and a process whose stream waits on another
        process must not do that in its hot path (docs/architecture.md, "Cross-process waits and
        lazy module loading").
        """
        counter = torch.zeros(1, dtype=torch.int64, device=self.device)
        counts = [counter if on else None for on in counted]
        for dtype in _ID_DTYPES:
            ids = torch.full((1, self.n_layers, self.shard.head_end), DEAD_ID, dtype=dtype,
                             device=self.device)
            for as_bytes, count, cache, leaders, ordered in itertools.product(packed, counts, caches,
                                                                               dedupe, sort):
                for rows in (DEFAULT_BLOCK_ROWS, WIDE_BLOCK_ROWS) if ordered else (DEFAULT_BLOCK_ROWS,):
                    self(ids, packed=as_bytes, stream=stream, out_of_range=count, cache=cache,
                         dedupe=leaders, sort=ordered, block_rows=rows)

    def output_shape(self, tokens: int, packed: bool = False) -> tuple[int, int, int, int]:
        width = self.row_bytes if packed else self.head_dim
        return (self.n_layers, tokens, self.shard.local_heads, width)

    def __call__(
        self,
        ids: Tensor,
        out: Tensor | None = None,
        *,
        packed: bool = False,
        num_programs: int | None = None,
        stream: torch.cuda.Stream | None = None,
        out_of_range: Tensor | None = None,
        block_rows: int | None = None,
        num_warps: int = DEFAULT_NUM_WARPS,
        cache: HotCache | None = None,
        dedupe: bool = False,
        sort: bool = False,
        descriptor: desc.TableDescriptor | None = None,
        layers: range | None = None,
    ) -> Tensor:
        """Queue the lookup of `ids` [T, n_layers, heads] into `out` (allocated when None).

        Returns `out`: bf16 [n_layers, T, local_heads, head_dim], or the packed uint8 rows
        [..., row_bytes] when `packed`. `out` may be a strided view (a slab slot) as long as each
        row is contiguous. `out_of_range`, an int64 device tensor of one element, is incremented
        by the number of owned-head IDs that are not DEAD_ID and lie outside the table. The
        launch goes on `stream`, else the current stream (no streams under the interpreter).

        `cache`: read rows resident in this device's hot-row cache from HBM, count every row in
        its sketch and log repeated misses (kernels/hot_cache.py). `dedupe`: read each distinct
        (layer, row) once (a sort, the gather of the leaders, then a copy to the followers).
        `sort`: read the rows in sorted order (a sort of the IDs first; no synchronisation).

        `block_rows` (default): DEFAULT_BLOCK_ROWS, or sorted_block_rows' choice for sorted reads.
        Grid size, measured on an H200 (8 M-row table, 393 K random rows): reads over UVA from
        pinned host memory run at 53-61 M rows/s whatever num_programs and block_rows are; from
        HBM, 4 programs per SM gather about twice as fast as 1 (1.3 G vs 0.6 G rows/s as bf16).

        `descriptor`: read the tables, and the cache, through this block instead of the plan's
        metadata (kernels/descriptor.py: what a CUDA graph records), counting out-of-range IDs
        in it; BF16 rows, no dedupe, no `cache` or `out_of_range` of the call's own. The plan's
        tables then only set the kernel's variant (row size, alignment) and the sort's keys.

        `layers`: gather only these of the plan's layers (a range of step 1; `out`'s other layers
        are left as they are), as a step gathered in several launches does, a layer each; not
        with dedupe. Through a descriptor, the launch whose range ends at the plan's last layer
        closes the step (the tables may switch after it, never between the launches before).
        """
        if descriptor is not None:
            self._check_descriptor(descriptor, packed, dedupe, cache, out_of_range)
            out_of_range = descriptor.out_of_range
        self._check_ids(ids)
        out = self._check_out(out, ids.shape[0], packed)
        layers = self._check_layers(layers, dedupe)
        n_items = len(layers) * ids.shape[0] * self.shard.local_heads
        programs = self._check_launch(num_programs, DEFAULT_BLOCK_ROWS if block_rows is None
                                      else block_rows, num_warps, out_of_range)
        if block_rows is None:
            block_rows = sorted_block_rows(n_items, programs) if sort else DEFAULT_BLOCK_ROWS
        if n_items > _MAX_ITEMS:
            raise ValueError(f"{n_items} rows in one lookup; at most {_MAX_ITEMS} per launch")
        if n_items == 0:
            return out
        self._check_cache(cache)
        launch = _Launch(min(programs, triton.cdiv(n_items, block_rows)), n_items, packed,
                         block_rows, num_warps, layers)
        self._launched = None
        if stream is None or _kernel_is_interpreted():
            self._launch(launch, ids, out, out_of_range, cache, dedupe, sort, descriptor)
        else:
            with torch.cuda.stream(stream):
                self._launch(launch, ids, out, out_of_range, cache, dedupe, sort, descriptor)
        return out

    def _launch(self, launch: _Launch, ids, out, out_of_range, cache, dedupe, sort,
                descriptor: desc.TableDescriptor | None = None) -> None:
        width = self.row_bytes if launch.packed else self.head_dim
        target = out if launch.packed else out.view(torch.int16)  # the kernel writes BF16 bits
        keys = self.item_keys(ids, launch.layers) if dedupe or sort else None
        ordered, order = torch.sort(keys) if keys is not None else (None, None)
        leaders = _leaders(ordered, order) if dedupe else self.meta  # unused without dedupe
        order = order.to(torch.int32) if sort else self.meta  # unused without sort
        args = self.kernel_args(
            ids, target, out_of_range, cache, leaders, order, launch, ids.shape[0],
            ids.stride(), (out.stride(0) // width, out.stride(1) // width), dedupe, sort, descriptor)
        # The compiled kernel (None under the interpreter), for SlotGather's direct launches.
        self._launched = _gather_kernel[(launch.grid,)](**args, num_warps=launch.num_warps)
        self._launched_with = launch
        if dedupe:
            _fanout_kernel[(launch.grid,)](
                leaders, target, launch.n_items, ids.shape[0], self.shard.local_heads,
                out.stride(0) // width, out.stride(1) // width,
                WIDTH=width, BLOCK_W=triton.next_power_of_2(width), BLOCK_ROWS=launch.block_rows,
                num_warps=launch.num_warps,
            )

    def kernel_args(self, ids, target, out_of_range, cache, leaders, order, launch: _Launch,
                    tokens: int, ids_strides, out_strides, dedupe: bool, sort: bool,
                    descriptor: desc.TableDescriptor | None = None) -> dict:
        """_gather_kernel's arguments by name; pointers may be tensors or raw addresses."""
        width = self.row_bytes if launch.packed else self.head_dim
        return dict(
            ids_ptr=ids, meta_ptr=self.meta if descriptor is None else descriptor.block, out_ptr=target,
            bad_ptr=out_of_range if out_of_range is not None else self.meta,  # unused unless counting
            cache_ptr=cache.meta if cache is not None else self.meta, lead_ptr=leaders,
            order_ptr=order, n_items=launch.n_items, tokens=tokens,
            local_heads=self.shard.local_heads, owned_heads=self.shard.owned_heads,
            head_start=self.shard.head_start, ids_stride_t=ids_strides[0],
            ids_stride_l=ids_strides[1], ids_stride_h=ids_strides[2], out_rows_l=out_strides[0],
            out_rows_t=out_strides[1], n_layers=self.n_layers, first_layer=launch.layers.start,
            closes=int(launch.layers.stop == self.n_layers),
            HEAD_DIM=self.head_dim, ROW_BYTES=self.row_bytes,
            WIDTH=width, BLOCK_W=triton.next_power_of_2(width), BLOCK_ROWS=launch.block_rows,
            PACKED=launch.packed, ALIGNED=self.aligned, COUNT_BAD=out_of_range is not None,
            CACHED=cache is not None or descriptor is not None, LEADERS_ONLY=dedupe, ORDERED=sort,
            WAYS=hot_cache.WAYS, DESCRIBED=descriptor is not None,
            KEY_SHIFT=hot_cache.KEY_LAYER_SHIFT, SET_MUL=hot_cache.SET_MULTIPLIER,
            SKETCH_MUL0=hot_cache.SKETCH_MULTIPLIERS[0], SKETCH_MUL1=hot_cache.SKETCH_MULTIPLIERS[1],
        )

    def leaders(self, ids: Tensor) -> Tensor:
        """int32 per work item: the first item, in sorted order, that reads the same row."""
        return _leaders(*torch.sort(self.item_keys(ids)))

    def item_keys(self, ids: Tensor, layers: range | None = None) -> Tensor:
        """int64 per work item (kernel order) of a launch of `layers` (default: all): the
        hot-cache key of the row it reads.

        Items that read nothing (DEAD, out of the shard's rows or the table, padding heads) get
        a negative key of their own, so that each leads itself under dedupe and is still zeroed
        and counted by the kernel. No host synchronisation.
        """
        layers = range(self.n_layers) if layers is None else layers
        tokens, local = ids.shape[0], self.shard.local_heads
        owned = self.shard.head_start + self.shard.owned_heads
        span = slice(layers.start, layers.stop)
        rows = ids[:, span, self.shard.head_start:owned].permute(1, 0, 2).to(torch.int64)
        lo, hi = (bound[span] for bound in self.row_bounds)
        item = torch.arange(len(layers) * tokens * local, device=ids.device).view(
            len(layers), tokens, local)
        keys = -1 - item
        layer = torch.arange(layers.start, layers.stop, device=ids.device).view(-1, 1, 1)
        reads = (rows >= lo) & (rows < hi)
        width = rows.shape[2]
        keys[:, :, :width] = torch.where(reads, hot_cache.row_keys(layer, rows), keys[:, :, :width])
        return keys.view(-1)

    def _check_cache(self, cache: HotCache | None) -> None:
        if cache is None:
            return
        if not isinstance(cache, HotCache):
            raise TypeError(f"cache must be a HotCache, got {type(cache).__name__}")
        if cache.device != self.device or cache.layout.row_bytes != self.row_bytes:
            raise ValueError(f"cache on {cache.device} with {cache.layout.row_bytes}-byte rows "
                             f"cannot serve a plan on {self.device} with {self.row_bytes}-byte rows")
        if cache.n_layers != self.n_layers:
            raise ValueError(f"cache counts {cache.n_layers} layers, the plan has {self.n_layers}")

    def _check_descriptor(self, descriptor: desc.TableDescriptor, packed: bool, dedupe: bool,
                          cache: HotCache | None, out_of_range: Tensor | None) -> None:
        if not isinstance(descriptor, desc.TableDescriptor):
            raise TypeError(f"descriptor must be a TableDescriptor, got {type(descriptor).__name__}")
        if packed or dedupe or cache is not None or out_of_range is not None:
            raise ValueError("a described gather writes BF16 rows without dedupe, through the "
                             "descriptor's cache and into its counter: no packed, dedupe, cache "
                             "or out_of_range of its own")
        if descriptor.device != self.device or descriptor.n_layers != self.n_layers:
            raise ValueError(f"a descriptor of {descriptor.n_layers} layers on {descriptor.device} "
                             f"for a plan of {self.n_layers} on {self.device}")

    def _check_ids(self, ids: Tensor) -> None:
        if not isinstance(ids, Tensor):
            raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype not in _ID_DTYPES:
            raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
        if ids.dim() != 3 or ids.shape[1] != self.n_layers or ids.shape[2] < self.shard.head_end:
            raise ValueError(
                f"ids must be [T, {self.n_layers}, heads >= {self.shard.head_end}], "
                f"got shape {tuple(ids.shape)}"
            )
        if ids.device != self.device:
            raise ValueError(f"ids are on {ids.device} but the plan runs on {self.device}")

    def _check_layers(self, layers: range | None, dedupe: bool) -> range:
        if layers is None:
            return range(self.n_layers)
        problem = layer_range_problem(layers, self.n_layers)
        if problem is not None:
            raise ValueError(f"layers must be {problem}, got {layers!r}")
        if dedupe and len(layers) != self.n_layers:
            raise ValueError("a dedupe lookup gathers every layer of the plan at once")
        return layers

    def _check_out(self, out: Tensor | None, tokens: int, packed: bool) -> Tensor:
        shape = self.output_shape(tokens, packed)
        dtype = torch.uint8 if packed else torch.bfloat16
        if out is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if not isinstance(out, Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != dtype:
            raise TypeError(f"out must be {dtype}{' (packed)' if packed else ''}, got {out.dtype}")
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        if out.device != self.device:
            raise ValueError(f"out is on {out.device} but the plan runs on {self.device}")
        width = shape[3]
        if out.numel() and (out.stride(3) != 1 or out.stride(2) != width
                            or out.stride(1) % width or out.stride(0) % width):
            raise ValueError(
                f"out rows must be contiguous and row-aligned (strides [{width}k, {width}m, "
                f"{width}, 1]), got {out.stride()}"
            )
        return out

    def _check_launch(self, num_programs, block_rows, num_warps, out_of_range) -> int:
        if num_programs is None:
            num_programs = _default_programs(self.device)
        for name, value in (("num_programs", num_programs), ("block_rows", block_rows),
                            ("num_warps", num_warps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if block_rows & (block_rows - 1) or num_warps & (num_warps - 1):
            raise ValueError(
                f"block_rows and num_warps must be powers of two, got {block_rows}, {num_warps}"
            )
        if out_of_range is not None and (
            not isinstance(out_of_range, Tensor) or out_of_range.dtype != torch.int64
            or out_of_range.numel() != 1 or out_of_range.device != self.device
        ):
            raise ValueError(f"out_of_range must be one int64 element on {self.device}")
        return num_programs


class SlotGather:
    """The plain gather (no sort, no dedupe) of one plan into fixed memory: a slab's slots.

    The served hot path calls it once per lookup with raw addresses, a mapped client once per
    gather. The first launch of each ID dtype goes through the plan's checked call and keeps
    the compiled kernel it returns, with the kernel's argument list (_DirectLaunch); later
    launches fill in the arguments that change from call to call and hand the list straight
    to that kernel: no binding by name, no stream context, no Triton helper calls. Under the
    interpreter, and if the compiled kernel refuses a direct launch (another Triton's
    launcher), every launch takes the checked path. Either way the same kernel variant runs
    with the same arguments.
    """

    def __init__(self, plan: GatherPlan, out_of_range: Tensor, cache: HotCache | None,
                 num_programs: int, block_rows: int = DEFAULT_BLOCK_ROWS,
                 num_warps: int = DEFAULT_NUM_WARPS) -> None:
        plan._check_launch(num_programs, block_rows, num_warps, out_of_range)
        plan._check_cache(cache)
        self.plan = plan
        self.out_of_range = out_of_range
        self.cache = cache
        self.programs = num_programs
        self.block_rows = block_rows
        self.num_warps = num_warps
        self.items_per_token = plan.n_layers * plan.shard.local_heads
        self._launches: dict[torch.dtype, _DirectLaunch] = {}
        self._direct = not _kernel_is_interpreted()

    def __call__(self, ids: Tensor, out: Tensor, stream: torch.cuda.Stream,
                 num_programs: int | None = None) -> None:
        """Queue the gather of `ids` [T, L, heads] (contiguous) into `out` (a slot's rows: each
        row contiguous, as GatherPlan checks on the first launch), on `num_programs` programs
        (>= 1; default: this launcher's). The grid is a launch argument: any grid reuses the
        kernel."""
        programs = self.programs if num_programs is None else num_programs
        direct = self._launches.get(ids.dtype) if self._direct else None
        if direct is None:
            self._checked(ids, out, stream, programs)
            return
        n_items = self.items_per_token * ids.shape[0]
        grid = min(programs, -(-n_items // self.block_rows))
        try:
            direct(grid, stream.cuda_stream, ids, out, n_items)
        except TypeError:  # this Triton's launcher takes other arguments: stay on the checked path
            self._direct = False
            self._checked(ids, out, stream, programs)

    def _checked(self, ids: Tensor, out: Tensor, stream: torch.cuda.Stream, programs: int) -> None:
        plan = self.plan
        plan(ids, out, stream=stream, out_of_range=self.out_of_range, cache=self.cache,
             num_programs=programs, block_rows=self.block_rows, num_warps=self.num_warps)
        if self._direct and plan._launched is not None and ids.shape[0] > 0:
            # The per-launch entries are left 0 here (no tensor of the caller's kept alive).
            args = plan.kernel_args(0, 0, self.out_of_range, self.cache, plan.meta, plan.meta,
                                    plan._launched_with, 0, (0, 0, 0), (0, 0), False, False)
            self._launches[ids.dtype] = _DirectLaunch(plan._launched, args, plan.head_dim)


class _DirectLaunch:
    """A compiled gather kernel and its positional argument list, of which a launch changes
    only the IDs', rows' and sizes' entries (_DIRECT_VARYING): the rest (the plan's metadata,
    the counter, the cache, the shard, the constexprs) is the same for every slot gather."""

    def __init__(self, kernel: Any, args: dict, head_dim: int) -> None:
        self.kernel, self.head_dim = kernel, head_dim
        names = _gather_kernel.arg_names
        self.args = [args[name] for name in names]
        self.at = [names.index(name) for name in _DIRECT_VARYING]

    def __call__(self, grid: int, stream: int, ids: Tensor, out: Tensor, n_items: int) -> None:
        args = self.args.copy()
        ids_t, ids_l, ids_h = ids.stride()
        out_l, out_t = out.stride(0) // self.head_dim, out.stride(1) // self.head_dim
        for at, value in zip(self.at, (ids.data_ptr(), out.data_ptr(), n_items, ids.shape[0],
                                       ids_t, ids_l, ids_h, out_l, out_t), strict=True):
            args[at] = value
        self.kernel[(grid, 1, 1)](*args, stream=stream)


# _DirectLaunch's arguments of one launch, in the order it fills them in.
_DIRECT_VARYING = ("ids_ptr", "out_ptr", "n_items", "tokens", "ids_stride_t", "ids_stride_l",
                   "ids_stride_h", "out_rows_l", "out_rows_t")


def layer_range_problem(layers: object, n_layers: int) -> str | None:
    """What a launch's `layers` must be, where they are not: a range of step 1 within the plan's."""
    if isinstance(layers, range) and layers.step == 1 and 0 <= layers.start < layers.stop <= n_layers:
        return None
    return f"a range of step 1 within range(0, {n_layers})"


def _leaders(ordered: Tensor, order: Tensor) -> Tensor:
    """For keys sorted as `ordered` = keys[order]: each item's first item of equal key."""
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    position = torch.arange(ordered.numel(), device=ordered.device)
    run_start = torch.where(starts, position, 0).cummax(0).values
    leaders = torch.empty_like(order, dtype=torch.int32)
    leaders[order] = order[run_start].to(torch.int32)
    return leaders


@dataclass(frozen=True)
class _Launch:
    grid: int
    n_items: int
    packed: bool
    block_rows: int
    num_warps: int
    layers: range


def gather(
    tables: Sequence[Tensor | LayerTable],
    ids: Tensor,
    shard: Shard,
    out: Tensor | None = None,
    packed: bool = False,
    num_programs: int | None = None,
    stream: torch.cuda.Stream | None = None,
) -> Tensor:
    """One-shot lookup: builds a GatherPlan on ids' device (a small host-to-device copy) and runs it.

    Same contract as gather_ref.gather, without the out-of-range count (see GatherPlan.__call__).
    """
    _require_triton()
    if not isinstance(ids, Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    plan = GatherPlan(tables, shard, ids.device)
    return plan(ids, out, packed=packed, num_programs=num_programs, stream=stream)


def _plan_device(device: torch.device | str | None) -> torch.device:
    if _kernel_is_interpreted():
        resolved = torch.device(device if device is not None else "cpu")
        if resolved.type != "cpu":
            raise ValueError(f"the Triton interpreter (TRITON_INTERPRET=1) runs on cpu, not {resolved}")
        return resolved
    if not torch.cuda.is_available():
        raise TritonUnavailableError(
            "no CUDA device: the Triton gather needs a GPU (or TRITON_INTERPRET=1 with CPU tensors)"
        )
    resolved = torch.device(device if device is not None else "cuda")
    if resolved.type != "cuda":
        raise ValueError(f"the Triton gather runs on a CUDA device, not {resolved}")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _common_row_bytes(tables: Sequence[LayerTable]) -> int:
    row_bytes = tables[0].row_bytes if tables else 0
    for i, table in enumerate(tables):
        if table.row_bytes != row_bytes:
            raise ValueError(f"tables[{i}] has row_bytes {table.row_bytes}, tables[0] {row_bytes}")
        if table.rows < 0 or (table.rows and table.address <= 0):
            raise ValueError(f"tables[{i}] has rows {table.rows} at address {table.address:#x}")
    head_dim_for(row_bytes)  # raises unless row_bytes = head_dim * 33 / 32
    return row_bytes


def _stage_meta(tables: Sequence[LayerTable], shard: Shard, device: torch.device) -> Tensor:
    rows = []
    for layer, (table, (lo, hi)) in enumerate(zip(tables, shard.row_ranges, strict=True)):
        if not 0 <= lo <= hi <= table.rows:
            raise ValueError(
                f"shard {shard.rank}/{shard.shards} owns rows [{lo}, {hi}) of layer {layer}, "
                f"but tables[{layer}] has {table.rows} rows"
            )
        rows.append([table.address, table.rows, lo, hi])  # _TABLE_ADDRESS, _TABLE_ROWS, _ROW_LO, _ROW_HI
    return torch.tensor(rows, dtype=torch.int64, device="cpu").reshape(-1, _META_COLUMNS).to(device)


_SM_COUNTS: dict[torch.device, int] = {}


def sorted_block_rows(n_items: int, programs: int) -> int:
    """Rows per block of a sorted lookup of `n_items` rows on a grid of `programs`.

    Sorted reads of host rows go faster in wider blocks once every program has many to do
    (benchmarks/results/h200/gather_pages.md, gather_grids.md: 16 GiB on an H200, alone on
    the GPU): at 66 programs (the daemon's half of the SMs) 4,096 tokens (2,979 rows a program)
    took 3.72-3.88 ms in blocks of 32 rows against 4.08-4.17 in blocks of 8; at 1,024 tokens (745 a program)
    32 rows were 8% slower, and at 132 programs 4,096 tokens (1,489) gained nothing. Beside a
    matmul wide blocks cost it more (unsorted, 66 programs: +24.3% against +9.8%; sm_cap_rows32.md,
    sm_cap.md); in the model step, where a mapped client's sorted lookup runs beside twelve
    matmuls, its step stayed 0.77-0.96 of the in-process one (model_step_grid_default.md)."""
    return WIDE_BLOCK_ROWS if n_items >= WIDE_FROM_ROWS * programs else DEFAULT_BLOCK_ROWS


def captured_block_rows(n_items: int, programs: int, sort: bool) -> int:
    """Rows per block of a captured lookup of `n_items` rows on a grid of at most `programs`.

    A lookup that one round of wide blocks covers takes them, on that many programs: a decode
    step's lookup is latency-bound, and the SMs its programs hold are SMs a matmul beside it
    cannot start on. At T = 16 (768 rows, 66 programs) blocks of 8 held 66 SMs for 46 us, and the
    lead matmul beside them ran 31 us longer than alone, where vLLM's two launches of 24 programs
    (16 rows a block) cost it 6 (medians; benchmarks/results/h200/2026-12-06/, pipelined traces). Larger
    lookups keep DEFAULT_BLOCK_ROWS (sorted: sorted_block_rows): once every program loops, wide
    blocks cost a matmul beside them about as much per row as narrow ones (sm_cap.md,
    sm_cap_rows32.md)."""
    if sort:
        return sorted_block_rows(n_items, programs)
    return WIDE_BLOCK_ROWS if n_items <= programs * WIDE_BLOCK_ROWS else DEFAULT_BLOCK_ROWS


def grid_programs(sms: int, sm_fraction: float) -> int:
    """Programs of a persistent grid on `sm_fraction` (clamped to [0, 1]) of `sms` SMs: at
    least one."""
    return max(1, int(sms * min(1.0, max(0.0, sm_fraction))))


def _default_programs(device: torch.device) -> int:
    """One program per SM; a couple of programs under the interpreter."""
    if device.type != "cuda":
        return 2
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]
