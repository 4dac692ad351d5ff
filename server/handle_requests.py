"""What the daemon answers on the handle socket: attach (a registration's slab or tables, and its
lease), the tables a mapped client re-maps after a reload, and the admin operations (clients,
drain, reload).

The handle socket's threads (server/handle_server.py; wire in client/shared/handles.py) read a request
and the peer's kernel credentials, and post them to the daemon's loop, which owns the registry:
`answer` runs there. `admits` runs on the handle threads, before a request is read. Not the
transport (the handle server), nor what each operation does (server/service.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from engramd.client.errors import EngramError, InternalError, PermissionDeniedError
from engramd.client.shared.handles import PeerCredentials, error_reply, ok_reply
from engramd.client.shared.messages import (
    AttachReply,
    AttachRequest,
    DrainReply,
    DrainRequest,
    Message,
    ReloadRequest,
    TablesRequest,
)
from engramd.server.grants import attach_reply
from engramd.server.leases import Leases
from engramd.server.registry import ClientRecord
from engramd.server.reload import TableReload
from engramd.server.service import Service
from engramd.server.throttle import ThrottledBy

log = logging.getLogger("engramd.daemon")


class HandleRequests:
    def __init__(self, service: Service, leases: Leases, post: Callable[[str, Any], None],
                 begin_stop: Callable[[str], None], reload_done: Callable[[TableReload], None]):
        """`post(kind, value)`: hands work to the loop (an "attach" comes back to `answer`);
        `begin_stop(reason)`: an admin's drain; `reload_done`: for an admin's reload."""
        self.service = service
        self.epoch = service.epoch
        self._leases = leases
        self._post = post
        self._begin_stop = begin_stop
        self._reload_done = reload_done
        self._refusals = ThrottledBy(log)  # handle-socket requests refused, per peer uid

    def ask(self, request: Message, peer: PeerCredentials, connection: int, future: Any) -> None:
        self._post("attach", (request, peer, connection, future))  # the registry is the loop's

    def admits(self, peer: PeerCredentials) -> bool:
        """From the handle threads, before a peer's request is read: allowed ids, or an admin."""
        if self.service.admits(peer):
            return True
        self._post("refused", PermissionDeniedError.code)  # the loop owns the statistics
        return False

    def answer(self, item: tuple[Message, PeerCredentials, int, Any]) -> None:
        request, peer, connection, future = item
        if not future.set_running_or_notify_cancel():
            return  # the asker gave up waiting and closed `connection` itself
        try:  # from here `connection` is ours: kept as a lease, or closed
            if isinstance(request, AttachRequest):
                future.set_result(self._attach(request, peer, connection))
                return
            os.close(connection)  # no lease: the reply is all
            fds: list[int] = []
            reply: Message
            if isinstance(request, TablesRequest):
                reply, fds = self.service.reloads.grant_tables(request.client_id, request.token, peer)
            else:
                reply = (self._admin_drain(peer) if isinstance(request, DrainRequest)  # admin operations
                         else self.service.reloads.ask(peer, self._reload_done)
                         if isinstance(request, ReloadRequest) else self.service.clients(peer))
            future.set_result((ok_reply(self.epoch, reply), fds))
        except Exception as exc:  # every asker gets its answer; the loop keeps serving
            if not isinstance(exc, EngramError):
                log.exception("handle socket: attach failed")
                exc = InternalError(f"attach failed: {type(exc).__name__}: {exc}")
            # Once per interval per user: 3,200 refused admin requests once wrote 564 KB in 1.4 s.
            self._refusals[peer.uid].info("handle socket: refused %s from pid %d uid %d gid %d: %s",
                                          request.OP, peer.pid, peer.uid, peer.gid, exc.message)
            self.service.count_error(exc.code)
            future.set_result((error_reply(exc, self.epoch), []))

    def _attach(self, request: AttachRequest, peer: PeerCredentials,
                lease: int) -> tuple[dict[str, Any], list[int]]:
        """Attach a registration: its slab (served) or the tables' read-only descriptors
        (mapped); `lease` (a duplicate of the connection, ours) becomes its lease, or is closed."""
        try:
            record = self.service.attach(request.client_id, request.token, peer)
            reply, fds = self._passed(record)
        except BaseException:
            os.close(lease)
            raise
        self._leases.begin(record.client_id, lease)
        return ok_reply(self.epoch, reply), fds

    def _passed(self, record: ClientRecord) -> tuple[AttachReply, list[int]]:
        """What an attached client maps, and the new descriptors to pass with it (the caller
        closes them once sent). Where they cannot be made, the registration is retired and the
        error raised."""
        service = self.service
        try:
            assert service.grants is not None  # the daemon serves with them (Daemon._event_loaded)
            return attach_reply(record, service.grants, service.tables_id, service.tables_seq)
        except Exception:
            service.retire_client(record.client_id, "retired (its descriptors could not be passed)")
            raise

    def _admin_drain(self, peer: PeerCredentials) -> DrainReply:
        """Admin: stop accepting, finish in-flight lookups, then exit 0 (as on SIGTERM)."""
        self.service.require_admin(peer, "drain")
        if self.service.state != "stopping":
            self._begin_stop(f"drain requested by pid {peer.pid} uid {peer.uid}")
        return DrainReply(in_flight=self.service.in_flight())

