"""The ZeroMQ socket's connections, counted per user: at most `per_uid` of one user's at once.

libzmq accepts every connection a peer opens, and keeps a queue of replies for each (up to the
socket's SNDHWM, request_socket.py): a peer that asks for `stats` on a connection and reads
nothing makes the daemon hold a full queue of them there, and one user with a few hundred such
connections made it hold gigabytes (7 MB a connection with 30 clients). libzmq names no queue's
size and cannot close one peer, so the daemon follows its connections through libzmq's monitor
(each accepted connection's descriptor, and its end), reads each one's kernel credentials
(SO_PEERCRED) from that descriptor, and past `per_uid` shuts the oldest connection down of the
process of that user that holds the most (libzmq then sees its end, drops its queue and retires
what it registered), as the handle socket does with connections waiting for their request:
one process's connections neither pile up nor crowd out the same user's real clients.

Every method runs on the loop's thread. Not the socket's options nor its messages
(request_socket.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from collections import Counter, OrderedDict

import zmq
from zmq.utils.monitor import recv_monitor_message

from engramd.client.shared.handles import PeerCredentials
from engramd.server.throttle import ThrottledBy

log = logging.getLogger("engramd.daemon")

EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
# A client holds two connections (its requests', its heartbeat's); `engramd health` and `stats`
# open one each while they run. Four a place leaves room for both and for restarts.
PER_PLACE = 4
MIN_PER_UID = 64
_MONITORS = itertools.count()  # each monitor's inproc name, unique in the process


def connections_per_uid(max_clients_per_uid: int, max_clients: int) -> int:
    """How many connections one user may hold: four for each client place it may take."""
    return max(MIN_PER_UID, PER_PLACE * (max_clients_per_uid or max_clients))


class ConnectionsPerUser:
    def __init__(self, sock: zmq.Socket, per_uid: int):
        """Follow the connections of `sock` (bound, or about to be) through a monitor socket."""
        self.monitor = monitor_socket(sock)  # polled by the loop
        self._per_uid = per_uid
        self._peers: dict[int, PeerCredentials] = {}  # descriptor -> who holds it
        self._by_uid: dict[int, OrderedDict[int, None]] = {}  # uid -> its descriptors, oldest first
        self._cut = ThrottledBy(log)

    def events(self) -> None:
        """What the monitor reported since the last call (the loop calls this when it is readable)."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = int(event["value"])
            self._forget(fd)  # a descriptor's number is reused once its connection is gone
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)

    def _accepted(self, fd: int) -> None:
        peer = credentials(fd)
        if peer is None:  # gone already (its end is on its way), or no socket of ours now
            return
        self._peers[fd] = peer
        held = self._by_uid.setdefault(peer.uid, OrderedDict())
        held[fd] = None
        if len(held) > self._per_uid:
            self._cut_oldest(peer.uid)

    def _cut_oldest(self, uid: int) -> None:
        """Shut down the oldest connection of the process of `uid` that holds the most, once
        its count is confirmed: a descriptor still counted may be no longer that peer's (its
        end not yet read), and a user whose count held such ones would lose a live connection
        below the bound."""
        for fd in [fd for fd in self._by_uid[uid] if credentials(fd) != self._peers[fd]]:
            self._forget(fd)
        held = self._by_uid.get(uid)
        if held is None or len(held) <= self._per_uid:
            return
        pids = Counter(self._peers[fd].pid for fd in held)
        most = max(pids.values())
        fd = next(fd for fd in held if pids[self._peers[fd].pid] == most)
        self._cut[uid].warning("uid %d holds more than %d connections to the request socket; "
                               "closed the oldest of pid %d, which holds %d", uid, self._per_uid,
                               self._peers[fd].pid, most)
        peer = self._peers[fd]
        self._forget(fd)
        shut_down(fd, peer)

    def _forget(self, fd: int) -> None:
        peer = self._peers.pop(fd, None)
        if peer is None:
            return
        held = self._by_uid[peer.uid]
        held.pop(fd, None)
        if not held:
            del self._by_uid[peer.uid]

    def close(self, sock: zmq.Socket) -> None:
        sock.disable_monitor()
        self.monitor.close(0)


def monitor_socket(sock: zmq.Socket) -> zmq.Socket:
    """The monitor's receiving end, its queue unbounded. With libzmq's default bounds (about
    2,000 events) a full queue held up the socket's I/O thread: no one's connection was
    accepted, nor any message read, until the loop read the events, and a flood of connections
    that come and go while the loop serves their requests fills it. An event is a few dozen
    bytes, and every one comes of a connection's start or end."""
    address = f"inproc://engramd-connections-{next(_MONITORS)}"  # libzmq frees a name late
    sock.monitor(address, EVENTS)
    monitor = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)  # before connecting: the pipe's bound is set then
    monitor.connect(address)
    return monitor


def credentials(fd: int) -> PeerCredentials | None:
    """The kernel's credentials of the peer of descriptor `fd`, a connection libzmq holds;
    None where `fd` is no Unix socket now."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.family != socket.AF_UNIX:
                return None
            return PeerCredentials.of(conn)
    except OSError:
        return None


def shut_down(fd: int, peer: PeerCredentials) -> None:
    """End libzmq's connection `fd` as its peer's close would: libzmq reads its end, drops its
    queue and forgets it (its descriptor is libzmq's to close). Only if `fd` is still held by
    `peer` (the number may have been reused meanwhile)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.family == socket.AF_UNIX and PeerCredentials.of(conn) == peer:
                conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # gone already
