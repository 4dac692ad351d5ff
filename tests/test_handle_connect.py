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


@pytest.mark.parametrize("ask", [
    lambda path: handles.admin_request(path, "hello", timeout=2.0),
    lambda path: handles._ask_for_descriptors(path, handles.HANDLE_REQUESTS["hello"](), 2.0),
], ids=["admin_request", "attach"])
def test_a_request_has_one_deadline_for_its_connect_and_its_answer(tmp_path, monkeypatch, ask):
    """The wait for room in the queue counts against the request's timeout: the connect and
    the answer are bounded by the same deadline, not one timeout each (a 2-s request that
    waited for room once took 3.8 s)."""
    path = tmp_path / "handles"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    deadlines = {}
    real_connect = handles.connect

    def connect(sock, where, deadline):
        deadlines["connect"] = deadline
        real_connect(sock, where, deadline)

    def recv_message(sock, max_fds=0, deadline=None, max_bytes=handles.MAX_MESSAGE_BYTES):
        deadlines["answer"] = deadline
        raise TimeoutError("no answer")  # as a peer that never answers

    monkeypatch.setattr(handles, "connect", connect)
    monkeypatch.setattr(handles, "recv_message", recv_message)
    try:
        with pytest.raises(DaemonUnavailableError, match="no answer"):
            ask(path)
    finally:
        listener.close()
    assert deadlines["answer"] == deadlines["connect"]


def test_connect_bounds_a_blocking_socket_by_the_deadline(full_queue):
    path, _ = full_queue
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # blocking: no timeout of its own
    try:
        with pytest.raises(DaemonUnavailableError, match="stayed full"):
            handles.connect(sock, path, time.monotonic() + 0.3)
    finally:
        sock.close()
