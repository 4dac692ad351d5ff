"""Synthetic Engram checkpoints: random tables in the DeepSeek safetensors layout.

Used where the real weights are not at hand (CI, benchmarks, the demo geometry) and by tests as a
source of tables whose every byte is known. `write_synthetic_checkpoint` writes `config.json`,
several safetensors shards and `model.safetensors.index.json`, streaming rows chunk by chunk so
that even the 189 GiB V4.1-Flash geometry is written in bounded memory. One shard also holds a
non-Engram tensor and one holds only non-Engram tensors, so readers must skip what is not theirs.

Values: weight bytes are uniform over the 254 FP8 E4M3 bit patterns that are not NaN (0x7F and
0xFF excluded); scale bytes are uniform in 127 +- 20 (scales 2^-20 .. 2^20, never the 0xFF NaN),
one per block of 32 values, so a wrong row, a wrong scale block or a wrong dequantization shows.
Every byte depends only on (seed, layer id, row): rows are generated in fixed blocks of
`BLOCK_ROWS`, each from its own generator, whatever chunk size the writer uses.

This module writes checkpoints; it does not read them (server/checkpoint.py does).
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engramd.client.geometry import TableGeometry
from engramd.server.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    SCALE_DTYPE,
    WEIGHT_DTYPE,
    CheckpointError,
    scale_name,
    weight_name,
)

BLOCK_ROWS = 4096  # rows per generator; part of the data's definition, do not change
DEFAULT_CHUNK_ROWS = 1 << 18  # 64 MiB of 256-byte weight rows per write
SCALE_CENTER = 127
SCALE_SPREAD = 20
MODEL_TYPE = "deepseek_v4"

_WEIGHT_STREAM, _SCALE_STREAM, _OTHER_STREAM = 0, 1, 2
_METADATA_MARGIN = 1 << 20  # room for config.json and the index beside the shards

Progress = Callable[[int, int], None]
# Makes one block of BLOCK_ROWS rows of `width` bytes from its generator, with a scratch buffer.
_BlockFn = Callable[[np.random.Generator, int, np.ndarray], np.ndarray]


class DiskSpaceError(CheckpointError):
    """The target file system has too little free space for the checkpoint."""


def synthetic_packed_rows(geometry: TableGeometry, layer_index: int, row_start: int,
                          row_stop: int, seed: int = 0,
                          out: np.ndarray | None = None) -> np.ndarray:
    """Packed rows [row_start, row_stop) of a layer as the writer writes them: uint8 [n, 264].

    With `out` (uint8 [n, row_bytes], e.g. a slice of a shared-memory table) the rows are
    generated straight into it, so a table can be filled without any checkpoint on disk.
    Calls share no state and may run in parallel threads over disjoint ranges.
    """
    layer_id = geometry.layer_ids[layer_index]
    if not 0 <= row_start <= row_stop <= geometry.rows[layer_index]:
        raise IndexError(f"rows [{row_start}, {row_stop}) outside layer {layer_id}'s "
                         f"[0, {geometry.rows[layer_index]})")
    shape = (row_stop - row_start, geometry.row_bytes)
    if out is None:
        out = np.empty(shape, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.shape != shape:
        raise ValueError(f"out must be uint8 {list(shape)}, got {out.dtype} {list(out.shape)}")
    head_dim = geometry.head_dim
    _weight_rows(seed, layer_id, head_dim, row_start, row_stop, out[:, :head_dim])
    _scale_rows(seed, layer_id, geometry.scale_bytes, row_start, row_stop, out[:, head_dim:])
    return out


def _block_rng(seed: int, layer_id: int, stream: int, block: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, layer_id, stream, block]))


def _weight_block(rng: np.random.Generator, width: int, scratch: np.ndarray) -> np.ndarray:
    # Full-range 64-bit draws are several times faster than bounded byte draws; the ~0.8% of
    # bytes that land on a NaN pattern are redrawn uniformly from the 254 valid ones, which
    # keeps the result exactly uniform over the valid patterns. The mask goes into a reused
    # scratch buffer: a fresh 1 MiB temporary per block halves the speed (page faults).
    words = rng.integers(0, 2**64 - 1, size=BLOCK_ROWS * width // 8, dtype=np.uint64,
                         endpoint=True)
    block = words.astype("<u8", copy=False).view(np.uint8)
    np.bitwise_or(block, 0x80, out=scratch)
    nan = np.equal(scratch, 0xFF, out=scratch.view(np.bool_))
    where = np.flatnonzero(nan)
    if where.size:
        redraw = rng.integers(0, 254, size=where.size, dtype=np.uint8)
        redraw += redraw >= 0x7F  # 0..253 -> every byte but 0x7F and 0xFF
        block[where] = redraw
    return block.reshape(BLOCK_ROWS, width)


def _scale_block(rng: np.random.Generator, width: int, scratch: np.ndarray) -> np.ndarray:
    return rng.integers(SCALE_CENTER - SCALE_SPREAD, SCALE_CENTER + SCALE_SPREAD,
                        size=(BLOCK_ROWS, width), dtype=np.uint8, endpoint=True)


def _block_rows(stream: int, make: _BlockFn, seed: int, layer_id: int, width: int,
                start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        out = np.empty((stop - start, width), dtype=np.uint8)
    scratch = np.empty(BLOCK_ROWS * width, dtype=np.uint8)
    for block in range(start // BLOCK_ROWS, -(-stop // BLOCK_ROWS)):
        lo = block * BLOCK_ROWS
        data = make(_block_rng(seed, layer_id, stream, block), width, scratch)
        a, z = max(start, lo), min(stop, lo + BLOCK_ROWS)
        out[a - start:z - start] = data[a - lo:z - lo]
    return out


def _weight_rows(seed: int, layer_id: int, width: int, start: int, stop: int,
                 out: np.ndarray | None = None) -> np.ndarray:
    return _block_rows(_WEIGHT_STREAM, _weight_block, seed, layer_id, width, start, stop, out)


def _scale_rows(seed: int, layer_id: int, width: int, start: int, stop: int,
                out: np.ndarray | None = None) -> np.ndarray:
    return _block_rows(_SCALE_STREAM, _scale_block, seed, layer_id, width, start, stop, out)


@dataclass(frozen=True)
class _Tensor:
    """One tensor to write: its header fields and a function giving rows [start, stop) as bytes."""

    name: str
    dtype: str
    shape: tuple[int, int]
    itemsize: int
    rows_fn: Callable[[int, int], np.ndarray]

    @property
    def row_nbytes(self) -> int:
        return self.shape[1] * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_nbytes


def _engram_tensor(geometry: TableGeometry, layer_index: int, seed: int, scale: bool) -> _Tensor:
    layer_id, rows = geometry.layer_ids[layer_index], geometry.rows[layer_index]
    if scale:
        width = geometry.scale_bytes
        return _Tensor(scale_name(layer_id), SCALE_DTYPE, (rows, width), 1,
                       lambda a, z: _scale_rows(seed, layer_id, width, a, z))
    width = geometry.head_dim
    return _Tensor(weight_name(layer_id), WEIGHT_DTYPE, (rows, width), 1,
                   lambda a, z: _weight_rows(seed, layer_id, width, a, z))


def _bf16_tensor(name: str, shape: tuple[int, int], seed: int) -> _Tensor:
    """A small non-Engram BF16 tensor (normal values), there only to be skipped by readers."""

    def rows_fn(start: int, stop: int) -> np.ndarray:
        rng = _block_rng(seed, zlib.crc32(name.encode()), _OTHER_STREAM, 0)
        values = rng.standard_normal(shape, dtype=np.float32)[start:stop]
        # BF16 is the top half of a float32; store little-endian as safetensors requires.
        halves = (values.view(np.uint32) >> 16).astype("<u2")
        return halves.view(np.uint8).reshape(stop - start, shape[1] * 2)

    return _Tensor(name, "BF16", shape, 2, rows_fn)


def _shard_plan(geometry: TableGeometry, seed: int) -> list[list[_Tensor]]:
    """The tensors of each shard, in file order.

    The first shard puts an attention weight before the first Engram table (so that table does
    not start at data offset 0); each other Engram tensor gets a shard of its own; the last shard
    holds only non-Engram tensors, one with an `engram` name that is not a table.
    """
    n = geometry.n_layers
    first_layer = geometry.layer_ids[0]
    shards = [[_bf16_tensor("layers.0.attn.wq.weight", (64, 128), seed),
               _engram_tensor(geometry, 0, seed, scale=False)]]
    shards += [[_engram_tensor(geometry, i, seed, scale=False)] for i in range(1, n)]
    shards += [[_engram_tensor(geometry, i, seed, scale=True)] for i in range(n)]
    shards.append([_bf16_tensor(f"layers.{first_layer}.engram.gate.weight", (16, 256), seed),
                   _bf16_tensor("embed.weight", (128, 64), seed)])
    return shards


def _shard_header(tensors: list[_Tensor]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
    return len(raw).to_bytes(8, "little") + raw


def _check_free_space(out_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise DiskSpaceError(
            f"{out_dir}: synthetic checkpoint needs {needed} bytes ({needed / 2**30:.2f} GiB), "
            f"only {free} bytes ({free / 2**30:.2f} GiB) are free")


class _Counter:
    """Bytes written so far, reported to the caller's progress callback."""

    def __init__(self, total: int, progress: Progress | None):
        self.done, self.total, self.progress = 0, total, progress

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)


def _write_shard(path: Path, header: bytes, tensors: list[_Tensor], chunk_rows: int,
                 counter: _Counter) -> None:
    # Written under a temporary name and renamed when complete, so an interrupted run never
    # leaves a shard that looks whole.
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(header)
            for t in tensors:
                for lo in range(0, t.shape[0], chunk_rows):
                    chunk = t.rows_fn(lo, min(t.shape[0], lo + chunk_rows))
                    f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))  # type: ignore[arg-type]  # numpy: a buffer on 3.12+
                    counter.add(chunk.nbytes)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _write_json(path: Path, doc: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(partial, path)


def write_synthetic_checkpoint(geometry: TableGeometry, out_dir: str | Path, seed: int = 0,
                               progress: Progress | None = None,
                               chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Path:
    """Write a random checkpoint of `geometry` into `out_dir` (created if needed); return it.

    `progress(done_bytes, total_bytes)` is called after each written chunk. Raises DiskSpaceError
    before writing anything if the file system lacks room. The index and config are written
    last, so a directory with both holds complete shards.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = _shard_plan(geometry, seed)
    headers = [_shard_header(tensors) for tensors in plan]
    data_bytes = sum(t.nbytes for tensors in plan for t in tensors)
    _check_free_space(out_dir, data_bytes + sum(map(len, headers)) + _METADATA_MARGIN)
    counter = _Counter(data_bytes, progress)
    weight_map = {}
    for number, (tensors, header) in enumerate(zip(plan, headers, strict=True), start=1):
        name = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        _write_shard(out_dir / name, header, tensors, chunk_rows, counter)
        weight_map.update({t.name: name for t in tensors})
    _write_json(out_dir / INDEX_FILE,
                {"metadata": {"total_size": data_bytes}, "weight_map": weight_map})
    config = {"model_type": MODEL_TYPE, **geometry.to_config(), "engramd_synthetic_seed": seed}
    _write_json(out_dir / CONFIG_FILE, config)
    return out_dir


def total_checkpoint_bytes(geometry: TableGeometry) -> int:
    """Bytes of tensor data a synthetic checkpoint of `geometry` holds (for progress displays)."""
    return sum(t.nbytes for tensors in _shard_plan(geometry, 0) for t in tensors)

