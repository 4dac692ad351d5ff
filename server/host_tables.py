"""Host tier of the daemon: one shared-memory file per Engram layer table.

What this is: the daemon's copy of each layer's packed table (`row_bytes` bytes a row: the FP8
values, then the UE8M0 scales) in a file under a shared-memory directory (/dev/shm, or a hugetlbfs
mount), mapped MAP_SHARED so that a GPU backend can later pin the pages in place with
cudaHostRegister. The files outlive the daemon: a restarted daemon of the same instance re-attaches
complete files in seconds instead of reloading ~189 GiB from the checkpoint.

What this is not: a checkpoint reader (the source object fills the rows), the GPU registration
(server/table_registration.py), or a cache.

One table file, little-endian:

    0              header: fixed struct `_HEADER`, then the CRC32 of that struct
    data_offset    rows * row_bytes packed bytes; data_offset is a multiple of 4096 and of the
                   directory's block size (the huge page size on hugetlbfs)
    ...            zero padding up to a multiple of the block size

A file is usable only when its header says `complete`. That header is written after the data is
filled and flushed, so a daemon killed mid-load leaves a file that the next start sees as
incomplete and removes.

Names: `{shm_dir}/engramd.{instance}.L{layer_id}.{fingerprint}.tbl`. The flock on
`{lock_dir}/engramd.{instance}.lock` lets one live store per instance exist; only that store
creates, re-attaches or removes the instance's files, and it never touches another instance's.
One exception reads them without the lock: a standby daemon maps complete files ahead of its
takeover (`attach_complete`, server/standby_tables.py), and the store it opens once it holds the
lock adopts those mappings only after checking them again (`open(adopt=...)`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import struct
import threading
import time
import traceback
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
DEFAULT_CHUNK_BYTES = 64 << 20

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

_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{1,128}")

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


class ReloadCancelled(TableStoreError):
    """A reload's load was stopped on request (open_next's `cancelled`)."""


class StoreLockedError(TableStoreError):
    """Another live store (another daemon) holds this instance's lock."""


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


class _InvalidFile(Exception):
    """A table file may not be re-attached; the message is the reason, logged at removal."""


@dataclass(frozen=True)
class _Layout:
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


def _layouts(geometry: TableGeometry, shm_dir: Path) -> list[_Layout]:
    """Every layer's layout for files in `shm_dir` (aligned to its block size)."""
    align = _alignment(os.statvfs(shm_dir))
    return [_layout(geometry, index, align) for index in range(geometry.n_layers)]


def _layout(geometry: TableGeometry, index: int, align: int) -> _Layout:
    data_offset = _round_up(HEADER_BYTES, align)
    nbytes = geometry.rows[index] * geometry.row_bytes
    return _Layout(index, geometry.layer_ids[index], geometry.rows[index], geometry.row_bytes,
                   data_offset, _round_up(data_offset + nbytes, align))


HUGE_PAGE_POOL = "/sys/kernel/mm/hugepages/hugepages-{kib}kB/free_hugepages"


def _available_bytes(folder: Path) -> int:
    """Bytes free for new table files. A hugetlbfs mount without a size limit reports no blocks
    at all (statvfs: 0 of 0, in blocks of the huge page size): it can take what the free pool of
    its page size holds."""
    st = os.statvfs(folder)
    if st.f_blocks or st.f_bsize <= PAGE_BYTES:
        return st.f_bavail * st.f_frsize
    pool = Path(HUGE_PAGE_POOL.format(kib=st.f_bsize // 1024))
    try:
        return int(pool.read_text()) * st.f_bsize
    except (OSError, ValueError):
        return 0


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
            raise _InvalidFile(f"header truncated to {len(raw)} bytes")
        body = raw[:_HEADER.size]
        (magic, version, state, layer_index, layer_id, rows, row_bytes, data_offset, checksum,
         blocks, block_bytes, fingerprint, created, pid) = _HEADER.unpack(body)
        if magic != MAGIC:
            raise _InvalidFile(f"no table header (magic {magic!r}, expected {MAGIC!r})")
        (crc,) = _HEADER_CRC.unpack_from(raw, _HEADER.size)
        if crc != zlib.crc32(body):
            raise _InvalidFile("header CRC mismatch (header damaged)")
        if version != FORMAT_VERSION:
            raise _InvalidFile(f"format version {version}, this daemon reads {FORMAT_VERSION}")
        return cls(state, layer_index, layer_id, rows, row_bytes, data_offset, checksum, blocks,
                   block_bytes, fingerprint.rstrip(b"\0").decode("ascii", "replace"), created,
                   pid)


def _check_header(header: _Header, layout: _Layout, fingerprint: str) -> None:
    """Raise _InvalidFile naming the first header field that does not fit the wanted table."""
    if header.state != STATE_COMPLETE:
        state = "loading" if header.state == STATE_LOADING else f"unknown ({header.state})"
        raise _InvalidFile(f"incomplete: state {state}, left by pid {header.pid}")
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
            raise _InvalidFile(f"header {field} is {found!r}, expected {expected!r}")
    if not (1 <= header.sample_blocks and 1 <= header.sample_block_bytes
            and header.sample_blocks * header.sample_block_bytes <= _MAX_SAMPLE_BYTES):
        raise _InvalidFile(f"header sample settings {header.sample_blocks} x "
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
    view = memoryview(data.reshape(-1))  # type: ignore[arg-type]  # numpy: a buffer on 3.12+
    joined = b"".join(view[lo:hi] for lo, hi in sample_ranges(view.nbytes, row_bytes, blocks,
                                                                block_bytes))
    return zlib.crc32(joined)


class HostTable:
    """One layer's table, mapped MAP_SHARED from its file, whose descriptor it keeps (the GPU
    registration maps the file again: host_pin.HostRegistration.of_files). Call close() when
    done with it. Equal only to itself (`in` a list of tables means that very object)."""

    def __init__(self, mapping: mmap.mmap, fd: int, path: Path, layout: _Layout, reattached: bool):
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

    def __init__(self, layout: _Layout, progress: ProgressFn | None):
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


class TableStore:
    """The table files of one daemon instance. Holds the instance lock from construction to close.

    close() unmaps and releases the lock but keeps the files, so that the next daemon of the same
    instance re-attaches them; remove_files() deletes them.
    """

    def __init__(self, shm_dir: str | Path, instance: str, lock_dir: str | Path | None = None):
        self.instance = _check_instance(instance)
        self.shm_dir = _check_dir(Path(shm_dir), "shm_dir")
        lock_parent = self.shm_dir if lock_dir is None else _check_dir(Path(lock_dir), "lock_dir")
        self.lock_path = lock_parent / f"engramd.{instance}.lock"
        self.tables: list[HostTable] = []
        self._fingerprint: str | None = None  # of `tables`
        self._next: list[HostTable] = []  # a reload's, until switch()
        self._next_fingerprint: str | None = None
        self._released: list[HostTable] = []  # replaced by a switch(), maybe still read
        self._name_re = re.compile(rf"engramd\.{re.escape(instance)}\.L(\d+)\.([0-9a-f]+)\.tbl")
        self._lock_fd: int | None = _acquire_lock(self.lock_path, instance)

    def __enter__(self) -> TableStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def table_path(self, layer_id: int, fingerprint: str) -> Path:
        return self.shm_dir / table_file_name(self.instance, layer_id, fingerprint)

    def open(self, source: TableSource, progress: ProgressFn | None = None,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: bool = False,
             adopt: list[HostTable] | None = None) -> list[HostTable]:
        """Re-attach complete matching files, remove stale ones, load the rest from `source`.
        With `verify`, every row of a re-attached file is compared with `source` first, and a
        file that differs anywhere is removed and loaded again. `adopt`: tables mapped ahead
        (attach_complete); one whose file is still the one at its path and passes the re-attach
        checks is taken as it is mapped, instead of mapping the file again. The caller keeps
        those it gets back that were not taken, and they stay its own if open() raises."""
        self._require_lock()
        if self.tables:
            raise TableStoreError(f"{self.lock_path}: tables are already open; close() first")
        self.tables = self._open_version(source, progress, chunk_bytes, verify, keep=None,
                                         adopt=adopt or [])
        self._fingerprint = source.fingerprint()
        return list(self.tables)

    def open_next(self, source: TableSource, progress: ProgressFn | None = None,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: bool = False,
                  cancelled: Callable[[], bool] = lambda: False) -> list[HostTable]:
        """A reload's first step: open `source`'s tables as open() does, beside the ones open
        now, which stay current (and their files untouched) until switch(). `cancelled` is
        asked between chunks of a load; when it says so, the load stops (its files removed)."""
        self._require_lock()
        if not self.tables:
            raise TableStoreError(f"{self.lock_path}: no tables are open to reload; open() first")
        if self._next:
            raise TableStoreError(f"{self.lock_path}: a reload's tables are open already")
        if source.fingerprint() == self._fingerprint:
            raise TableStoreError(f"{self.lock_path}: tables {self._fingerprint} are the ones open")

        def checked(report: LoadProgress) -> None:
            if cancelled() and not report.reattached:  # a re-attach is done: it is kept
                raise ReloadCancelled("the reload was cancelled (the daemon is stopping)")
            if progress is not None:
                progress(report)

        fingerprint = source.fingerprint()
        try:
            self._next = self._open_version(source, checked, chunk_bytes, verify,
                                            keep=self._fingerprint, adopt=[])
        except BaseException:  # the layers it completed hold shared memory for nothing
            for path, _, found in self._own_files():
                if found == fingerprint:
                    self._remove(path, "the reload did not finish")
            raise
        self._next_fingerprint = fingerprint
        return list(self._next)

    def switch(self) -> list[HostTable]:
        """Make the tables of open_next() current; the files of the ones current until now are
        removed (their memory is freed once the last mapping of them goes: close them with
        release() once nothing reads them). Returns those tables."""
        if not self._next:
            raise TableStoreError(f"{self.lock_path}: no reload's tables to switch to")
        old, self.tables, self._next = self.tables, self._next, []
        self._fingerprint, self._next_fingerprint = self._next_fingerprint, None
        self._released.extend(old)
        for table in old:
            try:  # the switch has happened: a file left behind is no reason to undo it
                self._remove(table.path, f"replaced by tables {self._fingerprint}")
            except TableStoreError as exc:
                logger.error("%s (remove it by hand)", exc)
        return old

    def abandon_next(self) -> None:
        """A reload that will not switch: close its tables and remove their files."""
        tables, self._next, self._next_fingerprint = self._next, [], None
        for table in tables:
            _close_quietly(table)
            self._remove(table.path, "the reload did not finish")

    def release(self, tables: list[HostTable]) -> threading.Thread:
        """Unmap tables that switch() replaced, now that nothing reads them, on a thread of its
        own (returned): the unmap that frees a removed file's memory takes ~0.25 s per GiB,
        which the caller (the daemon's loop) must not wait. Views of them that live on keep the
        mapping until they go."""
        for table in tables:
            if table in self._released:
                self._released.remove(table)

        def unmap() -> None:
            for table in tables:
                try:
                    table.close()
                except TableStoreError:
                    logger.info("%s: unmapped once the last view of it goes", table.path)

        thread = threading.Thread(target=unmap, name="engramd-unmap", daemon=True)
        thread.start()
        return thread

    def _open_version(self, source: TableSource, progress: ProgressFn | None, chunk_bytes: int,
                      verify: bool, keep: str | None, adopt: list[HostTable]) -> list[HostTable]:
        """The tables of `source`, sorted by layer; every other file of this instance but those
        of fingerprint `keep` removed."""
        geometry = source.geometry
        fingerprint = _check_fingerprint(source.fingerprint())
        _check_layer_ids(geometry)
        layouts = _layouts(geometry, self.shm_dir)
        self._sweep(geometry, fingerprint, keep)
        opened: list[HostTable] = []
        try:
            missing = []
            for layout in layouts:
                table = self._try_attach(layout, fingerprint, progress, adopt)
                if table is not None and verify:
                    table = self._verified(table, source, chunk_bytes, owned=table not in adopt)
                if table is None:
                    missing.append(layout)
                else:
                    opened.append(table)
            self._check_space(missing, reused=len(opened))
            for layout in missing:
                opened.append(self._create(source, layout, fingerprint, progress, chunk_bytes))
        except BaseException:
            for table in opened:
                if table not in adopt:  # those are the caller's to close
                    _close_quietly(table)
            raise
        return sorted(opened, key=lambda t: t.layer_index)

    def remove_files(self) -> list[Path]:
        """Delete every table file of this instance. Open mappings stay valid until closed."""
        self._require_lock()
        removed = []
        for path, _, _ in self._own_files():
            self._remove(path, "removal asked for")
            removed.append(path)
        return removed

    def close(self) -> None:
        """Unmap every table and release the lock; the files stay for a later re-attach."""
        errors = []
        for table in [*self.tables, *self._next, *self._released]:
            try:
                table.close()
            except TableStoreError as exc:
                errors.append(str(exc))
        self.tables, self._next, self._released = [], [], []
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
        if errors:
            raise TableStoreError("; ".join(errors))

    def _require_lock(self) -> None:
        if self._lock_fd is None:
            raise TableStoreError(f"{self.lock_path}: store is closed")

    def _own_files(self) -> list[tuple[Path, int, str]]:
        """(path, layer id, fingerprint) of every table file of this instance, by name."""
        found = []
        for name in sorted(os.listdir(self.shm_dir)):
            match = self._name_re.fullmatch(name)
            if match:
                found.append((self.shm_dir / name, int(match[1]), match[2]))
        return found

    def _sweep(self, geometry: TableGeometry, fingerprint: str, keep: str | None = None) -> None:
        """Remove this instance's files that no table of `geometry` + `fingerprint` would use,
        but for those of fingerprint `keep` (the tables served while a reload opens others)."""
        wanted = {self.table_path(layer_id, fp) for layer_id in geometry.layer_ids
                  for fp in (fingerprint, keep) if fp is not None}
        for path, layer_id, found in self._own_files():
            if path in wanted:
                continue
            if layer_id not in geometry.layer_ids:
                reason = f"layer id {layer_id} is not in the layers {list(geometry.layer_ids)}"
            elif found != fingerprint:
                reason = f"fingerprint {found} is not the current {fingerprint}"
            else:
                reason = "name is not in canonical form"
            self._remove(path, reason)

    def _try_attach(self, layout: _Layout, fingerprint: str, progress: ProgressFn | None,
                    adopt: list[HostTable]) -> HostTable | None:
        path = self.table_path(layout.layer_id, fingerprint)
        if not os.path.lexists(path):
            return None
        start = time.perf_counter()
        table = next((t for t in adopt if t.path == path and _still_valid(t, layout, fingerprint)),
                     None)
        try:
            table = table or _attach(path, layout, fingerprint)
        except _InvalidFile as exc:
            self._remove(path, str(exc))
            return None
        seconds = time.perf_counter() - start
        logger.info("L%d (layer %d): re-attached %s, %s, verified in %.3f s%s",
                    layout.layer_id, layout.layer_index, path, size(layout.nbytes), seconds,
                    " (mapped ahead by the standby)" if table in adopt else "")
        if progress is not None:
            progress(LoadProgress(layout.layer_index, layout.nbytes, layout.nbytes, seconds,
                                  reattached=True))
        return table

    def _verified(self, table: HostTable, source: TableSource, chunk_bytes: int,
                  owned: bool) -> HostTable | None:
        """`table` if every row equals `source`'s; else None, the file removed and the table
        closed if `owned` (else it is the caller's of open(): a standby's, with its pin)."""
        start = time.perf_counter()
        try:
            differs_at = _first_difference(table, source, chunk_bytes)
        except BaseException:
            if owned:  # not among the opened tables yet: nobody else would close it
                _close_quietly(table)
            raise
        if differs_at is not None:
            if owned:
                _close_quietly(table)
            self._remove(table.path, f"row {differs_at} differs from the checkpoint")
            return None
        logger.info("L%d (layer %d): every row matches the checkpoint (%s verified in %.2f s)",
                    table.layer_id, table.layer_index, size(table.nbytes), time.perf_counter() - start)
        return table

    def _check_space(self, missing: list[_Layout], reused: int) -> None:
        if not missing:
            return
        needed = sum(layout.file_size for layout in missing)
        available = _available_bytes(self.shm_dir)
        if needed > available:
            raise InsufficientSpaceError(
                f"{self.shm_dir}: {len(missing)} table file(s) to create need {needed} bytes "
                f"({needed / 2**30:.2f} GiB) but only {available} bytes "
                f"({available / 2**30:.2f} GiB) are available ({reused} complete file(s) "
                "re-attached and not counted); free space there or choose another directory")

    def _create(self, source: TableSource, layout: _Layout, fingerprint: str,
                progress: ProgressFn | None, chunk_bytes: int) -> HostTable:
        path = self.table_path(layout.layer_id, fingerprint)
        logger.info("L%d (layer %d): loading %s into %s", layout.layer_id,
                    layout.layer_index, size(layout.nbytes), path)
        mapping, fd = _create_mapping(path, layout)
        try:
            table = HostTable(mapping, fd, path, layout, reattached=False)
        except BaseException:
            mapping.close()
            os.close(fd)
            self._remove(path, "loading did not start")
            raise
        try:
            _fill(table, layout, source, fingerprint, progress, chunk_bytes)
        except BaseException as exc:
            # The traceback's frames hold views of the mapping (the chunk being filled); drop
            # their locals so that the unmap happens now rather than when the traceback dies.
            traceback.clear_frames(exc.__traceback__)
            _close_quietly(table)
            self._remove(path, "loading did not finish")
            raise
        return table

    def _remove(self, path: Path, reason: str) -> None:
        logger.warning("removing %s: %s", path, reason)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TableStoreError(f"{path}: cannot remove ({reason}): {exc.strerror}") from exc


def _first_difference(table: HostTable, source: TableSource, chunk_bytes: int) -> int | None:
    """The first row of `table` that differs from `source`, or None: read chunk by chunk."""
    rows = table.array
    chunk = max(1, chunk_bytes // table.row_bytes)
    expected = np.empty((min(chunk, table.rows), table.row_bytes), dtype=np.uint8)
    for row_start in range(0, table.rows, chunk):
        part = expected[: min(chunk, table.rows - row_start)]
        source.read_packed(table.layer_index, row_start, part)
        differs = np.flatnonzero((rows[row_start : row_start + len(part)] != part).any(axis=1))
        if differs.size:
            return row_start + int(differs[0])
    return None


def _close_quietly(table: HostTable) -> None:
    """Close on a failure path, where the original error must not be masked."""
    try:
        table.close()
    except TableStoreError as exc:
        logger.warning("%s (it is unmapped once the last view goes)", exc)


def table_file_name(instance: str, layer_id: int, fingerprint: str) -> str:
    return f"engramd.{instance}.L{layer_id}.{fingerprint}.tbl"


def attach_complete(shm_dir: Path, instance: str, source: TableSource) -> list[HostTable] | None:
    """Every layer table of `source` mapped from its complete file in `shm_dir`, checked as a
    re-attach checks it, without the instance's lock: a standby's preparation while another
    daemon holds the store. It only reads (nothing is created, written or removed); None while
    any file is missing or not valid (yet: another daemon may still be loading it)."""
    geometry = source.geometry
    fingerprint = _check_fingerprint(source.fingerprint())
    tables: list[HostTable] = []
    try:
        for layout in _layouts(geometry, shm_dir):
            path = shm_dir / table_file_name(_check_instance(instance), layout.layer_id, fingerprint)
            tables.append(_attach(path, layout, fingerprint))
    except _InvalidFile:
        for table in tables:
            _close_quietly(table)
        return None
    return tables


def still_in_place(table: HostTable) -> bool:
    """Whether the file `table` maps is still the one at its path (not removed, not replaced)."""
    try:
        st = os.stat(table.path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == table.identity


def _attach(path: Path, layout: _Layout, fingerprint: str) -> HostTable:
    """Map a complete file after validating owner, mode, header, size and sampled checksum."""
    fd, header = _open_checked(path, layout, fingerprint)
    try:  # mapping past the end of a file and touching it raises SIGBUS, so sizes came first
        table = HostTable(_map_writable(fd, layout.file_size), fd, path, layout, reattached=True)
    except BaseException:
        os.close(fd)
        raise
    try:
        _check_rows(table, header)
    except _InvalidFile:
        table.close()
        raise
    return table


def _still_valid(table: HostTable, layout: _Layout, fingerprint: str) -> bool:
    """Whether a table mapped earlier (attach_complete) passes _attach's checks now, the file at
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
    except _InvalidFile:
        return False
    return True


def _open_checked(path: Path, layout: _Layout, fingerprint: str) -> tuple[int, _Header]:
    """The file opened read-only and its header, checked against `layout` (_InvalidFile, the
    descriptor closed, if it does not fit)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _InvalidFile(f"cannot open: {exc.strerror}") from exc
    try:
        return fd, _read_header(fd, layout, fingerprint)
    except BaseException:
        os.close(fd)
        raise


def _check_rows(table: HostTable, header: _Header) -> None:
    checksum = sampled_checksum(table.array, table.row_bytes, header.sample_blocks,
                                header.sample_block_bytes)
    if checksum != header.checksum:
        raise _InvalidFile(f"sampled checksum {checksum:#010x}, header says "
                           f"{header.checksum:#010x} (data changed after loading)")


def _read_header(fd: int, layout: _Layout, fingerprint: str) -> _Header:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _InvalidFile("not a regular file")
    # A file someone else made, or may write, is not ours whatever its header says: its rows
    # could be anything (a planted file carries a valid header and its own checksum).
    if st.st_uid != os.geteuid():
        raise _InvalidFile(f"owned by uid {st.st_uid}, not by this daemon's user {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) & ~FILE_MODE or st.st_nlink != 1:
        raise _InvalidFile(f"mode {stat.S_IMODE(st.st_mode):o} with {st.st_nlink} links; the "
                           f"daemon writes its tables {FILE_MODE:o} with one")
    if st.st_size < HEADER_BYTES:
        raise _InvalidFile(f"truncated to {st.st_size} bytes, shorter than the header")
    header = _Header.unpack(os.pread(fd, _HEADER_LEN, 0))
    _check_header(header, layout, fingerprint)
    if st.st_size != layout.file_size:
        raise _InvalidFile(f"file is {st.st_size} bytes, expected {layout.file_size}")
    return header


def _map_writable(fd: int, size: int) -> mmap.mmap:
    """A shared writable mapping (as a loaded table's) of the file `fd` was opened read-only
    on, reopened through /proc so that the path is not looked up again."""
    try:
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise _InvalidFile(f"cannot reopen for mapping: {exc.strerror}") from exc
    try:
        return mmap.mmap(rw, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(rw)


def _create_mapping(path: Path, layout: _Layout) -> tuple[mmap.mmap, int]:
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


def _fill(table: HostTable, layout: _Layout, source: TableSource, fingerprint: str,
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


def _acquire_lock(path: Path, instance: str) -> int:
    """flock the instance's lock file (held until close) and write our pid into it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    except OSError as exc:
        raise TableStoreError(f"{path}: cannot open lock file: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        who = f"pid {holder}" if holder else "holder's pid not written"
        raise StoreLockedError(f"{path}: instance {instance!r} is in use by another daemon "
                               f"({who}); stop it or pick another instance name") from None
    except OSError as exc:
        os.close(fd)
        raise TableStoreError(f"{path}: cannot lock: {exc.strerror}") from exc
    os.ftruncate(fd, 0)
    try:
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:  # hugetlbfs files can only be mapped: the pid is a diagnostic anyway
        if exc.errno != errno.EINVAL:
            raise
    return fd


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _check_instance(instance: str) -> str:
    if not isinstance(instance, str) or not _INSTANCE_RE.fullmatch(instance):
        raise TableStoreError(f"instance name {instance!r} must be 1-64 characters of "
                              "[A-Za-z0-9_.-]")
    return instance


def _check_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise TableStoreError(f"{what} {path} is not a directory")
    return path


def _check_fingerprint(fingerprint: str) -> str:
    if not isinstance(fingerprint, str) or not _FINGERPRINT_RE.fullmatch(fingerprint):
        raise TableStoreError(f"source fingerprint {fingerprint!r} must be 1-128 lowercase hex "
                              "digits")
    return fingerprint


def _check_layer_ids(geometry: TableGeometry) -> None:
    ids = list(geometry.layer_ids)
    if len(set(ids)) != len(ids):
        raise TableStoreError(f"layer ids {ids} repeat; one table file per layer id")
