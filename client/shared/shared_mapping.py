"""A shared mapping of a descriptor whose address can outlive the descriptor: remap() puts
another descriptor's memory at the same address, so tensors viewing it read the new memory.

A CPU client maps its slab (a memfd) this way, so its rows stay where they were when a restarted
daemon hands it a new slab. The address is the mapping's for as long as any view of it lives:
the mapping is unmapped when the last tensor over it is freed, never under a view.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch

from engramd.client.shared.libc import MAP_FIXED, mmap_at, munmap

_PROT = mmap.PROT_READ | mmap.PROT_WRITE


class SharedMapping:
    def __init__(self, fd: int, size: int):
        self._check_size(fd, size)
        self.size = size
        self.address = mmap_at(None, size, _PROT, mmap.MAP_SHARED, fd)
        region = (ctypes.c_uint8 * size).from_address(self.address)
        unmap = weakref.finalize(region, munmap, self.address, size)  # torch keeps `region` alive
        unmap.atexit = False  # at exit a thread may still read a view; the exit unmaps anyway
        self.buffer: torch.Tensor | None = torch.frombuffer(region, dtype=torch.uint8)

    def remap(self, fd: int) -> None:
        """Replace the memory at this address by `fd`'s first `size` bytes (a view reads the old
        memory or the new one, never a hole). The mapping must still be viewed. Should the
        kernel refuse the new mapping after taking the old one away, zero pages are put there,
        so views read zeros instead of faulting; OSError either way."""
        if self.buffer is None:
            raise ValueError("the mapping was closed")
        self._check_size(fd, self.size)
        try:
            mmap_at(self.address, self.size, _PROT, mmap.MAP_SHARED | MAP_FIXED, fd)
        except OSError:
            mmap_at(self.address, self.size, _PROT,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED, -1)
            raise

    def close(self) -> None:
        """Drop this object's view; the memory goes with the last view of it."""
        self.buffer = None

    @staticmethod
    def _check_size(fd: int, size: int) -> None:
        have = os.fstat(fd).st_size
        if have < size:  # a mapping past the file's end faults (SIGBUS) when read
            raise ValueError(f"descriptor has {have} bytes, the mapping needs {size}")
