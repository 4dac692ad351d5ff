"""Row IDs [tokens, n_layers, heads] int64 for the benchmarks, drawn on the device before timing.

Three draws, each kept by the scripts whose committed results were measured with it:
  bucket_ids    uniform in each head's bucket [offset, offset + prime), as hashing makes them,
                from a seeded generator, optionally with DEAD_ID mixed in (gather_layouts, sm_cap);
  layer_rows    uniform over each layer's rows, randint per layer (model_step);
  scaled_rows   float32 rand scaled by each layer's rows (gpu_lookup, mapped_attach). float32 has
                24 bits of fraction, so it reaches at most 2^24 distinct rows of a layer: fewer
                than a table of tens of GiB holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engramd.client.geometry import DEAD_ID, TableGeometry


def bucket_ids(geometry: TableGeometry, tokens: int, count: int, device: torch.device,
               generator: torch.Generator, dead_fraction: float = 0.0) -> list[Tensor]:
    """`count` batches, uniform in each head's bucket (as hashed); `dead_fraction` of DEAD_ID."""
    primes = torch.tensor(geometry.primes, dtype=torch.int64, device=device)
    offsets = torch.tensor(geometry.offsets, dtype=torch.int64, device=device)
    shape = (tokens, geometry.n_layers, geometry.heads)
    batches = []
    for _ in range(count):
        # The modulo bias of 2^62 over a bucket of < 2^31 rows is below 1e-9.
        ids = torch.randint(0, 2**62, shape, dtype=torch.int64, device=device, generator=generator)
        ids = ids % primes + offsets
        if dead_fraction:
            dead = torch.rand(shape, device=device, generator=generator) < dead_fraction
            ids[dead] = DEAD_ID
        batches.append(ids)
    return batches


def layer_rows(geometry: TableGeometry, tokens: int, count: int) -> list[Tensor]:
    """`count` batches on the GPU, uniform over each layer's rows."""
    layers = [torch.randint(0, rows, (count, tokens, 1, geometry.heads), device="cuda")
              for rows in geometry.rows]
    return list(torch.cat(layers, dim=2).unbind(0))


def scaled_rows(geometry: TableGeometry, tokens: int, count: int) -> list[Tensor]:
    """`count` batches on the GPU, float32 rand scaled by each layer's rows (see above)."""
    rows = torch.tensor(geometry.rows, device="cuda").view(1, -1, 1)
    return [(torch.rand((tokens, geometry.n_layers, geometry.heads), device="cuda") * rows).long()
            for _ in range(count)]
