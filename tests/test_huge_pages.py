"""2 MiB pages for tables in tmpfs (client/shared/huge_pages.py), checked against the kernel's own
account (/proc/self/smaps): a HugeView maps the whole file aligned and reads exactly its bytes;
a collapsing view (the daemon's pin) turns the file's whole 2 MiB blocks into folios and says
how many bytes it could not; a reader's view (a client's, a standby's) never collapses, and maps
folios already made by PMDs as it faults them in; a writable view writes the file; close()
leaves no mapping behind, the reservation's ends included. Pinning through these views is a GPU
test (tests/gpu/test_host_pin_gpu.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import remove_tempdir, shm_tempdir

from engramd.client.shared.huge_pages import HUGE_PAGE, HugeView
from engramd.client.shared.libc import MAP_FIXED, libc, mmap_at, munmap

WHOLE_BLOCKS = 9  # the file: 9 huge pages and one 4 KiB page


def pmd_mapped(address: int) -> int:
    """ShmemPmdMapped bytes of this process's mapping that starts at `address`."""
    blocks = Path("/proc/self/smaps").read_text().split("\n" + format(address, "x") + "-")
    assert len(blocks) == 2, f"no mapping at {address:#x}"
    return int(re.search(r"ShmemPmdMapped:\s+(\d+) kB", blocks[1])[1]) << 10


def reserved() -> set[str]:
    """This process's PROT_NONE mappings (a view's reservation is one while it is made)."""
    return {line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines()
            if line.split()[1].startswith("---")}


def file_mappings(fd: int) -> list[str]:
    """This process's mappings of `fd`'s file: its device and inode (an inode number alone can
    be another file system's, say a shared library's)."""
    st = os.fstat(fd)
    return [line for line in Path("/proc/self/maps").read_text().splitlines()
            if _device_and_inode(line) == (st.st_dev, st.st_ino)]


def _device_and_inode(maps_line: str) -> tuple[int, int]:
    major, minor = maps_line.split()[3].split(":")
    return os.makedev(int(major, 16), int(minor, 16)), int(maps_line.split()[4])


def leftovers(fd: int, before: set[str]) -> list[str]:
    """What a closed view may have left: a mapping of its file, or a PROT_NONE mapping that
    was not there before it was made. Only for views made without threads (no collapse):
    new threads' stacks and malloc arenas bring PROT_NONE mappings of their own."""
    return file_mappings(fd) + sorted(reserved() - before)


def touch_every_page(address: int, size: int) -> None:
    for offset in range(0, size, mmap.PAGESIZE):
        ctypes.c_ubyte.from_address(address + offset).value  # noqa: B018 (a read faults it in)


@pytest.fixture(scope="module")
def kernel_collapses() -> bool:
    """Whether this kernel makes 2 MiB folios of tmpfs pages on MADV_COLLAPSE (Linux >= 6.1),
    asked without the module under test: a 2 MiB file mapped aligned by hand."""
    folder = shm_tempdir()  # the answer is what the module keeps; the probe goes at once
    try:
        path = folder / "probe"
        path.write_bytes(b"\1" * HUGE_PAGE)
        fd = os.open(path, os.O_RDONLY)
        reservation = mmap_at(None, 2 * HUGE_PAGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
        address = -(-reservation // HUGE_PAGE) * HUGE_PAGE
        try:
            mmap_at(address, HUGE_PAGE, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd)
            libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(HUGE_PAGE), 25)
            return pmd_mapped(address) == HUGE_PAGE
        finally:
            munmap(reservation, 2 * HUGE_PAGE)
            os.close(fd)
    finally:
        remove_tempdir(folder)


@pytest.fixture
def table_file(shm_dir):
    path = shm_dir / "table"
    data = np.random.default_rng(3).integers(0, 256, WHOLE_BLOCKS * HUGE_PAGE + 4096,
                                             dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def test_the_daemons_view_collapses_the_file_and_says_what_it_could_not(table_file, kernel_collapses):
    fd, data = table_file
    view = HugeView(fd, collapse_workers=4)
    address = view.address
    try:
        assert address % HUGE_PAGE == 0 and view.size == len(data)
        assert ctypes.string_at(address, len(data)) == data
        # What it says it could not collapse is what the kernel maps with small pages. The last
        # page always; a block the kernel found no free 2 MiB page for at that moment too (a
        # busy machine's memory is fragmented), so only some collapse is required of it.
        assert view.collapsed_short == len(data) - pmd_mapped(address)
        if kernel_collapses:
            assert 4096 <= view.collapsed_short < len(data) - HUGE_PAGE, "hardly any block collapsed"
        else:
            assert view.collapsed_short == len(data)
    finally:
        view.close()
    assert not file_mappings(fd)
    assert os.pread(fd, len(data), 0) == data


def test_a_readers_view_maps_folios_by_pmds_and_never_collapses(table_file, kernel_collapses):
    fd, data = table_file
    before = reserved()
    reader = HugeView(fd)  # small pages: a reader leaves them so
    try:
        touch_every_page(reader.address, reader.size)
        assert pmd_mapped(reader.address) == 0 and reader.collapsed_short == len(data)
    finally:
        reader.close()
    assert not leftovers(fd, before)  # nothing left of the view or its reservation
    HugeView(fd, collapse_workers=2).close()  # the daemon's pin
    reader = HugeView(fd)
    try:
        touch_every_page(reader.address, reader.size)
        assert pmd_mapped(reader.address) == (WHOLE_BLOCKS * HUGE_PAGE if kernel_collapses else 0)
        assert ctypes.string_at(reader.address, len(data)) == data
    finally:
        reader.close()


def test_a_writable_view_writes_the_file(table_file):
    fd, data = table_file
    before = reserved()
    view = HugeView(fd, writable=True)  # fd is read-only: the view reopens the file to write
    address = view.address
    try:
        ctypes.memmove(address + HUGE_PAGE + 5, b"engram", 6)
    finally:
        view.close()
    assert os.pread(fd, 6, HUGE_PAGE + 5) == b"engram"
    assert not leftovers(fd, before)
