"""Reading Engram tables out of a DeepSeek-style safetensors checkpoint.

A checkpoint directory holds `config.json` (the Engram geometry, DeepSeek field names) and either
sharded safetensors files listed by `model.safetensors.index.json` or one `model.safetensors`.
Per Engram layer L it must hold `layers.{L}.engram.embed.weight` (F8_E4M3, [rows, head_dim]) and
`layers.{L}.engram.embed.scale` (F8_E8M0, [rows, head_dim / 32]).

Safetensors layout, as parsed here:

    +-------------------+----------------------------+-------------------------------------+
    | u64 LE: header_n  | header_n bytes JSON header | data section (tensor bytes, packed) |
    +-------------------+----------------------------+-------------------------------------+
    header: {"__metadata__": {...}?, name: {"dtype", "shape", "data_offsets": [begin, end]}}
    offsets are relative to the start of the data section, i.e. to byte 8 + header_n.

This module parses headers itself and reads tensor bytes with positional reads into caller
buffers, so that a 94 GiB table can be copied straight into its final (shared-memory) place in
bounded chunks. It is not a general safetensors reader: only the Engram tensors are looked at;
every other tensor in the shards is skipped without reading its bytes, and shards that hold no
Engram tensor are never opened. Everything is validated in `EngramCheckpoint.open`, so a bad
checkpoint fails before hours of loading rather than in the middle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engramd.client.geometry import GeometryError, TableGeometry

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_DTYPE = "F8_E4M3"
SCALE_DTYPE = "F8_E8M0"

# The safetensors reference implementation refuses headers above 100 MB; a larger length field
# means a corrupt or foreign file, and reading it would allocate that much memory.
MAX_HEADER_BYTES = 100 * 1000 * 1000
# Bytes of weight rows read per positional read in `read_packed`: large enough to stream at disk
# speed, small enough that the bounce buffer stays in cache while it is copied out.
READ_CHUNK_BYTES = 16 * 1024 * 1024


class CheckpointError(Exception):
    """A checkpoint is missing, malformed or inconsistent; the message names file and tensor."""


def weight_name(layer_id: int) -> str:
    """Tensor name of Engram layer `layer_id`'s FP8 table (backbone layer id, not index)."""
    return f"layers.{layer_id}.engram.embed.weight"


def scale_name(layer_id: int) -> str:
    """Tensor name of Engram layer `layer_id`'s UE8M0 scale table."""
    return f"layers.{layer_id}.engram.embed.scale"


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie: `nbytes` bytes at absolute byte `offset` of `path`."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardHeader:
    """A parsed shard header plus the file facts the fingerprint is made of."""

    path: Path
    size: int
    mtime_ns: int
    data_start: int
    entries: dict[str, Any]


def read_header(path: Path) -> ShardHeader:
    """Parse the header of safetensors file `path`; raise CheckpointError if it is malformed."""
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: truncated file: {stat.st_size} bytes, no header length")
            (header_len,) = struct.unpack("<Q", prefix)
            _check_header_len(path, header_len, stat.st_size)
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read safetensors header: {exc}") from exc
    if len(raw) < header_len:
        raise CheckpointError(f"{path}: truncated file: header ends before {header_len} bytes")
    try:
        entries = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: bad header: not valid JSON ({exc})") from exc
    if not isinstance(entries, dict):
        raise CheckpointError(f"{path}: bad header: expected a JSON object, got "
                              f"{type(entries).__name__}")
    return ShardHeader(path, stat.st_size, stat.st_mtime_ns, 8 + header_len, entries)


def _check_header_len(path: Path, header_len: int, file_size: int) -> None:
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: bad header: length field {header_len} exceeds "
                              f"{MAX_HEADER_BYTES} bytes (not a safetensors file?)")
    if 8 + header_len > file_size:
        raise CheckpointError(f"{path}: truncated file: header needs {8 + header_len} bytes, "
                              f"file has {file_size}")


def tensor_ref(shard: ShardHeader, name: str, dtype: str, shape: tuple[int, ...]) -> TensorRef:
    """The validated location of 1-byte-element tensor `name` in `shard`.

    Checks that the entry exists, is well formed, has exactly `dtype` and `shape`, and that its
    bytes lie inside the file.
    """
    where = f"{shard.path}: tensor {name!r}"
    entry = shard.entries.get(name)
    if entry is None:
        raise CheckpointError(f"{where}: missing from the shard's header")
    got_dtype, got_shape, (begin, end) = _parse_entry(where, entry)
    if got_dtype != dtype:
        raise CheckpointError(f"{where}: wrong dtype {got_dtype}, expected {dtype}")
    if got_shape != shape:
        raise CheckpointError(f"{where}: wrong shape {list(got_shape)}, expected {list(shape)}")
    nbytes = math.prod(shape)  # both Engram dtypes are one byte per element
    if end - begin != nbytes:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, "
                              f"shape {list(shape)} needs {nbytes}")
    if shard.data_start + end > shard.size:
        raise CheckpointError(f"{where}: truncated file: data ends at byte "
                              f"{shard.data_start + end}, file has {shard.size} bytes")
    return TensorRef(name, shard.path, shard.data_start + begin, nbytes, dtype, shape)


def _parse_entry(where: str, entry: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: bad header entry {entry!r}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: bad header entry: dtype {dtype!r}")
    if not (isinstance(shape, list) and all(_is_uint(d) for d in shape)):
        raise CheckpointError(f"{where}: bad header entry: shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: bad header entry: data_offsets {offsets!r}")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def load_weight_map(directory: Path, names: list[str]) -> dict[str, Path]:
    """Shard path of every tensor in `names`, from the index file or the single-file form."""
    index = directory / INDEX_FILE
    if index.exists():
        return _from_index(index, names)
    single = directory / SINGLE_FILE
    if single.exists():
        return {name: single for name in names}
    raise CheckpointError(f"{directory}: no {INDEX_FILE} and no {SINGLE_FILE}")


def _from_index(index: Path, names: list[str]) -> dict[str, Path]:
    try:
        doc = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: bad index json: {exc}") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: bad index json: no 'weight_map' object")
    out = {}
    for name in names:
        shard = weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{index}: tensor {name!r} is missing from weight_map")
        # Shard names are plain file names beside the index; anything else would let an index
        # point outside the checkpoint directory.
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise CheckpointError(f"{index}: tensor {name!r} maps to bad shard name {shard!r}")
        path = index.parent / shard
        if not path.is_file():
            raise CheckpointError(f"{index}: tensor {name!r} maps to shard file {shard!r}, "
                                  f"which does not exist")
        out[name] = path
    return out


class EngramCheckpoint:
    """The Engram tables of one checkpoint directory, validated, located and readable in rows.

    Holds no open files: every read opens and closes its shards, so the object needs no close()
    and may be shared between threads (reads of different ranges are independent).
    """

    def __init__(self, directory: Path, geometry: TableGeometry,
                 weights: tuple[TensorRef, ...], scales: tuple[TensorRef, ...],
                 shards: dict[Path, ShardHeader]):
        self.directory = directory
        self.geometry = geometry
        self._weights = weights
        self._scales = scales
        self._shards = shards

    @classmethod
    def open(cls, directory: str | Path) -> EngramCheckpoint:
        """Read config, index and shard headers of `directory`; validate every Engram tensor.

        A symlink in the path is resolved here, once: every later read goes to the files found
        now, so a link repointed meanwhile (a new revision put in place) cannot mix two
        checkpoints in one load. The next open follows the link anew."""
        directory = Path(directory).resolve()
        geometry = _read_geometry(directory / CONFIG_FILE)
        g = geometry
        names = [n for lid in g.layer_ids for n in (weight_name(lid), scale_name(lid))]
        paths = load_weight_map(directory, names)
        shards = {path: read_header(path) for path in dict.fromkeys(paths.values())}
        weights = tuple(
            tensor_ref(shards[paths[weight_name(lid)]], weight_name(lid), WEIGHT_DTYPE,
                       (g.rows[i], g.head_dim))
            for i, lid in enumerate(g.layer_ids))
        scales = tuple(
            tensor_ref(shards[paths[scale_name(lid)]], scale_name(lid), SCALE_DTYPE,
                       (g.rows[i], g.scale_bytes))
            for i, lid in enumerate(g.layer_ids))
        return cls(directory, geometry, weights, scales, shards)

    def files(self) -> list[Path]:
        """The files that decide what it is: config, index and single-file form (whichever
        exist: one appearing changes it too), and the shards that hold its Engram tensors."""
        return [self.directory / CONFIG_FILE, self.directory / INDEX_FILE,
                self.directory / SINGLE_FILE, *sorted(self._shards)]

    def weight(self, layer_index: int) -> TensorRef:
        """The FP8 table of the layer at position `layer_index` of `geometry.layer_ids`."""
        return self._weights[self._check_layer(layer_index)]

    def scale(self, layer_index: int) -> TensorRef:
        """The UE8M0 scale table of the layer at position `layer_index`."""
        return self._scales[self._check_layer(layer_index)]

    def fingerprint(self) -> str:
        """A 16-hex-digit id of the tables' identity, stable while the files are untouched.

        Made of the geometry and, per Engram tensor, its shard's file name, size and mtime (as
        seen by `open`) and the tensor's offset, dtype and shape. Hashing 189 GiB of content
        would take minutes; rewriting a shard changes its mtime, so this is the cheap stand-in.
        The directory path is left out so that a copied checkpoint (mtimes kept) keeps its id.
        What it cannot see: another revision whose files carry the same names, sizes and mtimes
        (`touch -r`, `cp -p`, an image built with fixed timestamps). A reload compares sampled
        rows where the ids agree (server/reload.py), and a start self-checks re-attached tables.
        """
        digest = hashlib.sha256()
        digest.update(json.dumps(self.geometry.to_config(), sort_keys=True).encode())
        for ref in self._weights + self._scales:
            shard = self._shards[ref.path]
            fields = [ref.name, ref.path.name, shard.size, shard.mtime_ns, ref.offset,
                      ref.dtype, list(ref.shape)]
            digest.update(json.dumps(fields).encode())
        return digest.hexdigest()[:16]

    def read_packed(self, layer_index: int, row_start: int, out: np.ndarray) -> None:
        """Fill uint8 `out` [n, row_bytes] with packed rows row_start..row_start+n of a layer.

        Columns [0, head_dim) get the FP8 weight bytes and [head_dim, row_bytes) the scale
        bytes. `out` may be any writable view (e.g. a slice of a shared-memory table); the
        bytes go through a small bounce buffer because a packed row interleaves two tensors.
        """
        n = self._check_read(layer_index, row_start, out)
        if n == 0:
            return
        head_dim = self.geometry.head_dim
        weight, scale = self._weights[layer_index], self._scales[layer_index]
        step = max(1, min(n, READ_CHUNK_BYTES // head_dim))
        weight_buf = np.empty((step, head_dim), dtype=np.uint8)
        scale_buf = np.empty((step, self.geometry.scale_bytes), dtype=np.uint8)
        with _open_fd(weight) as weight_fd, _open_fd(scale) as scale_fd:
            for lo in range(0, n, step):
                k = min(step, n - lo)
                row = row_start + lo
                _pread_into(weight_fd, weight_buf[:k], weight, row * head_dim)
                _pread_into(scale_fd, scale_buf[:k], scale, row * self.geometry.scale_bytes)
                out[lo:lo + k, :head_dim] = weight_buf[:k]
                out[lo:lo + k, head_dim:] = scale_buf[:k]

    def _check_layer(self, layer_index: int) -> int:
        if not 0 <= layer_index < self.geometry.n_layers:
            raise IndexError(f"layer index {layer_index} outside [0, {self.geometry.n_layers}) "
                             f"(layer ids {list(self.geometry.layer_ids)})")
        return layer_index

    def _check_read(self, layer_index: int, row_start: int, out: np.ndarray) -> int:
        self._check_layer(layer_index)
        row_bytes = self.geometry.row_bytes
        if out.dtype != np.uint8 or out.ndim != 2 or out.shape[1] != row_bytes:
            raise ValueError(f"out must be uint8 [n, {row_bytes}], got {out.dtype} "
                             f"{list(out.shape)}")
        if not out.flags.writeable:
            raise ValueError("out is read-only")
        rows = self.geometry.rows[layer_index]
        n = out.shape[0]
        if row_start < 0 or row_start + n > rows:
            raise IndexError(f"rows [{row_start}, {row_start + n}) outside layer "
                             f"{self.geometry.layer_ids[layer_index]}'s [0, {rows})")
        return n


def _read_geometry(config: Path) -> TableGeometry:
    if not config.is_file():
        raise CheckpointError(f"{config}: missing {CONFIG_FILE}")
    try:
        return TableGeometry.from_file(config)
    except GeometryError as exc:
        raise CheckpointError(str(exc)) from exc


@contextmanager
def _open_fd(ref: TensorRef) -> Iterator[int]:
    try:
        fd = os.open(ref.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"{ref.path}: tensor {ref.name!r}: cannot open: {exc}") from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _pread_into(fd: int, buf: np.ndarray, ref: TensorRef, rel_offset: int) -> None:
    """Fill contiguous `buf` from byte `rel_offset` of tensor `ref`'s data, or raise."""
    view = memoryview(buf).cast("B")  # type: ignore[arg-type]  # numpy: a buffer on 3.12+
    if rel_offset + len(view) > ref.nbytes:  # guarded by _check_read; kept as a last defence
        raise CheckpointError(f"{ref.path}: tensor {ref.name!r}: read of {len(view)} bytes at "
                              f"{rel_offset} passes its {ref.nbytes} bytes")
    done = 0
    while done < len(view):
        # A positional read may return fewer bytes than asked (signals, >2 GiB requests).
        got = os.preadv(fd, [view[done:]], ref.offset + rel_offset + done)
        if got == 0:
            raise CheckpointError(
                f"{ref.path}: tensor {ref.name!r}: truncated file: ended at byte "
                f"{ref.offset + rel_offset + done}, expected {ref.offset + ref.nbytes}")
        done += got
