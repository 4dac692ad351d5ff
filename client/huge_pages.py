"""2 MiB pages for tables in tmpfs (/dev/shm), without a hugetlbfs pool: faster pinning.

Pinning walks page tables: a 64 GiB table in 4 KiB pages registers at 12-14 GB/s on the H200,
the same table on hugetlbfs (2 MiB pages) at 40-48 GB/s (benchmarks/results/h200/README.md), but
hugetlbfs needs a pool that root sets aside. In collapsed tmpfs folios: 37-39 GB/s, after a
one-time collapse at 7.3 GB/s (benchmarks/results/h200/thp_probe.md). tmpfs can hold 2 MiB folios as well: MADV_COLLAPSE
(Linux >= 6.1) turns a mapped range's pages into them whatever the THP settings say
(`shmem_enabled` may be `never`), and they stay in the file for every later mapping. A mapping
only uses them through PMD entries if it lies 2 MiB aligned with the file (Python's mmap does not
place it so) and the process asks, which MADV_COLLAPSE of a range of such folios does in
microseconds. So whoever registers a table for the GPUs maps its file aligned and collapses it
first (HugeView); the daemon collapses a table's pages once, when it loads it
(host_tables.py), so that a reader's collapse finds them done.

Everything here is best effort: on an older kernel, on pages pinned by another process (they
cannot move), or short of free 2 MiB blocks, the range stays in 4 KiB pages and works as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

from engramd.client.libc import MAP_FIXED, libc, mmap_at, munmap

HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25


def collapse(address: int, nbytes: int, workers: int) -> int:
    """MADV_COLLAPSE of [address, address + nbytes) in about `workers` parts at once (the
    kernel copies pages into new folios where they are small, ~0 s where they are not); the
    bytes left in small pages: those of the parts that failed, and those outside whole aligned
    2 MiB blocks (the kernel leaves them as they are)."""
    step = max(HUGE_PAGE, -(-nbytes // max(1, workers)) // HUGE_PAGE * HUGE_PAGE)
    parts = [(address + start, min(step, nbytes - start)) for start in range(0, nbytes, step)]

    def huge_bytes(part: tuple[int, int]) -> int:
        start, end = -(-part[0] // HUGE_PAGE) * HUGE_PAGE, (part[0] + part[1]) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            return 0
        failed = libc().madvise(ctypes.c_void_p(part[0]), ctypes.c_size_t(part[1]), _MADV_COLLAPSE)
        return 0 if failed else end - start

    with ThreadPoolExecutor(max(1, min(workers, len(parts))), thread_name_prefix="engramd-collapse") as pool:
        return nbytes - sum(pool.map(huge_bytes, parts))


class HugeView:
    """A file mapped whole, read-only, at a 2 MiB aligned address, its pages collapsed into 2
    MiB folios and mapped by PMDs where the kernel can. For the GPUs to register (the rows are
    read through Python's own mapping of the file); close() after unregistering."""

    def __init__(self, fd: int, workers: int):
        self.size = os.fstat(fd).st_size
        self.address = _map_aligned(fd, self.size)
        try:
            self.small_bytes = collapse(self.address, self.size, workers) if self.size else 0
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.address:
            munmap(self.address, self.size)
            self.address = 0


def collapse_file(fd: int, workers: int) -> int:
    """Collapse a whole file's pages into 2 MiB folios (the daemon, once it loaded a table);
    the bytes left in small pages."""
    view = HugeView(fd, workers)
    view.close()
    return view.small_bytes


def _map_aligned(fd: int, size: int) -> int:
    """`fd` mapped MAP_SHARED read-only from offset 0 at a 2 MiB aligned address: a reservation
    (PROT_NONE, 0) one huge page larger, the file mapped over its aligned part, the rest given
    back."""
    if size == 0:
        return 0
    span = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    reservation = mmap_at(None, span + HUGE_PAGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
    address = -(-reservation // HUGE_PAGE) * HUGE_PAGE
    try:
        mmap_at(address, size, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd)
    except BaseException:
        munmap(reservation, span + HUGE_PAGE)
        raise
    if address > reservation:
        munmap(reservation, address - reservation)
    if reservation + HUGE_PAGE > address:
        munmap(address + span, reservation + HUGE_PAGE - address)
    return address
