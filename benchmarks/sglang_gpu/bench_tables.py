"""bench_lookup.py's Engram table, filled twice from one definition: into SGLang's own table
parameters (EngramEmbedding's `weight`, FP8, and `scale`, UE8M0, in device memory on the GPU),
and into the /dev/shm table files that the daemon re-attaches (common/tables.fill_daemon_tables,
as the vLLM benchmark's).

Every byte is server/synthetic.py's `synthetic_packed_rows` of (seed, layer, row), whatever the
chunking; its scale bytes lie in 127 +- 20, where SGLang's dequantization and engramd's agree,
and its weights hold no FP8 NaN pattern (benchmarks/vllm_gpu/bench_tables.py says more). Threads
make block-aligned parts side by side (numpy's generators release the GIL) and copy each into
the parameters where they are.

What this is not: SGLang's loader. SGLang's weight loader copies a whole checkpoint tensor in
(`param.data.copy_(loaded[rows])`: a host copy as large as the table); the parameters' bytes
are the same.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from engramd.client.geometry import TableGeometry
from engramd.server.synthetic import synthetic_packed_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.tables import in_parts  # noqa: E402


def fill_sglang_tables(layers, geometry: TableGeometry, seed: int) -> float:
    """Every row of each SGLang Engram layer's table, written into its parameters; returns the
    seconds it took (the device's copies included)."""
    started = time.monotonic()
    for layer in layers:
        table, index = layer.embed, layer.layer_hash_index
        if (table.row_start, table.rows) != (0, geometry.rows[index]):
            raise ValueError(f"layer {index}: SGLang holds rows [{table.row_start}, "
                             f"{table.row_start + table.rows}), not the whole table (TP=1 "
                             "expected)")
        weight = table.weight.data.view(torch.uint8)
        scale = table.scale.data.view(torch.uint8)

        def fill(lo: int, hi: int, index=index, weight=weight, scale=scale) -> None:
            packed = torch.from_numpy(synthetic_packed_rows(geometry, index, lo, hi, seed))
            weight[lo:hi].copy_(packed[:, :geometry.head_dim])
            scale[lo:hi].copy_(packed[:, geometry.head_dim:])

        in_parts(0, geometry.rows[index], fill)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.monotonic() - started


def table_bytes(layers) -> int:
    """Bytes of SGLang's tables (weights and scales) across the layers."""
    return sum(layer.embed.weight.nbytes + layer.embed.scale.nbytes for layer in layers)
