"""What the SGLang plugin puts in place of SGLang's Engram tables (see engramd.client.engines.sglang).

One `EngramClient` per SGLang TP worker process, registered with SGLang's TP rank and size
(`get_parallel()`), so each rank gets its head shard; every Engram layer of the process shares
it. SGLang's own lookup path stays as it is around one replaced step:

    Engram.forward -> embed_rows -> EngramEmbedding.forward -> _lookup (or _dp_sharded_lookup,
    or the prefill-CP gather of the IDs) -> _owned_rows(ids)      <- replaced: the daemon's rows
                   -> SGLang's all-reduce over the TP group (each row has one owner, as in
                      SGLang's own row shards, so the sum is the rows, bit for bit)

`_owned_rows` is where SGLang's gather kernel fills "the rows this rank owns, zero for the rest"
into a fresh `[*ids, dim]` bf16 tensor: the replacement fills the same tensor with the daemon's
rows of this rank's heads (head-wise shards; SGLang's own row shards split on the same head
boundaries where the heads divide evenly, and either way every row has exactly one owner). The
IDs are SGLang's hash IDs, passed as they are; the rows come back in the current stream's order
(EngramClient.lookup/wait: no host sync on a GPU). The host work of the lookup runs in SGLang's
`eager_on_graph` break, so a breakable CUDA graph runs it at every replay; a full-graph capture,
which would replay none of it, is refused.

One lookup per step: SGLang hashes a step's tokens once, for every Engram layer
(`EngramHasher.forward` -> `[T, n_layers, heads]`), and hands each layer its column of that
tensor. The wrapped `EngramHasher.forward` submits one lookup of all of it (the step slot) as
soon as it returns, so the lookup runs while the layers before the first Engram layer do; a
layer's `_owned_rows` that is handed its column of that very tensor (same storage, offset, shape
and strides, not written since: its version counter) waits for that lookup and takes its layer's
rows. Any other IDs take a lookup of their own (the direct slot), as before:
- prefill context parallelism and DP attention, where SGLang gathers the IDs over ranks before
  `_owned_rows` (the hook submits nothing there);
- breakable CUDA graphs, capture and replay: the hasher runs inside a captured segment (decode)
  or its output is copied into a graph buffer (extend), so neither the hook's host work nor the
  tensor's identity would carry over to a replay (the hook submits nothing there either);
- IDs that did not come from the hasher (tests, offline tools);
- steps run under `torch.inference_mode()` (SGLANG_ENABLE_TORCH_INFERENCE_MODE): its tensors
  keep no version counter, so a rewrite of the hasher's output would go unseen.

What replaces what, on SGLang's `EngramEmbedding` (SGLang binds the class at import, so its
attributes are replaced, not the class):
- `__init__`: no table. Zero-row `weight` and `scale` parameters whose weight loader checks the
  checkpoint's tensor against the daemon's table and keeps nothing, so the checkpoint still
  loads; no host table, no peer shards (`finish_load` then has nothing to do).
- `_owned_rows`: above.
- `enable_scheduler_staging`: refused (the scheduler stages rows from a host table there is none
  of; engramd.client.engines.sglang also refuses the settings that would ask for it).
And on SGLang's `EngramHasher`, `forward` is wrapped (its result is SGLang's, unchanged): above.
Modules built before the plugin was installed keep SGLang's own path.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from sglang.srt.layers.engram import eager_on_graph, is_in_breakable_cuda_graph
from torch import nn

from engramd.client.client import EngramClient, LookupFuture
from engramd.client.engines import shared
from engramd.client.engines.sglang import SglangPluginError
from engramd.client.engines.shared import Settings
from engramd.client.geometry import DEAD_ID, SCALE_BLOCK, TableGeometry

log = logging.getLogger("engramd.sglang")

REPLACED = ("__init__", "_owned_rows", "enable_scheduler_staging")
STEP_SLOT, DIRECT_SLOT = 0, 1  # the client's slots: a step's one lookup, and any other lookup
DEFAULT_MAX_TOKENS = 8192  # where SGLang's prefill ceiling is not published (offline tools)

_originals: dict[str, Callable] = {}  # SGLang's own methods
_settings: Settings | None = None
_process_client: ProcessClient | None = None


def install(engram_module, settings: Settings) -> bool:
    """Replace the seams on SGLang's EngramEmbedding; False if this process did already."""
    global _settings
    if _originals:
        return False
    cls = engram_module.EngramEmbedding
    _settings = settings
    _originals.update({name: getattr(cls, name) for name in REPLACED})
    cls.__init__ = _embedding_init
    cls._owned_rows = _owned_rows
    cls.enable_scheduler_staging = _enable_scheduler_staging
    _originals["EngramHasher.forward"] = engram_module.EngramHasher.forward
    engram_module.EngramHasher.forward = _hasher_forward
    return True


# -- the process's client ----------------------------------------------------------------------

@dataclass
class StepLookup:
    """The lookup of a step's hash IDs, every layer's: the hasher's output, held (so its storage
    is not reused while the layers may still be handed views of it) with its version counter."""

    ids: torch.Tensor  # [T, n_layers, heads]
    version: int
    future: LookupFuture
    rows: torch.Tensor | None = None  # [n_layers, T, local_heads, dim], once waited for

    def layer_ids(self, layer: int, indices: torch.Tensor) -> bool:
        """Whether `indices` is this step's column of layer `layer`, unchanged since the lookup."""
        column = self.ids[:, layer]
        return (indices.device == column.device and indices.data_ptr() == column.data_ptr()
                and indices.shape == column.shape and indices.stride() == column.stride()
                and indices._version == self.version)


class ProcessClient:
    """The process's client, shared by its Engram layers, the step's lookup, and what the model
    was checked against."""

    def __init__(self, client: EngramClient):
        self.client = client
        self.step: StepLookup | None = None
        self._tables = shared.ServedTables(client, SglangPluginError, "SGLang")

    @property
    def geometry(self) -> TableGeometry:
        return self.client.geometry

    def submit_step(self, hash_ids: torch.Tensor) -> None:
        """One lookup of a step's `[T, n_layers, heads]` hash IDs (SGLang's hasher's output) into
        the step slot; IDs it cannot take in one lookup are left to the layers' own lookups."""
        self.step = None
        geometry = self.geometry
        if hash_ids.is_inference():  # no version counter: a rewrite of the IDs would go unseen
            return
        if (hash_ids.ndim != 3 or tuple(hash_ids.shape[1:]) != (geometry.n_layers, geometry.heads)
                or not 0 < hash_ids.shape[0] <= self.client.max_tokens):
            return
        future = self.client.lookup(hash_ids, slot=STEP_SLOT)
        self.step = StepLookup(hash_ids, hash_ids._version, future)

    def step_rows(self, layer: int, indices: torch.Tensor) -> torch.Tensor | None:
        """Layer `layer`'s rows `[T, local_heads, dim]` of the step's lookup if `indices` are its
        IDs there (valid in the current stream's order), else None."""
        step = self.step
        if step is None or not step.layer_ids(layer, indices):
            return None
        if step.rows is None:
            step.rows = step.future.wait()
            self.check_still_served()
        return step.rows[layer]

    def rows(self, layer: int, ids: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's heads of layer `layer` for `ids` `[N, heads]` into `out` `[N, heads, dim]`,
        zero elsewhere: the step's rows if these are its IDs, else in lookups of their own (of at
        most the client's max_tokens)."""
        step_rows = self.step_rows(layer, ids)
        if step_rows is not None:
            self._place(step_rows, out.view(-1, *out.shape[-2:]))
            return
        flat, out = ids.reshape(-1, ids.shape[-1]), out.view(-1, *out.shape[-2:])
        geometry = self.geometry
        for start in range(0, flat.shape[0], self.client.max_tokens):
            chunk = flat[start:start + self.client.max_tokens]
            step = chunk.new_full((chunk.shape[0], geometry.n_layers, geometry.heads), DEAD_ID)
            step[:, layer] = chunk
            rows = self.client.lookup(step, slot=DIRECT_SLOT).wait()
            self.check_still_served()
            self._place(rows[layer], out[start:start + chunk.shape[0]])

    def _place(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's heads' rows into their columns of `out`, zero elsewhere (a rank of all
        the heads has no elsewhere: a launch less a layer)."""
        shard = self.client.shard
        if (shard.head_start, shard.head_end) != (0, out.shape[-2]):
            out.zero_()
        out[:, shard.head_start:shard.head_end] = rows[:, :shard.head_end - shard.head_start]

    def check_still_served(self) -> None:
        """After a lookup's wait: refuse rows of other tables than the model was checked against."""
        self._tables.check()

    def close(self) -> None:
        self.client.close()


def process_client() -> ProcessClient:
    """The process's client, registered on first use (inside SGLang's model construction, where
    its parallel state is published)."""
    global _process_client
    if _process_client is None:
        _process_client = ProcessClient(_register_client())
        atexit.register(_process_client.close)
    return _process_client


def _register_client() -> EngramClient:
    from sglang.srt.runtime_context import get_parallel

    assert _settings is not None, "install() sets the settings first"
    parallel = get_parallel()
    tp_rank, tp_size = parallel.tp_rank, parallel.tp_size
    max_tokens = _max_tokens()
    client = EngramClient(_settings.socket, device=_device(), tp_rank=tp_rank, tp_size=tp_size,
                          max_tokens=max_tokens, name=f"sglang-tp{tp_rank}", mode=_settings.mode,
                          pin_tables=True, hot_cache_gib=_settings.hot_cache_gib,
                          gather_at=_settings.gather_at)
    log.info("engramd client %d (%s, pid %d): TP rank %d of %d, heads %d..%d, up to %d tokens a "
             "lookup", client.client_id, client.mode, os.getpid(), tp_rank, tp_size,
             client.shard.head_start, client.shard.head_end, max_tokens)
    return client


def _max_tokens() -> int:
    """SGLang's prefill ceiling (a lookup past it is split, so this only sizes the slots)."""
    try:
        from sglang.srt.runtime_context import max_prefill_buffer_tokens

        tokens = int(max_prefill_buffer_tokens())
    except (ValueError, RuntimeError, AttributeError):  # nothing published: offline use, tests
        return DEFAULT_MAX_TOKENS
    return tokens if tokens > 0 else DEFAULT_MAX_TOKENS


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_layer(geometry: TableGeometry, layer_id: int, num_embeddings: int, dim: int,
                column_bounds: tuple[int, ...], socket_path) -> int:
    """The daemon must serve this layer's table as the model's config describes it (rows, head
    size, bucket primes: `column_bounds` are their prefix sums); returns its index there."""
    served = None
    if layer_id in geometry.layer_ids:
        index = geometry.layer_ids.index(layer_id)
        bounds = (*geometry.offsets[index], geometry.rows[index])  # each bucket's first row, and the end
        served = (geometry.rows[index], geometry.head_dim, bounds)
        if served == (num_embeddings, dim, tuple(column_bounds)):
            return index
    raise SglangPluginError(
        f"the engramd daemon at {socket_path} serves Engram tables of layers "
        f"{list(geometry.layer_ids)} with {list(geometry.rows)} rows; the model's config has "
        f"layer {layer_id} with {num_embeddings} rows of {dim} (or its bucket primes differ): "
        "start the daemon on this model's checkpoint")


# -- the replaced EngramEmbedding methods ------------------------------------------------------

def _embedding_init(self, num_embeddings, dim, layer_id, column_bounds):
    """No table: what SGLang's forward reads, and zero-row parameters that check the checkpoint.
    SGLang's __init__ is not run: it allocates the table (device, host or peer shards)."""
    from sglang.srt.runtime_context import get_parallel

    nn.Module.__init__(self)
    daemon = process_client()
    self.engramd = daemon
    self.engramd_layer = check_layer(daemon.geometry, layer_id, num_embeddings, dim,
                                     tuple(column_bounds), daemon.client.socket_path)
    self.engramd_layer_id, self.num_embeddings = layer_id, num_embeddings
    self.dim = dim
    self.tp_size = get_parallel().tp_size
    self.row_start, self.rows = 0, 0  # rows held here: none
    self.host_table, self._sort_host_reads = None, False
    self.staged_by_scheduler, self.peer = False, None
    self.weight = _checking_parameter(self, torch.float8_e4m3fn, dim)
    self.scale = _checking_parameter(self, torch.float8_e8m0fnu, dim // SCALE_BLOCK)
    self.engramd_checkpoint = shared.CheckpointRows(daemon.client, self.engramd_layer,
                                                    SglangPluginError, DIRECT_SLOT,
                                                    daemon.check_still_served)


def _checking_parameter(embedding, dtype: torch.dtype, width: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(0, width, dtype=dtype), requires_grad=False)
    # SGLang's loader calls param.weight_loader(param, tensor) where a parameter has one.
    param.weight_loader = (  # type: ignore[attr-defined]
        lambda param, loaded: _skip_checkpoint_table(embedding, param, loaded))
    return param


def _skip_checkpoint_table(embedding, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """The checkpoint's table is the daemon's to load: keep nothing, but refuse one whose shape
    is not the table the daemon serves, or whose rows are not the ones it serves
    (shared.CheckpointRows: a sample of them)."""
    expected = (embedding.num_embeddings, param.shape[1])
    if tuple(loaded_weight.shape) != expected:
        raise SglangPluginError(
            f"checkpoint Engram tensor of layer {embedding.engramd_layer_id} has shape "
            f"{list(loaded_weight.shape)}; the daemon serves {list(expected)}")
    embedding.engramd_checkpoint.hand("weight" if param is embedding.weight else "scale",
                                      loaded_weight)


def _served(embedding) -> bool:
    """Built by the replaced __init__ (modules built before install keep SGLang's own path)."""
    return isinstance(embedding.__dict__.get("engramd"), ProcessClient)


def _owned_rows(self, indices: torch.Tensor) -> torch.Tensor:
    if not _served(self):
        return _originals["_owned_rows"](self, indices)
    out = self.new_rows(indices)
    _daemon_rows(self, indices, out)
    return out


def _enable_scheduler_staging(self) -> None:
    if not _served(self):
        return _originals["enable_scheduler_staging"](self)
    raise SglangPluginError(
        "SGLang's scheduler staging reads Engram rows from its own host table, and with "
        "ENGRAMD_SOCKET set there is none (engramd serves the rows): unset "
        "SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING")


# Host work of every lookup: in an eager break, so breakable CUDA graphs run it at every replay.

@eager_on_graph
def _daemon_rows(embedding, indices: torch.Tensor, out: torch.Tensor) -> None:
    _refuse_capture()
    embedding.engramd.rows(embedding.engramd_layer, indices, out)


# -- the wrapped EngramHasher.forward ----------------------------------------------------------

def _hasher_forward(self, input_ids, forward_batch):
    hash_ids = _originals["EngramHasher.forward"](self, input_ids, forward_batch)
    daemon = _process_client
    if daemon is not None:  # no served Engram layer in this process: nothing to look up
        if _layers_read_the_hashers_ids():
            daemon.submit_step(hash_ids)
        else:
            daemon.step = None
    return hash_ids


def _layers_read_the_hashers_ids() -> bool:
    """Whether this step's Engram layers are handed columns of the tensor the hasher returned,
    in this eager call (see the module docstring for where they are not)."""
    if is_in_breakable_cuda_graph() or torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return parallel.attn_cp_size == 1 and not (parallel.tp_size > 1 and parallel.attn_dp_size > 1)


def _refuse_capture() -> None:
    """Inside an eager break no capture is running; a capture here would record this step's
    lookup once and replay its rows forever."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise SglangPluginError(
            "engramd lookups are host work at every step and cannot be captured into a full CUDA "
            "graph: run SGLang with breakable CUDA graphs or --disable-cuda-graph")
