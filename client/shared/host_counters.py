"""A GPU slab's completion counters, in pinned host memory that the daemon and its client share.

The counters (client/shared/slab.py: IDS_READY, ROWS_DONE, FAILED, DONE_AT_RELEASE per slot) are written and waited on
by both processes' streams (cuStreamWriteValue32 / cuStreamWaitValue32 on the mapped host
address). Why host memory and not the slab's device memory: a stream wait holds up the hardware
queue it sits in, and streams share queues (more streams than CUDA_DEVICE_MAX_CONNECTIONS, and
every client of one MPS server). A release written by a GPU stream can therefore sit in a queue
behind the very wait it should release: under MPS, twenty killed clients left 12 slabs whose
daemon streams never drained, the release stream's writes queued behind their waits
(benchmarks/results/h200/README.md). A CPU store needs no queue: the daemon releases a dead
client's waits, and a client its own when the daemon is gone, whatever the GPU's queues hold.

One memfd per slab, sealed against resizing (a client holding the descriptor cannot shrink it
under the daemon's stores), mapped and registered (Portable|Mapped) by each side on its own.
Not sealed against a hole punched into it (fallocate PUNCH_HOLE, which needs write access, and
the client writes its counters): the daemon's stores would then go to a new page that no GPU
reads, and that client's own slab would stay allocated as stuck; no other client's counters
share the page.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

from engramd.client.shared.host_pin import HostRegistration
from engramd.client.shared.libc import mmap_at, munmap
from engramd.client.shared.slab import (
    DONE_AT_RELEASE,
    ROWS_DONE,
    SlabLayout,
    is_release,
    release_value,
)

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class HostCounters:
    """A mapping of a counter block, registered for the GPUs; close() unregisters and unmaps.

    Nothing may touch the counters after close(): the caller first synchronises every stream
    that writes or waits on them (the daemon: its slab stream has drained; the client: the
    device is synchronised)."""

    def __init__(self, fd: int, layout: SlabLayout, device: int):
        """Map `fd` and register it, in the context of GPU `device` (the slab's)."""
        self.layout = layout
        self.size = layout.counters_bytes
        have = os.fstat(fd).st_size
        if have < self.size:  # a mapping past the file's end faults (SIGBUS) when touched
            raise ValueError(f"counter block descriptor has {have} bytes, the layout needs {self.size}")
        self.base = mmap_at(None, self.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd)
        try:
            self._registration = HostRegistration([(self.base, self.size)], workers=1, device=device)
        except BaseException:
            munmap(self.base, self.size)
            raise
        self._words = (ctypes.c_uint32 * (self.size // 4)).from_address(self.base)
        self._fd: int | None = None

    @classmethod
    def create(cls, layout: SlabLayout, name: str, device: int) -> HostCounters:
        """A new zeroed counter block (the daemon's), whose descriptor() its client maps."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, layout.counters_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            counters = cls(fd, layout, device)
        except BaseException:
            os.close(fd)
            raise
        counters._fd = fd
        return counters

    def descriptor(self) -> int:
        """A new descriptor of the block (created here only), for the client; the caller closes it."""
        if self._fd is None:
            raise ValueError("only the block's creator hands out its descriptor")
        return os.dup(self._fd)

    def address(self, slot: int, word: int) -> int:
        """The word's address, for the streams of either side (unified addressing)."""
        return self.base + self.layout.counter_offset(slot, word)

    def load(self, slot: int, word: int) -> int:
        return self._words[self.layout.counter_offset(slot, word) // 4]

    def store(self, slot: int, word: int, value: int) -> None:
        """A CPU store: seen by every stream wait on the word, whatever the GPU queues hold."""
        self._words[self.layout.counter_offset(slot, word) // 4] = value & 0xFFFFFFFF

    def release(self, slot: int, last_seq: int) -> None:
        """Pass every wait on the slot's ROWS_DONE that a client can have made around `last_seq`
        (slab.release_value), first keeping in DONE_AT_RELEASE the seq its gathers had reached,
        unless an earlier release already overwrote it (slab.rows_written reads both)."""
        done = self.load(slot, ROWS_DONE)
        if not is_release(done, last_seq):
            self.store(slot, DONE_AT_RELEASE, done)
        self.store(slot, ROWS_DONE, release_value(last_seq))

    def unregister(self) -> None:
        """Unregister the block for the GPUs (it waits for the device); close() unmaps it."""
        if self.base:
            self._registration.unregister()

    def close_descriptor(self) -> None:
        """Let go of the creator's descriptor early (no client will be handed it again)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        if not self.base:
            return
        base, self.base = self.base, 0
        self._words = None
        try:
            self._registration.close()
        finally:
            munmap(base, self.size)
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
