"""A connect to the handle socket whose queue of unaccepted connections is full
(client/shared/handles.py, connect): a Unix socket refuses it at once (EAGAIN), and the client waits
for room until its deadline instead of failing."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from engramd.client.errors import DaemonUnavailableError
from engramd.client.shared import handles


@pytest.fixture
def full_queue(tmp_path):
    """A listening socket that accepts nothing, its queue filled: (its path, the listener)."""
    path = tmp_path / "handles"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    held = []
    while True:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.setblocking(False)
        try:
            peer.connect(str(path))
        except BlockingIOError:
            peer.close()
            break
        held.append(peer)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    with pytest.raises(BlockingIOError):  # what a plain connect meets: refused at once
        probe.connect(str(path))
    probe.close()
    yield path, listener
    for peer in held:
        peer.close()
    listener.close()


def test_a_connect_to_a_full_queue_waits_for_room(full_queue):
    path, listener = full_queue
    room = threading.Timer(0.2, lambda: listener.accept()[0].close())
    room.start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        handles.connect(sock, path, time.monotonic() + 30.0)
        assert sock.getpeername() == str(path)
    finally:
        room.join()
        sock.close()


def test_a_queue_full_past_the_deadline_fails_the_connect_with_why(full_queue):
    path, _ = full_queue
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        with pytest.raises(DaemonUnavailableError, match="queue of connections stayed full"):
            handles.connect(sock, path, time.monotonic() + 0.3)
    finally:
        sock.close()


def test_the_wait_for_room_counts_against_the_requests_timeout(full_queue):
    """One deadline for the whole request: a queue that has room only after most of the timeout,
    and a peer that then never answers, fail the request at its timeout, not a timeout later."""
    path, listener = full_queue
    accepted = []
    room = threading.Timer(1.5, lambda: accepted.append(listener.accept()[0]))  # held, unanswered
    room.start()
    started = time.monotonic()
    try:
        with pytest.raises(DaemonUnavailableError, match="no answer|not complete"):
            handles.admin_request(path, "hello", timeout=2.0)
        elapsed = time.monotonic() - started
    finally:
        room.join()
        for conn in accepted:
            conn.close()
    assert elapsed < 3.0, f"a 2-s request took {elapsed:.1f} s"


def test_connect_bounds_a_blocking_socket_by_the_deadline(full_queue):
    path, _ = full_queue
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # blocking: no timeout of its own
    try:
        with pytest.raises(DaemonUnavailableError, match="stayed full"):
            handles.connect(sock, path, time.monotonic() + 0.3)
    finally:
        sock.close()
