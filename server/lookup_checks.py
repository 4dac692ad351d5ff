"""Checks of a lookup request against its client's registration: the slot, the token count,
the IDs' shape, dtype and inline bytes, the tables it pinned, and whether its slot's last IDs
were handed over. Each raises the typed error the client gets.

Pure functions of the request and the registration, so they are tested with the registry
(tests/test_registry.py). Not the registry's bookkeeping (server/registry.py), nor the IDs'
range, which the gathers count (out_of_range).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engramd.client.errors import BadIdsError, BadRequestError, SlotBusyError, TablesChangedError
from engramd.client.geometry import TableGeometry
from engramd.client.shared.ids import ID_DTYPES, ids_from_bytes
from engramd.client.shared.messages import LookupRequest
from engramd.client.shared.slab import SlabLayout
from engramd.server.backend import LookupJob

if TYPE_CHECKING:
    from engramd.server.registry import ClientRecord


def check_lookup(record: ClientRecord, req: LookupRequest, payload: list[bytes], geometry: TableGeometry,
                 tables_id: str | None, orders_slots: bool) -> LookupJob:
    """The job a valid lookup makes; `tables_id`: the tables served now; `orders_slots`: the
    backend queues a slot's lookups in order (Backend.orders_slots)."""
    if record.pinned_tables is not None and record.pinned_tables != tables_id:
        raise TablesChangedError(f"client {record.client_id} pinned tables "
                                 f"{record.pinned_tables}; a reload replaced them with "
                                 f"{tables_id}")
    assert record.slab is not None  # a served, attached client's (start_lookup checked)
    layout: SlabLayout = record.slab.layout
    slot, tokens = req.slot, tokens_of(req)
    if not 0 <= slot < layout.slots:
        raise BadRequestError(f"slot {slot} outside [0, {layout.slots})")
    if record.in_flight[slot] and not orders_slots:
        raise SlotBusyError(f"slot {slot} still has a lookup in flight")
    if not 1 <= tokens <= layout.max_tokens:
        raise BadIdsError(f"{tokens} tokens; this client registered 1..{layout.max_tokens}")
    expected = [tokens, geometry.n_layers, geometry.heads]
    if req.ids_shape != expected:
        raise BadIdsError(f"ids shape {req.ids_shape!r}, expected {expected} ([T, n_layers, heads])")
    dtype = req.ids_dtype
    if dtype not in ID_DTYPES:
        raise BadIdsError(f"ids dtype {dtype!r}; expected int32 or int64")
    inline = None
    if req.inline:
        nbytes = tokens * geometry.n_layers * geometry.heads * np.dtype(dtype).itemsize
        if len(payload) != 1 or len(payload[0]) != nbytes:
            got = [len(p) for p in payload]
            raise BadIdsError(f"inline ids: expected one frame of {nbytes} bytes, got frames {got}")
        inline = ids_from_bytes(payload[0], dtype, tuple(expected))
    elif payload:
        raise BadIdsError("payload frames sent with inline=false")
    return LookupJob(record.client_id, record.slab, record.shard, slot, req.seq, tokens,
                     ids_dtype=dtype, inline_ids=inline)


def check_ids_handed_over(record: ClientRecord, req: LookupRequest) -> None:
    """A slot takes a lookup only once the IDs of its last one are handed over: then the
    daemon stream holds at most one wait per slot that its client has not satisfied, so a
    client cannot queue device work without bound behind waits it never satisfies (a full
    queue blocks the thread that launches into it). The library client sends a slot's next
    lookup only once its GPU has handed the last one over (EngramClient._await_submitted).
    Refused without a release: that would queue behind the same wait."""
    assert record.slab is not None  # a served, attached client's (start_lookup checked)
    previous = record.last_seq.get(req.slot)
    if previous is None or record.slab.ids_handed_over(req.slot, previous):
        return
    record.errors += 1
    raise SlotBusyError(f"slot {req.slot}: the IDs of lookup {previous} are not handed over yet "
                        "(a slot takes its next lookup once its client's stream has copied "
                        "the last one's)")


def refused_tokens(req: LookupRequest, max_tokens: int) -> int:
    try:
        tokens = tokens_of(req)
    except BadIdsError:
        return max_tokens
    return tokens if 0 < tokens <= max_tokens else max_tokens


def tokens_of(req: LookupRequest) -> int:
    """A lookup's token count: its IDs' first dimension (a `tokens` field, if sent, must agree)."""
    shape = req.ids_shape
    if not shape or type(shape[0]) is not int:
        raise BadIdsError(f"ids shape {shape!r}: expected [T, n_layers, heads] of ints")
    if req.tokens not in (None, shape[0]):
        raise BadIdsError(f"tokens {req.tokens!r} but ids shape {shape!r}")
    return shape[0]
