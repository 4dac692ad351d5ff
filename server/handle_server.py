"""The daemon's end of the handle socket (client/handles.py has the wire format).

A thread accepts connections and serves each on a thread of its own, at most MAX_CONNECTIONS at
once (more wait in the listen backlog, not refused). It reads the peer's kernel credentials
first and turns away a peer the daemon would refuse anyway, before reading anything; then it
reads the one request before an absolute deadline (REQUEST_DEADLINE_S from the accept) and asks
the request loop for the answer, because the registrations belong to the loop's thread. With
the request goes a duplicate of the connection: once the loop has taken the request it owns that
duplicate (it keeps it as the registration's lease, or closes it), and it hands back the reply
and the descriptors to send (made for this one message, closed here once sent). Nothing here
knows about clients or tables.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

from engramd.client.errors import (
    NotReadyError,
    PermissionDeniedError,
    ProtocolError,
    UnknownOperationError,
)
from engramd.client.handles import (
    HANDLE_TIMEOUT_S,
    PeerCredentials,
    decode_request,
    error_reply,
    ok_reply,
    recv_message,
    send_message,
)
from engramd.client.messages import HelloReply, HelloRequest, Message
from engramd.server.throttle import Throttled

log = logging.getLogger("engramd.handles")

MAX_CONNECTIONS = 16

# Posts (request, peer, duplicate of the connection) to the loop; the future gets (reply header,
# descriptors to send). The loop owns the duplicate once it has set the future running.
Ask = Callable[[Message, PeerCredentials, int, futures.Future], None]
# Whether the daemon would serve this peer at all (its allowed ids, or an admin).
Admit = Callable[[PeerCredentials], bool]
# Counts a request refused here, before the loop saw it (its error code).
Count = Callable[[str], None]
BACKLOG = 256
# A client sends its one small request right after connecting: a peer that has not within this
# long is holding a connection slot, not using it.
REQUEST_DEADLINE_S = 2.0
CLOSE_WAIT_S = 2.0  # close() lets connections in progress send their answers for this long


class HandleServer:
    def __init__(self, path: Path, ask: Ask, epoch: str, admit: Admit = lambda peer: True,
                 count: Count = lambda code: None):
        self.path = path
        self._ask = ask
        self._admit = admit
        self._count = count
        self._epoch = epoch
        path.unlink(missing_ok=True)  # stale: the caller holds the daemon's socket lock
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o660)  # like the ZeroMQ socket: the runtime folder's group may connect
        self._listener.listen(BACKLOG)
        self._listener.settimeout(0.2)  # so that close() is noticed
        self._closing = threading.Event()
        # A connection each on a thread of its own, at most MAX_CONNECTIONS at once: a slow or
        # silent peer holds one of them until its deadline, never the others; a burst of
        # attaches waits in the backlog.
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._threads: set[threading.Thread] = set()  # connections in progress
        # What a peer can provoke at will is logged once per interval (server/throttle.py).
        self._accept_failed, self._refused, self._dropped = Throttled(log), Throttled(log), Throttled(log)
        self._thread = threading.Thread(target=self._serve, name="engramd-handles", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closing.is_set():
            if not self._slots.acquire(timeout=0.2):
                continue  # all busy: the next connection waits in the backlog
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                self._slots.release()
                continue
            except OSError as exc:  # out of descriptors, an aborted connection: keep serving
                self._slots.release()
                if self._closing.is_set():
                    return
                self._accept_failed.warning("handle socket: accept failed (%s)", exc)
                self._closing.wait(0.05)
                continue
            thread = threading.Thread(target=self._connection, args=(conn,), name="engramd-handle",
                                      daemon=True)
            self._threads.add(thread)
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: let this one go
                self._threads.discard(thread)
                conn.close()
                self._slots.release()

    def _connection(self, conn: socket.socket) -> None:
        try:
            with conn:
                peer = PeerCredentials.of(conn)
                if not self._admit(peer):
                    self._refused.warning("handle socket: refused pid %d uid %d gid %d",
                                          peer.pid, peer.uid, peer.gid)
                    conn.settimeout(1.0)
                    self._try_send(conn, error_reply(PermissionDeniedError(
                        f"uid {peer.uid} / gid {peer.gid} may not use this daemon "
                        "(config: allowed_uids, allowed_gids)"), self._epoch))
                    return
                self._answer(conn, peer, time.monotonic() + REQUEST_DEADLINE_S)
        except Exception:  # a bug must not end the handle socket for everyone
            log.exception("handle socket: unexpected error")
        finally:
            self._threads.discard(threading.current_thread())
            self._slots.release()

    def _answer(self, conn: socket.socket, peer: PeerCredentials, deadline: float) -> None:
        fds: list[int] = []
        try:
            header, _ = recv_message(conn, deadline=deadline)
            request = decode_request(header)
            if isinstance(request, HelloRequest):  # an access check: admitted is all it asks
                reply = ok_reply(self._epoch, HelloReply())
            else:
                reply, fds = self._ask_loop(request, peer, conn)
            conn.settimeout(HANDLE_TIMEOUT_S)
            send_message(conn, reply, fds)
        except (ProtocolError, UnknownOperationError, NotReadyError) as exc:
            self._count(exc.code)
            self._refused.warning("handle socket: refused a request from pid %d uid %d: %s",
                                  peer.pid, peer.uid, exc.message)
            self._try_send(conn, error_reply(exc, self._epoch))
        except (OSError, TimeoutError) as exc:
            self._dropped.warning("handle socket: dropped a connection (%s)", exc)
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
                raise NotReadyError(f"the daemon did not take the request within "
                                    f"{HANDLE_TIMEOUT_S} s (busy); retry") from None
            return future.result()  # taken: the loop answers every request it takes

    def _try_send(self, conn: socket.socket, reply: dict[str, Any]) -> None:
        try:
            send_message(conn, reply)
        except OSError:
            pass  # the peer went away; nothing was handed out

    def close(self) -> None:
        """Stop accepting, and give the connections in progress CLOSE_WAIT_S to answer (a drain's
        requester wants to hear that it worked); those left end by their own deadline."""
        self._closing.set()
        self._thread.join()
        self._listener.close()
        self.path.unlink(missing_ok=True)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
