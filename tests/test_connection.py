"""client/shared/connection.py against a stand-in daemon (a ZeroMQ ROUTER in this process): a
wait whose daemon is gone."""

from __future__ import annotations

import threading

import pytest
import zmq
from helpers import raised_in_thread

from engramd.client.errors import DaemonUnavailableError
from engramd.client.shared import connection, protocol
from engramd.client.shared.connection import Connection
from engramd.client.shared.messages import StatsReply


@pytest.fixture
def daemon_and_client(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 30_000)  # a test that failed early leaves no thread waiting
    router.bind(f"ipc://{tmp_path}/engramd.sock")
    conn = Connection(tmp_path / "engramd.sock")
    conn.watch_daemon(lambda: "the daemon closed this client's lease")  # gone from the start
    yield router, conn
    conn.close()
    router.close(0)
    ctx.term()


def answer_later(router: zmq.Socket, delay: float | None) -> threading.Thread:
    """Answer the next request after `delay` seconds, as a stats reply (None: read it, answer
    nothing)."""
    def answer():
        identity, *frames = router.recv_multipart()
        if delay is None:
            return
        request = protocol.decode_request(frames)
        threading.Event().wait(delay)
        reply = StatsReply(state="stopping", uptime=1.0, lookups=1, errors={})
        router.send_multipart([identity, *protocol.encode_reply(request.rid, "ep", reply)])
    thread = threading.Thread(target=answer)
    thread.start()
    return thread


def test_a_reply_still_on_its_way_when_the_daemon_is_gone_is_taken(daemon_and_client, monkeypatch):
    """A stopping daemon sends its replies before it closes the leases, but the lease's end can
    be seen before this process's ZeroMQ thread has handed the reply over: the wait gives it a
    grace (it failed a lookup the daemon had answered, before). The reply comes 0.1 s after the
    request, which the wait sees gone from the start; the grace is made long enough that a
    loaded machine's delays do not decide."""
    monkeypatch.setattr(connection, "GONE_GRACE_S", 60.0)
    router, conn = daemon_and_client
    thread = answer_later(router, 0.1)
    try:
        assert conn.call("stats", timeout=120).body.lookups == 1
    finally:
        thread.join()


def test_a_reply_that_does_not_come_fails_the_wait_once_the_daemon_is_gone(daemon_and_client, monkeypatch):
    monkeypatch.setattr(connection, "GONE_GRACE_S", 0.2)
    router, conn = daemon_and_client
    thread = answer_later(router, None)
    try:
        with pytest.raises(DaemonUnavailableError, match="closed this client's lease while waiting for stats"):
            conn.call("stats", timeout=120)  # the timeout is far: the daemon's end decides
    finally:
        thread.join()


def test_a_path_that_cannot_be_the_daemons_socket_is_refused_at_once(tmp_path):
    """The handle socket's path given as the daemon's waited 30 s for a reply it never sends,
    then blamed the daemon; a folder made the client look for the handle socket in its parent."""
    from engramd.client import EngramClient

    handles = tmp_path / "engramd.handles"
    for path, says in ((handles, "is the daemon's handle socket"), (tmp_path, "is a folder"),
                       (tmp_path / "none.sock", "no daemon socket at")):
        with pytest.raises(DaemonUnavailableError, match=says):
            EngramClient(path, device="cpu", timeout=30)
        with pytest.raises(DaemonUnavailableError, match=says):
            connection.probe(path, "health", 30)


def test_a_wait_on_a_connection_another_thread_closes_is_told_so(tmp_path):
    """A thread waiting for a reply when another closed the connection (a reconnect, close())
    got zmq's 'Operation not supported' from the closed socket; now DaemonUnavailableError."""
    conn = Connection(tmp_path / "nobody.sock")
    rid = conn.send("health")  # queued: nothing listens there
    wait_s = 30.0  # what the waiter allows; the close must end its wait first, as its error says
    closer = threading.Timer(0.0, conn.close)
    closer.start()
    raised = raised_in_thread(lambda: conn.wait(rid, wait_s, "health"), join_s=2 * wait_s)
    closer.join()
    assert isinstance(raised, DaemonUnavailableError) and "was closed" in str(raised), raised
