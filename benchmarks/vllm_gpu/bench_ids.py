"""Row IDs for bench_lookup.py: [T, n_layers, heads] int32 on the benchmark's device, drawn before
timing. int32 is the dtype of vLLM's hashes (NgramHashState), and both sides get the same.

`uniform`: every head's IDs uniform in its own bucket, as hashes fall (common/ids.bucket_ids),
from one seeded generator: every pool is new.
`text`: traces.TextIds (a real-text trace hashed for this table's geometry), as int32 on the
benchmark's device, optionally cut to its first documents (a dry run's).
`check_ids`: the one batch per T whose rows both phases compare, drawn on the CPU from its own
seed (so the second phase draws the same), 5% of them DEAD (-1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from engramd.client.geometry import TableGeometry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.ids import bucket_ids  # noqa: E402

DEAD_FRACTION = 0.05  # of the check IDs


class UniformIds:
    name = "uniform"
    tokens = None  # no trace behind them

    def __init__(self, geometry: TableGeometry, device: torch.device, seed: int):
        self.geometry, self.device = geometry, device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def pool(self, tokens: int, count: int) -> list[Tensor]:
        batches = bucket_ids(self.geometry, tokens, count, self.device, self.generator)
        return [ids.to(torch.int32) for ids in batches]


def check_ids(geometry: TableGeometry, tokens: int, seed: int) -> Tensor:
    """The check batch of `tokens` tokens, on the CPU."""
    generator = torch.Generator().manual_seed(seed * 100_003 + tokens)
    ids = bucket_ids(geometry, tokens, 1, torch.device("cpu"), generator, DEAD_FRACTION)[0]
    return ids.to(torch.int32)
