"""The model-runner adapter: token IDs in at forward entry, BF16 rows out per Engram layer.

    engram = EngramRunnerAdapter("/run/engramd/engramd.sock", device="cuda:0", tp_rank=r, tp_size=n,
                                 max_tokens=8192)            # the token map comes from the tokenizer
    state = None
    # forward entry: hash on the GPU and submit the lookup, returns at once
    state = engram.prefetch(token_ids, cu_seqlens=cu_seqlens, state=state)
    ...
    x = engram.rows(layer_id=1)   # [T, local_heads, 256] bf16, valid in the runner's stream order

    # a decode step replayed as a CUDA graph (a mapped GPU client): the lookup inside the graph
    captured = engram.capturable_lookup()
    state = engram.hash_into(captured, token_ids, state=state)   # each step, before the replay
    with torch.cuda.graph(graph):
        rows = captured.record(T)
        x = engram.layer_rows(rows, layer_id=1)

One object per rank. On the GPU it never synchronises the host: hashing runs on the caller's
stream, the IDs are copied into the slot on that stream, and `rows()` makes the stream wait for
the daemon's completion counter. On the CPU backend `rows()` blocks until the daemon answered.
The geometry is the daemon's (it serves the tables); the token map must match its
`engram_compressed_vocab_size`.
"""

from __future__ import annotations

import operator
import os
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from engramd.client.captured import CapturedLookup
from engramd.client.client import EngramClient, LookupFuture
from engramd.client.errors import TablesChangedError
from engramd.client.hashing import EngramHasher, HashState, check_inputs
from engramd.client.token_map import build_token_map, default_tokenizer_path, load_token_map


class EngramRunnerAdapter:
    def __init__(self, socket_path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                 tp_rank: int = 0, tp_size: int = 1, max_tokens: int = 8192, slots: int = 2,
                 tokenizer_json_path: str | Path | None = None,
                 token_map_path: str | Path | None = None, token_map: np.ndarray | None = None,
                 timeout: float = 30.0, mode: str = "auto", hot_cache_gib: float | None = None,
                 gather_at: str = "wait"):
        self.client = EngramClient(socket_path, device=device, tp_rank=tp_rank, tp_size=tp_size,
                                   max_tokens=max_tokens, slots=slots, timeout=timeout, name="runner",
                                   mode=mode, hot_cache_gib=hot_cache_gib, gather_at=gather_at)
        try:
            if token_map is None:
                token_map = (load_token_map(token_map_path) if token_map_path is not None else
                             build_token_map(tokenizer_json_path or default_tokenizer_path()))
            self.hasher = EngramHasher(self.client.geometry, token_map, source="runner token map")
        except BaseException:
            self.client.close()
            raise
        self.device = self.client.device
        self._registration = self.client.registrations  # the one the hasher was built for
        self._future: LookupFuture | None = None
        self._rows: torch.Tensor | None = None

    @property
    def geometry(self):
        return self.client.geometry

    def prefetch(self, token_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                 dead: torch.Tensor | None = None, state: HashState | None = None,
                 stream: torch.cuda.Stream | None = None,
                 sm_fraction: float | None = None) -> HashState:
        """Hash this step's tokens and submit their lookup; returns the carry for the next step.

        `token_ids` [T] raw token IDs of B request chunks laid end to end (`cu_seqlens` [B+1]),
        `dead` [T] marks DEAD tokens, `state` is what the previous prefetch returned for the
        same requests (None: every chunk starts its sequence). `sm_fraction`: as
        EngramClient.lookup's (a mapped client's gather grid for this lookup).
        """
        # Forgotten first: a step refused anywhere below (its tokens, its lookup) must leave no
        # lookup for rows() to hand out, least of all the previous step's.
        self._future, self._rows = None, None
        ids, next_state = self._hash(token_ids, cu_seqlens, dead, state, stream)
        future = self.client.lookup(ids, stream, sm_fraction=sm_fraction)
        self._check_geometry()
        self._future = future
        return next_state

    def _check_geometry(self) -> None:
        """After a lookup, which may have registered again with a restarted daemon: refuse rows
        of tables of another geometry than the hasher's. Their rows of IDs hashed for other
        buckets would be no n-gram's, and pass for this step's."""
        client = self.client
        if client.registrations == self._registration:
            return
        if client.geometry != self.hasher.geometry:
            raise TablesChangedError(
                f"the engramd daemon at {client.socket_path} restarted on tables of another "
                f"geometry (rows per layer {list(client.geometry.rows)}) than this adapter hashes "
                f"for ({list(self.hasher.geometry.rows)}): make a new adapter")
        self._registration = client.registrations

    def rows(self, layer_id: int, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """`[T, local_heads, head_dim]` bf16 rows of Engram layer `layer_id` (backbone layer id)."""
        if self._future is None:
            raise RuntimeError("rows() before prefetch(): nothing was looked up for this step")
        index = self._layer_index(layer_id)
        if self.device.type == "cuda":
            return self._future.wait(stream)[index]  # one stream wait per call: any stream may ask
        if self._rows is None:
            self._rows = self._future.result()
        return self._rows[index]

    def capturable_lookup(self, max_tokens: int | None = None) -> CapturedLookup:
        """A lookup a CUDA graph can record (EngramClient.capturable_lookup), over an IDs buffer
        of its own of `max_tokens` tokens (default: the client's). Each step `hash_into` writes
        the step's hash IDs into it; inside the capture `record(T)` queues the gather of the
        first T, and `layer_rows` picks a layer of its rows."""
        geometry = self.geometry
        buffer = torch.full((max_tokens or self.client.max_tokens, geometry.n_layers, geometry.heads),
                            -1, dtype=torch.int64, device=self.device)
        return self.client.capturable_lookup(buffer)

    def hash_into(self, captured: CapturedLookup, token_ids: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, dead: torch.Tensor | None = None,
                  state: HashState | None = None, stream: torch.cuda.Stream | None = None) -> HashState:
        """prefetch()'s hashing, into `captured`'s IDs buffer (the first T of it) on `stream`
        (default: the current one), before the replay that reads them; returns the carry. A
        graph recorded for more tokens than these (padding) reads the rest of the buffer as it
        is: an earlier step's IDs, in range, whose rows the engine does not use."""
        if token_ids.shape[0] > captured.ids.shape[0]:
            raise ValueError(f"{token_ids.shape[0]} tokens; the captured lookup's buffer holds "
                             f"{captured.ids.shape[0]}")
        ids, next_state = self._hash(token_ids, cu_seqlens, dead, state, stream)
        with self._on(stream):
            captured.ids[:ids.shape[0]].copy_(ids, non_blocking=True)
        return next_state

    def _hash(self, token_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
              dead: torch.Tensor | None, state: HashState | None,
              stream: torch.cuda.Stream | None) -> tuple[torch.Tensor, HashState]:
        """The hash IDs of a step's tokens, on `stream`; validated on the CPU only (on a GPU
        that would synchronise)."""
        check_inputs(token_ids, cu_seqlens, dead, state)  # before .to(), which lists lack
        with self._on(stream):  # the copies too: the hash reads them in this stream's order
            token_ids = token_ids.to(self.device, non_blocking=True)
            cu_seqlens, dead = (None if tensor is None else tensor.to(self.device, non_blocking=True)
                                for tensor in (cu_seqlens, dead))
            return self.hasher.hash_batch(token_ids, cu_seqlens, dead, state,
                                          validate=self.device.type != "cuda")

    def _on(self, stream: torch.cuda.Stream | None):
        return torch.cuda.stream(stream) if self.device.type == "cuda" and stream is not None \
            else nullcontext()

    def layer_rows(self, rows: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Layer `layer_id`'s `[T, local_heads, head_dim]` of a captured lookup's rows."""
        return rows[self._layer_index(layer_id)]

    def _layer_index(self, layer_id: int) -> int:
        """The position of `layer_id` among the Engram layers. Only an integer names a layer:
        list.index compares by ==, and True == 1, 14.0 == 14 picked a layer's rows."""
        try:
            if isinstance(layer_id, bool):
                raise TypeError("a bool names no layer")
            return self.geometry.layer_ids.index(operator.index(layer_id))
        except (TypeError, ValueError):
            raise ValueError(f"layer {layer_id!r} has no Engram table; Engram layers: "
                             f"{list(self.geometry.layer_ids)}") from None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> EngramRunnerAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
