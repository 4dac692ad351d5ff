"""Pinning host memory for the GPUs: cudaHostRegister of large ranges, fast.

Both sides pin tables that already sit in shared memory: the daemon its own files (at every
start, re-attached or freshly loaded), a mapped client its read-only mapping of them. On the
H200 a fresh process registers a 16 GiB /dev/shm file (benchmarks/results/h200/pin_probe.md) at
5.5 GB/s with Portable|Mapped, 17.9 GB/s adding ReadOnly (the driver need not prepare the pages
for device writes), 25 GB/s when eight threads first populate the page tables
(MADV_POPULATE_READ) and then register eight parts at once, and ~40 GB/s on hugetlbfs or in
/dev/shm pages collapsed into 2 MiB folios (37-39 GB/s, benchmarks/results/h200/thp_probe.md;
HostRegistration.of_files, client/shared/huge_pages.py). Threads without the prefault gain nothing.
cuda-python releases the GIL in these calls.

No torch here: the daemon pins its tables while it is still importing torch.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache

from engramd.client.shared.cuda import CudaError, check, cudart, enter_thread, require_cuda_python
from engramd.client.shared.huge_pages import HugeView
from engramd.client.shared.libc import libc

# The largest range registered in one call (docs/architecture.md, "Host tier").
REGISTER_CHUNK = 64 << 30
PART_ALIGN = 2 << 20  # parts start on 2 MiB boundaries: no two parts share a 2 MiB huge page
PIN_WORKERS = 8  # the fastest measured; more threads were no faster
_MADV_POPULATE_READ = 22  # Linux >= 5.14; older kernels answer EINVAL and the pin faults pages itself


def split_ranges(ranges: list[tuple[int, int]], parts: int) -> list[tuple[int, int]]:
    """Cut (address, nbytes) ranges into about `parts` pieces of one size overall: at most
    REGISTER_CHUNK, a multiple of PART_ALIGN (a range's last piece takes the rest)."""
    total = sum(n for _, n in ranges)
    target = max(PART_ALIGN, -(-total // max(1, parts)) // PART_ALIGN * PART_ALIGN)
    step = min(target, REGISTER_CHUNK)
    return [(address + start, min(step, nbytes - start))
            for address, nbytes in ranges for start in range(0, nbytes, step)]


class HostRegistration:
    """cudaHostRegister of host ranges (Portable|Mapped, optionally ReadOnly), in parts that
    `workers` threads prefault and register at once, each part checked to be device-visible at
    its own address (unified addressing: one host copy serves every GPU). `addresses`: each
    range's device-visible address. close() unregisters; a failed start unregisters what it did.
    of_files() registers files through HugeViews of their own (2 MiB pages where possible)."""

    def __init__(self, ranges: list[tuple[int, int]], read_only: bool = False,
                 workers: int = PIN_WORKERS, device: int | None = None,
                 views: list[HugeView] | None = None,
                 unregister_later: Callable[[HostRegistration], None] | None = None):
        """`device`: the GPU whose context the registering threads use (default: device 0, as a
        fresh thread's; a process on another GPU would get a context on GPU 0 for it). `views`:
        the mappings the ranges lie in, closed with it. `unregister_later`: where a failed
        start hands what it registered (the registration, to unregister and close), instead of
        unregistering it here: an unregister waits for the whole device, which a serving
        daemon must not do on any thread (server/quiet_gate.py)."""
        self.addresses = [address for address, _ in ranges]
        self._views: list[HugeView] = list(views or [])
        self._parts: list[int] = []
        try:
            require_cuda_python()
            flags = cudart.cudaHostRegisterPortable | cudart.cudaHostRegisterMapped
            if read_only and read_only_supported():  # the device only ever reads these pages
                flags |= cudart.cudaHostRegisterReadOnly
            parts = split_ranges(ranges, workers)
        except BaseException:
            self.close()  # nothing registered yet: the views go
            raise
        registered: list[int] = []  # list.append is atomic
        try:
            with ThreadPoolExecutor(max(1, workers), thread_name_prefix="engramd-pin") as pool:
                list(pool.map(_prefault, parts))
                list(pool.map(lambda part: registered.append(_register(part, flags, device)), parts))
        except BaseException:  # the pool has joined: every part that registered is listed
            self._parts = registered
            if registered and unregister_later is not None:
                unregister_later(self)
                raise
            try:
                self.close()
            except CudaError:
                pass  # the first error is the one to report
            raise
        self._parts = registered

    @classmethod
    def of_files(cls, files: list[tuple[int, int, int]], read_only: bool = False,
                 workers: int = PIN_WORKERS, device: int | None = None, collapse: bool = False,
                 unregister_later: Callable[[HostRegistration], None] | None = None) -> HostRegistration:
        """Register (fd, offset, nbytes) ranges of files, each file mapped for it by a HugeView
        (the caller may close the descriptors after): the pin walks 2 MiB pages where the
        file's pages are 2 MiB folios, which `collapse` makes them first (the daemon's pin
        only: client/shared/huge_pages.py). The views go with close(). `unregister_later` as
        for the constructor."""
        writable = not (read_only and read_only_supported())  # a read-only view needs the flag
        views: list[HugeView] = []
        try:
            for fd, _, _ in files:
                views.append(HugeView(fd, writable, workers if collapse else 0))
        except BaseException:
            for view in views:
                view.close()
            raise
        return cls([(view.address + offset, nbytes) for view, (_, offset, nbytes) in zip(views, files, strict=True)],
                   read_only, workers, device, views=views, unregister_later=unregister_later)

    @property
    def not_collapsed_bytes(self) -> int:
        """Bytes of the files of_files(collapse=True) mapped that it did not collapse."""
        return sum(view.collapsed_short for view in self._views)

    def unregister(self) -> None:
        """cudaHostUnregister of every part (it waits for the device: a daemon makes it through
        its quiet gate, server/quiet_gate.py); the views stay mapped until close()."""
        parts, self._parts = self._parts, []
        errors = []
        for address in parts:
            try:
                check("cudaHostUnregister", cudart.cudaHostUnregister(address))
            except CudaError as exc:
                errors.append(str(exc))
        if errors:  # a view still registered must stay mapped: the pages are the driver's
            self._views = []
            raise CudaError("; ".join(errors))

    def close(self) -> None:
        self.unregister()
        views, self._views = self._views, []
        for view in views:
            view.close()


def _prefault(part: tuple[int, int]) -> None:
    """Populate the page tables of a part (no GIL held): registering it then walks no faults."""
    address, nbytes = part
    start = address - address % mmap.PAGESIZE
    libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start),
                    _MADV_POPULATE_READ)  # failure only loses the speed-up


def _register(part: tuple[int, int], flags: int, device: int | None) -> int:
    """Register one part; on any failure after the registration, unregister it again."""
    address, nbytes = part
    if device is not None:
        enter_thread(device)
    check(f"cudaHostRegister({nbytes} bytes at {address:#x})",
          cudart.cudaHostRegister(address, nbytes, flags))
    try:
        device_ptr = int(check("cudaHostGetDevicePointer", cudart.cudaHostGetDevicePointer(address, 0)))
        if device_ptr != address:
            raise CudaError(f"registered host memory at {address:#x} maps to device address "
                            f"{device_ptr:#x}; engramd needs unified addressing")
    except BaseException:
        cudart.cudaHostUnregister(address)
        raise
    return address


@cache
def read_only_supported() -> bool:
    """Whether every visible GPU can register host memory read-only (asked once a process)."""
    count = int(check("cudaGetDeviceCount", cudart.cudaGetDeviceCount()))
    attribute = cudart.cudaDeviceAttr.cudaDevAttrHostRegisterReadOnlySupported
    return all(int(check("cudaDeviceGetAttribute", cudart.cudaDeviceGetAttribute(attribute, i)))
               for i in range(count))
