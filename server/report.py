"""What the daemon reports of itself: `stats` and `health` (the wire's replies) and what the
Prometheus endpoint shows (server/metrics.py).

Read from the service's state (server/service.py) on the loop's thread. Not the operations, nor
the counting itself (the registry's accounting, server/accounting.py), nor the Prometheus
endpoint.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from engramd.client.shared.messages import HealthReply, StatsReply

if TYPE_CHECKING:
    from engramd.server.service import Service


class ServiceReport:
    def __init__(self, service: Service):
        self.service = service

    def stats(self) -> StatsReply:
        """Counts anyone who may connect may see: no client's pid, name or uid (see clients)."""
        service = self.service
        stats = service.registry.stats() if service.registry is not None else {}
        backend = service.tables.backend if service.tables is not None else None
        return StatsReply(state=service.state, uptime=time.monotonic() - service.started,
                          hot_cache=self.cache_stats(), mps=self.mps(), tables=service.tables_id,
                          reload=service.reloads.status(),
                          deferred=backend.deferred() if backend else [], **stats)

    def health(self) -> HealthReply:
        service = self.service
        return HealthReply(live=True, ready=service.state == "ready", state=service.state,
                           progress=round(service.progress, 4), pid=os.getpid(),
                           uptime=round(time.monotonic() - service.started, 3),
                           backend=service.tables.backend.name if service.tables else None, mps=self.mps(),
                           tables=service.tables_id, reload=service.reloads.status())

    def mps(self) -> dict[str, Any]:
        """Per GPU UUID, the daemon's MPS state there (empty on the CPU backend or while loading)."""
        service = self.service
        backend = service.tables.backend if service.tables is not None else None
        return {uuid: s.to_wire() for uuid, s in backend.mps_states().items()} if backend else {}

    def cache_stats(self) -> dict[str, Any]:
        """Per GPU UUID, the hot-row cache's counters (empty without a cache or a GPU backend)."""
        service = self.service
        return service.tables.backend.cache_stats() if service.tables is not None else {}

    def metrics(self) -> dict[str, Any]:
        """What the Prometheus endpoint shows (server/metrics.py)."""
        service = self.service
        stats = service.registry.stats() if service.registry is not None else {}
        slab_bytes: dict[str, int] = {}
        for client in (service.registry.clients.values() if service.registry is not None else ()):
            if client.slab is not None:
                slab_bytes[client.device] = slab_bytes.get(client.device, 0) + client.slab.layout.size
        backend = service.tables.backend if service.tables is not None else None
        return {"ready": service.state == "ready", "progress": service.progress,
                "uptime": time.monotonic() - service.started, "epoch": service.epoch,
                "backend": backend.name if backend else None,
                "clients": stats.get("clients", []), "lookups": stats.get("lookups", 0),
                "rows": stats.get("rows", 0), "out_of_range": stats.get("out_of_range", 0),
                "errors": stats.get("errors", {}), "slab_bytes": slab_bytes,
                "pinned_bytes": backend.pinned_bytes if backend else 0,
                "hot_cache": self.cache_stats(), "mps": self.mps(), "tables": service.tables_id,
                "reload": service.reloads.status()}
