"""A client's registration with its daemon: connect, register, build what the reply describes
(the served slab's view or the mapped tables), and let it all go or register again.

The state it makes is the client's (its connection, id, epoch, mode, geometry, shard, slots),
read by every path; this is the code that makes and drops it. Not here: riding a mapped client
through a restart on its old mapping (client/rejoin.py), the lease and heartbeats
(client/watchdog.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engramd.client.errors import DaemonUnavailableError, InternalError
from engramd.client.geometry import TableGeometry
from engramd.client.rejoin import LONGEST_ATTEMPT_S, RETRIED, release_quietly, retry_until
from engramd.client.served import CudaSlabView, MemfdSlabView
from engramd.client.shared.connection import Connection, check_daemon_socket
from engramd.client.shared.handles import (
    HANDLE_TIMEOUT_S,
    Attachment,
    attach,
    check_access,
    handle_socket_path,
)
from engramd.client.shared.mapped import LocalSlots
from engramd.client.shared.messages import RegisterReply
from engramd.client.shared.slab import SlabLayout

if TYPE_CHECKING:
    from engramd.client.client import EngramClient

log = logging.getLogger("engramd.client")


class Session:
    """The registration of one client (EngramClient), made and remade."""

    def __init__(self, client: EngramClient):
        self._client = client

    def connect(self, timeout: float | None = None) -> None:
        """A fresh connection and registration (first start, or a new daemon epoch)."""
        client = self._client
        client._conn = self.open_connection(timeout or client.timeout)
        client.registrations += 1
        client._slots_epoch += 1
        client._pending = {}
        client._served.reset()
        client._next_slot = 0
        client._seqs = itertools.count(1)
        client._dead = None
        self.register(timeout or client.timeout)

    def open_connection(self, timeout: float) -> Connection:
        """A connection to the daemon at the client's socket, once its handle socket says this
        user may register (a daemon that admits only some users drops the others' ZeroMQ
        connections unanswered: one round trip there says why instead of a timeout)."""
        socket_path = self._client.socket_path
        check_daemon_socket(socket_path)
        check_access(handle_socket_path(socket_path), timeout)
        return Connection(socket_path)

    def reconnect(self, pause: Callable[[float], bool | None] = time.sleep, once: bool = False) -> None:
        """The daemon went away: register again, with backoff, until `reconnect_timeout`;
        `pause(s)` between attempts, true to stop (rejoin.Stopped). `once`: one attempt, for a
        caller that tries again on its own (the captured lookups' upkeep, which holds the
        client's lock meanwhile)."""
        client = self._client
        gone = self.gone_reason()
        self.disconnect(keep_rows=True)

        def attempt(timeout: float) -> None:
            try:
                self.connect(timeout=timeout)
            except BaseException:
                self.disconnect()  # never left half-registered: the next attempt starts afresh
                raise

        if once:
            try:
                attempt(min(client.timeout, LONGEST_ATTEMPT_S))
            except RETRIED as exc:
                raise DaemonUnavailableError(f"{gone}; no daemon to re-register with yet (last: "
                                             f"{exc.message})") from None
        else:
            retry_until(attempt, time.monotonic() + client.reconnect_timeout, gone,
                        client.reconnect_timeout, client.timeout, pause)
        log.info("re-registered with daemon epoch %s as client %d", client.epoch, client.client_id)

    def gone_reason(self) -> str:
        client = self._client
        return client._dead or "the daemon is gone"

    def disconnect(self, keep_rows: bool = False) -> None:
        """Drop the connection and the slab mapping without talking to the daemon; with
        `keep_rows`, keep the slot memory's address for the next registration (KeptRows.keep)."""
        client = self._client
        client._watchdog.stop()
        if isinstance(client._slab, CudaSlabView):
            client._served.await_stopping_daemon()
            client._served.release_waits()  # the daemon is gone or going: its counters may never move
        try:
            client._mapped_path.unmap()  # first: it synchronises the device, so no gather of ours still reads
        finally:           # the old mapping or writes our slots
            slab, client._slab = client._slab, None
            if slab is not None and not (keep_rows and client._rows.hold(slab)):
                slab.close()
            client._watchdog.close_lease()
            if client._conn is not None:
                client._conn.close()
                client._conn = None
            client.client_id = None

    def register_fields(self) -> dict[str, Any]:
        """The register request's fields: who we are, where, and what we ask for."""
        client = self._client
        tp_rank, tp_size, max_tokens, slots, name = client._asked
        wire_device, mps = "cpu", None
        if client.device.type == "cuda":
            from engramd.client.shared.cuda import device_uuid
            from engramd.client.shared.mps import mps_state
            wire_device = f"cuda:{device_uuid(client.device.index)}"
            mps = mps_state(client.device.index).to_wire()
        pinned = client.tables_id if client.pin_tables else None  # a re-registration names them
        return dict(pid=os.getpid(), device=wire_device, tp_rank=tp_rank, tp_size=tp_size,
                    max_tokens=max_tokens, slots=slots, name=name, mps=mps,
                    mode=client.requested_mode, pin_tables=client.pin_tables, tables=pinned,
                    warm_file=client.device.type == "cuda" and client._cache_cap != 0)

    def register(self, timeout: float) -> None:
        conn = self._client._conn
        if conn is None:
            raise InternalError("register() without a connection: connect() makes one")
        reply = conn.call("register", timeout, **self.register_fields())
        try:
            self.adopt(reply)
        except BaseException:  # the daemon registered us: it must not keep that for nothing
            release_quietly(conn, reply.body.client_id, min(timeout, 2.0))
            raise

    def adopt(self, reply: Any) -> None:
        """Build what the register reply describes: the slab view or the mapped tables."""
        client = self._client
        f: RegisterReply = reply.body
        client.mode = f.mode
        client.mps = f.mps  # GPU clients: {"daemon", "client", "shared"}; CPU: None
        if client.mode == "served" and client.mps is not None and not client.mps["shared"] and not client._warned_mps:
            client._warned_mps = True
            log.warning("engramd serves this GPU without a shared MPS server: each lookup's gather "
                        "waits for this process's kernels instead of overlapping them (measured on "
                        "an H200: +0.4-0.7 ms per decode step). Run nvidia-cuda-mps-control -d for "
                        "the daemon and the engines (README, 'MPS').")
        client.client_id = f.client_id
        client.epoch = reply.epoch
        client._read_tables(f.tables, f.tables_seq)  # what the daemon serves (None: it does not say)
        client._tables_lost = None  # pinned: the daemon registered us, so it serves ours
        client._heard_tables, client._token, client._gather_policy = None, f.token, f.gather
        client._mapped_path.reset_counts()  # this registration's
        client.geometry = TableGeometry.from_config(f.geometry, source="daemon register reply")
        tp_rank, tp_size = client._asked[:2]
        client.shard = client.geometry.shard(tp_rank, tp_size)
        if client.shard.local_heads != f.shard.get("local_heads"):
            raise InternalError(f"daemon and client disagree on the shard: {f.shard!r}")
        client.layout = SlabLayout.from_wire(f.layout)
        # Attaching may wait behind other clients' slab allocations: the caller's whole timeout.
        attachment = attach(handle_socket_path(client.socket_path), client.client_id, f.token,
                            timeout=max(client.timeout, HANDLE_TIMEOUT_S))
        client._watchdog.take_lease(attachment)
        client._watchdog.start(f.heartbeat_interval)  # from now on: mapping tables may take seconds
        try:
            self.take_attachment(attachment)
        finally:
            attachment.close_descriptors()  # what was mapped keeps its memory

    def take_attachment(self, attachment: Attachment) -> None:
        """Map what the attach passed: the slab (served) or the tables (mapped, which gather
        by the daemon's `gather` policy)."""
        client = self._client
        if client.mode != "mapped":
            client._mapped_path.lose_captured(f"the daemon serves this client in {client.mode} mode "
                                            f"now: a captured lookup needs mapped tables")
        if client.mode == "mapped":
            client._mapped_path.map_tables(attachment)
            client._slab = client._rows.keep(LocalSlots, None, client.layout) or LocalSlots(client.layout, client.device)
        elif attachment.slab is None or attachment.slab_fd is None:
            raise InternalError("the daemon attached a served client without a slab")
        elif attachment.slab.get("kind") == "cuda_vmm":
            client._slab = (client._rows.keep(CudaSlabView, attachment, client.layout)
                          or CudaSlabView(attachment, client.layout, client.device))
            client._served.warm_up()
        elif attachment.slab.get("kind") == "memfd" and client.device.type == "cpu":
            client._slab = (client._rows.keep(MemfdSlabView, attachment, client.layout)
                          or MemfdSlabView(attachment.slab_fd, client.layout))
        else:
            raise InternalError(f"slab of kind {attachment.slab.get('kind')!r} for a {client.device} client")
