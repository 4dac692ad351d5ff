"""The daemon's operations, with no transport in them.

What a request asks and what the answer holds, for every operation: register, attach, lookup,
release, heartbeat, stats, health, and the admin operations (who the clients are, drain,
reload), plus the daemon's state (starting, loading, ready, stopping) that decides which may
run. A reload is the service's too, run by its ReloadControl (server/reload_control.py,
`Service.reloads`: starting one, switching to its tables, the tables a mapped client re-maps
after it). The daemon (daemon.py) owns the sockets, threads, signals and leases: it decodes a
request, calls the method here, and encodes what comes back (a declared reply of
client/shared/messages.py, or a typed EngramError) with the descriptors a reply passes (made by
server/grants.py); what `stats`, `health` and the metrics report is read by server/report.py
(`Service.report`). Nothing here knows ZeroMQ or the handle socket, so tests drive the service
in-process (tests/test_service.py), as an engine core is driven without its client.

Every method runs on the daemon's loop thread, except `admits` (the handle socket's threads ask
it before reading a request; it only reads settings).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from engramd.client.errors import NotReadyError, PermissionDeniedError
from engramd.client.shared.handles import PeerCredentials
from engramd.client.shared.messages import (
    ClientsReply,
    HeartbeatReply,
    HeartbeatRequest,
    LookupReply,
    LookupRequest,
    RegisterReply,
    RegisterRequest,
    ReleaseReply,
    ReleaseRequest,
)
from engramd.server.backend import Completion, LookupJob
from engramd.server.config import DaemonConfig, id_set
from engramd.server.grants import MappedGrants
from engramd.server.job_context import JobContext
from engramd.server.registry import ClientRecord, ClientRegistry, Limits
from engramd.server.reload_control import ReloadControl
from engramd.server.report import ServiceReport
from engramd.server.table_loader import LoadedTables


class Service:
    @classmethod
    def from_config(cls, config: DaemonConfig, epoch: str) -> Service:
        return cls(config, epoch)

    def __init__(self, config: DaemonConfig, epoch: str):
        self.config = config
        self.epoch = epoch
        self.limits = Limits.from_config(config)
        # Who may run admin operations: the daemon's own user, and whom the config names.
        self.admins = frozenset({os.geteuid(), *(id_set(config.admin_uids) or ())})
        self.state = "starting"
        self.progress = 0.0  # of the tables loaded, while loading
        self.started = time.monotonic()
        self.registry: ClientRegistry | None = None
        self.tables: LoadedTables | None = None
        self.grants: MappedGrants | None = None  # the served tables' descriptors, for mapped clients
        self.reloads = ReloadControl(self)  # starts them, switches to their tables
        self.report = ServiceReport(self)  # stats, health, metrics

    # -- lifecycle ------------------------------------------------------------------------------

    def serve(self, loaded: LoadedTables, on_retire: Callable[[ClientRecord], None],
              grants: MappedGrants | None = None) -> None:
        """The tables are loaded and checked: from now on clients may register. `grants`: their
        descriptors, where mapped clients attach (the caller closes them)."""
        self.tables = loaded
        self.grants = grants
        self.registry = ClientRegistry(loaded.geometry, loaded.backend, self.limits, on_retire=on_retire,
                                       tables_id=loaded.checkpoint.fingerprint())
        self.state = "ready"
        self.progress = 1.0

    def close(self) -> None:
        """Free the slabs and let go of the devices and the tables, in this order: the backend
        takes no more jobs, so no gather is added to a slab; the slabs are freed, whose releases
        pass waits on IDs never written; then the devices are synchronised and the tables unpinned."""
        tables, registry = self.tables, self.registry
        if tables is not None:
            tables.backend.stop()  # every job enqueued: no gather is added to a slab after it
        if registry is not None:
            registry.close()  # frees the slabs, whose releases pass waits on IDs never written
        if tables is not None:
            tables.backend.close()  # then the devices are synchronised and the tables unpinned
            tables.close()

    @property
    def tables_id(self) -> str | None:
        return self.registry.tables_id if self.registry is not None else None

    @property
    def tables_seq(self) -> int:
        return self.registry.tables_seq if self.registry is not None else 0

    def in_flight(self) -> int:
        if self.registry is None:
            return 0
        return sum(sum(c.in_flight.values()) for c in self.registry.clients.values())

    def gathers_done(self) -> Callable[[], bool]:
        """A probe: whether every lookup enqueued until now has written its rows (Backend.gathers_done)."""
        return self.tables.backend.gathers_done() if self.tables is not None else (lambda: True)

    def identities(self) -> list[bytes]:
        """The connections of every registration, for a notice to all of them."""
        return [c.identity for c in self.registry.clients.values()] if self.registry is not None else []

    def retire_client(self, client_id: int, why: str) -> None:
        """Its lease closed (registry.retire_client)."""
        self._registered("retire").retire_client(client_id, why)

    def retire_identity(self, identity: bytes, why: str) -> None:
        """Its connection is gone: whatever it registered goes too."""
        if self.registry is not None:
            self.registry.retire_identity(identity, why)

    def housekeeping(self) -> list[str]:
        """Retire the dead (registry.reap_dead); what to say of lookups overdue for their IDs."""
        if self.registry is None:
            return []
        self.registry.reap_dead()
        return self.registry.overdue_lookups()

    def count_error(self, code: str) -> None:
        if self.registry is not None:
            self.registry.accounts.count_error(code)

    # -- operations -----------------------------------------------------------------------------

    def serving(self, op: str) -> ClientRegistry:
        """The registry, if the daemon serves now; NotReadyError naming the state otherwise
        (the reloads' `tables` request asks it too)."""
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
        return self.serving("register").register(identity, request, peer)

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
        """The second step of a registration (registry.attach). What the client is then passed
        is made where the handle socket answers it (handle_requests.py, grants.attach_reply)."""
        return self.serving("attach").attach(client_id, token, peer)

    def gathering(self) -> bool:
        """Whether the backend's gather threads have work now (see Backend.gathering)."""
        return self.tables is not None and self.tables.backend.gathering

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
