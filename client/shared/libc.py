"""The C library calls engramd makes through ctypes (no torch, no CUDA): declared once a process."""

from __future__ import annotations

import ctypes
import os
from functools import cache

MAP_FIXED = 0x10  # Linux; Python's mmap module does not export it
MAP_FAILED = ctypes.c_void_p(-1).value


@cache
def libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]
    lib.mmap.restype = ctypes.c_void_p
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.munmap.restype = ctypes.c_int
    lib.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    lib.statfs.restype = ctypes.c_int
    return lib


def mmap_at(address: int | None, size: int, prot: int, flags: int, fd: int) -> int:
    """mmap(2) of `fd` from offset 0; the mapping's address, or OSError."""
    got = libc().mmap(address, size, prot, flags, fd, 0)
    if got is None or got == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    return got


def munmap(address: int, size: int) -> None:
    libc().munmap(address, size)


def filesystem_type(path: str | os.PathLike) -> int:
    """statfs(2)'s f_type (the filesystem's magic number) of the filesystem holding `path`, or
    OSError; os.statvfs does not report the type."""
    buffer = ctypes.create_string_buffer(256)  # struct statfs (120 bytes), f_type its first field
    if libc().statfs(os.fsencode(path), buffer) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF
