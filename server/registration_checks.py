"""Checks of a registration request against the daemon's settings: the tables it pinned, the
mode it gets, its TP shard, its slots' layout, the slab budget, and whether its GPU shares an
MPS server with the daemon. Each raises the typed error the client gets.

Functions of the request, the settings and the registrations held, so they are tested with the
registry (tests/test_registry.py). Not the registry's bookkeeping (server/registry.py: which
registrations make room for a new one, the places a user or a connection may hold), nor a
lookup's checks (server/lookup_checks.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from engramd.client.errors import BadRequestError, ResourceError, TablesChangedError
from engramd.client.geometry import GeometryError, ShardView, TableGeometry
from engramd.client.shared.messages import RegisterRequest
from engramd.client.shared.mps import MpsState
from engramd.client.shared.slab import SlabLayout
from engramd.server.accounting import printable
from engramd.server.backend import Backend

if TYPE_CHECKING:
    from engramd.server.registry import ClientRecord, Limits

MODES = ("served", "mapped")  # how a client is served; "auto" asks the daemon to choose
# What a client's device may be called: "cpu", or "cuda:" and a GPU's id ("GPU-<uuid>", 40
# characters; MIG instances' are longer). It reaches `stats` for every client, and the log.
DEVICE = re.compile(r"cpu|cuda:[A-Za-z0-9-]{1,64}")


def check_pinned_tables(req: RegisterRequest, tables_id: str | None) -> None:
    """A client that pinned its tables registers again only with a daemon serving them."""
    if req.tables is not None and req.tables != tables_id:
        raise TablesChangedError(f"this client pinned tables {req.tables}; the daemon serves "
                                 f"{tables_id} now (a reload, or a restart on another "
                                 "checkpoint)")


def check_device_name(device: str) -> None:
    """A device named as clients name them. A served client's is checked against the backend's
    devices too (Backend.check_device); a mapped one's only here, and each is in every `stats`
    reply: three of 30,000 characters made it larger than any client reads."""
    if not DEVICE.fullmatch(device):
        raise BadRequestError(f"device {printable(device[:80])!r}{'...' if len(device) > 80 else ''}"
                              ": expected 'cpu' or 'cuda:GPU-<uuid>'")


def mode_for(asked: Any, device: str, allowed: tuple[str, ...]) -> str:
    """The mode a registration gets: the one asked for if allowed; for "auto", mapped on a
    GPU and served on the CPU. A mapped GPU client reads through a hot-row cache of its own
    and launches its gathers with no hop through the daemon: without MPS it is the only mode
    that overlaps the model, and under MPS, its gathers queued at the wait, it was within 2%
    of served or faster in all 24 model-step cells (benchmarks/results/h200/README.md, "The
    gather queued where the engine waits")."""
    if asked is None:  # a client that predates modes: what it expects is a slab
        asked = "served"
    if asked == "auto":
        preferred = "served" if device == "cpu" else "mapped"
        return preferred if preferred in allowed else allowed[0]
    if asked not in MODES:
        raise BadRequestError(f"mode {asked!r}: expected auto, served or mapped")
    if asked not in allowed:
        raise BadRequestError(f"mode {asked!r} is not allowed by this daemon "
                              f"(client_modes = {','.join(allowed)})")
    return asked


def shard_for(req: RegisterRequest, geometry: TableGeometry) -> ShardView:
    if req.tp_size < 1 or req.tp_size > geometry.heads * 64:
        raise BadRequestError(f"tp_size {req.tp_size} out of range [1, {geometry.heads * 64}]")
    try:
        return geometry.shard(req.tp_rank, req.tp_size)
    except GeometryError as exc:
        raise BadRequestError(f"tp_rank/tp_size: {exc}") from None


def layout_for(req: RegisterRequest, shard: ShardView, geometry: TableGeometry,
               limits: Limits) -> SlabLayout:
    """The slots a registration asked for, within the daemon's bounds."""
    return SlabLayout(
        slots=_bounded("slots", req.slots, 1, limits.max_slots),
        max_tokens=_bounded("max_tokens", req.max_tokens, 1, limits.max_tokens),
        n_layers=geometry.n_layers, heads=geometry.heads,
        local_heads=shard.local_heads, head_dim=geometry.head_dim)


def check_budget(clients: Iterable[ClientRecord], layout: SlabLayout, budget: int) -> None:
    """Slabs are reserved at registration (allocated at attach) against one budget."""
    held = sum(c.layout.size for c in clients if c.mode == "served")
    if held + layout.size > budget:
        raise ResourceError(f"a slab of {layout.size} bytes would exceed the slab budget "
                            f"({held} of {budget} bytes held; config: "
                            "slab_budget_gib); register fewer slots or max_tokens")


def mps_report(backend: Backend, device: str, reported: Any) -> dict[str, Any] | None:
    """GPU clients: the daemon's and the client's MPS state there, and whether they share."""
    daemon = backend.mps_states().get(device.removeprefix("cuda:")) if device.startswith("cuda:") else None
    if daemon is None:
        return None
    client = MpsState.from_wire(reported)
    shared = client is not None and daemon.shares_with(client)
    return {"daemon": daemon.to_wire(), "client": client.to_wire() if client else None,
            "shared": shared}


def _bounded(name: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise BadRequestError(f"{name} {value} out of range [{low}, {high}]")
    return value
