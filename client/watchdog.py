"""A client's watch of its registration: the lease the daemon holds the other end of, and the
thread that sends heartbeats and notices the lease close.

The daemon frees a registration when it closes the lease, and a client knows the daemon died (or
retired it) when the lease closes: the thread then marks the client dead (`_dead`) and, for a
served GPU client, releases every stream wait on the daemon's counters (client/served.py). Not
here: what a lookup does about a dead daemon (reconnect: client/client.py; ride through it:
client/rejoin.py).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING

from engramd.client.shared.connection import Connection
from engramd.client.shared.handles import Attachment, lease_closed

if TYPE_CHECKING:
    from engramd.client.client import EngramClient

WATCHDOG_S = 0.1

# Leases of this process's clients. A child made by fork() must not hold them: a lease is closed
# by the kernel when its last holder exits, so a child outliving its parent would keep a dead
# parent's registration alive.
_LEASES: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _drop_leases_in_child() -> None:
    for lease in list(_LEASES):
        lease.close()


os.register_at_fork(after_in_child=_drop_leases_in_child)


class Watchdog:
    """The lease and the watchdog thread of a client's current registration."""

    def __init__(self, client: EngramClient):
        self._client = client
        self.lease: socket.socket | None = None  # the daemon frees us when it closes
        self.thread: threading.Thread | None = None
        self.closing: threading.Event | None = None

    def _watch(self, closing: threading.Event, client_id: int, token: str, interval: float) -> None:
        """Background thread: heartbeats on a connection of its own (so a daemon that cannot see
        our process knows we live), and for GPU clients, release of every stream wait on the
        daemon's counters once the lease closes (the daemon died or retired us)."""
        client = self._client
        if client.device.type == "cuda":
            from engramd.client.shared import cuda

            cuda.enter_thread(client.device.index)  # the release's driver calls need the context
        beat = Connection(client.socket_path)
        next_beat = 0.0
        try:
            while not closing.wait(WATCHDOG_S):
                gone = self.lease_gone()
                if gone is not None:
                    if client.mode == "mapped":  # its lookups are its own: they go on (riding_through)
                        client._dead = gone
                        return
                    client._dead = f"{gone}; results of in-flight lookups are invalid"
                    if client.device.type == "cuda":
                        client._served.release_waits()
                        client._served.keep_releasing(closing)
                    return
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + interval
                    beat.send("heartbeat", client_id=client_id, token=token,
                              counts=self._heartbeat_counts(),
                              tables=client.tables_id if client.mode == "mapped" else None)
                for reply in beat.take_replies():  # heartbeat replies, in no order: the latest tables
                    body, heard = reply.body, client._heard_tables
                    if (getattr(body, "tables", None) is not None and reply.epoch == client.epoch
                            and (heard is None or body.tables_seq >= heard[1])):
                        client._heard_tables = (body.tables, body.tables_seq)
                client._mapped_path.follow_while_idle()
        finally:
            beat.close()

    def _heartbeat_counts(self) -> dict[str, int] | None:
        """Mapped clients: this registration's cumulative counts for the daemon's stats."""
        client = self._client
        if client.mode != "mapped":
            return None
        return client._mapped_path.since_registered(client._mapped_path.mapped_counts())

    def take_lease(self, attachment: Attachment) -> None:
        conn = self._client._conn
        assert conn is not None, "a lease comes with a registration's connection"
        self.lease = attachment.lease
        _LEASES.add(self.lease)
        conn.watch_daemon(self.lease_gone)

    def start(self, heartbeat_interval: float) -> None:
        """Heartbeats and the watch of the lease (_watch) of the current registration."""
        client = self._client
        self.closing = threading.Event()
        self.thread = threading.Thread(
            target=self._watch, args=(self.closing, client.client_id, client._token, heartbeat_interval),
            name="engramd-watchdog", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.closing is not None:
            self.closing.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def close_lease(self) -> None:
        if self.lease is not None:
            self.lease.close()
            self.lease = None

    def lease_gone(self) -> str | None:
        lease = self.lease
        if lease is None or lease_closed(lease):
            return "the daemon closed this client's lease (it exited, or retired the client)"
        return None
