"""What bench_lookup.py times: each variant is a call `variant(ids)` for IDs [T, n_layers, heads]
on the device, after which the rows are ready in the current stream's order (no host sync), and
`variant.rows(ids)`, the rows it gives, [n_layers, T, heads, head_dim] bf16, for the row check.

Lookup alone:
  vllm_fg   vLLM's ParallelEngramEmbedding.lookup(ids[:, i], out[i]) for each layer i, on the
            current stream: its Triton kernel, a persistent grid of one program per SM (on the
            GPU reading the pinned tables through UVA).
  vllm_bg   vLLM's Engram.prepare_embeddings(ids[:, i]) for each layer, then each layer's
            _ready_rows(T): its offloaded prefetch, lookup(background=True) (half the SMs) on
            the prefetch stream behind the current stream's work, and the current stream's wait
            for the layer's event.
  mapped    EngramClient(mode="mapped").lookup(ids, stream).wait(stream): this process gathers
            from its mapping of the daemon's tables, on the client's side stream, queued at the
            wait (the client's default).
  served    the same with mode="served": the daemon gathers into the client's slab.
Model step (`ModelStep`, over vLLM's Engram layers, its own or built with the plugin loaded):
  each layer's prepare_embeddings(ids[:, i]) -> LEAD bf16 [N x N] @ [N x N] matmuls (torch.mm
  into a preallocated tensor) -> each layer's forward(hidden [T, hc_mult, hidden], ids[:, i]),
  whose embed() takes the rows from _ready_rows(T), then the WKV GEMM and vLLM's fused post-WKV
  kernel. Run eagerly: vllm (vLLM's own layers: its offloaded prefetch on its prefetch stream),
  plugin_mapped, plugin_mapped_at_lookup (the client's gather queued in lookup(), at the last
  layer's prepare_embeddings, not at the first layer's wait: ENGRAMD_GATHER_AT=lookup),
  plugin_served.
Model step in a CUDA graph (`GraphStep`):
  vllm_graph       vLLM's own step, recorded once per (T, lead) and replayed, as vLLM's full
                   graphs record it: outside a breakable capture its eager breaks run in line,
                   so its prefetch stream's fork, lookup(background=True) and join are in the
                   graph.
  plugin_captured  the same step over the layers built with ENGRAMD_CAPTURE=on: every layer's
                   prepare_embeddings (the last layer's forks the gather to the plugin's
                   side stream, reading the graph's hash IDs in place, a launch per layer;
                   --captured-launches step: one for the step), the LEAD matmuls, each
                   layer's forward (its _ready_rows joins the launch of its rows, once; no
                   host work).
  compute_graph    the floor: the same graph without prepare_embeddings (the LEAD matmuls and
                   each layer's forward, over the rows the last lookup left). plugin_captured
                   less compute_graph is the lookup's cost in the graph; vllm less
                   plugin_captured, in host time, what capture saves.
  Each graph reads the step's hash IDs from a persistent buffer [T_max, n_layers, heads] that
  each step writes (a device copy from the pool) before the replay, as an engine writes its
  graph's inputs. In a dry run (no graphs on a CPU) each "replay" runs the recorded function eagerly.

What this is not: the timing (common/timing.time_cell), the row check (bench_lookup.py), or the
pieces the SGLang benchmark shares (common/steps.py: the client variant, the matmuls).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from common.steps import Matmuls, seed_projections
from torch import Tensor

LOOKUP_VARIANTS = ("vllm_fg", "vllm_bg", "mapped", "served")
STEP_VARIANTS = ("vllm", "vllm_graph", "plugin_mapped", "plugin_mapped_at_lookup", "plugin_served",
                 "plugin_captured", "compute_graph")
GRAPH_VARIANTS = ("plugin_captured", "compute_graph")  # the plugin's graph and its floor
# What a profiled cell's third pass times (common/wall_timers.py): vLLM's Engram step, and the
# plugin's path through it down to the client's mapped lookup; each variant runs the part it has.
_ENGRAM, _PLUGIN = "vllm.models.deepseek_v41.common.engram", "engramd.client.engines.vllm_engram"
TIMED = (
    *(f"{_ENGRAM}:Engram.{name}" for name in ("prepare_embeddings", "_start_prefetch", "_ready_rows",
                                              "_finish_prefetch", "embed", "forward")),
    f"{_ENGRAM}:ParallelEngramEmbedding.lookup",
    f"{_PLUGIN}:_hand_ids", f"{_PLUGIN}:_ready",
    *(f"{_PLUGIN}:ProcessRows.{name}" for name in ("hand", "_submit", "ready", "_await_rows",
                                                   "check_still_served")),
    "engramd.client.client:EngramClient.lookup", "engramd.client.future:LookupFuture.wait",
    *(f"engramd.client.mapped_path:MappedPath.{name}" for name in ("lookup", "_gather_inputs",
                                                                   "queue_gather", "queued", "stream_wait")),
)
Capture = Callable[[Callable[[], object], str], Callable[[], object]]  # bench_device's capture(body, label)


class VllmForeground:
    name = "vllm_fg"

    def __init__(self, layers: list, max_tokens: int):
        table = layers[0].embed_tokens
        self.layers = layers
        self.out = torch.empty((len(layers), max_tokens, table.part_n_hash_cols, table.dim),
                               dtype=torch.bfloat16, device=layers[0].staged_rows.device)

    def __call__(self, ids: Tensor) -> None:
        tokens = ids.shape[0]
        for layer in self.layers:
            index = layer.layer_hash_index
            layer.embed_tokens.lookup(ids[:, index], self.out[index, :tokens])

    def rows(self, ids: Tensor) -> Tensor:
        self(ids)
        return self.out[:, :ids.shape[0]]


class EngramLayers:
    """vLLM's staged path through its Engram layers: vllm_bg with vLLM's own layers; with the
    plugin's, the client's lookup (what the model step's plugin variants run)."""

    def __init__(self, name: str, layers: list):
        self.name, self.layers = name, layers

    def __call__(self, ids: Tensor) -> None:
        self.prepare(ids)
        for layer in self.layers:
            layer._ready_rows(ids.shape[0])

    def prepare(self, ids: Tensor) -> None:
        for layer in self.layers:
            layer.prepare_embeddings(ids[:, layer.layer_hash_index])

    def rows(self, ids: Tensor) -> Tensor:
        self.prepare(ids)
        return torch.stack([layer._ready_rows(ids.shape[0]) for layer in self.layers])


class ModelStep:
    """prepare_embeddings -> `lead` matmuls -> forward, over one set of Engram layers."""

    def __init__(self, name: str, layers: list, matmuls: Matmuls, seed: int):
        self.name, self.layers, self.matmuls, self.seed = name, layers, matmuls, seed
        self.staged = EngramLayers(name, layers)
        self._hidden: dict[int, Tensor] = {}

    def hidden(self, tokens: int) -> Tensor:
        """The residual stream [T, hc_mult, hidden] bf16, the same for every step of T tokens."""
        if tokens not in self._hidden:
            layer = self.layers[0]
            device = layer.q_weight.device
            generator = torch.Generator(device=device).manual_seed(self.seed + tokens)
            shape = (tokens, layer.hc_mult, layer.dim)
            self._hidden[tokens] = torch.randn(shape, generator=generator,
                                               device=device).to(torch.bfloat16)
        return self._hidden[tokens]

    def step(self, lead: int, lookup: bool = True):
        def run(ids: Tensor) -> None:
            hidden = self.hidden(ids.shape[0])
            if lookup:
                self.staged.prepare(ids)
            self.matmuls(lead)
            for layer in self.layers:
                layer(hidden, ids[:, layer.layer_hash_index])

        return run


class GraphStep:
    """A ModelStep's step (with its lookup, or without: the floor) recorded once per (T, lead)
    by `capture` (bench_device: a CUDA graph on the GPU, the step itself in a dry run) over a
    persistent IDs buffer, and replayed: each step copies its IDs into the buffer, then replays.
    close() drops the graphs, which must go before the client whose memory they read.
    `label`: what names its graphs (their DOT files), if not `name`."""

    def __init__(self, name: str, model: ModelStep, capture: Capture, max_tokens: int,
                 lookup: bool, note: str = "", label: str = ""):
        self.name, self.model, self.capture, self.lookup, self.note = name, model, capture, lookup, note
        self.label = label or name
        layer = model.layers[0]
        shape = (max_tokens, len(model.layers), layer.embed_tokens.n_hash_cols)
        self.ids = torch.full(shape, -1, dtype=torch.int32, device=layer.q_weight.device)
        self._replays: dict[tuple[int, int], Callable[[], object]] = {}

    def recorded(self, tokens: int, lead: int) -> Callable[[], object]:
        """The replay of the (T, lead) graph, recorded now if it was not."""
        key = (tokens, lead)
        if key not in self._replays:
            self._replays[key] = self.capture(lambda: self.model.step(lead, self.lookup)(
                self.ids[:tokens]), f"{self.label}-T{tokens}-L{lead}")
        return self._replays[key]

    def step(self, lead: int):
        def run(ids: Tensor) -> None:
            replay = self.recorded(ids.shape[0], lead)
            self.ids[:ids.shape[0]].copy_(ids, non_blocking=True)
            replay()

        return run

    def rows(self, ids: Tensor, lead: int) -> Tensor:
        """The rows each layer's forward reads after one replay of the (T, lead) graph with
        `ids`: [n_layers, T, heads, head_dim], in the current stream's order."""
        self.step(lead)(ids)
        return torch.stack([layer.staged_rows[:ids.shape[0]] for layer in self.model.layers])

    def close(self) -> None:
        self._replays.clear()


def init_projections(layers: list, seed: int) -> None:
    """The same q, k and WKV weights for every build of the layers (vLLM's own, the plugin's),
    then finished as vLLM's loader finishes a layer."""
    seed_projections(layers, seed)
    for layer in layers:
        layer.wkv.quant_method.process_weights_after_loading(layer.wkv)
