"""2 MiB pages for tables in tmpfs (/dev/shm), without a hugetlbfs pool: faster pinning.

Pinning walks page tables: a 64 GiB table in 4 KiB pages registers at 12-14 GB/s on the H200,
the same table on hugetlbfs (2 MiB pages) at 40-48 GB/s (benchmarks/results/h200/README.md), but
hugetlbfs needs a pool that root sets aside. tmpfs can hold 2 MiB folios as well: MADV_COLLAPSE
(Linux >= 6.1) turns a mapped range's pages into them whatever the THP settings say
(`shmem_enabled` may be `never`), a copy at ~7 GB/s, and they stay in the file for every later
mapping. A mapping that lies aligned with the file (Python's mmap does not place it so) then
maps them by PMDs as it faults them in, and pins at 37-39 GB/s
(benchmarks/results/h200/thp_probe.md).

Who does what: the daemon collapses a table when it pins it (server/table_registration.py: once
per loaded table; later pins find the folios made). Everyone who pins a table (the daemon, a
standby, a mapped client) maps it through a HugeView; only the daemon asks for the collapse,
so a client never pays for a copy (nor is its memory cgroup charged for one).

Everything here is best effort: on an older kernel, on pages another process holds pinned (they
cannot move), or short of free 2 MiB blocks, the range stays in 4 KiB pages and works as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

from engramd.client.shared.libc import MAP_FIXED, libc, mmap_at, munmap

HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25


def collapse(address: int, nbytes: int, workers: int) -> int:
    """MADV_COLLAPSE of [address, address + nbytes) in about `workers` parts at once (the
    kernel copies pages into new folios where they are small, ~0 s where they are not); the
    bytes not collapsed: those of the parts that failed (on hugetlbfs, all: its pages need
    none), and those outside whole aligned 2 MiB blocks (the kernel leaves them as they are)."""
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
    """A file mapped whole at an address aligned for its largest pages (2 MiB, or the
    filesystem's block on hugetlbfs), read-only unless `writable`, for the GPUs to register:
    the rows' CPU reads go through the store's own mapping. With `collapse_workers`, the file's
    pages are collapsed into 2 MiB folios first (`collapsed_short`: the bytes that were not).
    close() after unregistering."""

    def __init__(self, fd: int, writable: bool = False, collapse_workers: int = 0):
        self.size = os.fstat(fd).st_size
        self.address = _map_aligned(fd, self.size, writable)
        self.collapsed_short = self.size
        try:
            if collapse_workers and self.size:
                self.collapsed_short = collapse(self.address, self.size, collapse_workers)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.address:
            munmap(self.address, self.size)
            self.address = 0


def _map_aligned(fd: int, size: int, writable: bool) -> int:
    """`fd` mapped MAP_SHARED from offset 0 at an aligned address: a reservation (PROT_NONE, 0)
    one alignment larger, the file mapped over its aligned part, the rest given back. A
    writable view reopens the file for writing through /proc (the path is not looked up)."""
    if size == 0:
        return 0
    align = max(HUGE_PAGE, os.fstatvfs(fd).f_bsize)
    span = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    reservation = mmap_at(None, span + align, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
    address = -(-reservation // align) * align
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    try:
        if writable:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                mmap_at(address, size, prot, mmap.MAP_SHARED | MAP_FIXED, rw)
            finally:
                os.close(rw)
        else:
            mmap_at(address, size, prot, mmap.MAP_SHARED | MAP_FIXED, fd)
    except BaseException:
        munmap(reservation, span + align)
        raise
    if address > reservation:
        munmap(reservation, address - reservation)
    if reservation + align > address:
        munmap(address + span, reservation + align - address)
    return address
