"""The host tables of the benchmarks: V4.1-shaped geometries, random rows in /dev/shm over a
sparse checkpoint that the daemon re-attaches, and the demo tables of the CPU-backend runs.

The checkpoint holds headers only (its tensor bytes are holes), enough to open and fingerprint:
the daemon finds complete table files of that fingerprint in the shm folder and re-attaches them,
so no checkpoint of tens of GB is ever written or read. Its rows are random bytes, so the daemon's
self-check has nothing to compare against and is switched off (reattach_flags).
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from engramd.client.geometry import V41_FLASH_CONFIG, TableGeometry
from engramd.server.checkpoint import EngramCheckpoint, scale_name, weight_name
from engramd.server.host_tables import TableStore
from engramd.server.synthetic import BLOCK_ROWS, synthetic_packed_rows, write_synthetic_checkpoint
from engramd.server.table_file import HostTable
from engramd.server.table_loader import tables_folder

INSTANCE = "bench"  # the daemon instance the tables belong to (it names their files)
ROW_BYTES = 264  # V4.1: 256 E4M3 weights + 8 UE8M0 scales
ROWS_PER_TOKEN = 48  # 2 layers x 24 heads


def v41_geometry(rows_per_bucket: int, source: str = "config") -> TableGeometry:
    """V4.1's shape (2 layers x 24 prime buckets) with buckets of about `rows_per_bucket` rows."""
    config = {k: v for k, v in V41_FLASH_CONFIG.items() if k != "engram_num_embeddings"}
    return TableGeometry.from_config({**config, "engram_vocab_size": rows_per_bucket},
                                     source=source)


def geometry_for(table_gib: float) -> TableGeometry:
    """A V4.1-shaped table of at least `table_gib` GiB of rows in all."""
    return v41_geometry(int(table_gib * 2**30 / ROW_BYTES / ROWS_PER_TOKEN) + 1)


def write_sparse_checkpoint(geometry: TableGeometry, out: Path) -> None:
    """A valid checkpoint whose tensor bytes are holes: enough to open and fingerprint."""
    out.mkdir(parents=True)
    weight_map = {}
    for i, layer_id in enumerate(geometry.layer_ids):
        for name, dtype, width in ((weight_name(layer_id), "F8_E4M3", geometry.head_dim),
                                   (scale_name(layer_id), "F8_E8M0", geometry.scale_bytes)):
            nbytes = geometry.rows[i] * width
            header = json.dumps({name: {"dtype": dtype, "shape": [geometry.rows[i], width],
                                        "data_offsets": [0, nbytes]}}).encode()
            header += b" " * (-len(header) % 8)
            path = out / f"{name}.safetensors"
            with open(path, "wb") as f:
                f.write(len(header).to_bytes(8, "little") + header)
                f.truncate(8 + len(header) + nbytes)
            weight_map[name] = path.name
    (out / "config.json").write_text(json.dumps(geometry.to_config()))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


class RandomRows:
    """Table source for TableStore: random bytes made on the GPU (fast), fingerprint of the ckpt."""

    def __init__(self, checkpoint: EngramCheckpoint):
        self.geometry = checkpoint.geometry
        self._fingerprint = checkpoint.fingerprint()

    def fingerprint(self) -> str:
        return self._fingerprint

    def read_packed(self, layer_index: int, row_start: int, out: np.ndarray) -> None:
        data = torch.randint(0, 256, out.shape, dtype=torch.uint8, device="cuda")
        torch.from_numpy(out).copy_(data.cpu())


class CpuRandomRows(RandomRows):
    """RandomRows without a GPU (for CPU smoke runs): seeded numpy bytes."""

    def read_packed(self, layer_index: int, row_start: int, out: np.ndarray) -> None:
        rng = np.random.default_rng([layer_index, row_start])
        out[:] = rng.integers(0, 256, size=out.shape, dtype=np.uint8)


@contextmanager
def random_tables(geometry: TableGeometry, checkpoint: Path, shm: Path, instance: str,
                  backend: str = "cuda") -> Iterator[list[HostTable]]:
    """Write the sparse checkpoint to `checkpoint` and fill its tables in `shm` as daemon
    `instance` would; yields them open (drop every view of them before the block ends)."""
    write_sparse_checkpoint(geometry, checkpoint)
    source_type = RandomRows if backend == "cuda" else CpuRandomRows
    started = time.monotonic()
    with TableStore(tables_folder(shm, instance), instance) as store:  # where the daemon looks
        tables = store.open(source_type(EngramCheckpoint.open(checkpoint)))
        print(f"filled {geometry.total_bytes / 2**30:.1f} GiB in "
              f"{time.monotonic() - started:.1f} s", flush=True)
        yield tables


def fill_tables(geometry: TableGeometry, checkpoint: Path, shm: Path, instance: str,
                backend: str = "cuda") -> list[dict]:
    """random_tables, closed again; returns where each layer's rows are (for MappedTable)."""
    with random_tables(geometry, checkpoint, shm, instance, backend) as tables:
        return [{"path": str(t.path), "data_offset": t.data_offset, "rows": t.rows,
                 "row_bytes": t.row_bytes} for t in tables]


def reattach_flags(checkpoint: Path, shm: Path, instance: str) -> list[str]:
    """`engramd serve` flags of a daemon that re-attaches the tables random_tables filled."""
    return ["--tables", str(checkpoint), "--shm-dir", str(shm), "--instance", instance,
            "--self-check", "false"]


def cpu_demo_flags(work: Path, shm: Path) -> list[str]:
    """`engramd serve` flags of a CPU daemon on the demo tables, written to work/tables."""
    tables = work / "tables"
    write_synthetic_checkpoint(TableGeometry.named("demo"), tables, seed=1)
    return ["--tables", str(tables), "--shm-dir", str(shm), "--backend", "cpu",
            "--metrics-address", "127.0.0.1:0"]


class MappedTable:
    """A table file mapped MAP_SHARED the way the daemon maps it: what PinnedTables needs.

    The store's HostTable cannot be used here: opening the store takes the instance lock, and the
    point is that a process maps the same file on its own, as engines with their own tables do.
    It keeps its descriptor (`fd`, `data_offset`) as HostTable does: register_for_gpus maps the file
    through a view of its own (client/shared/huge_pages.py).
    """

    def __init__(self, path: str, data_offset: int, rows: int, row_bytes: int):
        self.path = path
        self.data_offset = data_offset
        self.rows = rows
        self.row_bytes = row_bytes
        self.nbytes = rows * row_bytes
        self.fd = os.open(path, os.O_RDWR)
        try:
            self._mapping = mmap.mmap(self.fd, data_offset + self.nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.array: np.ndarray | None = np.frombuffer(
            self._mapping, dtype=np.uint8, count=self.nbytes, offset=data_offset,
        ).reshape(rows, row_bytes)
        self.address = self.array.ctypes.data  # row 0, as HostTable.address

    def close(self) -> None:
        self.array = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._mapping.close()
        except BufferError:
            pass  # a tensor view is still alive; the mapping goes with it


def pin_as_reader(tables: list[MappedTable]):
    """`tables` registered for the GPUs as an engine with its own tables would: through views
    of its own, as a reader (the daemon's pin made the pages 2 MiB folios; a reader only maps
    them). A PinnedTables (server/cuda_backend.py); needs CUDA."""
    from engramd.server.cuda_backend import PinnedTables
    from engramd.server.table_registration import register_for_gpus

    return PinnedTables(tables, register_for_gpus(tables, collapse=False))


# -- synthetic rows, reproducible: the engine benchmarks fill the engine's copy and the daemon's
# from one definition (server/synthetic.synthetic_packed_rows of (seed, layer, row)).

PART_ROWS = 16 * BLOCK_ROWS  # rows per thread task: 17 MB of packed rows, whole generator blocks


def threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def in_parts(start: int, stop: int, fill: Callable[[int, int], None]) -> None:
    """fill(lo, hi) over [start, stop) in parts of PART_ROWS, by threads side by side."""
    with ThreadPoolExecutor(threads()) as pool:
        list(pool.map(lambda lo: fill(lo, min(stop, lo + PART_ROWS)),
                      range(start, stop, PART_ROWS)))


class SyntheticRows(RandomRows):
    """A TableStore source: synthetic_packed_rows of `seed` under the fingerprint of the sparse
    checkpoint (RandomRows' own rows are random, not reproducible)."""

    def __init__(self, checkpoint: EngramCheckpoint, seed: int):
        super().__init__(checkpoint)
        self.seed = seed

    def read_packed(self, layer_index: int, row_start: int, out: np.ndarray) -> None:
        def fill(lo: int, hi: int) -> None:
            synthetic_packed_rows(self.geometry, layer_index, lo, hi, self.seed,
                                  out=out[lo - row_start:hi - row_start])

        in_parts(row_start, row_start + len(out), fill)


def fill_daemon_tables(geometry: TableGeometry, checkpoint: Path, shm: Path, seed: int) -> float:
    """The sparse checkpoint at `checkpoint` and its tables in `shm`, filled as daemon INSTANCE
    would fill them (common/tables.reattach_flags starts one that re-attaches them). Returns the
    seconds it took."""
    started = time.monotonic()
    write_sparse_checkpoint(geometry, checkpoint)
    source = SyntheticRows(EngramCheckpoint.open(checkpoint), seed)
    with TableStore(tables_folder(shm, INSTANCE), INSTANCE) as store:
        # Chunks of a part per thread, so that the threads fill each chunk together.
        store.open(source, chunk_bytes=threads() * PART_ROWS * geometry.row_bytes)
        # Closing the store unmaps the tables; their files stay for the daemon.
    return time.monotonic() - started
