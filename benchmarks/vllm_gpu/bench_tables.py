"""bench_lookup.py's Engram table, filled twice from one definition: into vLLM's own table
parameters, and into the /dev/shm table files that the daemon re-attaches.

The two copies never exist at once (vLLM's pinned copy and the daemon's shared-memory copy of a
64 GiB table do not fit beside each other in the GPU machine's 128 GiB), so each phase fills its
own from server/synthetic.py's `synthetic_packed_rows`: every byte a function of (seed, layer,
row) alone, whatever the chunking. Its scale bytes lie in 127 +- 20, where vLLM's dequantization
(the float32 bit-cast `s << 23`) and engramd's exact 2^(s - 127) agree on every value (they part
at scale bytes 0 and 255 only: README.md), and its weights hold no FP8 NaN pattern. Threads fill
block-aligned ranges side by side (numpy's generators release the GIL).

What this is not: the daemon's loader. The daemon re-attaches the files filled here, found by the
fingerprint of a sparse checkpoint (benchmarks/common/tables.py), as model_step.py's tables are.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from engramd.client.geometry import TableGeometry
from engramd.server.checkpoint import EngramCheckpoint
from engramd.server.host_tables import TableStore
from engramd.server.synthetic import BLOCK_ROWS, synthetic_packed_rows
from engramd.server.table_loader import tables_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.tables import INSTANCE, RandomRows, write_sparse_checkpoint  # noqa: E402

PART_ROWS = 16 * BLOCK_ROWS  # rows per thread task: 17 MB of packed rows, whole generator blocks


def threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def in_parts(start: int, stop: int, fill: Callable[[int, int], None]) -> None:
    """fill(lo, hi) over [start, stop) in parts of PART_ROWS, by threads side by side."""
    with ThreadPoolExecutor(threads()) as pool:
        list(pool.map(lambda lo: fill(lo, min(stop, lo + PART_ROWS)),
                      range(start, stop, PART_ROWS)))


def fill_vllm_tables(layers, geometry: TableGeometry, seed: int) -> float:
    """Every row of each vLLM Engram layer's table (ParallelEngramEmbedding's `weight`, FP8, and
    `weight_scale_inv`, UE8M0 bytes), written into its parameters where they are (pinned host
    memory with cpu_offload). vLLM's loader would copy whole checkpoint tensors in through the
    weight loader; the parameters' bytes are the same. Returns the seconds it took."""
    started = time.monotonic()
    for layer in layers:
        table, index = layer.embed_tokens, layer.layer_hash_index
        if (table.vocab_start_idx, table.vocab_end_idx) != (0, geometry.rows[index]):
            raise ValueError(f"layer {index}: vLLM holds rows [{table.vocab_start_idx}, "
                             f"{table.vocab_end_idx}), not the whole table (TP=1 expected)")
        weight = table.weight.data.view(torch.uint8).numpy()
        scales = table.weight_scale_inv.data.numpy()

        def fill(lo: int, hi: int, index=index, weight=weight, scales=scales) -> None:
            packed = synthetic_packed_rows(geometry, index, lo, hi, seed)
            weight[lo:hi] = packed[:, :geometry.head_dim]
            scales[lo:hi] = packed[:, geometry.head_dim:]

        in_parts(0, geometry.rows[index], fill)
    return time.monotonic() - started


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
