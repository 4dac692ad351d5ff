"""server/startup.SocketLock: one daemon per socket, and a standby's wait for the lock.

flock locks belong to open file descriptions, so two SocketLocks of one process contend like two
daemons would."""

from __future__ import annotations

import threading

import pytest

from engramd.server.startup import EXIT_OK, EXIT_SOCKET_IN_USE, DaemonHalt, SocketLock

WAIT_S = 10.0  # a bound against hanging: the events below take a poll or two (50 ms each)


def test_a_held_lock_refuses_a_second_daemon(tmp_path):
    held = SocketLock(tmp_path / "e.sock")
    held.acquire()
    with pytest.raises(DaemonHalt, match="in use by another engramd") as halt:
        SocketLock(tmp_path / "e.sock").acquire()
    assert halt.value.status == EXIT_SOCKET_IN_USE
    held.release()


def test_a_standby_takes_the_lock_once_it_is_free(tmp_path):
    held = SocketLock(tmp_path / "e.sock")
    held.acquire()
    standby, holders, took = SocketLock(tmp_path / "e.sock"), [], threading.Event()

    def wait() -> None:
        standby.acquire(threading.Event(), on_held=holders.append)
        took.set()
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert not took.wait(0.3), "took a lock that is held"
    assert len(holders) == 1 and holders[0].isdigit()  # told once, with the holder's pid
    held.release()
    assert took.wait(WAIT_S)
    waiter.join(WAIT_S)
    with pytest.raises(DaemonHalt):  # it holds it now
        SocketLock(tmp_path / "e.sock").acquire()
    standby.release()


def test_a_stopped_standby_gives_up_the_wait_and_takes_nothing(tmp_path):
    held = SocketLock(tmp_path / "e.sock")
    held.acquire()
    stop, result = threading.Event(), []

    def wait() -> None:
        try:
            SocketLock(tmp_path / "e.sock").acquire(stop)
            result.append("took it")
        except DaemonHalt as halt:
            result.append(halt.status)
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    stop.set()
    waiter.join(WAIT_S)
    assert result == [EXIT_OK]
    held.release()
    stop_first = threading.Event()
    stop_first.set()
    with pytest.raises(DaemonHalt) as halt:  # stopped before the lock came free: not taken
        SocketLock(tmp_path / "e.sock").acquire(stop_first)
    assert halt.value.status == EXIT_OK
    SocketLock(tmp_path / "e.sock").acquire()  # still free
