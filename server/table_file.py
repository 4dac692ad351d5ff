"""One table file: the on-disk format of a layer's table, and its mapping (`HostTable`).

What this is: the daemon's copy of each layer's packed table (`row_bytes` bytes a row: the FP8
values, then the UE8M0 scales) in a file under a shared-memory directory (/dev/shm, or a hugetlbfs
mount), mapped MAP_SHARED so that a GPU backend can later pin the pages in place with
cudaHostRegister; how such a file is laid out, created and filled from a source, and checked
before it is mapped again. Little-endian:

    0              header: fixed struct `_HEADER`, then the CRC32 of that struct
    data_offset    rows * row_bytes packed bytes; data_offset is a multiple of 4096 and of the
                   directory's block size (the huge page size on hugetlbfs)
    ...            zero padding up to a multiple of the block size

A file is usable only when its header says `complete`. That header is written after the data is
filled and flushed, so a daemon killed mid-load leaves a file that the next start sees as
incomplete and removes.

What this is not: the store of an instance's files, which decides which files exist, holds the
instance's lock and removes what is stale (host_tables.py); a checkpoint reader (the source
object fills the rows); the GPU registration (server/table_registration.py).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engramd.client.geometry import TableGeometry
from engramd.server.units import size

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("engramd.tables")

MAGIC = b"ENGRAMD\x01"
FORMAT_VERSION = 1
STATE_LOADING = 1
STATE_COMPLETE = 2
HEADER_BYTES = 4096
PAGE_BYTES = 4096
# The daemon writes, its group may read (inspection tools). A client running as the daemon's own
# user could change the rows whatever the mode (an owner may chmod through any descriptor): run
# the daemon as a user of its own (README, "Who may register").
FILE_MODE = 0o640

# Re-attach verifies a sampled checksum, not a full one. Reading 94 GiB per layer again at a
# restart would cost tens of seconds and defeat the point of re-attaching; 256 blocks of 64 KiB
# (plus the first and last rows) cost 16 MiB of reads, a few milliseconds. What it catches: a
# file filled from other data, a zeroed or shifted data section, a truncation the size check
# missed, an overwrite of any sizeable region. What it misses: a change confined to the bytes
# between samples (one 64 KiB block about every 380 MiB at V4.1 size). The files live in RAM and
# are written only by this module, so a torn load (guarded by the completion mark) and a foreign
# writer are the realistic failures; bit rot is left to ECC memory. Tables smaller than the sample
# budget are checksummed in full.
SAMPLE_BLOCKS = 256
SAMPLE_BLOCK_BYTES = 64 << 10
_MAX_SAMPLE_BYTES = 1 << 32  # bound on sample settings read back from a header

# magic, version, state, layer_index, layer_id, rows, row_bytes, data_offset, checksum,
# sample_blocks, sample_block_bytes, fingerprint (ASCII, NUL padded), created (unix s), pid
_HEADER = struct.Struct("<8sIIIIQIQIII128sdQ")
_HEADER_CRC = struct.Struct("<I")
_HEADER_LEN = _HEADER.size + _HEADER_CRC.size
assert _HEADER_LEN <= HEADER_BYTES


class TableStoreError(Exception):
    """A table file or the store directory is unusable; the message names the path."""


class InsufficientSpaceError(TableStoreError):
    """The shared-memory directory has too little free space for the tables to create."""


class TableSource(Protocol):
    """What the store loads from (the checkpoint reader, or a fake in tests)."""

    geometry: TableGeometry

    def fingerprint(self) -> str: ...

    def read_packed(self, layer_index: int, row_start: int, out: np.ndarray) -> None: ...


@dataclass(frozen=True)
class LoadProgress:
    """Progress of one layer's table: filled from the source, or re-attached (done at once)."""

    layer_index: int
    done_bytes: int
    total_bytes: int
    seconds: float
    reattached: bool

    @property
    def gbps(self) -> float:
        """Bytes per second so far, in GB/s (10^9)."""
        return self.done_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0


ProgressFn = Callable[[LoadProgress], None]


class InvalidFile(Exception):
    """A table file may not be re-attached; the message is the reason, logged at removal."""


@dataclass(frozen=True)
class FileLayout:
    """Where one layer's table lives and how its file is laid out."""

    layer_index: int
    layer_id: int
    rows: int
    row_bytes: int
    data_offset: int
    file_size: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def file_layouts(geometry: TableGeometry, shm_dir: Path) -> list[FileLayout]:
    """Every layer's layout for files in `shm_dir` (aligned to its block size)."""
    align = _alignment(os.statvfs(shm_dir))
    return [_layout(geometry, index, align) for index in range(geometry.n_layers)]


def _layout(geometry: TableGeometry, index: int, align: int) -> FileLayout:
    data_offset = _round_up(HEADER_BYTES, align)
    nbytes = geometry.rows[index] * geometry.row_bytes
    return FileLayout(index, geometry.layer_ids[index], geometry.rows[index], geometry.row_bytes,
                   data_offset, _round_up(data_offset + nbytes, align))


def _alignment(st: os.statvfs_result) -> int:
    """Data offset and file size granule: the block size if it is a page multiple, else a page.

    On hugetlbfs the block size is the huge page size, and a mapping must cover whole huge pages.
    """
    block = int(st.f_bsize)
    if block >= PAGE_BYTES and block % PAGE_BYTES == 0 and block & (block - 1) == 0:
        return block
    return PAGE_BYTES


@dataclass(frozen=True)
class _Header:
    state: int
    layer_index: int
    layer_id: int
    rows: int
    row_bytes: int
    data_offset: int
    checksum: int
    sample_blocks: int
    sample_block_bytes: int
    fingerprint: str
    created: float
    pid: int

    def pack(self) -> bytes:
        body = _HEADER.pack(MAGIC, FORMAT_VERSION, self.state, self.layer_index, self.layer_id,
                            self.rows, self.row_bytes, self.data_offset, self.checksum,
                            self.sample_blocks, self.sample_block_bytes,
                            self.fingerprint.encode("ascii"), self.created, self.pid)
        return body + _HEADER_CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, raw: bytes) -> _Header:
        if len(raw) < _HEADER_LEN:
            raise InvalidFile(f"header truncated to {len(raw)} bytes")
        body = raw[:_HEADER.size]
        (magic, version, state, layer_index, layer_id, rows, row_bytes, data_offset, checksum,
         blocks, block_bytes, fingerprint, created, pid) = _HEADER.unpack(body)
        if magic != MAGIC:
            raise InvalidFile(f"no table header (magic {magic!r}, expected {MAGIC!r})")
        (crc,) = _HEADER_CRC.unpack_from(raw, _HEADER.size)
        if crc != zlib.crc32(body):
            raise InvalidFile("header CRC mismatch (header damaged)")
        if version != FORMAT_VERSION:
            raise InvalidFile(f"format version {version}, this daemon reads {FORMAT_VERSION}")
        return cls(state, layer_index, layer_id, rows, row_bytes, data_offset, checksum, blocks,
                   block_bytes, fingerprint.rstrip(b"\0").decode("ascii", "replace"), created,
                   pid)


def _check_header(header: _Header, layout: FileLayout, fingerprint: str) -> None:
    """Raise InvalidFile naming the first header field that does not fit the wanted table."""
    if header.state != STATE_COMPLETE:
        state = "loading" if header.state == STATE_LOADING else f"unknown ({header.state})"
        raise InvalidFile(f"incomplete: state {state}, left by pid {header.pid}")
    wanted = {
        "layer index": (header.layer_index, layout.layer_index),
        "layer id": (header.layer_id, layout.layer_id),
        "rows": (header.rows, layout.rows),
        "row bytes": (header.row_bytes, layout.row_bytes),
        "data offset": (header.data_offset, layout.data_offset),
        "fingerprint": (header.fingerprint, fingerprint),
    }
    for field, (found, expected) in wanted.items():
        if found != expected:
            raise InvalidFile(f"header {field} is {found!r}, expected {expected!r}")
    if not (1 <= header.sample_blocks and 1 <= header.sample_block_bytes
            and header.sample_blocks * header.sample_block_bytes <= _MAX_SAMPLE_BYTES):
        raise InvalidFile(f"header sample settings {header.sample_blocks} x "
                           f"{header.sample_block_bytes} bytes are out of range")


def sample_ranges(nbytes: int, row_bytes: int, blocks: int = SAMPLE_BLOCKS,
                  block_bytes: int = SAMPLE_BLOCK_BYTES) -> list[tuple[int, int]]:
    """Byte ranges [lo, hi) of the data section that the checksum covers, sorted.

    `blocks` evenly spaced blocks from the first byte to the last, plus the first and the last
    row; the whole section when it is no larger than that budget.
    """
    if nbytes <= blocks * block_bytes + 2 * row_bytes:
        return [(0, nbytes)]
    span = nbytes - block_bytes
    starts = {(i * span) // max(blocks - 1, 1) for i in range(blocks)}
    ranges = {(s, s + block_bytes) for s in starts}
    ranges |= {(0, row_bytes), (nbytes - row_bytes, nbytes)}
    return sorted(ranges)


def sampled_checksum(data: np.ndarray, row_bytes: int, blocks: int, block_bytes: int) -> int:
    """zlib.crc32 of the `sample_ranges` of the flat uint8 `data`, one after the other.

    The ranges are joined first and checksummed in one call. A call per range (the same value:
    a CRC chains) gives the GIL back ~500 times, and at a restart another thread imports torch
    meanwhile: each take back then waits out a switch interval, 1.0-1.4 s at 64 GiB on the
    H200 host against 0.02 s alone (benchmarks/experiments/checksum_gil.py). The join copies
    16 MiB."""
    view = data.reshape(-1).data  # a memoryview of the flat array
    joined = b"".join(view[lo:hi] for lo, hi in sample_ranges(view.nbytes, row_bytes, blocks,
                                                                block_bytes))
    return zlib.crc32(joined)


class HostTable:
    """One layer's table, mapped MAP_SHARED from its file, whose descriptor it keeps (the GPU
    registration maps the file again: host_pin.HostRegistration.of_files). Call close() when
    done with it. Equal only to itself (`in` a list of tables means that very object)."""

    def __init__(self, mapping: mmap.mmap, fd: int, path: Path, layout: FileLayout, reattached: bool):
        self.path = path
        self._fd: int | None = fd
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)  # of the file mapped, whatever is at `path` now
        self.layer_index = layout.layer_index
        self.layer_id = layout.layer_id
        self.rows = layout.rows
        self.row_bytes = layout.row_bytes
        self.data_offset = layout.data_offset
        self.reattached = reattached
        self._mapping = mapping
        self._data: np.ndarray | None = np.frombuffer(
            mapping, dtype=np.uint8, count=layout.nbytes, offset=layout.data_offset,
        ).reshape(layout.rows, layout.row_bytes)
        self.address: int = self._data.ctypes.data  # host virtual address of row 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def closed(self) -> bool:
        return self._data is None

    @property
    def array(self) -> np.ndarray:
        """uint8 [rows, row_bytes], a read-only view of the mapping (no copy)."""
        view = self._writable().view()
        view.flags.writeable = False
        return view

    @property
    def tensor(self) -> torch.Tensor:
        """torch.uint8 [rows, row_bytes] sharing the mapping (no copy). Do not write to it."""
        import torch  # the store itself needs only numpy; torch loads where a tensor is asked for

        return torch.from_numpy(self._writable())

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise TableStoreError(f"{self.path}: table is closed")
        return self._fd

    def close(self) -> None:
        """Unmap. Raises TableStoreError while views from `array`/`tensor` are still alive."""
        self._data = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._mapping.closed:
            return
        try:
            self._mapping.close()
        except BufferError as exc:
            raise TableStoreError(
                f"{self.path}: cannot unmap, arrays or tensors viewing the table are still alive; "
                "drop them before close()") from exc

    def _writable(self) -> np.ndarray:
        if self._data is None:
            raise TableStoreError(f"{self.path}: table is closed")
        return self._data

    def __repr__(self) -> str:
        return (f"HostTable(L{self.layer_id}, index {self.layer_index}, {self.rows} rows x "
                f"{self.row_bytes} B, {self.path.name}, reattached={self.reattached})")


class _Meter:
    """Turns bytes filled into LoadProgress calls and a log line every 10 percent."""

    def __init__(self, layout: FileLayout, progress: ProgressFn | None):
        self.layout = layout
        self.progress = progress
        self.start = time.perf_counter()
        self.next_log = 0.1

    def update(self, done: int) -> LoadProgress:
        report = LoadProgress(self.layout.layer_index, done, self.layout.nbytes,
                              time.perf_counter() - self.start, reattached=False)
        if self.progress is not None:
            self.progress(report)
        if report.fraction >= self.next_log or done == report.total_bytes:
            logger.info("L%d (layer %d): %3.0f%% %s of %s, %.2f GB/s",
                        self.layout.layer_id, self.layout.layer_index, 100 * report.fraction,
                        size(done), size(report.total_bytes), report.gbps)
            self.next_log = (int(report.fraction * 10) + 1) / 10
        return report


def close_quietly(table: HostTable) -> None:
    """Close on a failure path, where the original error must not be masked."""
    try:
        table.close()
    except TableStoreError as exc:
        logger.warning("%s (it is unmapped once the last view goes)", exc)


def close_all_quietly(tables: list[HostTable]) -> None:
    for table in tables:
        close_quietly(table)


def table_file_name(instance: str, layer_id: int, fingerprint: str) -> str:
    return f"engramd.{instance}.L{layer_id}.{fingerprint}.tbl"



def attach_file(path: Path, layout: FileLayout, fingerprint: str) -> HostTable:
    """Map a complete file after validating owner, mode, header, size and sampled checksum."""
    fd, header = _open_checked(path, layout, fingerprint)
    try:  # mapping past the end of a file and touching it raises SIGBUS, so sizes came first
        table = HostTable(_map_writable(fd, layout.file_size), fd, path, layout, reattached=True)
    except BaseException:
        os.close(fd)
        raise
    try:
        _check_rows(table, header)
    except InvalidFile:
        table.close()
        raise
    return table


def still_valid(table: HostTable, layout: FileLayout, fingerprint: str) -> bool:
    """Whether a table mapped earlier (attach_complete) passes attach_file's checks now, the file at
    its path being the very one it maps."""
    if table.closed or (table.layer_index, table.rows, table.row_bytes, table.data_offset) != (
            layout.layer_index, layout.rows, layout.row_bytes, layout.data_offset):
        return False
    try:
        fd, header = _open_checked(table.path, layout, fingerprint)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if (st.st_dev, st.st_ino) != table.identity:
            return False
        _check_rows(table, header)
    except InvalidFile:
        return False
    return True


def _open_checked(path: Path, layout: FileLayout, fingerprint: str) -> tuple[int, _Header]:
    """The file opened read-only and its header, checked against `layout` (InvalidFile, the
    descriptor closed, if it does not fit)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidFile(f"cannot open: {exc.strerror}") from exc
    try:
        return fd, _read_header(fd, layout, fingerprint)
    except BaseException:
        os.close(fd)
        raise


def _check_rows(table: HostTable, header: _Header) -> None:
    checksum = sampled_checksum(table.array, table.row_bytes, header.sample_blocks,
                                header.sample_block_bytes)
    if checksum != header.checksum:
        raise InvalidFile(f"sampled checksum {checksum:#010x}, header says "
                           f"{header.checksum:#010x} (data changed after loading)")


def _read_header(fd: int, layout: FileLayout, fingerprint: str) -> _Header:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidFile("not a regular file")
    # A file someone else made, or may write, is not ours whatever its header says: its rows
    # could be anything (a planted file carries a valid header and its own checksum).
    if st.st_uid != os.geteuid():
        raise InvalidFile(f"owned by uid {st.st_uid}, not by this daemon's user {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) & ~FILE_MODE or st.st_nlink != 1:
        raise InvalidFile(f"mode {stat.S_IMODE(st.st_mode):o} with {st.st_nlink} links; the "
                           f"daemon writes its tables {FILE_MODE:o} with one")
    if st.st_size < HEADER_BYTES:
        raise InvalidFile(f"truncated to {st.st_size} bytes, shorter than the header")
    header = _Header.unpack(os.pread(fd, _HEADER_LEN, 0))
    _check_header(header, layout, fingerprint)
    if st.st_size != layout.file_size:
        raise InvalidFile(f"file is {st.st_size} bytes, expected {layout.file_size}")
    return header


def _map_writable(fd: int, size: int) -> mmap.mmap:
    """A shared writable mapping (as a loaded table's) of the file `fd` was opened read-only
    on, reopened through /proc so that the path is not looked up again."""
    try:
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidFile(f"cannot reopen for mapping: {exc.strerror}") from exc
    try:
        return mmap.mmap(rw, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(rw)


def create_mapping(path: Path, layout: FileLayout) -> tuple[mmap.mmap, int]:
    """A new file at `path` of the layout's size, mapped; the mapping and the descriptor."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        raise TableStoreError(f"{path}: cannot create: {exc.strerror}") from exc
    try:
        os.fchmod(fd, FILE_MODE)  # the umask must not decide who may read the tables
        os.ftruncate(fd, layout.file_size)
        _reserve(fd, path, layout.file_size)
        return mmap.mmap(fd, layout.file_size, flags=mmap.MAP_SHARED), fd
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def _reserve(fd: int, path: Path, size: int) -> None:
    """Allocate the file's pages now, so a full tmpfs fails here and not as a SIGBUS mid-fill.

    tmpfs zeroes a page when it is first faulted in anyway, so allocating up front moves that
    work rather than adding to it. The statvfs check before covers the common case; this covers
    another process filling the directory while we load.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise InsufficientSpaceError(
                f"{path}: cannot allocate {size} bytes: no space left in {path.parent}") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise TableStoreError(f"{path}: cannot allocate {size} bytes: {exc.strerror}") from exc


def fill(table: HostTable, layout: FileLayout, source: TableSource, fingerprint: str,
          progress: ProgressFn | None, chunk_bytes: int) -> None:
    """Fill rows from the source straight into the mapping, then mark the file complete."""
    mapping = table._mapping
    blocks, block_bytes = SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES
    header = _Header(STATE_LOADING, layout.layer_index, layout.layer_id, layout.rows,
                     layout.row_bytes, layout.data_offset, 0, blocks, block_bytes, fingerprint,
                     time.time(), os.getpid())
    mapping[:_HEADER_LEN] = header.pack()
    data = table._writable()
    step = max(1, chunk_bytes // layout.row_bytes)
    meter = _Meter(layout, progress)
    for start in range(0, layout.rows, step):
        out = data[start:start + step]
        source.read_packed(layout.layer_index, start, out)
        meter.update((start + out.shape[0]) * layout.row_bytes)
    mapping.flush()  # data reaches the file before the header that vouches for it
    checksum = sampled_checksum(data, layout.row_bytes, blocks, block_bytes)
    done = _Header(STATE_COMPLETE, layout.layer_index, layout.layer_id, layout.rows,
                   layout.row_bytes, layout.data_offset, checksum, blocks, block_bytes,
                   fingerprint, header.created, header.pid)
    mapping[:_HEADER_LEN] = done.pack()
    mapping.flush()
