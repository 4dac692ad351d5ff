"""sd_notify: messages reach a datagram socket (path and abstract), and nothing happens without one."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from engramd.server import notify
from engramd.server.notify import Notifier


def receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + address[1:] if address.startswith("@") else address)
    sock.settimeout(2)
    return sock


@pytest.mark.parametrize("abstract", [False, True])
def test_ready_status_stopping_reach_the_socket(tmp_path, abstract):
    address = f"@engramd-test-{uuid.uuid4().hex}" if abstract else str(tmp_path / "notify.sock")
    with receiver(address) as sock:
        notifier = Notifier(address)
        notifier.ready("ready: 2 layers")
        notifier.status("loading tables: 40%")
        notifier.stopping()
        messages = [sock.recv(4096).decode() for _ in range(3)]
    assert messages[0].split("\n") == ["READY=1", "STATUS=ready: 2 layers", f"MAINPID={os.getpid()}"]
    assert messages[1] == "STATUS=loading tables: 40%"
    assert messages[2].startswith("STOPPING=1\n")


def test_no_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled

    def no_socket(*args, **kwargs):
        raise AssertionError("a notifier without NOTIFY_SOCKET opened a socket")

    monkeypatch.setattr(notify.socket, "socket", no_socket)
    notifier.ready("x")
    notifier.status("y")
    notifier.stopping()


def test_unreachable_socket_is_logged_not_raised(tmp_path, caplog):
    Notifier(str(tmp_path / "nobody-listens.sock")).ready("x")
    assert "cannot notify" in caplog.text


def test_watchdog_interval_is_half_the_unit_setting(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier("").watchdog_interval == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert Notifier("").watchdog_interval is None
