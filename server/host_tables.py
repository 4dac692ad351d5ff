"""Host tier of the daemon: the store of one instance's table files, one per Engram layer.

The files (their format and mapping: table_file.py) outlive the daemon: a restarted daemon of
the same instance re-attaches complete files in seconds instead of reloading ~189 GiB from the
checkpoint. The store creates, re-attaches, switches (a reload) and removes them.

What this is not: the file format (table_file.py), a checkpoint reader (the source object fills
the rows), the GPU registration (server/table_registration.py), or a cache.

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
import os
import re
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engramd.client.geometry import TableGeometry
from engramd.server.ownership import LOCK_FILE_MODE
from engramd.server.table_file import (
    PAGE_BYTES,
    FileLayout,
    HostTable,
    InsufficientSpaceError,
    InvalidFile,
    LoadProgress,
    ProgressFn,
    TableSource,
    TableStoreError,
    attach_file,
    close_quietly,
    create_mapping,
    file_layouts,
    fill,
    still_valid,
    table_file_name,
)
from engramd.server.units import size

logger = logging.getLogger("engramd.tables")

DEFAULT_CHUNK_BYTES = 64 << 20

_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{1,128}")


class ReloadCancelled(TableStoreError):
    """A reload's load was stopped on request (open_next's `cancelled`)."""


class StoreLockedError(TableStoreError):
    """Another live store (another daemon) holds this instance's lock."""


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
        for table in self.detach_next():
            close_quietly(table)

    def detach_next(self) -> list[HostTable]:
        """A reload that will not switch: its tables leave the store and their files go now (what
        is mapped or pinned of them stays until let go); the caller closes the tables."""
        tables, self._next, self._next_fingerprint = self._next, [], None
        for table in tables:
            self._remove(table.path, "the reload did not finish")
        return tables

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
        layouts = file_layouts(geometry, self.shm_dir)
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
                    close_quietly(table)
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

    def _try_attach(self, layout: FileLayout, fingerprint: str, progress: ProgressFn | None,
                    adopt: list[HostTable]) -> HostTable | None:
        path = self.table_path(layout.layer_id, fingerprint)
        if not os.path.lexists(path):
            return None
        start = time.perf_counter()
        table = next((t for t in adopt if t.path == path and still_valid(t, layout, fingerprint)),
                     None)
        try:
            table = table or attach_file(path, layout, fingerprint)
        except InvalidFile as exc:
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
                close_quietly(table)
            raise
        if differs_at is not None:
            if owned:
                close_quietly(table)
            self._remove(table.path, f"row {differs_at} differs from the checkpoint")
            return None
        logger.info("L%d (layer %d): every row matches the checkpoint (%s verified in %.2f s)",
                    table.layer_id, table.layer_index, size(table.nbytes), time.perf_counter() - start)
        return table

    def _check_space(self, missing: list[FileLayout], reused: int) -> None:
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

    def _create(self, source: TableSource, layout: FileLayout, fingerprint: str,
                progress: ProgressFn | None, chunk_bytes: int) -> HostTable:
        path = self.table_path(layout.layer_id, fingerprint)
        logger.info("L%d (layer %d): loading %s into %s", layout.layer_id,
                    layout.layer_index, size(layout.nbytes), path)
        mapping, fd = create_mapping(path, layout)
        try:
            table = HostTable(mapping, fd, path, layout, reattached=False)
        except BaseException:
            mapping.close()
            os.close(fd)
            self._remove(path, "loading did not start")
            raise
        try:
            fill(table, layout, source, fingerprint, progress, chunk_bytes)
        except BaseException as exc:
            # The traceback's frames hold views of the mapping (the chunk being filled); drop
            # their locals so that the unmap happens now rather than when the traceback dies.
            traceback.clear_frames(exc.__traceback__)
            close_quietly(table)
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

def attach_complete(shm_dir: Path, instance: str, source: TableSource) -> list[HostTable] | None:
    """Every layer table of `source` mapped from its complete file in `shm_dir`, checked as a
    re-attach checks it, without the instance's lock: a standby's preparation while another
    daemon holds the store. It only reads (nothing is created, written or removed); None while
    any file is missing or not valid (yet: another daemon may still be loading it)."""
    geometry = source.geometry
    fingerprint = _check_fingerprint(source.fingerprint())
    tables: list[HostTable] = []
    try:
        for layout in file_layouts(geometry, shm_dir):
            path = shm_dir / table_file_name(_check_instance(instance), layout.layer_id, fingerprint)
            tables.append(attach_file(path, layout, fingerprint))
    except InvalidFile:
        for table in tables:
            close_quietly(table)
        return None
    return tables


def still_in_place(table: HostTable) -> bool:
    """Whether the file `table` maps is still the one at its path (not removed, not replaced)."""
    try:
        st = os.stat(table.path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == table.identity


def _acquire_lock(path: Path, instance: str) -> int:
    """flock the instance's lock file (held until close) and write our pid into it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, LOCK_FILE_MODE)
    except OSError as exc:
        raise TableStoreError(f"{path}: cannot open lock file: {exc.strerror}") from exc
    try:
        os.fchmod(fd, LOCK_FILE_MODE)  # one made by an earlier version was the group's too
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
