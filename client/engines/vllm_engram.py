"""What the vLLM plugin puts in place of vLLM's Engram tables (see engramd.client.engines.vllm).

One `EngramClient` per vLLM worker process, registered with vLLM's TP rank and size, so each rank
gets its head shard; every Engram layer of the process shares it. Per forward:

    model.forward:  NgramHashState -> hashes [T, layers, 24]        (vLLM's own hashing)
    each layer's prepare_embeddings(hashes[:, i])   -> ProcessRows.hand(i, ids)
        the last local layer's IDs complete the step -> client.lookup([T, layers, 24])
    each layer's _ready_rows(T)                     -> ProcessRows.ready(i, T)
        the current stream waits for the rows (GPU: stream order, no host sync; CPU: the reply),
        the first layer's for the lookup (with ENGRAMD_CAPTURE in a full graph, a launch a
        layer: each waits for its own)

Each layer's `staged_rows` is a view of that layer's rows in the client's staging slot (the slab
in served mode, the client's own memory in mapped mode): the rows are read where the lookup put
them, with no copy. The view is persistent, as vLLM's own buffer is: a slot's rows stay at one
address whatever the lookup's token count and across daemon restarts (client/shared/slab.py,
EngramClient.slot_rows), so graph segments replayed after `_ready_rows` read them at the address
they were captured with; should the daemon re-register the client elsewhere (another mode or
layout), the next `_ready_rows` fails closed. vLLM's direct `lookup` calls (not the staged path)
use the client's other slot and copy into the caller's tensor. The host work (the lookup
message, the stream wait) runs inside vLLM's `eager_break_during_capture`, as vLLM's own
offloaded prefetch does, so it runs at every replay of a breakable CUDA graph; a full-graph
capture, which would replay none of it, is refused.

With ENGRAMD_CAPTURE=on a mapped GPU worker records its lookup in vLLM's graphs instead
(client/captured.py): the staging slot is a captured lookup's, the last local layer's
`prepare_embeddings` queues the gather, `_ready_rows` makes the current stream wait for it and
returns the staged rows; no eager break, so full and piecewise graphs and eager steps run the
same launch. In a graph that holds the whole step (a full graph) the gather runs on a side
stream beside the layers before their `_ready_rows`, a launch per layer, each layer's
`_ready_rows` joining its own (or, without `split_layers`, one launch that the first joins),
and reads the hashes in place,
as vLLM's own prefetch does, where they are one tensor of every layer's columns that the
lookup can read (CapturedLookup.why_not_in_place; else it reads copies made on that stream);
in a graph captured in pieces and in eager steps, one launch in line on the current stream,
after each layer's copy of its hashes into the lookup's IDs buffer. A served worker keeps the eager
breaks (logged).
Every step of such a worker first checks the captured lookup's replays (`check()`, wrapped
around vLLM's `Worker.execute_model`, the Python a full graph's step still runs): NaN rows that
replays wrote because the client lost its tables fail the worker's next step, a step or so after
the replay that wrote them, with ReplayFailedError.

What replaces what, on vLLM's classes (vLLM binds the classes at import, so attributes of the
classes are replaced, not the classes):
- `Engram._create_embedding` -> `EngramdEmbedding`: zero-row table parameters whose weight loader
  checks the checkpoint's table against the daemon's and keeps nothing, so the checkpoint still
  loads; no DP sharding (`dp_size` 1: the daemon holds the whole table once per node, so each
  replica looks its own tokens up and vLLM's DP hash gather and `EngramBatch` stay off).
- `Engram._init_staging`: the staging buffer, and no prefetch stream or event (the client's
  lookup overlaps on its own; vLLM's decode-time WKV prefetch therefore stays off).
- `Engram.prepare_embeddings`, `Engram._ready_rows`: above.
- With ENGRAMD_CAPTURE=on, `Worker.execute_model` (vllm.v1.worker.gpu_worker): the replays' check
  before vLLM's step.
Engram modules built before the plugin was installed keep vLLM's own path.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
from vllm.config import CUDAGraphMode
from vllm.models.deepseek_v41.common.engram import (
    ParallelEngramEmbedding,
    eager_break_during_capture,
    get_forward_context,
    is_forward_context_available,
)

from engramd.client.captured import CapturedLookup
from engramd.client.client import EngramClient, LookupFuture
from engramd.client.engines import shared
from engramd.client.engines.shared import CAPTURE_ENV
from engramd.client.engines.vllm import VllmPluginError
from engramd.client.errors import CaptureUnsupportedError
from engramd.client.geometry import DEAD_ID, SCALE_BLOCK, TableGeometry
from engramd.client.shared import cuda

log = logging.getLogger("engramd.vllm")

REPLACED = ("_create_embedding", "_init_staging", "prepare_embeddings", "_ready_rows")
STAGED_SLOT, DIRECT_SLOT = 0, 1  # the client's slots: staged_rows views the first
SLOTS = 2

_originals: dict[str, object] = {}  # vLLM's own methods, for modules built before install
# Where and how the process's client registers.
_settings: dict = {"socket": "", "mode": "auto", "hot_cache_gib": None, "gather_at": "wait",
                   "capture": False}
_process_rows: ProcessRows | None = None


def install(engram_module, socket_path: str, mode: str, hot_cache_gib: float | None = None,
            gather_at: str = "wait", capture: bool = False) -> bool:
    """Replace the seams on vLLM's Engram class; False if this process did already.
    `hot_cache_gib`, `gather_at`: the client's options of those names (EngramClient);
    `capture`: record a mapped GPU worker's lookups in vLLM's graphs (ENGRAMD_CAPTURE)."""
    cls = engram_module.Engram
    if _originals:
        return False
    _settings.update(socket=socket_path, mode=mode, hot_cache_gib=hot_cache_gib, gather_at=gather_at,
                     capture=capture)
    _originals.update({name: getattr(cls, name) for name in REPLACED})
    cls._create_embedding = _create_embedding
    cls._init_staging = _init_staging
    cls.prepare_embeddings = _prepare_embeddings
    cls._ready_rows = _ready_rows
    return True


# -- the process's client ----------------------------------------------------------------------

class ProcessRows:
    """The process's client and the lookup of the current forward, shared by its Engram layers."""

    def __init__(self, client: EngramClient, capture: bool = False):
        self.client = client
        # ENGRAMD_CAPTURE: the staging slot's lookup, recorded in vLLM's graphs (None: eager breaks)
        self.captured = self._capture(client) if capture else None
        # Where a graph's captured gather runs beside the layers before the rows' readers: its
        # stream and, per layer, the event of the launch that layer's reader waits for (a GPU's
        # only). The stream is this object's own, not one of torch's pooled streams, which the
        # model's own side streams (and a capture's) come from: sharing one would serialise the
        # gather behind their work.
        self._side: tuple[torch.cuda.Stream, list[torch.cuda.Event]] | None = None
        if self.captured is not None and client.device.type == "cuda":
            self._side = (cuda.owned_stream(self, client.device.index),
                          [torch.cuda.Event() for _ in range(client.geometry.n_layers)])
        # Whether a forked gather launches per layer, each layer's reader waiting for its own
        # rows only, as vLLM's own prefetch does, or once for the step, which the first reader
        # waits for whole. Per layer, on one H100 without MPS, vLLM's step at lead 1 took
        # 1.007 / 0.977x its graph at T = 16 and 0.853 / 0.820x at T = 256 (pipelined /
        # synced), where one launch took 1.035 / 1.050x and 0.935 / 0.934x
        # (benchmarks/results/h100/2026-12-07-f/; bench_lookup.py --captured-launches)
        self.split_layers = True
        # Whether this step's gather goes to _side, with its IDs read in place or copied there
        # (its first hand says), until it is recorded
        self._on_side = False
        self._joins: dict[int, torch.cuda.Event] = {}  # layer -> the forked launch its reader waits for
        self.staged: dict[int, torch.Tensor] = {}  # layer index -> [max_tokens, local_heads, dim]
        self._ids: dict[int, torch.Tensor] = {}  # this step's IDs, per layer, until all are in
        self._future: LookupFuture | None = None
        self._tokens = 0
        self._rows_generation = client.rows_generation  # where the staged views point
        # What the model's layout was checked against (process_rows): a re-registration with a
        # restarted daemon must find the same tables.
        self._tables = shared.ServedTables(client, VllmPluginError, "vLLM")

    @staticmethod
    def _capture(client: EngramClient) -> CapturedLookup | None:
        """The staging slot's captured lookup over an IDs buffer that starts all DEAD (layers of
        other pipeline stages stay so), or None where the client cannot make one or vLLM splits
        its batches into microbatches (each would take the one IDs buffer and slot of the step)."""
        if _microbatched():
            log.warning("%s=on, but vLLM splits batches into microbatches (DBO or ubatch_size > 1): "
                        "this worker's lookups stay in eager breaks", CAPTURE_ENV)
            return None
        geometry = client.geometry
        ids = torch.full((client.max_tokens, geometry.n_layers, geometry.heads), DEAD_ID,
                         dtype=torch.int32, device=client.device)
        try:
            return client.capturable_lookup(ids, slot=STAGED_SLOT)
        except CaptureUnsupportedError as exc:
            log.warning("%s=on, but this worker's lookups stay in eager breaks: %s", CAPTURE_ENV, exc)
            return None

    @property
    def geometry(self) -> TableGeometry:
        return self.client.geometry

    def staging(self, layer: int) -> torch.Tensor:
        """The layer's persistent rows (its `staged_rows`): a view of the staging slot."""
        self.staged[layer] = self.client.slot_rows(STAGED_SLOT)[layer]
        return self.staged[layer]

    def hand(self, layer: int, hash_ids: torch.Tensor) -> None:
        """One layer's `[T, heads]` IDs of this step; the last local layer's submit the lookup."""
        if layer in self._ids:  # a new step began before every layer of the last one handed in
            self._leave()
        if self.captured is not None:
            if not self._ids:  # the step's first layer: where its lookup runs (no tokens: nowhere)
                self._begin_step(hash_ids.shape[0])
            if not self._on_side:  # where the hands are: a graph in pieces may hold only them
                self._copy_ids({layer: hash_ids})
        self._ids[layer] = hash_ids
        if len(self._ids) == len(self.staged):
            self._submit()

    def _begin_step(self, tokens: int) -> None:
        """Decide where this step's lookup runs: forked, on the side stream, in a GPU's graph
        that holds the whole step (_graph_holds_the_step). The fork itself comes at the submit
        (_record), after every hand's hashes; a step whose later layers run after its capture
        ended is refused there. (A stream that only waited does not keep CUDA from ending a
        capture, measured on an H100: a wait here would not make such a capture fail.)"""
        self._on_side = tokens > 0 and self._side is not None and _graph_holds_the_step()
        self._joins = {}

    def _leave(self) -> None:
        """A new step began before every layer of the last one handed in (its capture failed,
        say). A captured step is dropped: the next step's gather writes the same slot before any
        layer could read its rows, and its hashes may be a failed capture's memory, which no
        graph recorded now may read. An eager worker's is looked up, as every step of it is."""
        if self.captured is None:
            self._submit()
            return
        self._ids, self._tokens, self._on_side, self._joins = {}, 0, False, {}

    def _copy_ids(self, parts: dict[int, torch.Tensor]) -> None:
        """Layers' IDs into the captured lookup's buffer, in the current stream's order."""
        assert self.captured is not None
        for layer, hash_ids in parts.items():
            self.captured.ids[:hash_ids.shape[0], layer].copy_(hash_ids, non_blocking=True)

    def _submit(self) -> None:
        parts, self._ids = self._ids, {}
        first = next(iter(parts.values()))
        self._tokens = 0  # until this step's lookup is submitted, no layer reads the last one's rows
        shape = (first.shape[0], self.geometry.heads)
        for layer, part in parts.items():  # columns of one [T, layers, heads] tensor in vLLM
            if tuple(part.shape) != shape:
                self._on_side = False
                raise VllmPluginError(
                    f"Engram layer {layer} handed in IDs of {part.shape[0]} tokens "
                    f"{list(part.shape)}; this step's other layers handed in {list(shape)}: "
                    "vLLM's layers no longer take columns of one hash tensor")
        tokens = first.shape[0]
        if tokens == 0:
            return
        if self.captured is not None:
            self._record(parts, tokens)
            self._tokens = tokens
            if not _capturing():  # a check reads the host; in a replay no Python runs
                self.captured.check()
            return
        ids = columns_view(parts, self.geometry.n_layers)
        if ids is None:  # layers of other pipeline stages (and any that did not hand in) look up nothing
            ids = first.new_full((tokens, self.geometry.n_layers, self.geometry.heads), DEAD_ID)
            for layer, part in parts.items():
                ids[:, layer] = part
        self._future = self.client.lookup(ids, slot=STAGED_SLOT)
        self._tokens = tokens

    def ready(self, layer: int, num_tokens: int) -> torch.Tensor:
        """The layer's rows of the first `num_tokens` tokens, valid in the current stream's order."""
        if self._ids:
            self._submit()
        if num_tokens > self._tokens:
            raise VllmPluginError(f"Engram layer {layer} asked for {num_tokens} tokens of rows; "
                                  f"this step looked up {self._tokens}")
        if self.captured is None:
            self._await_rows()
        else:
            self._join(layer)
            self.check_still_served()
        return self.staged[layer][:num_tokens]

    def _record(self, parts: dict[int, torch.Tensor], tokens: int) -> None:
        """Queue the captured gather. In a graph that holds the whole step (a full graph), on the
        side stream, which its first reader joins in the same graph (with split_layers a launch
        per layer, each joined by its layer's reader, which then waits for its own rows only):
        the gather runs beside the layers before its readers, as vLLM's own prefetch does.
        Elsewhere one launch in line on the current stream, after the hands' copies: in a graph
        captured in pieces a fork would have to join in the piece it began in, and an eager step
        of this worker is not what it is tuned for (the default mapped path overlaps eager
        steps)."""
        captured = self.captured
        assert captured is not None
        fork, on_side, self._on_side = self._fork(), self._on_side, False
        if fork is None and on_side:
            raise VllmPluginError(
                "the CUDA graph capture that held this step's first Engram layers ended before its "
                "last layer handed in its IDs: the step's hashes are that capture's memory, which "
                "nothing wrote; capture the whole step in one graph, or in pieces")
        if fork is None:
            captured.record(tokens)  # the rows follow in the current stream's order, after the copies
            return
        side, gathered = fork
        side.wait_stream(torch.cuda.current_stream(self.client.device))  # after every hand's hashes
        ids = self._in_place(parts)
        with torch.cuda.stream(side):
            if ids is None:
                self._copy_ids(parts)
            for part in parts.values():  # the current stream may reuse it before side reads it
                part.record_stream(side)
            for layers in self._launches(parts):
                captured.record(tokens, stream=side, ids=ids, layers=layers)
                event = gathered[layers.stop - 1]
                event.record(side)
                self._joins.update({layer: event for layer in parts if layer in layers})

    def _launches(self, parts: dict[int, torch.Tensor]) -> list[range]:
        """The layers of each launch of a forked gather, in order: one each where every layer
        handed in and split_layers holds, else one launch of them all (layers of other
        pipeline stages look up their DEAD IDs)."""
        n_layers = self.geometry.n_layers
        if self.split_layers and sorted(parts) == list(range(n_layers)):
            return [range(layer, layer + 1) for layer in range(n_layers)]
        return [range(n_layers)]

    def _in_place(self, parts: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """The step's IDs as the one tensor the forked gather reads in place, or None where it
        reads copies: the side stream's first kernel is then the gather's (or, for sorted reads,
        from the policy's `sort_min_tokens`, its sort's), as in vLLM's own prefetch, whose lookup
        reads the hashes in place and mostly starts before the first matmul (which waits for a
        memset). Behind copies of its own, the gather mostly started only at the tail of that
        matmul, which takes every SM (benchmarks/results/h100/2026-12-07-c)."""
        assert self.captured is not None
        ids = columns_view(parts, self.geometry.n_layers)
        return ids if ids is not None and self.captured.why_not_in_place(ids) is None else None

    def _fork(self) -> tuple[torch.cuda.Stream, list[torch.cuda.Event]] | None:
        """The side stream and events of this step's lookup, or None where it runs in line: a
        fork needs the step's first hand in a graph that holds the whole step (hand) and that
        capture still running (a step whose capture failed between its hands and its reader
        runs in line, its reader joining nothing)."""
        return self._side if self._on_side and _capturing() else None

    def _join(self, layer: int) -> None:
        """Make the current stream wait for the launch of the forked gather that wrote `layer`'s
        rows, once per launch. A graph replays as a whole, so the next step's IDs are written
        after this one's gather read them. A capture that ends with a launch unjoined fails there
        (CUDA refuses it); the launches of a capture that failed before their joins are dropped
        by the next step's first hand, which decides afresh, or by an eager reader."""
        event = self._joins.pop(layer, None)
        if event is None:
            return
        self._joins = {other: e for other, e in self._joins.items() if e is not event}
        if _capturing():
            torch.cuda.current_stream(self.client.device).wait_event(event)

    def _await_rows(self) -> None:
        """Make the current stream wait for the pending lookup (GPU: in stream order, no host
        sync; CPU: the reply), once per lookup; the next lookup into the slot waits for that
        stream's reads (EngramClient.lookup)."""
        future, self._future = self._future, None
        if future is None:
            return
        future.wait()
        self.check_still_served()

    def check_still_served(self) -> None:
        """After a lookup's wait: refuse rows that no longer are what the model was checked
        against and reads (see client/client.py, slot_rows and tables_id)."""
        client = self.client
        if client.rows_generation != self._rows_generation:
            raise VllmPluginError(
                "the engramd daemon re-registered this client with another mode or slab layout, "
                "so its rows moved away from the staged_rows that vLLM's captured graphs read: "
                "restart this vLLM server")
        self._tables.check()

    def close(self) -> None:
        self.client.close()


def columns_view(parts: dict[int, torch.Tensor], n_layers: int) -> torch.Tensor | None:
    """The step's `[T, n_layers, heads]` IDs as one view, where every layer handed in its
    column of one contiguous tensor (vLLM's `gathered_hashes[:, layer_hash_index]`), else None.
    The view costs no kernel: building the IDs anew took three launches (a fill and a copy per
    layer, about 60 us of a decode step's host time on an H100).

    A mapped client's gather reads the IDs where they are, on its side stream, when the first
    layer's `_ready_rows` queues it (gather_at "wait"). That holds because vLLM keeps the hashes
    alive and unwritten through the whole forward, and the step's stream waits for the gather
    there, before anything after it can write their memory again (the next step's hashes in a
    graph's pool included). A lookup whose rows no layer waits for (a forward cut short) is
    gathered before the next one, possibly from hashes rewritten since: rows nobody reads, in
    a slot the next gather writes over."""
    if len(parts) != n_layers or sorted(parts) != list(range(n_layers)):
        return None
    first = parts[0]
    tokens, heads = first.shape
    storage = first.untyped_storage().data_ptr()
    for layer, part in parts.items():
        if (part.dtype != first.dtype or part.device != first.device
                or part.untyped_storage().data_ptr() != storage
                or part.storage_offset() != first.storage_offset() + layer * heads
                or tuple(part.shape) != (tokens, heads)
                or (tokens > 1 and part.stride(0) != n_layers * heads) or (heads > 1 and part.stride(1) != 1)):
            return None
    return first.as_strided((tokens, n_layers, heads), (n_layers * heads, heads, 1))


def process_rows(layout) -> ProcessRows:
    """The process's ProcessRows, registered on first use (inside vLLM's model construction, where
    its parallel state and config are set) and checked against the model's Engram layout."""
    global _process_rows
    if _process_rows is None:
        client = _register_client()
        try:
            _check_geometry(client.geometry, layout, client.socket_path)
        except BaseException:
            client.close()
            raise
        _process_rows = ProcessRows(client, _settings["capture"])
        atexit.register(_process_rows.close)
        if _process_rows.captured is not None:
            _check_replays_every_step()
    return _process_rows


def _check_replays_every_step() -> None:
    """Wrap vLLM's `Worker.execute_model` so that every step of this worker first checks the
    captured lookup's replays (CapturedLookup.check: no device wait, so it sees the replays up to
    a step or so behind) and fails that step with ReplayFailedError if any wrote NaN rows. A full
    graph's replay runs no model code; the worker's step is the Python that still runs."""
    import importlib

    from engramd.client.engines.vllm import WORKER_MODULE, check_worker_seams

    module = importlib.import_module(WORKER_MODULE)
    check_worker_seams(module)
    if "execute_model" in _originals:
        return
    original = _originals["execute_model"] = module.Worker.execute_model

    @functools.wraps(original)
    def execute_model(self, scheduler_output):
        rows = _process_rows
        if rows is not None and rows.captured is not None:
            rows.captured.check()
        return original(self, scheduler_output)

    module.Worker.execute_model = execute_model


def _register_client() -> EngramClient:
    from vllm.config import get_current_vllm_config
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    max_tokens = get_current_vllm_config().scheduler_config.max_num_batched_tokens
    client = EngramClient(_settings["socket"], device=_device(), tp_rank=tp_rank, tp_size=tp_size,
                          max_tokens=max_tokens, slots=SLOTS, name=f"vllm-tp{tp_rank}",
                          mode=_settings["mode"], pin_tables=True,
                          hot_cache_gib=_settings["hot_cache_gib"], gather_at=_settings["gather_at"])
    log.info("engramd client %d (%s, pid %d): TP rank %d of %d, heads %d..%d, up to %d tokens",
             client.client_id, client.mode, os.getpid(), tp_rank, tp_size,
             client.shard.head_start, client.shard.head_end, max_tokens)
    return client


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.accelerator.current_device_index())


def _check_geometry(geometry: TableGeometry, layout, socket_path) -> None:
    """The daemon must serve the tables the model's config describes (bucket primes included)."""
    ours = (geometry.layer_ids, geometry.max_ngram, geometry.heads_per_order, geometry.head_dim,
            geometry.primes, geometry.rows)
    flat_primes = tuple(tuple(p for order in layer for p in order) for layer in layout.primes)
    theirs = (tuple(layout.layer_ids), layout.max_ngram_size, layout.n_heads, layout.head_dim,
              flat_primes, tuple(layout.num_embeddings))
    if ours != theirs:
        raise VllmPluginError(
            f"the engramd daemon at {socket_path} serves Engram tables of layers "
            f"{list(geometry.layer_ids)} with {list(geometry.rows)} rows, the model's config has "
            f"layers {list(layout.layer_ids)} with {list(layout.num_embeddings)} rows (or their "
            "n-gram orders, heads, head size or bucket primes differ): start the daemon on this "
            "model's checkpoint")


# -- the table: EngramdEmbedding ---------------------------------------------------------------

class EngramdEmbedding(ParallelEngramEmbedding):
    """vLLM's `ParallelEngramEmbedding` with no table: the attributes vLLM reads (shard, sizes),
    zero-row parameters, and `lookup` answered by the daemon.

    vLLM's __init__ is not run: it allocates the table and may form DP peer groups."""

    def __init__(self, rows: ProcessRows, layout, layer_index: int):
        nn.Module.__init__(self)
        shard = rows.client.shard
        self.rows = rows
        self.layer_index = layer_index
        self.num_embeddings = layout.num_embeddings[layer_index]
        self.dim, self.block_size = layout.head_dim, SCALE_BLOCK
        self.n_hash_cols, self.part_n_hash_cols = layout.n_hash_cols, shard.local_heads
        self.tp_size, self.dp_size, self.peer_rows = shard.shards, 1, 0
        self.cpu_offload, self.dp_shared_memory, self.use_thp = False, False, False
        self.head_start = shard.head_start
        self.vocab_start_idx, self.vocab_end_idx = shard.row_ranges[layer_index]
        self.part_num_embeddings = 0  # rows held here
        self.weight = self._empty_parameter(torch.float8_e4m3fn, self.dim)
        self.weight_scale_inv = self._empty_parameter(torch.uint8, self.dim // self.block_size)
        self.checkpoint_rows = shared.CheckpointRows(rows.client, layer_index, VllmPluginError,
                                                     DIRECT_SLOT, rows.check_still_served)

    def _empty_parameter(self, dtype: torch.dtype, width: int) -> nn.Parameter:
        from vllm.model_executor.utils import set_weight_attrs

        param = nn.Parameter(torch.empty(0, width, dtype=dtype), requires_grad=False)
        set_weight_attrs(param, {"weight_loader": self._skip_checkpoint_table})
        return param

    def _skip_checkpoint_table(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """The checkpoint's table is the daemon's to load: keep nothing, but refuse one whose
        shape is not the table the daemon serves, or whose rows are not the ones it serves
        (shared.CheckpointRows: a sample of them)."""
        expected = (self.num_embeddings, param.shape[1])
        if tuple(loaded_weight.shape) != expected:
            raise VllmPluginError(
                f"checkpoint Engram tensor of layer {self.rows.geometry.layer_ids[self.layer_index]} "
                f"has shape {list(loaded_weight.shape)}; the daemon serves {list(expected)}")
        self.checkpoint_rows.hand("weight" if param is self.weight else "scale", loaded_weight)

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """vLLM's direct lookup (`[T, heads]` IDs into `[T, local_heads, dim]` bf16), through a
        lookup of its own: for callers other than the staged path (vLLM's `forward`)."""
        if out.dtype != torch.bfloat16:
            raise VllmPluginError(f"engramd serves bf16 Engram rows; a lookup into {out.dtype} "
                                  "(vLLM's packed FP8 path, EngramBatch) cannot be served")
        if indices.shape[0] == 0:
            return
        geometry = self.rows.geometry
        ids = indices.new_full((indices.shape[0], geometry.n_layers, geometry.heads), DEAD_ID)
        ids[:, self.layer_index] = indices
        rows = self.rows.client.lookup(ids, slot=DIRECT_SLOT).wait()
        self.rows.check_still_served()  # its lookup may have re-registered with a new daemon
        out.copy_(rows[self.layer_index])


# -- the replaced Engram methods ---------------------------------------------------------------

def _served(engram) -> bool:
    return isinstance(getattr(engram, "embed_tokens", None), EngramdEmbedding)


def _create_embedding(self, layout, layer_hash_index):
    return EngramdEmbedding(process_rows(layout), layout, layer_hash_index)


def _init_staging(self, max_tokens, head_dim):
    if not _served(self):
        return _originals["_init_staging"](self, max_tokens, head_dim)
    self.staged_rows = self.embed_tokens.rows.staging(self.layer_hash_index)
    self._prefetch_stream, self._prefetch_done = None, None


def _prepare_embeddings(self, hash_ids):
    if not _served(self):
        return _originals["prepare_embeddings"](self, hash_ids)
    if self.embed_tokens.rows.captured is not None:  # device work only: in the graph
        self.embed_tokens.rows.hand(self.layer_hash_index, hash_ids)
    else:
        _hand_ids(self, hash_ids)


def _ready_rows(self, num_tokens):
    if not _served(self):
        return _originals["_ready_rows"](self, num_tokens)
    if self.embed_tokens.rows.captured is not None:
        return self.embed_tokens.rows.ready(self.layer_hash_index, num_tokens)
    _ready(self, num_tokens)
    return self.staged_rows[:num_tokens]


# Host work of every step: in eager breaks, so breakable CUDA graphs run it at every replay.

@eager_break_during_capture
def _hand_ids(engram, hash_ids: torch.Tensor) -> None:
    _refuse_capture()
    engram.embed_tokens.rows.hand(engram.layer_hash_index, hash_ids)


@eager_break_during_capture
def _ready(engram, num_tokens: int) -> None:
    _refuse_capture()
    engram.embed_tokens.rows.ready(engram.layer_hash_index, num_tokens)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _graph_holds_the_step() -> bool:
    """Whether a capture is under way that the step's `_ready_rows` are part of, so that a
    stream forked now is joined in it: a full graph, where vLLM forks its own prefetch inside the
    graph too. vLLM's model runner V2 captures its full graphs with the runtime mode NONE
    (outside a breakable capture, whose eager breaks then run in line), V1's CUDAGraphWrapper
    with FULL. Not a piecewise graph (mode PIECEWISE) or a breakable capture in pieces, where
    the layers between the lookup and its reader are other graphs. A capture of vLLM's layers
    from outside vLLM (no forward context) is taken to hold the whole step, as a full graph
    does; one that does not fails at its end, unjoined, never silently."""
    if not _capturing():
        return False
    mode = get_forward_context().cudagraph_runtime_mode if is_forward_context_available() else None
    if BreakableCUDAGraphCapture.current() is not None:
        return mode == CUDAGraphMode.FULL
    return mode != CUDAGraphMode.PIECEWISE


def _microbatched() -> bool:
    from vllm.config import get_current_vllm_config

    return bool(get_current_vllm_config().parallel_config.use_ubatching)


def _refuse_capture() -> None:
    """Inside an eager break no capture is running; a capture here would record this step's
    lookup once and replay its rows forever."""
    if _capturing():
        raise VllmPluginError(
            "engramd lookups are host work at every step and cannot be captured into a full CUDA "
            "graph: run vLLM with breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1, "
            "cudagraph_mode PIECEWISE) or --enforce-eager, or let a mapped GPU worker record its "
            f"lookups in the graphs ({CAPTURE_ENV}=on)")
