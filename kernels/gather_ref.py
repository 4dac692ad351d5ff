"""Gather + dequantize of Engram table rows in plain torch: the reference, and the CPU kernel.

A layer's table is uint8 ``[rows, row_bytes]``; a row is ``head_dim`` FP8 E4M3 bytes followed by
``head_dim / 32`` UE8M0 scale bytes, one per block of 32 values (256 + 8 = 264 bytes for V4.1).
A lookup takes hash IDs ``[T, n_layers, heads]`` and, for one head-wise shard, returns per layer
``[T, local_heads, head_dim]`` BF16 (or the packed bytes ``[T, local_heads, row_bytes]``), with
zero rows for ``DEAD_ID``, for IDs outside the rows the shard owns, and for padded heads.

This module is the oracle the GPU kernel is tested against and the kernel of the CPU backend. It
runs on any torch device but is written for clarity, not speed; it knows nothing of pinned memory,
streams or slabs.

Why the dequantization is exact: ``bf16(float32(e4m3) * 2^(s - 127))``. An E4M3 value has at most
4 significant bits and lies in [2^-9, 448], so for every scale byte s in 0..254 its product with
2^(s - 127) is a multiple of 2^-136 and either below 2^128 (then exact in float32, whose subnormals
reach 2^-149) or at least 2^128 (then float32 rounds it to inf, which is also the correctly rounded
result). BF16 holds 8 significant bits over float32's exponent range, so the final rounding changes
nothing except below 2^-126, where BF16's subnormal step is 2^-133; there round-to-nearest-even
applies. The result is therefore the single correctly rounded BF16 value of the exact product,
which any other exact implementation (the Triton kernel, a float64 test oracle) reproduces. Scale
byte 0 means 2^-127, a float32 subnormal (bit pattern 0x00400000), not the 0.0 that the shortcut
``bitcast(s << 23)`` would give; scale byte 255 is UE8M0's NaN, as in ``torch.float8_e8m0fnu``.
This relies on float32 arithmetic that keeps subnormals, which is torch's default
(``torch.set_flush_denormal(True)`` would flush products for scale bytes below about 10).
NaN inputs (E4M3 bytes 0x7F/0xFF, scale byte 255) give NaN; its bit pattern is not part of the
contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from engramd.kernels.contract import DEAD_ID, SCALE_BLOCK, Shard

# Rows dequantized per step: bounds the float32 temporaries (16 Ki rows x 256 x 4 B = 16 MiB)
# whatever T is; a prefill chunk of 16 Ki tokens x 24 heads is 384 Ki rows.
CHUNK_ROWS = 16384

_ID_DTYPES = (torch.int32, torch.int64)
_SCALE_ONE = 127  # UE8M0 exponent bias
_SCALE_NAN = 255  # UE8M0 has no inf; 0xFF is NaN
_F32_SCALE_ZERO_BITS = 0x00400000  # 2^-127 as float32: a subnormal
_F32_NAN_BITS = 0x7FC00000


def row_bytes_for(head_dim: int) -> int:
    """Bytes of one packed row: head_dim FP8 bytes then one scale byte per 32 values."""
    if head_dim <= 0 or head_dim % SCALE_BLOCK:
        raise ValueError(f"head_dim must be a positive multiple of {SCALE_BLOCK}, got {head_dim}")
    return head_dim + head_dim // SCALE_BLOCK


def head_dim_for(row_bytes: int) -> int:
    """Inverse of row_bytes_for: row_bytes = 33/32 * head_dim."""
    head_dim, rest = divmod(row_bytes * SCALE_BLOCK, SCALE_BLOCK + 1)
    if rest or head_dim <= 0 or head_dim % SCALE_BLOCK:
        raise ValueError(
            f"row_bytes {row_bytes} is not head_dim + head_dim/{SCALE_BLOCK} for any head_dim"
        )
    return head_dim


def scale_factors(scale_bytes: Tensor) -> Tensor:
    """UE8M0 bytes -> float32 2^(s - 127), built from bits (exact; 0 -> 2^-127, 255 -> NaN)."""
    s = scale_bytes.to(torch.int32)
    bits = torch.where(s == 0, _F32_SCALE_ZERO_BITS, s << 23)
    bits = torch.where(s == _SCALE_NAN, _F32_NAN_BITS, bits)
    return bits.view(torch.float32)


def dequantize_rows(packed: Tensor, head_dim: int) -> Tensor:
    """Packed rows uint8 [..., row_bytes] -> bf16 [..., head_dim] (see the module docstring)."""
    row_bytes = row_bytes_for(head_dim)
    if not isinstance(packed, Tensor):
        raise TypeError(f"packed rows must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed rows must be uint8, got {packed.dtype}")
    if packed.dim() < 1 or packed.shape[-1] != row_bytes:
        raise ValueError(
            f"packed rows must have last dimension {row_bytes} for head_dim {head_dim}, "
            f"got shape {tuple(packed.shape)}"
        )
    weights = packed[..., :head_dim].view(torch.float8_e4m3fn).to(torch.float32)
    scales = scale_factors(packed[..., head_dim:])
    blocks = weights.unflatten(-1, (head_dim // SCALE_BLOCK, SCALE_BLOCK))
    return (blocks * scales.unsqueeze(-1)).to(torch.bfloat16).flatten(-2)


def differing_values(actual: Tensor, expected: Tensor) -> Tensor:
    """Where two BF16 tensors differ bit for bit, except that NaN equals NaN: a NaN's sign and
    payload are not part of the contract (above). For scale byte 255 this reference's NaN is
    0xFFFF on an x86 CPU, the Triton kernel's 0x7FC0; every comparison of served rows with
    rows dequantized here (the daemon's self-check, an engine plugin's checkpoint sample) needs it."""
    nan = torch.isnan(actual)
    return (nan != torch.isnan(expected)) | (~nan & (actual.view(torch.int16) != expected.view(torch.int16)))


def gather_layer(
    table: Tensor,
    ids: Tensor,
    head_start: int,
    head_end: int,
    local_heads: int,
    row_lo: int,
    row_hi: int,
    out: Tensor | None = None,
) -> tuple[Tensor, int]:
    """Dequantized rows of one layer for one shard: (bf16 [T, local_heads, head_dim], out_of_range).

    `ids` is [T, heads] (int32/int64, row indices into `table`); local head j reads column
    head_start + j. A row is zero when its ID is DEAD_ID, lies outside [row_lo, row_hi), or j is a
    padded head (j >= head_end - head_start). `out_of_range` counts the owned-head IDs that are not
    DEAD_ID and lie outside [0, rows) of the table: malformed input, reported for statistics.
    """
    return _gather_layer(table, ids, head_start, head_end, local_heads, row_lo, row_hi, out, False)


def gather_packed_layer(
    table: Tensor,
    ids: Tensor,
    head_start: int,
    head_end: int,
    local_heads: int,
    row_lo: int,
    row_hi: int,
    out: Tensor | None = None,
) -> Tensor:
    """Like gather_layer, but the raw rows: uint8 [T, local_heads, row_bytes], zeros where masked."""
    packed, _ = _gather_layer(
        table, ids, head_start, head_end, local_heads, row_lo, row_hi, out, True
    )
    return packed


def gather(
    tables: Sequence[Tensor],
    ids: Tensor,
    shard: Shard,
    out: Tensor | None = None,
    packed: bool = False,
) -> tuple[Tensor, int]:
    """All layers for one shard: ([n_layers, T, local_heads, head_dim or row_bytes], out_of_range).

    `tables[l]` is layer l's uint8 table, `ids` is [T, n_layers, heads]; the shard's head range and
    per-layer row ranges decide what is returned (see gather_layer). The output is bf16, or uint8
    packed rows when `packed`. `out_of_range` is summed over layers.
    """
    n_layers = _check_tables(tables, len(shard.row_ranges))
    _check_ids(ids, dims=3, name="ids [T, n_layers, heads]")
    if ids.shape[1] != n_layers:
        raise ValueError(
            f"ids [T, n_layers, heads] has {ids.shape[1]} layers but {n_layers} tables were given"
        )
    row_bytes = tables[0].shape[1]
    width = row_bytes if packed else head_dim_for(row_bytes)
    shape = (n_layers, ids.shape[0], shard.local_heads, width)
    out = _output(out, shape, torch.uint8 if packed else torch.bfloat16, tables[0].device)
    bad = 0
    for layer, table in enumerate(tables):
        lo, hi = shard.row_ranges[layer]
        _, count = _gather_layer(
            table, ids[:, layer], shard.head_start, shard.head_end, shard.local_heads,
            lo, hi, out[layer], packed,
        )
        bad += count
    return out, bad


def _gather_layer(
    table: Tensor,
    ids: Tensor,
    head_start: int,
    head_end: int,
    local_heads: int,
    row_lo: int,
    row_hi: int,
    out: Tensor | None,
    packed: bool,
) -> tuple[Tensor, int]:
    _check_table(table, "table")
    _check_ids(ids, dims=2, name="ids [T, heads]")
    rows, row_bytes = table.shape
    _check_shard_args(ids.shape[1], head_start, head_end, local_heads, row_lo, row_hi, rows)
    if ids.device != table.device:
        raise ValueError(f"ids are on {ids.device} but the table is on {table.device}")
    width = row_bytes if packed else head_dim_for(row_bytes)
    shape = (ids.shape[0], local_heads, width)
    out = _output(out, shape, torch.uint8 if packed else torch.bfloat16, table.device)
    out.zero_()
    owned = ids[:, head_start:head_end]
    bad = 0
    step = max(1, CHUNK_ROWS // max(1, owned.shape[1]))
    for t0 in range(0, owned.shape[0], step):
        chunk = owned[t0:t0 + step].to(torch.int64)
        bad += int(((chunk != DEAD_ID) & ((chunk < 0) | (chunk >= rows))).sum())
        keep = (chunk >= row_lo) & (chunk < row_hi)
        found = table[chunk[keep]]
        view = out[t0:t0 + step, :owned.shape[1]]
        view[keep] = found if packed else dequantize_rows(found, width)
    return out, bad


def _check_table(table: object, name: str) -> None:
    if not isinstance(table, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 [rows, row_bytes], got dtype {table.dtype}")
    if table.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, row_bytes], got shape {tuple(table.shape)}")
    head_dim_for(table.shape[1])


def _check_tables(tables: Sequence[Tensor], n_layers: int) -> int:
    if isinstance(tables, Tensor) or len(tables) != n_layers:
        got = "a single tensor" if isinstance(tables, Tensor) else f"{len(tables)} tables"
        raise ValueError(f"expected a sequence of {n_layers} tables (one per layer), got {got}")
    for layer, table in enumerate(tables):
        _check_table(table, f"tables[{layer}]")
        if table.shape[1] != tables[0].shape[1] or table.device != tables[0].device:
            raise ValueError(
                f"tables[{layer}] has row_bytes {table.shape[1]} on {table.device}, but tables[0] "
                f"has {tables[0].shape[1]} on {tables[0].device}"
            )
    return n_layers


def _check_ids(ids: object, dims: int, name: str) -> None:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {ids.dtype}")
    if ids.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(ids.shape)}")


def _check_shard_args(
    heads: int, head_start: int, head_end: int, local_heads: int, lo: int, hi: int, rows: int
) -> None:
    if not 0 <= head_start <= head_end <= heads:
        raise ValueError(f"head range [{head_start}, {head_end}) is not inside [0, {heads})")
    if local_heads < head_end - head_start:
        raise ValueError(
            f"local_heads {local_heads} is less than the {head_end - head_start} owned heads"
        )
    if not 0 <= lo <= hi <= rows:
        raise ValueError(f"row range [{lo}, {hi}) is not inside the table's [0, {rows})")


def _output(out: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out must be {dtype}, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    if out.device != torch.device(device):
        raise ValueError(f"out is on {out.device} but the table is on {device}")
    return out
