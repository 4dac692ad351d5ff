"""Row IDs for bench_lookup.py: [T, n_layers, heads] int32 on the benchmark's device, drawn before
timing. int32 is the dtype of vLLM's hashes (NgramHashState), and both sides get the same.

`uniform`: every head's IDs uniform in its own bucket, as hashes fall (common/ids.bucket_ids),
from one seeded generator: every pool is new.
`text`: a real-text trace (benchmarks/traces.py) hashed for this table's geometry. As in
model_step.py's TextIds, its first half is written as the daemon's hot-row cache warm file and
the pools walk the second half, each the next stretch (starting again once read through); here on
either device, and optionally cut to its first documents (a dry run's).
`check_ids`: the one batch per T whose rows both phases compare, drawn on the CPU from its own
seed (so the second phase draws the same), 5% of them DEAD (-1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from engramd.client.geometry import TableGeometry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.ids import bucket_ids  # noqa: E402
from traces import TextTrace  # noqa: E402

DEAD_FRACTION = 0.05  # of the check IDs


class UniformIds:
    name = "uniform"
    trace_tokens = None

    def __init__(self, geometry: TableGeometry, device: torch.device, seed: int):
        self.geometry, self.device = geometry, device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def pool(self, tokens: int, count: int) -> list[Tensor]:
        batches = bucket_ids(self.geometry, tokens, count, self.device, self.generator)
        return [ids.to(torch.int32) for ids in batches]


class TextIds:
    name = "text"

    def __init__(self, folder: Path, geometry: TableGeometry, device: torch.device,
                 warm_file: Path, max_tokens: int | None = None):
        trace = TextTrace.load(folder, geometry, device=device, max_tokens=max_tokens)
        half = len(trace) // 2
        np.save(warm_file, trace.rows[:half].cpu().numpy())
        self.rows = trace.rows[half:].to(torch.int32)
        self.trace_tokens = len(trace)
        self.cursor = 0

    def pool(self, tokens: int, count: int) -> list[Tensor]:
        need = tokens * count
        at = (self.cursor + torch.arange(need, device=self.rows.device)) % self.rows.shape[0]
        self.cursor = (self.cursor + need) % self.rows.shape[0]
        return list(self.rows[at].view(count, tokens, *self.rows.shape[1:]).unbind(0))


def check_ids(geometry: TableGeometry, tokens: int, seed: int) -> Tensor:
    """The check batch of `tokens` tokens, on the CPU."""
    generator = torch.Generator().manual_seed(seed * 100_003 + tokens)
    ids = bucket_ids(geometry, tokens, 1, torch.device("cpu"), generator, DEAD_FRACTION)[0]
    return ids.to(torch.int32)
