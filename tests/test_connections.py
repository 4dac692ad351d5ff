"""server/connections.py: the request socket's connections counted per user, the excess cut."""

from __future__ import annotations

import os
import socket

import pytest
import zmq

from engramd.client.shared.handles import PeerCredentials
from engramd.server.connections import ConnectionsPerUser, credentials


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


def test_the_excess_connection_cuts_the_oldest(counted):
    pairs = [connection() for _ in range(3)]
    for ours, _ in pairs:
        counted._accepted(ours.fileno())
    assert [is_shut_down(peer) for _, peer in pairs] == [True, False, False]


def test_a_counted_descriptor_that_is_no_longer_the_peers_costs_no_live_connection(counted):
    """An end the monitor did not report leaves its descriptor counted; the number may now be
    anything (here a pipe). The user's live connections are within the bound: none is cut."""
    oldest, peer_of_oldest = connection()
    counted._accepted(oldest.fileno())
    read_end, write_end = os.pipe()  # what the stale descriptor's number holds now
    counted._peers[read_end] = credentials(oldest.fileno())
    counted._by_uid[os.getuid()][read_end] = None
    newest, peer_of_newest = connection()
    counted._accepted(newest.fileno())
    assert not is_shut_down(peer_of_oldest) and not is_shut_down(peer_of_newest)
    assert set(counted._by_uid[os.getuid()]) == {oldest.fileno(), newest.fileno()}
    os.close(read_end)
    os.close(write_end)


def test_credentials_of_a_descriptor_that_is_no_unix_socket_are_none():
    read_end, write_end = os.pipe()
    try:
        assert credentials(read_end) is None
    finally:
        os.close(read_end)
        os.close(write_end)
    ours, _peer = connection()
    assert credentials(ours.fileno()) == PeerCredentials.of(ours)


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
        live = [fd for fd, peer in counted._peers.items() if credentials(fd) == peer]
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
