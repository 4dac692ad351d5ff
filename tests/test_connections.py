"""server/connections.py: the request socket's connections counted per user, the excess cut."""

from __future__ import annotations

import dataclasses
import errno
import os
import socket

import pytest
import zmq

from engramd.client.shared.handles import PeerCredentials
from engramd.server import connections as module
from engramd.server.connections import ConnectionsPerUser, identify, inode_of, shut_down


@pytest.fixture
def counted(tmp_path):
    """A ConnectionsPerUser of a bound ROUTER socket that lets one user hold two connections."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{tmp_path}/s")
    connections = ConnectionsPerUser(sock, per_uid=2)
    yield connections
    connections.close(sock)
    sock.close(0)
    ctx.term()


def connection() -> tuple[socket.socket, socket.socket]:
    """A connected pair: (the daemon's end, whose descriptor is counted; the peer's end)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def is_shut_down(peer_end: socket.socket) -> bool:
    peer_end.setblocking(False)
    try:
        return peer_end.recv(1) == b""  # the other end shut down: end of stream
    except BlockingIOError:
        return False


def accept(counted: ConnectionsPerUser, *ours: socket.socket) -> None:
    """What events() does for the acceptance of each of `ours`, then for their user's excess."""
    for conn in ours:
        counted._accepted(conn.fileno())
    counted._cut_excess(os.getuid())


def test_the_excess_connections_cut_are_the_oldest(counted):
    pairs = [connection() for _ in range(5)]
    accept(counted, *(ours for ours, _ in pairs))
    assert [is_shut_down(peer) for _, peer in pairs] == [True, True, True, False, False]
    assert counted.held_by(os.getuid()) == 2


@pytest.mark.parametrize("now", ["free", "a pipe", "hung up"])
def test_a_counted_descriptor_that_is_no_longer_the_peers_costs_no_live_connection(counted, now):
    """A connection whose end libzmq has not read, or the loop not yet heard of, is counted
    still: its peer may have hung up, its number be free, or hold anything. The user's live
    connections are within the bound: none is cut."""
    live, peer_of_live = connection()
    stale, peer_of_stale = connection()
    accept(counted, live, stale)
    newest, peer_of_newest = connection()  # before the number is free: it does not take it
    pipe = os.pipe()
    if now == "free":
        stale.close()
    elif now == "a pipe":
        os.dup2(pipe[0], stale.fileno())
    else:
        peer_of_stale.close()
    accept(counted, newest)
    assert not is_shut_down(peer_of_live) and not is_shut_down(peer_of_newest)
    assert counted.held_by(os.getuid()) == 2
    for fd in pipe:
        os.close(fd)


def test_a_descriptor_whose_number_was_reused_is_not_shut_down():
    """The number of a connection counted may hold another connection by the time it is cut
    (its end not read yet): that one is left alone."""
    counted_end, _ = connection()
    held = identify(counted_end.fileno())
    other, peer_of_other = connection()
    os.dup2(other.fileno(), counted_end.fileno())  # the number now holds `other`
    shut_down(counted_end.fileno(), held)
    assert not is_shut_down(peer_of_other)


def test_a_descriptor_that_is_no_unix_socket_is_no_connection_and_a_connection_is_its_peers():
    read_end, write_end = os.pipe()
    try:
        assert identify(read_end) is None
    finally:
        os.close(read_end)
        os.close(write_end)
    ours, _peer = connection()
    held = identify(ours.fileno())
    assert held is not None and held.peer == PeerCredentials.of(ours)
    assert held.inode == os.fstat(ours.fileno()).st_ino


def test_a_burst_of_connections_while_the_loop_is_busy_loses_no_acceptance(tmp_path):
    """The monitor's events pile up while the loop serves requests. With libzmq's default
    bounds, past about 2,000 of them the socket's I/O thread waited for the loop: no connection
    was accepted nor message read, anyone's. Here 1,600 connections come and go (3,200 events
    at least) before the loop reads any; the five that stay are served, then counted."""
    ctx, peers_ctx = zmq.Context(), zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{tmp_path}/s")
    counted = ConnectionsPerUser(sock, per_uid=64)
    peers: list[zmq.Socket] = []  # those not closed yet
    try:
        for _ in range(8):
            dealers(peers_ctx, f"ipc://{tmp_path}/s", sock, 200, peers)
            while peers:
                peers.pop().close(0)
        dealers(peers_ctx, f"ipc://{tmp_path}/s", sock, 5, peers)
        counted.events()
        live = [fd for fd, held in counted._held.items() if inode_of(fd) == held.inode]
        assert len(live) == 5, f"{len(live)} of the 5 connections that stayed are counted"
    finally:
        for peer in peers:
            peer.close(0)
        counted.events()  # a full queue holds up the monitor's stop
        counted.close(sock)
        sock.close(0)
        peers_ctx.term()
        ctx.term()


def dealers(ctx: zmq.Context, address: str, router: zmq.Socket, count: int,
            peers: list[zmq.Socket]) -> None:
    """`count` DEALER connections to `router` into `peers`, each accepted: its first message
    read there."""
    for _ in range(count):
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(address)
        peer.send(b"hello")
        peers.append(peer)
    for _ in range(count):
        assert router.poll(10_000), "a connection's message never came"
        router.recv_multipart()


def test_the_excess_is_cut_from_the_process_that_holds_the_most(counted, monkeypatch):
    """A user's process of many connections loses its oldest; its other process, of fewer, keeps
    its own, though one is the oldest of all."""
    pairs = [connection() for _ in range(4)]
    pids = {pairs[0][0].fileno(): 1, pairs[1][0].fileno(): 2, pairs[2][0].fileno(): 2,
            pairs[3][0].fileno(): 2}
    real = module.identify

    def identify(fd):
        held = real(fd)
        return module.Held(dataclasses.replace(held.peer, pid=pids[fd]), held.inode)

    monkeypatch.setattr(module, "identify", identify)
    accept(counted, *(ours for ours, _ in pairs))
    assert [is_shut_down(peer) for _, peer in pairs] == [False, True, True, False]


def test_a_connection_whose_peer_half_closed_is_shut_down_not_only_uncounted(counted):
    """A peer that shuts its sending side and reads nothing is still served: libzmq reads the
    end only after every request queued before it, and queues every reply. Such a connection
    of a user over the bound is shut down, so that libzmq drops it."""
    live, peer_of_live = connection()
    half, peer_of_half = connection()
    accept(counted, live, half)
    peer_of_half.shutdown(socket.SHUT_WR)
    newest, peer_of_newest = connection()
    accept(counted, newest)
    assert is_shut_down(peer_of_half)
    assert not is_shut_down(peer_of_live) and not is_shut_down(peer_of_newest)
    assert counted.held_by(os.getuid()) == 2


def no_descriptor(fd):
    raise OSError(errno.EMFILE, "Too many open files")


def the_oldest_is_cut_once_a_descriptor_is_free(counted, monkeypatch, pairs) -> None:
    """Descriptors to spare again (os.dup restored): the next call cuts the oldest of the three
    connections of `pairs` and leaves the bound of two."""
    monkeypatch.undo()
    counted.events()
    assert [is_shut_down(peer) for _, peer in pairs] == [True, False, False]
    assert counted.held_by(os.getuid()) == 2


def test_a_connection_not_identified_for_want_of_a_descriptor_is_counted_at_the_next_call(
        counted, monkeypatch):
    """A flood of connections is when the daemon may run out of descriptors: an acceptance it
    could not identify (no descriptor to duplicate) is not lost from the count, but identified
    at the next call that finds one, and its user's excess cut then."""
    pairs = [connection() for _ in range(3)]
    accept(counted, *(ours for ours, _ in pairs[:2]))
    monkeypatch.setattr(module.os, "dup", no_descriptor)
    counted._unidentified[pairs[2][0].fileno()] = None  # as events() holds an acceptance read
    counted.events()
    assert counted.held_by(os.getuid()) == 2
    assert not any(is_shut_down(peer) for _, peer in pairs)
    the_oldest_is_cut_once_a_descriptor_is_free(counted, monkeypatch, pairs)


def test_a_cut_without_a_descriptor_to_spare_keeps_the_connection_counted_and_is_done_later(
        counted, monkeypatch):
    """A cut that could not shut its connection down (no descriptor to duplicate) neither
    forgets it nor says it was closed; the next call cuts it."""
    pairs = [connection() for _ in range(3)]
    for ours, _ in pairs:
        counted._accepted(ours.fileno())
    monkeypatch.setattr(module.os, "dup", no_descriptor)
    counted._cut_excess(os.getuid())
    assert counted.held_by(os.getuid()) == 3
    assert not any(is_shut_down(peer) for _, peer in pairs)
    the_oldest_is_cut_once_a_descriptor_is_free(counted, monkeypatch, pairs)


@pytest.mark.parametrize("look", [identify, lambda fd: shut_down(fd, module.Held(None, 0))],
                         ids=["identify", "shut_down"])
def test_a_number_that_holds_no_socket_costs_no_descriptor(look):
    """A connection's number may hold a pipe or a file by the time it is looked at: its
    duplicate is closed all the same."""
    read_end, write_end = os.pipe()
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            look(read_end)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(read_end)
        os.close(write_end)


def test_events_cut_a_users_connections_down_to_the_bound(tmp_path):
    """Through the monitor, as the loop sees them: five connections of one user to a bound of
    two leave two counted."""
    ctx, peers_ctx = zmq.Context(), zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{tmp_path}/s")
    counted = ConnectionsPerUser(sock, per_uid=2)
    peers: list[zmq.Socket] = []
    try:
        dealers(peers_ctx, f"ipc://{tmp_path}/s", sock, 5, peers)
        counted.events()
        assert counted.held_by(os.getuid()) == 2
    finally:
        for peer in peers:
            peer.close(0)
        counted.events()
        counted.close(sock)
        sock.close(0)
        peers_ctx.term()
        ctx.term()
