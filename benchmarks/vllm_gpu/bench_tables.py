"""bench_lookup.py's Engram table, filled twice from one definition: into vLLM's own table
parameters (here), and into the /dev/shm table files that the daemon re-attaches
(common/tables.fill_daemon_tables).

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

import sys
import time
from pathlib import Path

import torch

from engramd.client.geometry import TableGeometry
from engramd.server.synthetic import synthetic_packed_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.tables import in_parts  # noqa: E402


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
