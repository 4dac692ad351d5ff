"""The handle socket's request deadline, as a real client meets it: a process that stalls
between its connect and its send (its other threads, a debugger, a sanitizer) is told why its
connection was closed, and its attach asks again, instead of failing on a bare close."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import wait_until
from reference import random_ids

from engramd.client import EngramClient, NotReadyError
from engramd.client.shared import handles
from engramd.client.shared.handles import handle_socket_path, recv_message
from engramd.server.handle_server import REQUEST_DEADLINE_S

ANSWER_WAIT_S = REQUEST_DEADLINE_S + 10.0  # the daemon's deadline, and room for a loaded machine


def wait_for_the_daemon(sock: socket.socket) -> None:
    """Until the daemon writes to or closes the connection (a stall past its deadline)."""
    readable, _, _ = select.select([sock], [], [], ANSWER_WAIT_S)
    assert readable, f"the daemon neither answered nor closed an idle connection in {ANSWER_WAIT_S} s"


def test_a_connection_that_sends_nothing_hears_why_it_is_closed(daemon_factory):
    daemon = daemon_factory()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(handle_socket_path(daemon.socket)))
        wait_for_the_daemon(sock)
        header, fds = recv_message(sock, 0, deadline=time.monotonic() + ANSWER_WAIT_S)
    assert fds == []
    assert (header["status"], header["code"], header.get("not_taken")) == ("error", "not_ready", True), header
    assert f"no whole request within {REQUEST_DEADLINE_S:.1f} s" in header["message"], header
    assert daemon.proc.poll() is None


def test_an_attach_stalled_past_the_deadline_is_asked_again(daemon_factory, reference, monkeypatch):
    """The first attach's request goes out only after the daemon has given up on it (as a
    process whose sending thread stalled); the client still attaches and its rows are exact."""
    daemon = daemon_factory()
    send, attaches = handles._send_request, []

    def stalled_once(sock, request):
        if request.OP == "attach":
            if not attaches:
                wait_for_the_daemon(sock)
            attaches.append(time.monotonic())
        send(sock, request)

    monkeypatch.setattr(handles, "_send_request", stalled_once)
    ids = random_ids(np.random.default_rng(5), 4, reference.rows, reference.heads)
    with EngramClient(daemon.socket, max_tokens=4) as client:
        rows = client.lookup(torch.from_numpy(ids)).result().double().numpy()
    assert np.array_equal(rows, reference.expected(ids))
    assert len(attaches) == 2, f"{len(attaches)} attach requests: the stalled one, then one more"
    assert daemon.proc.poll() is None


@pytest.mark.parametrize("not_taken", [True, False])
def test_attach_asks_again_only_what_the_daemon_did_not_take(monkeypatch, not_taken):
    """A not-taken error is asked again until an attach comes back; any other (a stopping
    daemon's NotReadyError) is raised at once, never retried for the whole timeout."""
    calls = []

    def attach_once(path, client_id, token, timeout):
        calls.append(timeout)
        if len(calls) < 3:
            error = NotReadyError("attach: daemon is stopping")
            error.not_taken = not_taken
            raise error
        return "attached"

    monkeypatch.setattr(handles, "_attach_once", attach_once)
    if not_taken:
        assert handles.attach("unused", 1, "t", timeout=30.0) == "attached"
        assert len(calls) == 3
    else:
        with pytest.raises(NotReadyError, match="stopping"):
            handles.attach("unused", 1, "t", timeout=30.0)
        assert len(calls) == 1


def test_each_peers_dropped_connection_is_logged_under_its_pid(daemon_factory):
    """Dropped connections are logged once per interval per peer: a process that drops them at
    will (a probe that stopped waiting for its answer) must not hide why another's went."""
    daemon = daemon_factory()
    path = str(handle_socket_path(daemon.socket))
    other = subprocess.Popen([sys.executable, "-c", IDLE_PEER, path, str(ANSWER_WAIT_S)])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        wait_for_the_daemon(sock)
    assert other.wait(timeout=ANSWER_WAIT_S + 30) == 0, "the other peer's connection was not closed"
    log = daemon.log()
    for pid in (os.getpid(), other.pid):
        assert f"dropped a connection of pid {pid} " in log, f"pid {pid}'s dropped connection unlogged"


def test_a_dropped_answer_does_not_hide_the_same_peers_next_dropped_connection(daemon_factory):
    """A client's readiness probe that gave up on its hello must not hide, for the interval,
    why the same process's attach connection was closed a moment later."""
    daemon = daemon_factory()
    path = str(handle_socket_path(daemon.socket))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.shutdown(socket.SHUT_RD)  # the daemon's answer to what follows fails: EPIPE
        handles._send_request(sock, handles.HANDLE_REQUESTS["hello"]())
        wait_until(lambda: "while answering its hello request" in daemon.log(), timeout=ANSWER_WAIT_S)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        wait_for_the_daemon(sock)
    # Logged before the answer the daemon sent with the close, which the read above saw.
    assert f"dropped a connection of pid {os.getpid()} " in daemon.log()


IDLE_PEER = """
import select, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
sys.exit(0 if select.select([sock], [], [], float(sys.argv[2]))[0] else 1)
"""
