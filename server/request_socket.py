"""The daemon's ZeroMQ socket (`engramd.sock`): the ROUTER every client's DEALER talks to, the
options that bound what a peer can make the daemon hold, and the requests read and the replies
sent on it.

What a peer can make the daemon hold is bounded at every step: libzmq refuses a peer outside the
allowed ids when it accepts (`admit_only_allowed_peers`) and a frame larger than the largest
request while it decodes (MAXMSGSIZE); a message of more frames than any request has is dropped
here uncopied, its sender answered (`recv`). A reply never blocks the loop: one to a peer whose
queue is full is dropped, and that peer gets no answers but to lookups for DEAF_FOR_S; a peer
that has gone is noticed when a reply to it fails, and its registrations retired (`send`).

Not the loop that reads it nor what each request gets (server/daemon.py), nor the wire format
(client/shared/protocol.py), nor the handle socket beside it (server/handle_server.py). Every
method runs on the loop's thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from engramd.client.errors import ProtocolError
from engramd.client.shared import protocol
from engramd.client.shared.handles import PeerCredentials
from engramd.server.connections import ConnectionsPerUser, connections_per_uid
from engramd.server.throttle import Throttled

if TYPE_CHECKING:
    from engramd.server.service import Service

log = logging.getLogger("engramd.daemon")

# Replies one peer may have waiting, at least (bind: send_queue). At 64, a peer that sent 60
# requests before reading (the fuzzer) lost replies: the loop answers faster than libzmq's
# I/O thread moves them to the kernel on a loaded machine.
MIN_SEND_QUEUE = 256
DEAF_FOR_S = 1.0  # how long a peer whose reply queue was full gets no answers but to lookups
# The most frames a request may have: the peer's identity, the header, the payload frames.
MAX_MESSAGE_FRAMES = 2 + protocol.MAX_PAYLOAD_FRAMES


class RequestSocket:
    def __init__(self, ctx: zmq.Context, service: Service):
        """`service` counts the errors and retires a gone peer's clients."""
        self.service = service
        seed_routing_ids()  # before the socket: its first routing id is drawn when it is made
        self.sock = ctx.socket(zmq.ROUTER)  # closed by close(), whether bound or not
        self.path: Path | None = None  # once bound there
        self._dropped = Throttled(log)  # a peer that reads no replies must not flood the log
        self._oversized = Throttled(log)
        # Peers whose reply queue was full, until when: their requests other than lookups are
        # not worth the loop's time (nobody reads the answer). Lookups are always served.
        self._deaf: dict[bytes, float] = {}
        self._first_frame: zmq.Frame | None = None  # of the message being handled
        self.connections: ConnectionsPerUser | None = None  # once bound; its monitor is polled

    def bind(self, path: Path, max_frame: int) -> None:
        """Listen at `path`, whose stale socket goes (the caller holds the socket's lock, so no
        live daemon is on it); `max_frame`: the largest frame a request may carry
        (daemon.largest_frame)."""
        self.path = path  # from here close() removes it: ours, or a dead daemon's
        path.unlink(missing_ok=True)
        sock = self.sock
        sock.setsockopt(zmq.LINGER, 0)
        # Replies queued for one peer before the next is dropped (and the peer deaf, see send): a
        # client reads its replies and has at most its slots' lookups in flight (max_slots). At
        # 100,000, a peer that asked for `stats` and read nothing held 680 MB; at 1,024, 7 MB,
        # and each further connection as much again (connections.py bounds those of one user).
        limits = self.service.limits
        sock.setsockopt(zmq.SNDHWM, send_queue(limits.max_slots))
        self.connections = ConnectionsPerUser(sock, connections_per_uid(
            limits.max_clients_per_uid, limits.max_clients))
        # Messages one peer may have queued here before libzmq stops reading its connection (it
        # then waits in the peer's socket; nothing is dropped). Clients keep a few in flight; a
        # flooding peer's deep queue is memory the daemon holds for it, and (the suspicion of
        # benchmarks/results/floods.md) bursts in which libzmq's one I/O thread refills it while
        # other peers' replies wait.
        sock.setsockopt(zmq.RCVHWM, 1000)
        # Enforced by libzmq while decoding, before the frame is allocated: a peer that sends a
        # larger frame is disconnected; the daemon never buffers it. Each connection holds up to
        # one frame in progress: sized to what this daemon's clients send, not the protocol's
        # 64 MiB, 16 peers leaving frames unfinished held 1.2 GB of it. (Set before bind: the
        # listener copies the options then.)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        # Sending to a peer that has disconnected fails instead of vanishing: that is how a client
        # that died before its registration was answered is noticed (see send).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        admit_only_allowed_peers(sock, self.service)
        sock.bind(f"ipc://{path}")
        os.chmod(path, 0o660)

    def recv(self) -> list[bytes] | None:
        """The next message's frames, copied; None for one of more frames than any request has
        (answered here); zmq.Again when none waits. libzmq limits each frame's size but hands
        over a message of any number of them; past MAX_MESSAGE_FRAMES the rest are received
        uncopied and dropped at once (a copy of gigabytes stalled the loop for seconds)."""
        sock = self.sock
        first = sock.recv(zmq.NOBLOCK, copy=False)
        self._first_frame = first  # its metadata says who sent the message (sender)
        frames = [first.bytes]
        while sock.getsockopt(zmq.RCVMORE):
            if len(frames) == MAX_MESSAGE_FRAMES:
                self._refuse_oversized(frames)
                return None
            frames.append(sock.recv())
        return frames

    def _refuse_oversized(self, frames: list[bytes]) -> None:
        """Drop the rest of a message of too many frames, uncopied, and answer its sender."""
        count, size = len(frames) - 1, sum(len(frame) for frame in frames[1:])  # not the identity
        while self.sock.getsockopt(zmq.RCVMORE):
            count, size = count + 1, size + len(self.sock.recv(copy=False))
        identity = frames[0]
        header = frames[1] if len(frames[1]) <= protocol.MAX_HEADER_BYTES else b""
        op, rid = protocol.peek_rid([header])
        err = ProtocolError(f"a message of {count} frames ({size} bytes) dropped unread: requests "
                            f"are a header and at most {protocol.MAX_PAYLOAD_FRAMES} payload frame")
        self.service.count_error(err.code)
        self._oversized.warning("dropped a message of %d bytes with too many frames", size)
        self.send(identity, protocol.encode_error(op, rid, self.service.epoch, err))

    def sender(self) -> PeerCredentials | None:
        """Who holds the connection of the message being handled: libzmq reads the kernel's
        credentials of an ipc peer (SO_PEERCRED) when it accepts, and names them in each
        message's Peer-Address, "<host>:<uid>:<gid>:<pid>". None where it does not."""
        frame = self._first_frame
        try:
            address = frame.get("Peer-Address") if frame is not None else None
        except zmq.ZMQError:  # libzmq names none
            return None
        try:
            _, uid, gid, pid = str(address).rsplit(":", 3)
            return PeerCredentials(int(pid), int(uid), int(gid))
        except ValueError:  # none, or not "<host>:<uid>:<gid>:<pid>"
            return None

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.Again:
            self._dropped.warning("dropping a reply: the client's queue is full (it reads none)")
            self._deaf[identity] = time.perf_counter() + DEAF_FOR_S
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.service.retire_identity(identity, "reaped (its connection is gone)")  # the peer is gone

    def deaf(self, identity: bytes, received: float) -> bool:
        """Whether the peer read none of its replies lately (its queue was full when one was
        sent): answering it costs the others, and tells it nothing."""
        return identity in self._deaf and self._deaf[identity] > received

    def hear_again(self, now: float) -> None:
        """Forget the peers deaf until before `now` (time.perf_counter)."""
        self._deaf = {peer: until for peer, until in self._deaf.items() if until > now}

    def close(self, flush_s: float = 0.0) -> None:
        """Close the socket, and remove its path if it was bound there; replies still queued
        are sent for up to `flush_s` more (by the context's term())."""
        if self.connections is not None:
            self.connections.close(self.sock)
        self.sock.close(linger=int(flush_s * 1000))
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def send_queue(max_slots: int) -> int:
    """Replies one peer may have waiting: four for each of a client's slots (a lookup in flight
    each), room for its heartbeats' replies and notices besides."""
    return max(MIN_SEND_QUEUE, 4 * max_slots)


def seed_routing_ids() -> None:
    """Seed the C library's rand() from the kernel's randomness. libzmq names each peer that names
    no routing id of its own (every client of this library) by a counter that starts at rand()
    when the ROUTER is made, and aborts the process (an assertion in add_out_pipe) when the id it
    hands out is one a peer has claimed for itself; peers may claim any id not in use. rand() was
    never seeded, so the counter started at the same number in every daemon (0x6b8b4567 with
    glibc), and a peer that claimed the next few ids aborted the daemon at the next connection.
    Seeded, the start is one of 2**32 no peer is told (ids are never sent to peers). This makes
    the abort a search, not a certainty: a claim of an id in use is ignored, which a peer can
    notice, so one that holds K connections and claims ids at random finds where the counter is
    after some 2**32 / K claims (thousands a second here: hours for K = 100). Only libzmq can
    close that; allowed_uids/allowed_gids keep everyone else off the socket."""
    try:
        libc = ctypes.CDLL(None)
        libc.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))
    except (OSError, AttributeError):  # no C library to seed here: libzmq seeds its own, or none
        log.warning("cannot seed rand(): libzmq's routing ids start where they always do")


def admit_only_allowed_peers(sock: zmq.Socket, service: Service) -> None:
    """With allowed ids configured, libzmq refuses every other peer when it accepts the
    connection, by the kernel's credentials (SO_PEERCRED) as the handle socket does: a
    refused peer cannot send the daemon one byte (a flood, a huge message, a `stats` that
    names the clients). libzmq also admits members of an allowed group by its group file;
    the handle socket then checks the effective gid. Admins pass, so `engramd health` and
    `drain` work for them."""
    limits = service.limits
    if limits.allowed_uids is None and limits.allowed_gids is None:
        return
    for uid in sorted({*(limits.allowed_uids or ()), *service.admins}):
        sock.setsockopt(zmq.IPC_FILTER_UID, uid)
    for gid in sorted(limits.allowed_gids or ()):
        sock.setsockopt(zmq.IPC_FILTER_GID, gid)
