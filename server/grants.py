"""What an attached client is passed: its slab's descriptors (served), or descriptors of the
served table files and of the warm-up trace (mapped).

A mapped client gathers from its own mapping of the daemon's table files. At attach, and after a
reload (the handle socket's `tables` request), it gets a read-only descriptor of each file with
a `TableGrant` (client/shared/handles.py, the wire's own type) saying where the rows are in it, and,
when it keeps a hot-row cache of its own, a descriptor of hot_cache_warm_file. This module holds
the daemon's descriptors of them, opened once per version of the tables, and makes the copies a
reply passes (the caller closes those once sent); `attach_reply` is what an attach answers,
either mode.

Not who may have them (the registry decides), nor how they travel (the handle socket,
server/handle_server.py).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from engramd.client.errors import ResourceError
from engramd.client.shared.handles import TableGrant
from engramd.client.shared.messages import AttachReply
from engramd.server.table_file import HostTable

if TYPE_CHECKING:
    from engramd.server.registry import ClientRecord

log = logging.getLogger("engramd.daemon")


class TableDescriptors:
    """Read-only descriptors of one version of the tables' files, the daemon's own."""

    def __init__(self, tables: list[HostTable]):
        self.tables = tables
        self.fds: list[int] = []
        try:
            for table in tables:
                self.fds.append(os.open(table.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
        except BaseException:
            self.close()
            raise

    def grants(self) -> list[TableGrant]:
        """A grant per table, each with a new descriptor (the caller closes them)."""
        fds: list[int] = []
        try:
            fds.extend(os.dup(fd) for fd in self.fds)
            return [TableGrant(fd, layer_id=t.layer_id, rows=t.rows, row_bytes=t.row_bytes,
                               data_offset=t.data_offset, file_bytes=os.fstat(fd).st_size)
                    for t, fd in zip(self.tables, fds, strict=True)]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


class MappedGrants:
    """The served tables' descriptors and the warm-up trace's, for mapped clients; a reload
    replaces the tables' (`replace`)."""

    def __init__(self, tables: list[HostTable], warm_file: str):
        """`warm_file`: hot_cache_warm_file where mapped GPU clients keep caches, else ""."""
        self._tables = TableDescriptors(tables)
        self._warm_fd = _open_warm_file(warm_file)

    def tables(self) -> tuple[list[dict[str, int]], list[int]]:
        """The served tables' descriptions, and a new descriptor of each (the caller closes them)."""
        grants = self._tables.grants()
        return [grant.wire() for grant in grants], [grant.fd for grant in grants]

    def warm_file(self) -> int | None:
        """A new descriptor of the warm-up trace (the caller closes it); None without one."""
        return os.dup(self._warm_fd) if self._warm_fd is not None else None

    def replace(self, tables: TableDescriptors) -> None:
        """A reload switched to `tables`: grant theirs from now on (ours now), close the old."""
        old, self._tables = self._tables, tables
        old.close()

    def close(self) -> None:
        self._tables.close()
        if self._warm_fd is not None:
            os.close(self._warm_fd)
            self._warm_fd = None


def _open_warm_file(path: str) -> int | None:
    """A read-only descriptor of the warm-up trace at `path` ("": none); a file that cannot be
    opened, or is no regular file, leaves the mapped clients' caches to start cold (the daemon's
    own cache checked it already where it has one)."""
    if not path:
        return None
    try:
        # Without O_NONBLOCK the open of a FIFO waits for a writer: the loop, which opens it
        # as the daemon becomes ready, then waited for good, deaf to `health` and SIGTERM.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        log.warning("hot_cache_warm_file %s: %s; mapped clients' caches start cold", path,
                    exc.strerror)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        log.warning("hot_cache_warm_file %s is not a regular file; mapped clients' caches start "
                    "cold", path)
        return None
    return fd


def attach_reply(record: ClientRecord, grants: MappedGrants, version: str | None,
                 tables_seq: int) -> tuple[AttachReply, list[int]]:
    """What an attached client maps: its slab (served) or the tables `version` (mapped), and the
    new descriptors to pass with it (the caller closes them once sent). Where they cannot be
    made, none is left open and the error raised (ResourceError for want of descriptors)."""
    fds: list[int] = []
    try:
        with passable():
            if record.slab is not None:
                fds.extend(record.slab.descriptors())
                return AttachReply(slab=record.slab.wire()), fds
            tables, table_fds = grants.tables()
            fds.extend(table_fds)
            warm_fd = grants.warm_file() if record.warm_file else None  # for its own cache
            if warm_fd is not None:
                fds.append(warm_fd)
            return AttachReply(tables=tables, version=version, tables_seq=tables_seq,
                               warm=warm_fd is not None), fds
    except Exception:  # out of descriptors, or the device would not export
        for fd in fds:
            os.close(fd)
        raise


@contextmanager
def passable() -> Iterator[None]:
    """Descriptors that cannot be made now (the daemon is out of them) are the client's
    ResourceError, which it may retry, not an internal error."""
    try:
        yield
    except OSError as exc:
        raise ResourceError(f"cannot pass descriptors now: {exc.strerror}") from None
