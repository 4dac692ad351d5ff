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

import errno
import itertools
import logging
import os
import select
import socket
import stat
from collections import Counter, OrderedDict
from dataclasses import dataclass

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
NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)  # a duplicate could not be made: tried again later


def connections_per_uid(max_clients_per_uid: int, max_clients: int) -> int:
    """How many connections one user may hold: four for each client place it may take."""
    return max(MIN_PER_UID, PER_PLACE * (max_clients_per_uid or max_clients))


@dataclass(frozen=True)
class Held:
    """A connection counted: who holds it, and its socket's inode (a descriptor whose inode is
    another, or none, holds that connection no longer)."""

    peer: PeerCredentials
    inode: int


class ConnectionsPerUser:
    def __init__(self, sock: zmq.Socket, per_uid: int):
        """Follow the connections of `sock` (bound, or about to be) through a monitor socket."""
        self.monitor = monitor_socket(sock)  # polled by the loop
        self._per_uid = per_uid
        self._held: dict[int, Held] = {}  # descriptor -> its connection
        # uid -> pid -> its descriptors, oldest first
        self._by_process: dict[int, dict[int, OrderedDict[int, None]]] = {}
        self._cut = ThrottledBy(log)
        # What could not be done for want of a descriptor (a flood of connections is when the
        # daemon runs out of them), tried again at every call: connections not yet identified,
        # users not yet cut down to the bound.
        self._unidentified: OrderedDict[int, None] = OrderedDict()
        self._over: set[int] = set()

    def events(self) -> None:
        """What the monitor reported since the last call, then each user's excess cut (the loop
        calls this when the monitor is readable, and between batches of requests). Peers that
        were cut reconnect (a DEALER's default) hundreds of times a second: every connection
        costs one read of its credentials, and a user over its bound a look at each of its
        descriptors (fstat, poll) a call, not a cut."""
        over, self._over = self._over, set()
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] != zmq.EVENT_ACCEPTED:
                self._forget(fd)
                continue
            self._unidentified[fd] = None  # identified below, after its ends of this drain
        for fd in list(self._unidentified):
            uid = self._accepted(fd)
            if uid is not None and self.held_by(uid) > self._per_uid:
                over.add(uid)
        for uid in over:
            self._cut_excess(uid)

    def held_by(self, uid: int) -> int:
        return sum(len(fds) for fds in self._by_process.get(uid, {}).values())

    def _accepted(self, fd: int) -> int | None:
        """Count connection `fd` (in place of what its number held before: a descriptor's number
        is reused once its connection is gone); its user's uid, or None where it is gone already
        (its end is on its way), no socket of ours now, or not identified for want of a
        descriptor (then tried again at the next call)."""
        self._forget(fd)
        try:
            held = identify(fd)
        except OSError:  # NO_DESCRIPTOR
            self._unidentified[fd] = None
            return None
        if held is None:
            return None
        self._held[fd] = held
        self._by_process.setdefault(held.peer.uid, {}).setdefault(held.peer.pid, OrderedDict())[fd] = None
        return held.peer.uid

    def _cut_excess(self, uid: int) -> None:
        """Shut down the oldest connections of the process of `uid` that holds the most, one at
        a time, until `uid` holds `per_uid`; its count confirmed first: a connection whose
        number holds another now is forgotten (its end raced the drain), and one whose peer
        hung up, or half-closed its end, is shut down, since libzmq reads that end only after
        every request queued before it and answers them all meanwhile (the peer need read
        none). A connection is forgotten once it is shut down; where no descriptor is left to
        do that, it stays counted and its user is cut again at the next call."""
        counted = [fd for process in self._by_process.get(uid, {}).values() for fd in process]
        for fd in ended(counted, self._held):
            if not self._shut(fd):
                return
        cut: Counter[int] = Counter()
        while self.held_by(uid) > self._per_uid:
            pid, fds = max(self._by_process[uid].items(), key=lambda process: len(process[1]))
            if not self._shut(next(iter(fds))):
                break
            cut[pid] += 1
        if cut:
            self._cut[uid].warning("uid %d held more than %d connections to the request socket; "
                                   "closed the oldest of the processes that held the most: %s",
                                   uid, self._per_uid, ", ".join(f"{n} of pid {pid}"
                                                                 for pid, n in cut.items()))

    def _shut(self, fd: int) -> bool:
        """Shut counted connection `fd` down and forget it; False where no descriptor was left
        to do that (its user to be cut again at the next call)."""
        held = self._held[fd]
        try:
            shut_down(fd, held)
        except OSError:  # NO_DESCRIPTOR
            self._over.add(held.peer.uid)
            return False
        self._forget(fd)
        return True

    def _forget(self, fd: int) -> None:
        self._unidentified.pop(fd, None)
        held = self._held.pop(fd, None)
        if held is None:
            return
        processes = self._by_process[held.peer.uid]
        fds = processes[held.peer.pid]
        del fds[fd]
        if not fds:
            del processes[held.peer.pid]
        if not processes:
            del self._by_process[held.peer.uid]

    def close(self, sock: zmq.Socket) -> None:
        sock.disable_monitor()
        self.monitor.close(0)


def monitor_socket(sock: zmq.Socket) -> zmq.Socket:
    """The monitor's receiving end, its queue unbounded. With libzmq's default bounds (about
    2,000 events) a full queue held up the socket's I/O thread: no one's connection was
    accepted, nor any message read, until the loop read the events, and a flood of connections
    that come and go while the loop serves their requests fills it. An event is two messages of
    a few hundred bytes in all, and every one comes of a connection's start or end."""
    address = f"inproc://engramd-connections-{next(_MONITORS)}"  # libzmq frees a name late
    sock.monitor(address, EVENTS)
    monitor = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)  # before connecting: the pipe's bound is set then
    monitor.connect(address)
    return monitor


def identify(fd: int) -> Held | None:
    """Who holds connection `fd` and its socket's inode, read from one duplicate of it; None
    where `fd` is no Unix socket now. OSError (NO_DESCRIPTOR) where no duplicate could be made."""
    conn = duplicate(fd)
    if conn is None:
        return None
    with conn:
        inode = inode_of(conn.fileno())
        if conn.family != socket.AF_UNIX or inode is None:
            return None
        try:
            return Held(PeerCredentials.of(conn), inode)
        except OSError:
            return None


def ended(fds: list[int], held: dict[int, Held]) -> list[int]:
    """Those of `fds` that no longer hold their connection (`held`), or whose peer has hung up."""
    gone, poller = [], select.poll()
    for fd in fds:
        if inode_of(fd) != held[fd].inode:
            gone.append(fd)
        else:
            poller.register(fd, select.POLLRDHUP)  # looked at, not read: libzmq reads it
    gone += [fd for fd, _ in poller.poll(0)]  # POLLRDHUP, or POLLHUP / POLLERR, always reported
    return gone


def inode_of(fd: int) -> int | None:
    """The inode of the socket at descriptor `fd`; None where `fd` holds no socket now."""
    try:
        status = os.fstat(fd)
    except OSError:
        return None
    return status.st_ino if stat.S_ISSOCK(status.st_mode) else None


def shut_down(fd: int, held: Held) -> None:
    """End libzmq's connection `fd` as its peer's close would: libzmq reads its end, drops its
    queue and forgets it (its descriptor is libzmq's to close). Only if `fd` still holds that
    connection (the number may have been reused meanwhile): checked on the duplicate, which
    holds what `fd` held when it was made. OSError (NO_DESCRIPTOR) where no duplicate could be
    made: then nothing was done."""
    conn = duplicate(fd)
    if conn is None:
        return  # gone already
    with conn:
        if inode_of(conn.fileno()) == held.inode:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # its peer's end came first


def duplicate(fd: int) -> socket.socket | None:
    """A socket of its own over a duplicate of descriptor `fd` (closed with it), or None where
    `fd` is closed or no socket now; OSError (NO_DESCRIPTOR) where no descriptor was left for
    the duplicate."""
    try:
        copy = os.dup(fd)
    except OSError as error:
        if error.errno in NO_DESCRIPTOR:
            raise
        return None
    try:
        return socket.socket(fileno=copy)
    except OSError:  # not a socket: the number holds a file, a pipe...
        os.close(copy)
        return None
