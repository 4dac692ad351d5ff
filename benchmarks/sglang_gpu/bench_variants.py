"""What bench_lookup.py times: each variant is a call `variant(x)` after which its result is
ready in the current stream's order (no host sync), and, for the row check, what it gives.

Lookup alone, a call per batch of row IDs [T, n_layers, heads] int64 (SGLang's hash IDs' dtype):
  sglang    SGLang's EngramEmbedding.forward(ids[:, i]) of each layer: at TP=1, `_lookup` ->
            `_owned_rows`, its Triton `engram_gather` from the layer's table in device memory
            into a fresh [T, heads, dim] bf16 tensor, on the current stream (its torch gather
            on the CPU). `rows(ids)`: the layers' rows stacked, [n_layers, T, heads, dim].
  sglang_host  the same with SGLang's host table (SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE): the
            table in pinned host memory, read over PCIe by the same kernel (in sorted order on
            a GPU without ATS, as SGLang decides): where a table larger than HBM lives.
  mapped    EngramClient(mode="mapped").lookup(ids, stream).wait(stream) (common/steps
            ClientLookup): this process gathers from its mapping of the daemon's host tables.
  served    the same with mode="served": the daemon gathers into the client's slab.
Model step (`ModelStep`), a call per batch of T token IDs, over SGLang's Engram layers (its own,
or built with the plugin loaded):
  SGLang's EngramHasher.forward(tokens, batch) -> hash IDs [T, n_layers, heads] -> LEAD bf16
  [N x N] @ [N x N] matmuls (the layers before the first Engram layer) -> each layer's
  Engram.forward(hidden [T, hc_mult, hidden], its column of the IDs): the lookup (SGLang's
  gather, or with the plugin the rows of the one lookup it submitted when the hasher returned),
  the wkv linear and SGLang's gate. The batch (`step_batch`) is a decode step of T requests of
  one token each for T <= DECODE_MAX_TOKENS, else an extend of one request's T tokens.

What this is not: the timing (common/timing.time_cell) or the row check (bench_lookup.py).
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

LOOKUP_VARIANTS = ("sglang", "sglang_host", "mapped", "served")
STEP_VARIANTS = ("sglang", "sglang_host", "plugin_mapped", "plugin_served")
REFERENCES = ("sglang", "sglang_host")  # SGLang's own, its table in device or in host memory
# What a profiled cell's third pass times (common/wall_timers.py): SGLang's Engram step, and the
# plugin's path through it down to the client's mapped lookup; each variant runs the part it has.
_ENGRAM, _PLUGIN = "sglang.srt.layers.engram", "engramd.client.engines.sglang_engram"
TIMED = (
    f"{_ENGRAM}:EngramHasher.forward", f"{_ENGRAM}:Engram.forward",
    *(f"{_ENGRAM}:EngramEmbedding.{name}" for name in ("forward", "_lookup", "_owned_rows")),
    *(f"{_PLUGIN}:ProcessClient.{name}" for name in ("submit_step", "step_rows", "rows", "_place",
                                                     "check_still_served")),
    "engramd.client.client:EngramClient.lookup", "engramd.client.future:LookupFuture.wait",
    *(f"engramd.client.mapped_path:MappedPath.{name}" for name in ("lookup", "_gather_inputs",
                                                                   "queue_gather", "queued", "stream_wait")),
)
DECODE_MAX_TOKENS = 256  # above it a step is a prefill chunk (one request), below a decode batch
POSITION = 1000  # where every request is: its whole look-back is in its history, none blocked


class EmbeddingLookup:
    """EngramEmbedding.forward of each layer: SGLang's own (`sglang`), or the plugin's."""

    def __init__(self, name: str, layers: list):
        self.name, self.layers = name, layers

    def __call__(self, ids: Tensor) -> list[Tensor]:
        return [layer.embed(ids[:, layer.layer_hash_index]) for layer in self.layers]

    def rows(self, ids: Tensor) -> Tensor:
        return torch.stack(self(ids))


def step_batch(tokens: int, device: torch.device) -> types.SimpleNamespace:
    """The fields of SGLang's ForwardBatch that EngramHasher.forward reads, for a step of `tokens`
    tokens at POSITION, each with its KV cache slot (nonzero: slot 0 marks CUDA-graph padding,
    whose history SGLang does not commit). History is read from and committed to the requests'
    slots of the hasher's history (slots 0 .. T-1 for a decode step, 0 for an extend)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cache_slots = torch.arange(1, tokens + 1, device=device)
    if tokens <= DECODE_MAX_TOKENS:
        return types.SimpleNamespace(
            forward_mode=ForwardMode.DECODE, req_pool_indices=torch.arange(tokens, device=device),
            positions=torch.full((tokens,), POSITION, device=device), out_cache_loc=cache_slots,
            engram_staged_rows=None)
    return types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.zeros(1, dtype=torch.int64,
                                                                      device=device),
        positions=torch.arange(POSITION, POSITION + tokens, device=device),
        extend_seq_lens=torch.tensor([tokens], device=device),
        extend_start_loc=torch.zeros(1, dtype=torch.int64, device=device),
        extend_seq_lens_cpu=[tokens], engram_history=None, out_cache_loc=cache_slots,
        engram_staged_rows=None)


def history_slots(tokens: list[int]) -> int:
    """Request slots the hasher's history needs for steps of these sizes."""
    return max([1, *(t for t in tokens if t <= DECODE_MAX_TOKENS)])


class TokenPools:
    """Token IDs [T] int64 on the device, uniform over the tokenizer's vocabulary, from one
    seeded generator: every pool is new."""

    name = "uniform tokens"

    def __init__(self, vocab: int, device: torch.device, seed: int):
        self.vocab, self.device = vocab, device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def pool(self, tokens: int, count: int) -> list[Tensor]:
        return [torch.randint(0, self.vocab, (tokens,), device=self.device,
                              generator=self.generator) for _ in range(count)]


class ModelStep:
    """hash -> `lead` matmuls -> each layer's Engram.forward, over one set of Engram layers."""

    def __init__(self, name: str, layers: list, hasher, matmuls, seed: int):
        self.name, self.layers, self.hasher, self.matmuls, self.seed = (
            name, layers, hasher, matmuls, seed)
        self._hidden: dict[int, Tensor] = {}
        self._batches: dict[int, types.SimpleNamespace] = {}

    def hidden(self, tokens: int) -> Tensor:
        """The residual stream [T, hc_mult, hidden] bf16, the same for every step of T tokens."""
        if tokens not in self._hidden:
            layer = self.layers[0]
            device = layer.q_weight.device
            generator = torch.Generator(device=device).manual_seed(self.seed + tokens)
            shape = (tokens, *layer.q_weight.shape)  # q_weight is [hc_mult, hidden]
            self._hidden[tokens] = torch.randn(shape, generator=generator,
                                               device=device).to(torch.bfloat16)
        return self._hidden[tokens]

    def batch(self, tokens: int) -> types.SimpleNamespace:
        if tokens not in self._batches:
            self._batches[tokens] = step_batch(tokens, self.hidden(tokens).device)
        return self._batches[tokens]

    def forward(self, tokens: Tensor, lead: int) -> list[Tensor]:
        """One step; each layer's Engram.forward output."""
        count = tokens.shape[0]
        hidden = self.hidden(count)
        hash_ids = self.hasher(tokens, self.batch(count))
        self.matmuls(lead)
        return [layer(hidden, hash_ids[:, layer.layer_hash_index], None, input_ids=tokens)
                for layer in self.layers]

    def step(self, lead: int):
        def run(tokens: Tensor) -> None:
            self.forward(tokens, lead)

        return run

    def outputs(self, tokens: Tensor) -> Tensor:
        """The check: one step of `tokens` from zeroed history, the layers' outputs stacked."""
        self.hasher.history.zero_()
        return torch.stack(self.forward(tokens, 0))
