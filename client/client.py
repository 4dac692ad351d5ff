"""The engramd client library: register with the daemon, send hash IDs, get BF16 rows back.

    from engramd.client import EngramClient
    with EngramClient("/run/engramd/engramd.sock", tp_rank=0, tp_size=1, max_tokens=4096) as client:
        rows = client.lookup(hash_ids).result()   # [n_layers, T, local_heads, 256] bfloat16

A lookup's rows live in one of the client's `slots` in the daemon's slab; `result()` returns a view
of that memory, valid until `slots` further lookups have been submitted on this client (pass
`copy=True` to keep a private copy). Slots are used round-robin, and a slot is reused only after
its previous lookup has completed. One client object serves one thread.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import torch

from engramd.client.connection import Connection, default_socket_path
from engramd.client.errors import (
    BadIdsError,
    BadRequestError,
    EngramError,
    InternalError,
    ReplyTimeoutError,
)
from engramd.client.geometry import ShardView, TableGeometry
from engramd.client.ids import dtype_name
from engramd.client.slab import SlabLayout

DEFAULT_TIMEOUT_S = 30.0


class LookupFuture:
    """The pending rows of one lookup."""

    def __init__(self, client: EngramClient, rid: int, slot: int, tokens: int):
        self._client = client
        self.rid = rid
        self.slot = slot
        self.tokens = tokens
        self._rows: torch.Tensor | None = None
        self._error: EngramError | None = None
        self.out_of_range = 0

    def done(self) -> bool:
        if self._rows is None and self._error is None:
            if self._client._conn.poll_reply(self.rid):
                self._complete(None)
        return self._rows is not None or self._error is not None

    def result(self, timeout: float | None = None, copy: bool = False) -> torch.Tensor:
        """Block until the rows are ready; `[n_layers, T, local_heads, head_dim]` bfloat16."""
        if self._rows is None and self._error is None:
            self._complete(timeout)
        if self._error is not None:
            raise self._error
        return self._rows.clone() if copy else self._rows

    def _complete(self, timeout: float | None) -> None:
        try:
            reply = self._client._conn.wait(self.rid, timeout, f"lookup of {self.tokens} tokens")
            self.out_of_range = int(reply.fields.get("out_of_range", 0))
            self._rows = self._client._slab_rows(self.slot, self.tokens)
        except ReplyTimeoutError:
            raise  # the lookup may still complete: a later result() call can collect it
        except EngramError as exc:
            self._error = exc
        finally:
            if self._rows is not None or self._error is not None:
                self._client._slot_done(self.slot, self)


class _ShmSlabView:
    """The client's mapping of a CPU-backend slab."""

    def __init__(self, wire: dict[str, Any], layout: SlabLayout):
        self.layout = layout
        fd = os.open(wire["path"], os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < layout.size:
                raise InternalError(f"slab {wire['path']} has {size} bytes, layout needs {layout.size}")
            self._map = mmap.mmap(fd, layout.size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        lay = self.layout
        start = lay.rows_offset(slot)
        n = lay.n_layers * tokens * lay.local_heads * lay.head_dim
        view = self.buffer[start:start + 2 * n].view(torch.bfloat16)
        return view.view(lay.n_layers, tokens, lay.local_heads, lay.head_dim)

    def close(self) -> None:
        del self.buffer
        try:
            self._map.close()
        except BufferError:
            pass  # the caller still holds row views; the mapping goes when they do


class EngramClient:
    def __init__(self, socket_path: str | os.PathLike | None = None, device: str = "cpu",
                 tp_rank: int = 0, tp_size: int = 1, max_tokens: int = 1024, slots: int = 2,
                 timeout: float = DEFAULT_TIMEOUT_S, name: str = ""):
        if device != "cpu":
            raise BadRequestError(f"device {device!r}: this build of the client serves 'cpu' only")
        self.socket_path = Path(socket_path or default_socket_path())
        self.device = device
        self.timeout = timeout
        self._conn = Connection(self.socket_path)
        self._pending: dict[int, LookupFuture] = {}
        self._next_slot = 0
        self._seq = 0
        self._slab: _ShmSlabView | None = None
        self.client_id: int | None = None
        try:
            self._register(device, tp_rank, tp_size, max_tokens, slots, name)
        except BaseException:
            self.close()
            raise

    def _register(self, device: str, tp_rank: int, tp_size: int, max_tokens: int, slots: int,
                  name: str) -> None:
        reply = self._conn.call("register", self.timeout, pid=os.getpid(), device=device,
                                tp_rank=tp_rank, tp_size=tp_size, max_tokens=max_tokens,
                                slots=slots, name=name)
        f = reply.fields
        self.client_id = int(f["client_id"])
        self.epoch = reply.epoch
        self.geometry = TableGeometry.from_config(f["geometry"], source="daemon register reply")
        self.shard: ShardView = self.geometry.shard(tp_rank, tp_size)
        if self.shard.local_heads != f["shard"]["local_heads"]:
            raise InternalError(f"daemon and client disagree on the shard: {f['shard']!r}")
        self.layout = SlabLayout.from_wire(f["slab"]["layout"])
        self._slab = _ShmSlabView(f["slab"], self.layout)
        if "daemon_pid" in f:
            self._conn.watch_daemon(int(f["daemon_pid"]))

    @property
    def max_tokens(self) -> int:
        return self.layout.max_tokens

    @property
    def slots(self) -> int:
        return self.layout.slots

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, hash_ids: torch.Tensor) -> LookupFuture:
        """Submit `[T, n_layers, heads]` int32/int64 row IDs (-1 = DEAD); returns at once."""
        ids = self._check_ids(hash_ids)
        slot = self._claim_slot()
        self._seq += 1
        tokens = ids.shape[0]
        rid = self._conn.send(
            "lookup", [memoryview(ids.numpy()).cast("B")], client_id=self.client_id, slot=slot,
            seq=self._seq, tokens=tokens, ids_dtype=dtype_name(ids.dtype),
            ids_shape=list(ids.shape), inline=True)
        future = LookupFuture(self, rid, slot, tokens)
        self._pending[slot] = future
        return future

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise BadIdsError(f"hash IDs must be a torch.Tensor, got {type(ids).__name__}")
        if dtype_name(ids.dtype) is None:
            raise BadIdsError(f"hash IDs must be int32 or int64, got {ids.dtype}")
        expected = (self.geometry.n_layers, self.geometry.heads)
        if ids.dim() != 3 or tuple(ids.shape[1:]) != expected:
            raise BadIdsError(f"hash IDs must have shape [T, {expected[0]}, {expected[1]}], "
                              f"got {list(ids.shape)}")
        if not 1 <= ids.shape[0] <= self.max_tokens:
            raise BadIdsError(f"{ids.shape[0]} tokens; this client registered 1..{self.max_tokens}")
        return ids.detach().to("cpu").contiguous()

    def _claim_slot(self) -> int:
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.slots
        previous = self._pending.get(slot)
        if previous is not None:
            try:
                previous.result(timeout=self.timeout)  # the slot is reused only once it is done
            except EngramError:
                pass  # that lookup's owner sees its error; the slot is free either way
        return slot

    def _slot_done(self, slot: int, future: LookupFuture) -> None:
        if self._pending.get(slot) is future:
            del self._pending[slot]

    def _slab_rows(self, slot: int, tokens: int) -> torch.Tensor:
        return self._slab.rows(slot, tokens)

    # -- other operations -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self._conn.call("stats", self.timeout).fields

    def health(self) -> dict[str, Any]:
        return self._conn.call("health", self.timeout).fields

    def close(self) -> None:
        """Release the registration and the slab mapping. Safe to call twice."""
        if self.client_id is not None:
            for future in list(self._pending.values()):
                try:
                    future.result(timeout=self.timeout)
                except EngramError:
                    pass
            try:
                self._conn.call("release", min(self.timeout, 5.0), client_id=self.client_id)
            except EngramError:
                pass  # the daemon is gone or already forgot us: nothing left to release
            self.client_id = None
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> EngramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
