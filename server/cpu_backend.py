"""CPU backend: shared-memory slabs and the plain-torch reference gather on a thread pool.

It makes the whole service runnable where there is no GPU (CI, laptops) and is the second
implementation the CUDA backend is tested against. Completion is the reply message: the client
reads its rows from the slab once the daemon has answered.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from engramd.client.errors import BadRequestError, ResourceError
from engramd.client.geometry import ShardView, TableGeometry
from engramd.client.ids import ID_DTYPES
from engramd.client.slab import SlabLayout
from engramd.kernels.gather_ref import gather
from engramd.server.backend import Completion, LookupJob

log = logging.getLogger("engramd.cpu")


class ShmSlab:
    """A slab in a shared-memory file the client maps by path. Owns the file and the mapping."""

    def __init__(self, path: Path, layout: SlabLayout):
        self.path = path
        self.layout = layout
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.fchmod(fd, 0o660)  # the umask must not narrow what the client's group may open
            # Reserve the pages now: a full /dev/shm must fail here with ENOSPC, not later
            # with SIGBUS inside a gather.
            os.posix_fallocate(fd, 0, layout.size)
            self._map = mmap.mmap(fd, layout.size, mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ResourceError(f"cannot create slab {path} of {layout.size} bytes: {exc.strerror}") from None
        os.close(fd)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)

    def ids(self, slot: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        return self.layout.ids_view(self.buffer, slot, tokens, dtype)

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        return self.layout.rows_view(self.buffer, slot, tokens)

    def wire(self) -> dict[str, Any]:
        return {"kind": "shm", "path": str(self.path), "layout": self.layout.to_wire()}

    def close(self) -> None:
        if self._map is None:
            return
        del self.buffer
        try:
            self._map.close()
        except BufferError:
            pass  # a view outlives us; the mapping is freed with it, the file is unlinked now
        self._map = None
        self.path.unlink(missing_ok=True)


class CpuBackend:
    name = "cpu"
    orders_slots = False

    def __init__(self, tables: list[torch.Tensor], geometry: TableGeometry, shm_dir: Path,
                 file_prefix: str, workers: int):
        self.tables = tables
        self.geometry = geometry
        self.shm_dir = Path(shm_dir)
        self.file_prefix = file_prefix
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engramd-gather")

    def allocate_slab(self, device: str, layout: SlabLayout, client_id: int, shard: ShardView) -> ShmSlab:
        if device != "cpu":
            raise BadRequestError(f"device {device!r} not served: this daemon runs the cpu backend")
        return ShmSlab(self.shm_dir / f"{self.file_prefix}.c{client_id}.slab", layout)

    def submit(self, job: LookupJob, done: Completion) -> None:
        self._pool.submit(self._run, job, done)

    def _run(self, job: LookupJob, done: Completion) -> None:
        try:
            slab = job.slab
            ids = slab.ids(job.slot, job.tokens, ID_DTYPES[job.ids_dtype])
            if job.inline_ids is not None:
                ids.copy_(torch.from_numpy(job.inline_ids.copy()))
            _, job.out_of_range = gather(self.tables, ids, job.shard, out=slab.rows(job.slot, job.tokens))
        except BaseException as exc:  # reported to the client; the worker must survive
            log.exception("gather failed for client %d slot %d", job.client_id, job.slot)
            job.error = exc
        job.context["enqueued"] = time.perf_counter()  # on the CPU: the rows are written
        done(job)

    def mps_states(self) -> dict:
        return {}  # no GPU, so nothing to share

    def check_gather(self, ids: torch.Tensor):
        """(where, rows) of a full-shard lookup of `ids`, for the start-up self-check."""
        yield "cpu", gather(self.tables, ids, self.geometry.shard(0, 1))[0]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.tables = []  # drop the table views so the host tables can be unmapped
