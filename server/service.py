"""The daemon's operations, with no transport in them.

What a request asks and what the answer holds, for every operation: register, lookup, release,
heartbeat, stats, health, and the admin operations (who the clients are, drain), plus the
daemon's state (starting, loading, ready, stopping) that decides which may run. The daemon
(daemon.py) owns the sockets, threads and signals: it decodes a request, calls the method here,
and encodes what comes back (a declared reply of client/messages.py, or a typed EngramError).
Nothing here knows ZeroMQ, the handle socket or file descriptors, so tests drive the service
in-process (tests/test_service.py), as an engine core is driven without its client.

Every method runs on the daemon's loop thread, except `admits` (the handle socket's threads ask
it before reading a request; it only reads settings).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from engramd.client.errors import NotReadyError, PermissionDeniedError
from engramd.client.handles import PeerCredentials
from engramd.client.messages import (
    ClientsReply,
    HealthReply,
    HeartbeatReply,
    HeartbeatRequest,
    LookupReply,
    LookupRequest,
    RegisterReply,
    RegisterRequest,
    ReleaseReply,
    ReleaseRequest,
    StatsReply,
)
from engramd.server.backend import Completion, LookupJob
from engramd.server.config import DaemonConfig, id_set
from engramd.server.job_context import JobContext
from engramd.server.registry import ClientRecord, ClientRegistry, Limits
from engramd.server.table_loader import LoadedTables


class Service:
    @classmethod
    def from_config(cls, config: DaemonConfig, epoch: str) -> Service:
        # Who may run admin operations: the daemon's own user, and whom the config names.
        return cls(epoch, Limits.from_config(config), {os.geteuid(), *(id_set(config.admin_uids) or ())})

    def __init__(self, epoch: str, limits: Limits, admins: set[int]):
        self.epoch = epoch
        self.limits = limits
        self.admins = frozenset(admins)  # uids that may run admin operations
        self.state = "starting"
        self.progress = 0.0  # of the tables loaded, while loading
        self.started = time.monotonic()
        self.registry: ClientRegistry | None = None
        self.tables: LoadedTables | None = None
        self.reload: Any = None  # the last reload (server/reload.py TableReload), if any

    # -- lifecycle ------------------------------------------------------------------------------

    def serve(self, loaded: LoadedTables, on_retire: Callable[[ClientRecord], None]) -> None:
        """The tables are loaded and checked: from now on clients may register."""
        self.tables = loaded
        self.registry = ClientRegistry(loaded.geometry, loaded.backend, self.limits, on_retire=on_retire,
                                       tables_id=loaded.checkpoint.fingerprint())
        self.state = "ready"
        self.progress = 1.0

    def replace_tables(self, loaded: LoadedTables, tables_id: str) -> None:
        """A reload switched to `loaded`, of id `tables_id` (the backend serves them already)."""
        self.tables = loaded
        self.registry.tables_changed(tables_id)

    @property
    def tables_id(self) -> str | None:
        return self.registry.tables_id if self.registry is not None else None

    @property
    def tables_seq(self) -> int:
        return self.registry.tables_seq if self.registry is not None else 0

    def reload_status(self) -> dict[str, Any]:
        return self.reload.status() if self.reload is not None else {}

    def in_flight(self) -> int:
        if self.registry is None:
            return 0
        return sum(sum(c.in_flight.values()) for c in self.registry.clients.values())

    def count_error(self, code: str) -> None:
        if self.registry is not None:
            self.registry.count_error(code)

    # -- operations -----------------------------------------------------------------------------

    def _serving(self, op: str) -> ClientRegistry:
        """The registry, if the daemon serves now; NotReadyError naming the state otherwise."""
        if self.state != "ready" or self.registry is None:
            raise NotReadyError(f"{op}: daemon is {self.state} "
                                f"(tables {self.progress:.0%} loaded); retry when `engramd health` says ready")
        return self.registry

    def _registered(self, op: str) -> ClientRegistry:
        """The registry, if there is one (a stopping daemon still finishes its clients' work)."""
        if self.registry is None:
            raise NotReadyError(f"{op}: daemon is {self.state}")
        return self.registry

    def register(self, identity: bytes, request: RegisterRequest,
                 peer: PeerCredentials | None = None) -> RegisterReply:
        """`peer`: who holds the connection, where the transport can say (registry.register)."""
        return self._serving("register").register(identity, request, peer)

    def lookup(self, identity: bytes, request: LookupRequest, payload: list[bytes], done: Completion,
               context: JobContext) -> None:
        """Start a lookup; `done(job)` is called once, from any thread (see finish_lookup)."""
        self._registered("lookup").start_lookup(identity, request, payload, done, context)

    def finish_lookup(self, job: LookupJob) -> LookupReply | None:
        """The lookup's reply (None for a job that was skipped), or its typed error raised."""
        return self._registered("lookup").finish_lookup(job)

    def release(self, identity: bytes, request: ReleaseRequest) -> ReleaseReply:
        self._registered("release").release(identity, request.client_id, request.counts)
        return ReleaseReply()

    def heartbeat(self, identity: bytes, request: HeartbeatRequest) -> HeartbeatReply:
        if request.client_id is not None:  # a bare heartbeat only asks whether we are here
            self._registered("heartbeat").heartbeat(identity, request.client_id, request.token,
                                                    request.counts, request.tables)
        return HeartbeatReply(tables=self.tables_id, tables_seq=self.tables_seq)

    def attach(self, client_id: int, token: str, peer: PeerCredentials) -> ClientRecord:
        return self._serving("attach").attach(client_id, token, peer)

    def grant_tables(self, client_id: int, token: str, peer: PeerCredentials) -> ClientRecord:
        return self._serving("tables").grant_tables(client_id, token, peer)

    def stats(self) -> StatsReply:
        """Counts anyone who may connect may see: no client's pid, name or uid (see clients)."""
        stats = self.registry.stats() if self.registry is not None else {}
        return StatsReply(state=self.state, uptime=time.monotonic() - self.started,
                          hot_cache=self.cache_stats(), mps=self.mps(), tables=self.tables_id,
                          reload=self.reload_status(), **stats)

    def health(self) -> HealthReply:
        return HealthReply(live=True, ready=self.state == "ready", state=self.state,
                           progress=round(self.progress, 4), pid=os.getpid(),
                           uptime=round(time.monotonic() - self.started, 3),
                           backend=self.tables.backend.name if self.tables else None, mps=self.mps(),
                           tables=self.tables_id, reload=self.reload_status())

    def mps(self) -> dict[str, Any]:
        """Per GPU UUID, the daemon's MPS state there (empty on the CPU backend or while loading)."""
        backend = self.tables.backend if self.tables is not None else None
        return {uuid: s.to_wire() for uuid, s in backend.mps_states().items()} if backend else {}

    def cache_stats(self) -> dict[str, Any]:
        """Per GPU UUID, the hot-row cache's counters (empty without a cache or a GPU backend)."""
        return self.tables.backend.cache_stats() if self.tables is not None else {}

    def gathering(self) -> bool:
        """Whether the backend's gather threads have work now (see Backend.gathering)."""
        return self.tables is not None and self.tables.backend.gathering

    def metrics(self) -> dict[str, Any]:
        """What the Prometheus endpoint shows (server/metrics.py)."""
        stats = self.registry.stats() if self.registry is not None else {}
        slab_bytes: dict[str, int] = {}
        for client in (self.registry.clients.values() if self.registry is not None else ()):
            if client.slab is not None:
                slab_bytes[client.device] = slab_bytes.get(client.device, 0) + client.slab.layout.size
        backend = self.tables.backend if self.tables is not None else None
        return {"ready": self.state == "ready", "progress": self.progress,
                "uptime": time.monotonic() - self.started, "epoch": self.epoch,
                "backend": backend.name if backend else None,
                "clients": stats.get("clients", []), "lookups": stats.get("lookups", 0),
                "rows": stats.get("rows", 0), "out_of_range": stats.get("out_of_range", 0),
                "errors": stats.get("errors", {}), "slab_bytes": slab_bytes,
                "pinned_bytes": backend.pinned_bytes if backend else 0,
                "hot_cache": self.cache_stats(), "mps": self.mps(), "tables": self.tables_id,
                "reload": self.reload_status()}

    # -- who may ----------------------------------------------------------------------------------

    def admits(self, peer: PeerCredentials) -> bool:
        """Whether the daemon serves this peer at all: an allowed id, or an admin."""
        return peer.uid in self.admins or self.limits.allows(peer)

    def require_admin(self, peer: PeerCredentials, op: str) -> None:
        if peer.uid not in self.admins:
            raise PermissionDeniedError(f"{op} is an admin operation: uid {peer.uid} may not "
                                        f"(admin_uids: {sorted(self.admins)})")

    def clients(self, peer: PeerCredentials) -> ClientsReply:
        """Admin: who each live client is (pid in the daemon's namespace, name, uid); `stats`,
        open to every member of the socket's group, leaves these out."""
        self.require_admin(peer, "clients")
        return ClientsReply(clients=self.registry.who() if self.registry is not None else [])
