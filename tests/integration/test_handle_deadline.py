"""The handle socket's request deadline, as a real client meets it: a process that stalls
between its connect and its send (its other threads, a debugger, a sanitizer) is told why its
connection was closed, and its attach asks again, instead of failing on a bare close."""

from __future__ import annotations

import select
import socket
import time

import numpy as np
import torch
from reference import random_ids

from engramd.client import EngramClient
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
    assert (header["status"], header["code"]) == ("error", "not_ready"), header
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
