"""Registering again with a restarted daemon: the retry loop, and a mapped client's rejoin thread.

A served client's rows come from the daemon, so its lookups wait for a restarted daemon
(`retry_until`, in lookup()). A mapped client's rows come from its own mapping of the tables,
which stays valid whatever the daemon does: its lookups go on from that mapping while a `Rejoin`
thread registers with the restarted daemon and hands the registration to the client, which keeps
it if the new daemon serves the same tables in the same mode and layout (else the registration
is let go and the client reconnects as a served one does). `RideThrough` is the client's side of
that: it starts the thread, and makes the registration the thread brings the client's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from engramd.client.errors import (
    DaemonUnavailableError,
    EngramError,
    NotReadyError,
    NotRegisteredError,
)
from engramd.client.geometry import TableGeometry
from engramd.client.shared.connection import Connection
from engramd.client.shared.handles import (
    HANDLE_TIMEOUT_S,
    Attachment,
    attach,
    handle_socket_path,
)
from engramd.client.shared.messages import RegisterReply
from engramd.client.shared.slab import SlabLayout

if TYPE_CHECKING:
    from engramd.client.client import EngramClient

log = logging.getLogger("engramd.client")

T = TypeVar("T")

RETRIED = (DaemonUnavailableError, NotReadyError, NotRegisteredError)  # a daemon not (yet) there
# Pauses between attempts. The longest bounds how long a client sleeps past the moment its
# daemon is back: a standby takes over in about a second, and at 1.0 the served clients' outage
# was half a second longer than that. An attempt on an absent daemon costs one refused connect.
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.05, 0.2
LONGEST_ATTEMPT_S = 2.0  # a socket left by a dead daemon answers nothing: a short wait per attempt
REJOIN_STOP_S = 3.0  # how long close() waits for a rejoin in flight


class Stopped(Exception):
    """The retry loop was told to stop (the client closes)."""


def retry_until(attempt: Callable[[float], T], deadline: float, gone: str, patience: float,
                attempt_timeout: float, pause: Callable[[float], bool | None] = time.sleep) -> T:
    """`attempt(timeout)` with backoff until it succeeds or `deadline` (time.monotonic) passes;
    only RETRIED errors are retried. `pause(seconds)` waits between attempts and returns true to
    stop (Stopped). Past the deadline: DaemonUnavailableError saying what was `gone` and the
    last attempt's error, for a client that waited `patience` seconds."""
    delay = FIRST_PAUSE_S
    while True:
        try:
            return attempt(max(0.1, min(attempt_timeout, LONGEST_ATTEMPT_S, deadline - time.monotonic())))
        except RETRIED as exc:
            if time.monotonic() + delay > deadline:
                raise DaemonUnavailableError(
                    f"{gone}; no daemon to re-register with within {patience:.0f} s "
                    f"(last: {exc.message}); raise reconnect_timeout to wait longer") from None
            if pause(delay):
                raise Stopped from None
            delay = min(delay * 2, LONGEST_PAUSE_S)


class Rejoin(Generic[T]):
    """`join(timeout)` retried on a thread of its own until `deadline`; what it returns goes to
    `take` (true: kept), else to `drop`. `error`: why it ended without one (the lookup that sees
    it raises it); `stop()` ends it, dropping a registration not taken yet."""

    def __init__(self, join: Callable[[float], T], take: Callable[[T], bool], drop: Callable[[T], None],
                 deadline: float, gone: str, patience: float, attempt_timeout: float):
        self.error: BaseException | None = None
        self._join, self._take, self._drop = join, take, drop
        self._retry = (deadline, gone, patience, attempt_timeout)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engramd-rejoin", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        """Ask it to end and wait up to `timeout` s; a registration it makes after that goes to
        `take`, which must refuse it (the caller has moved on)."""
        self._stopping.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            joined = retry_until(self._join, *self._retry, pause=self._stopping.wait)
        except Stopped:
            return
        except BaseException as exc:  # told to the next lookup
            self.error = exc
            return
        try:
            taken = not self._stopping.is_set() and self._take(joined)
        except BaseException as exc:
            self.error, taken = exc, False
        if not taken:
            try:
                self._drop(joined)
            except Exception:  # the daemon forgets it with its lease; nothing else holds it
                log.exception("letting go of a registration not taken")


def release_quietly(conn: Connection, client_id: int, timeout: float) -> None:
    """Release a registration this client will not use; a daemon gone meanwhile has let it go."""
    try:
        conn.call("release", timeout, client_id=client_id)
    except EngramError:
        pass


class RideThrough:
    """A mapped client's ride through a daemon restart: the Rejoin in flight (`rejoin`), and the
    connection and lease it replaced (`replaced`), which the lookup thread closes."""

    def __init__(self, client: EngramClient):
        self._client = client
        self.rejoin: Rejoin | None = None  # mapped: registering with a restarted daemon
        self.replaced: list[Any] = []  # its connection and lease before the rejoin: closed by lookup()

    def riding_through(self) -> bool:
        """The daemon is gone. A mapped client goes on gathering from its mapping (its rows do
        not change with the daemon) while a thread registers with the restarted daemon: True
        while that runs. False: reconnect in this call, as a served client does (nothing mapped
        yet, or the restarted daemon serves other tables, mode or layout). Raises what ended
        the rejoin otherwise (no daemon within reconnect_timeout, a refusal)."""
        client, rejoin = self._client, self.rejoin
        if rejoin is None:
            if client.mode != "mapped" or client._mapped_path.tables is None:
                return False
            gone = client._session.gone_reason()
            self.rejoin = Rejoin(self.join_again, self.take_rejoined, self.drop_rejoined,
                                 time.monotonic() + client.reconnect_timeout, gone,
                                 client.reconnect_timeout, client.timeout)
            log.warning("%s: client %s goes on gathering from its mapping of tables %s while it "
                        "registers again", gone, client.client_id, client.tables_id)
            return True
        if rejoin.running():
            return True
        self.rejoin = None
        if rejoin.error is not None:
            client._session.disconnect(keep_rows=True)  # the next lookup registers again, into them
            raise rejoin.error
        return False  # a registration was made and let go: it did not fit

    def stop(self) -> None:
        """close(): end a rejoin in flight (before the client's lock, which it may be waiting
        for; past the wait it finds the client closed and lets its registration go)."""
        rejoin, self.rejoin = self.rejoin, None
        if rejoin is not None:
            rejoin.stop(REJOIN_STOP_S)

    def join_again(self, timeout: float) -> tuple[Connection, Any, Attachment]:
        """Rejoin thread: a registration with the restarted daemon, attached, not taken yet."""
        client = self._client
        conn = client._session.open_connection(timeout)
        try:
            reply = conn.call("register", timeout, **client._session.register_fields())
            try:
                attachment = attach(handle_socket_path(client.socket_path), reply.body.client_id,
                                    reply.body.token, timeout=max(client.timeout, HANDLE_TIMEOUT_S))
            except BaseException:
                release_quietly(conn, reply.body.client_id, timeout)
                raise
        except BaseException:
            conn.close()
            raise
        return conn, reply, attachment

    def take_rejoined(self, joined: tuple[Connection, Any, Attachment]) -> bool:
        """Rejoin thread: make the new registration the client's, keeping the mapping, the
        slots and the lookups in flight, if it serves what the mapping holds (same tables, mode,
        geometry and layout); False (nothing changed) otherwise."""
        client = self._client
        conn, reply, attachment = joined
        f: RegisterReply = reply.body
        tables = (attachment.version, attachment.tables_seq) if attachment.version is not None \
            else (f.tables, f.tables_seq)
        with client._tables_lock:
            if self.rejoin is None or client._conn is None:
                return False  # close() came first
            if client._mapped_path.remapping is not None:  # a reload's tables of the old daemon, being mapped
                log.warning("a reload was being mapped when the daemon went away: registering "
                            "again from scratch")
                return False
            if (f.mode != "mapped" or client._mapped_path.tables is None or tables[0] is None
                    or tables[0] != client.tables_id
                    or TableGeometry.from_config(f.geometry, source="daemon register reply") != client.geometry
                    or f.shard.get("local_heads") != client.shard.local_heads
                    or SlabLayout.from_wire(f.layout) != client.layout):
                log.warning("the restarted daemon serves tables %s in mode %s (this client mapped "
                            "%s): registering again from scratch", tables[0], f.mode, client.tables_id)
                return False
            client._watchdog.stop()  # the old registration's (already ended if its lease closed)
            # The lookup thread may be reading the old connection: it closes them (ZeroMQ
            # sockets are not thread-safe).
            self.replaced += [client._conn, client._watchdog.lease]
            client._conn, client._dead, client.registrations = conn, None, client.registrations + 1
            client.client_id, client.epoch, client.mps = f.client_id, reply.epoch, f.mps
            client._token, client._gather_policy = f.token, f.gather  # the policy applies from the next mapping
            # The new daemon counts this client from here on, as it would a new registration:
            # lookups made before its start are not its own (its counters began at zero).
            # (No copy queued from this thread: the last finished one's value serves.)
            client._mapped_path.counts_base = client._mapped_path.mapped_counts(queue_copy=False)
            client._read_tables(*tables)
            client._heard_tables, client._mapped_path.idle_follow_failed, client._tables_lost = None, None, None
            client._watchdog.take_lease(attachment)
            client._watchdog.start(f.heartbeat_interval)
            self.rejoin = None
        attachment.close_descriptors()  # the same tables: the mapping we hold serves
        log.info("re-registered with daemon epoch %s as client %d; gathering from the same mapping",
                 client.epoch, client.client_id)
        return True

    def close_replaced(self) -> None:
        replaced, self.replaced = self.replaced, []
        for closing in replaced:
            if closing is not None:
                closing.close()

    @staticmethod
    def drop_rejoined(joined: tuple[Connection, Any, Attachment]) -> None:
        conn, reply, attachment = joined
        release_quietly(conn, reply.body.client_id, 2.0)
        attachment.close_descriptors()
        attachment.lease.close()
        conn.close()
