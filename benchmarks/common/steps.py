"""The pieces of the engine benchmarks' steps (benchmarks/vllm_gpu, benchmarks/sglang_gpu) that
are not the engine's: an EngramClient's lookup as a variant, the wait for a mapped client's
hot-row cache to warm, and the LEAD matmuls that stand for the model's other work.

What this is not: the engines' own layers or steps (each benchmark's bench_variants.py).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from engramd.client import EngramClient

WARM_CACHE_S = 120.0  # at most, for a mapped client's hot-row cache to warm after its attach


class ClientLookup:
    """An EngramClient's lookup, the current stream (None on the CPU) waiting for its rows."""

    def __init__(self, client: EngramClient, stream: torch.cuda.Stream | None):
        self.name, self.client, self.stream = client.mode, client, stream

    def __call__(self, ids: Tensor) -> Tensor:
        return self.client.lookup(ids, self.stream).wait(self.stream)

    rows = __call__


def wait_warm(client: EngramClient) -> None:
    """A mapped client's keeper warms its hot-row cache after the attach: time it warm, as the
    daemon's own cache is warm before it serves (model_step.py does the same)."""
    deadline = time.monotonic() + WARM_CACHE_S
    while (client.hot_cache_stats() or {}).get("warming") and time.monotonic() < deadline:
        time.sleep(0.05)


class Matmuls:
    """`count` bf16 [n x n] @ [n x n] products into one preallocated tensor."""

    def __init__(self, n: int, device: torch.device, seed: int):
        generator = torch.Generator(device=device).manual_seed(seed)
        self.a = torch.randn((n, n), generator=generator, device=device).to(torch.bfloat16)
        self.b = torch.randn((n, n), generator=generator, device=device).to(torch.bfloat16)
        self.c = torch.empty_like(self.a)

    def __call__(self, count: int) -> None:
        for _ in range(count):
            torch.mm(self.a, self.b, out=self.c)


def seed_projections(layers: list, seed: int) -> None:
    """The same q, k and WKV weights for every build of an engine's Engram layers (the engine's
    own, the plugin's): seeded per layer, made where they live (WKV scaled as
    tests/engine_worker.copy_projections does). Both engines' layers name them alike."""
    for layer in layers:
        generator = torch.Generator(device=layer.q_weight.device)
        generator.manual_seed(seed + layer.layer_hash_index)
        weights = ((layer.q_weight, 1.0), (layer.k_weight, 1.0), (layer.wkv.weight, 0.02))
        for param, scale in weights:
            values = torch.randn(param.shape, generator=generator, device=param.device) * scale
            param.data.copy_(values)
