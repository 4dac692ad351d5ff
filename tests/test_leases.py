"""The client's lease across fork(): a child must not hold its parent's registration alive."""

from __future__ import annotations

import os
import socket

from engramd.client import watchdog as watchdog_module


def test_a_forked_child_lets_go_of_its_parents_leases():
    ours, daemons_end = socket.socketpair()
    watchdog_module._LEASES.add(ours)
    try:
        pid = os.fork()
        if pid == 0:  # the child: its copy of the lease must already be closed
            os._exit(0 if ours.fileno() == -1 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child kept the lease open"
        assert ours.fileno() != -1, "the parent keeps its own"
        ours.close()  # the last holder lets go: the daemon's end sees end-of-file
        daemons_end.settimeout(5)
        assert daemons_end.recv(1) == b""
    finally:
        watchdog_module._LEASES.discard(ours)
        ours.close()
        daemons_end.close()
