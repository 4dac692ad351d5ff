"""2 MiB pages for tables in tmpfs (client/huge_pages.py): a HugeView maps the whole file at a
2 MiB aligned address and reads exactly the file's bytes; what it reports as left in small
pages agrees with the kernel's own account (/proc/self/smaps); close() leaves no mapping
behind, the reservation's ends included. Whoever pins a table maps it this way
(host_pin.HostRegistration.of_files): pinning that is a GPU test (tests/gpu/test_host_pin_gpu.py)."""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np
import pytest

from engramd.client.huge_pages import HUGE_PAGE, HugeView, collapse_file
from tests.conftest import shm_tempdir


def pmd_mapped(address: int) -> int:
    """ShmemPmdMapped bytes of this process's mapping that starts at `address`."""
    blocks = Path("/proc/self/smaps").read_text().split("\n" + format(address, "x") + "-")
    assert len(blocks) == 2, f"no mapping at {address:#x}"
    return int(re.search(r"ShmemPmdMapped:\s+(\d+) kB", blocks[1])[1]) << 10


def leftovers(address: int, size: int, fd: int) -> list[str]:
    """Mappings of this process that are the view's or its reservation's: of the file, or
    PROT_NONE ones overlapping the view or the huge page on either side of it."""
    inode = os.fstat(fd).st_ino
    lo, hi = address - HUGE_PAGE, address + size + HUGE_PAGE
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms, _, _, line_inode = line.split()[:5]
        start, end = (int(x, 16) for x in span.split("-"))
        if int(line_inode) == inode or (perms.startswith("---") and start < hi and end > lo):
            found.append(line)
    return found


@pytest.fixture
def table_file():
    """A file in shared memory of 9 huge pages and one 4 KiB page, random bytes."""
    path = shm_tempdir() / "table"
    data = np.random.default_rng(3).integers(0, 256, 9 * HUGE_PAGE + 4096, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def test_a_huge_view_reads_the_file_and_reports_its_small_pages_as_the_kernel_does(table_file):
    fd, data = table_file
    view = HugeView(fd, workers=4)
    address = view.address
    try:
        assert view.address % HUGE_PAGE == 0 and view.size == len(data)
        assert ctypes.string_at(view.address, len(data)) == data
        # The kernel's account: the whole huge pages it maps by PMDs; the tail page is small.
        assert view.small_bytes == len(data) - pmd_mapped(view.address)
        assert view.small_bytes in (4096, len(data))  # all collapsed, or (an old kernel) none
    finally:
        view.close()
    assert not leftovers(address, len(data), fd)  # nothing left of the view or its reservation
    again = HugeView(fd, workers=1)  # a second reader finds the folios made: the same outcome
    try:
        assert again.small_bytes == view.small_bytes
        assert ctypes.string_at(again.address, len(data)) == data
    finally:
        again.close()


def test_collapsing_a_file_keeps_its_bytes(table_file):
    fd, data = table_file
    assert collapse_file(fd, workers=3) in (4096, len(data))
    assert os.pread(fd, len(data), 0) == data
