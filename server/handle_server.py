"""The daemon's end of the handle socket (client/shared/handles.py has the wire format).

One thread accepts every connection at once and reads every request, without blocking on any
peer (a selector): a silent or trickling peer costs a descriptor and a few bytes, never another
peer's time. It reads the peer's kernel credentials first and turns away a peer the daemon would
refuse anyway, before reading anything; then it reads the one request before an absolute
deadline (REQUEST_DEADLINE_S from the accept). Each user (by those credentials) may have at
most `per_uid` connections waiting for their request: past that, one is closed, the oldest of
the process that has the most of them waiting, so that one process's idle connections neither
pile up nor lock out the same user's real clients, which send their request at once. A
connection closed either way is told why first (NotReadyError): a real client that stalled
between its connect and its send retries its attach (client/shared/handles.py).

A request read whole goes to one of MAX_CONNECTIONS answering threads, which asks the request
loop for the answer (the registrations belong to the loop's thread). With the request goes a
duplicate of the connection: once the loop has taken the request it owns that duplicate (it
keeps it as the registration's lease, or closes it), and it hands back the reply and the
descriptors to send (made for this one message, closed here once sent). Nothing here knows
about clients or tables.

Before this, each connection had a thread of its own, at most 16 at once, the rest waiting in
the listen backlog: 100 connections that sent nothing, reopened when cut, made every client's
attach time out.
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from engramd.client.errors import (
    NotReadyError,
    PermissionDeniedError,
    ProtocolError,
    UnknownOperationError,
)
from engramd.client.shared.handles import (
    HANDLE_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    PeerCredentials,
    decode_request,
    error_reply,
    ok_reply,
    send_message,
)
from engramd.client.shared.messages import HelloReply, HelloRequest, Message
from engramd.client.shared.protocol import PROTOCOL_VERSION
from engramd.server.config import default
from engramd.server.throttle import Throttled, ThrottledBy

log = logging.getLogger("engramd.handles")

# Requests being answered at once (each holds the descriptors it passes until they are sent).
MAX_CONNECTIONS = 16

# Posts (request, peer, duplicate of the connection) to the loop; the future gets (reply header,
# descriptors to send). The loop owns the duplicate once it has set the future running.
Ask = Callable[[Message, PeerCredentials, int, futures.Future], None]
# Whether the daemon would serve this peer at all (its allowed ids, or an admin).
Admit = Callable[[PeerCredentials], bool]
# Counts a request refused here, before the loop saw it (its error code).
Count = Callable[[str], None]
BACKLOG = 1024  # connections are accepted as fast as they come; this only absorbs a burst
# Connections accepted per turn of the selector, before it reads what has arrived: a flood of
# connects must not evict a real client's connection before its request is read.
ACCEPT_BATCH = 8
# A client sends its one small request right after connecting: a peer that has not within this
# long is holding a connection, not using it.
REQUEST_DEADLINE_S = 2.0
TICK_S = 0.2  # the selector's longest wait, so that close() is noticed
DROPS_LOGGED = 20  # dropped-connection lines per throttle interval, over all peers
CLOSE_WAIT_S = 2.0  # close() lets connections in progress send their answers for this long
_LENGTH = struct.Struct("<I")


@dataclass(eq=False)
class _Waiting:
    """A connection accepted and not yet answered; its request as read so far."""

    conn: socket.socket
    peer: PeerCredentials
    deadline: float
    data: bytearray = field(default_factory=bytearray)

    def request(self) -> dict[str, Any] | None:
        """The request header once it is all here; ProtocolError for one that cannot be one."""
        if len(self.data) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self.data)
        if length > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"handle message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
        if len(self.data) < _LENGTH.size + length:
            return None
        if len(self.data) > _LENGTH.size + length:
            raise ProtocolError("handle socket: bytes after the request (one request a connection)")
        try:
            header = msgpack.unpackb(bytes(self.data[_LENGTH.size:]), raw=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise ProtocolError(f"handle message is not valid msgpack: {type(exc).__name__}") from None
        if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"handle message must be a version {PROTOCOL_VERSION} msgpack map")
        return header


def _not_taken(message: str) -> NotReadyError:
    """The error for a request that was never handed on: its client may ask again."""
    error = NotReadyError(message)
    error.not_taken = True
    return error


class HandleServer:
    def __init__(self, path: Path, ask: Ask, epoch: str, admit: Admit = lambda peer: True,
                 count: Count = lambda code: None,
                 per_uid: int = default("handle_connections_per_uid")):
        self.path = path
        self._ask = ask
        self._admit = admit
        self._count = count
        self._epoch = epoch
        self._per_uid = per_uid
        path.unlink(missing_ok=True)  # stale: the caller holds the daemon's socket lock
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o660)  # like the ZeroMQ socket: the runtime folder's group may connect
        self._listener.listen(BACKLOG)
        self._listener.setblocking(False)
        self._closing = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        # Per uid, its connections waiting for their request, oldest first (the selector
        # thread's alone). Those read whole are answered as fast as the loop answers.
        self._waiting: dict[int, OrderedDict[_Waiting, None]] = {}
        self._answers: queue.SimpleQueue[tuple[_Waiting, Message] | None] = queue.SimpleQueue()
        # What a peer can provoke at will is logged once per interval (server/throttle.py).
        self._accept_failed, self._refused = Throttled(log), Throttled(log)
        # Per peer pid and what was under way (reading, no request, answering which request): a
        # peer that drops its connections at will (a probe that stops waiting for its answer)
        # must not hide why another's attach connection went, nor its own (a client's readiness
        # probe gives up on a hello, then its attach is dropped); 20 lines per interval in all,
        # whatever the number of processes. (Peers in another pid namespace all read as pid 0.)
        self._dropped = ThrottledBy(log, most=DROPS_LOGGED)
        self._evicted = Throttled(log)
        self._threads = [threading.Thread(target=self._answering, name="engramd-handle", daemon=True)
                         for _ in range(MAX_CONNECTIONS)]
        for thread in self._threads:
            thread.start()
        self._thread = threading.Thread(target=self._serve, name="engramd-handles", daemon=True)
        self._thread.start()

    # -- the selector thread: accept, credentials, read the request ----------------------------

    def _serve(self) -> None:
        try:
            while not self._closing.is_set():
                for key, _ in self._selector.select(self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read(key.data)
                self._expire()
        except Exception:  # a bug must not end the handle socket silently
            log.exception("handle socket: unexpected error; no more connections are served")
        finally:
            for waiting in [w for per_uid in self._waiting.values() for w in per_uid]:
                self._forget(waiting)

    def _next_timeout(self) -> float:
        first = min((next(iter(w)).deadline for w in self._waiting.values() if w), default=None)
        return TICK_S if first is None else min(TICK_S, max(0.0, first - time.monotonic()))

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors, an aborted connection: keep serving
                self._accept_failed.warning("handle socket: accept failed (%s)", exc)
                return
            try:
                self._welcome(conn)
            except OSError as exc:  # gone already
                self._dropped[None].warning("handle socket: dropped a connection as it came (%s)", exc)
                conn.close()

    def _welcome(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        peer = PeerCredentials.of(conn)
        if not self._admit(peer):
            self._refused.warning("handle socket: refused pid %d uid %d gid %d",
                                  peer.pid, peer.uid, peer.gid)
            self._try_send(conn, error_reply(PermissionDeniedError(
                f"uid {peer.uid} / gid {peer.gid} may not use this daemon "
                "(config: allowed_uids, allowed_gids)"), self._epoch))
            conn.close()
            return
        if len(self._waiting.get(peer.uid, ())) >= self._per_uid:
            self._evict_oldest(peer.uid)
        waiting = _Waiting(conn, peer, time.monotonic() + REQUEST_DEADLINE_S)
        self._waiting.setdefault(peer.uid, OrderedDict())[waiting] = None
        self._selector.register(conn, selectors.EVENT_READ, waiting)
        self._read(waiting)  # a client's request is often here with its connect

    def _evict_oldest(self, uid: int) -> None:
        """Close the oldest connection of the process of `uid` that has the most connections
        waiting for their request (a client has one, and it sends its request at once)."""
        waiting = self._waiting[uid]
        pids = Counter(w.peer.pid for w in waiting)
        most = max(pids.values())
        oldest = next(w for w in waiting if pids[w.peer.pid] == most)
        self._evicted.warning("handle socket: uid %d has %d connections waiting for their "
                              "request (config: handle_connections_per_uid); closed its oldest "
                              "(pid %d)", uid, self._per_uid, oldest.peer.pid)
        self._drop(oldest, f"closed before its request came: uid {uid} had {self._per_uid} "
                           "connections waiting for theirs (config: handle_connections_per_uid)")

    def _read(self, waiting: _Waiting) -> None:
        try:
            chunk = waiting.conn.recv(MAX_MESSAGE_BYTES + _LENGTH.size + 1 - len(waiting.data))
        except BlockingIOError:
            return
        except OSError as exc:
            self._dropped[waiting.peer.pid, "reading"].warning(
                "handle socket: dropped pid %d's connection while reading its request (%s)",
                waiting.peer.pid, exc)
            self._forget(waiting)
            return
        if not chunk:  # the peer closed it before its request was whole
            self._forget(waiting)
            return
        waiting.data += chunk
        try:
            header = waiting.request()
            if header is None:
                return
            request = decode_request(header)
        except (ProtocolError, UnknownOperationError) as exc:
            self._refuse(waiting, exc)
            return
        self._unwait(waiting)
        self._answers.put((waiting, request))

    def _expire(self) -> None:
        now = time.monotonic()
        for per_uid in list(self._waiting.values()):
            while per_uid and (oldest := next(iter(per_uid))).deadline <= now:
                self._dropped[oldest.peer.pid, "no request"].warning(
                    "handle socket: dropped a connection of pid %d uid %d (no request within %.1f s)",
                    oldest.peer.pid, oldest.peer.uid, REQUEST_DEADLINE_S)
                self._drop(oldest, f"closed: no whole request within {REQUEST_DEADLINE_S:.1f} s "
                                   "of connecting")

    def _unwait(self, waiting: _Waiting) -> None:
        """The connection no longer waits for its request (answered, or closed)."""
        self._selector.unregister(waiting.conn)
        per_uid = self._waiting.get(waiting.peer.uid)
        if per_uid is not None:
            per_uid.pop(waiting, None)
            if not per_uid:
                del self._waiting[waiting.peer.uid]

    def _forget(self, waiting: _Waiting) -> None:
        self._unwait(waiting)
        waiting.conn.close()

    def _drop(self, waiting: _Waiting, why: str) -> None:
        """Close a connection whose request never came whole, saying why (NotReadyError, not
        taken: a client's attach asks again): a peer that stalled between its connect and its
        send (a busy process's threads, a debugger) hears that it may ask again. Not
        counted as an error of the daemon's: any admitted user can make these at will."""
        self._try_send(waiting.conn, error_reply(_not_taken(f"handle socket: {why}; retry"), self._epoch))
        self._forget(waiting)

    def _refuse(self, waiting: _Waiting, exc: ProtocolError | UnknownOperationError) -> None:
        self._count(exc.code)
        self._refused.warning("handle socket: refused a request from pid %d uid %d: %s",
                              waiting.peer.pid, waiting.peer.uid, exc.message)
        self._try_send(waiting.conn, error_reply(exc, self._epoch))
        self._forget(waiting)

    # -- the answering threads ------------------------------------------------------------------

    def _answering(self) -> None:
        while (item := self._answers.get()) is not None:
            waiting, request = item
            try:
                self._answer(waiting.conn, waiting.peer, request)
            except Exception:  # a bug must not end the handle socket for everyone
                log.exception("handle socket: unexpected error")
            finally:
                waiting.conn.close()

    def _answer(self, conn: socket.socket, peer: PeerCredentials, request: Message) -> None:
        fds: list[int] = []
        try:
            if isinstance(request, HelloRequest):  # an access check: admitted is all it asks
                reply = ok_reply(self._epoch, HelloReply())
            else:
                reply, fds = self._ask_loop(request, peer, conn)
            conn.settimeout(HANDLE_TIMEOUT_S)  # a reply fits the socket's buffer: no wait
            send_message(conn, reply, fds)
        except NotReadyError as exc:
            self._count(exc.code)
            self._refused.warning("handle socket: refused a request from pid %d uid %d: %s",
                                  peer.pid, peer.uid, exc.message)
            self._try_send(conn, error_reply(exc, self._epoch))
        except (OSError, TimeoutError) as exc:
            self._dropped[peer.pid, request.OP].warning(
                "handle socket: dropped pid %d's connection while answering its %s request (%s)",
                peer.pid, request.OP, exc)
        finally:
            for fd in fds:
                os.close(fd)

    def _ask_loop(self, request: Message, peer: PeerCredentials,
                  conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
        future: futures.Future = futures.Future()
        duplicate = os.dup(conn.fileno())
        self._ask(request, peer, duplicate, future)
        try:
            return future.result(timeout=HANDLE_TIMEOUT_S)
        except futures.TimeoutError:
            if future.cancel():  # the loop never took it: the duplicate is still ours
                os.close(duplicate)
                raise _not_taken(f"the daemon did not take the request within "
                                 f"{HANDLE_TIMEOUT_S} s (busy); retry") from None
            return future.result()  # taken: the loop answers every request it takes

    @staticmethod
    def _try_send(conn: socket.socket, reply: dict[str, Any]) -> None:
        try:
            conn.settimeout(0.0)  # an answer that does not fit at once is not worth a wait
            send_message(conn, reply)
        except OSError:
            pass  # the peer went away, or reads nothing; nothing was handed out

    def close(self) -> None:
        """Stop accepting, and give the requests being answered CLOSE_WAIT_S to finish (a
        drain's requester wants to hear that it worked); those left end by their own deadline."""
        self._closing.set()
        self._thread.join()
        self._selector.close()
        self._listener.close()
        self.path.unlink(missing_ok=True)
        for _ in self._threads:
            self._answers.put(None)  # after every request already read
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
