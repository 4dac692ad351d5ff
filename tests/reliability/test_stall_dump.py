"""A request loop that stops turning writes every thread's stack to the daemon's log by itself
(server/daemon.py arm_stall_dump), and a loop that turns never does."""

from __future__ import annotations

import time

from helpers import DEMO_HEARTBEAT_S, wait_until

from engramd.client.shared.connection import probe

STALL = ["--stall-dump-s", "1"]  # the demo daemons beat every 0.2 s: the floor is 0.6 s


def test_a_stalled_loop_dumps_every_threads_stack_and_serves_on(daemon_factory):
    daemon = daemon_factory(extra=STALL, env={"ENGRAMD_DEBUG_LOOP_STALL_S": "4"})
    wait_until(lambda: "Timeout (0:00:01)!" in daemon.log(), timeout=30)
    # The dump is written a thread at a time: read on until it names where the loop stood.
    wait_until(lambda: "in _housekeeping" in daemon.log().partition("Timeout (0:00:01)!")[2],
               timeout=30)
    assert probe(daemon.socket, "health", 30.0).body.ready  # it comes back, and serves
    assert daemon.stop() == 0


def test_a_turning_loop_never_dumps(daemon_factory):
    # The loop re-arms the dump every heartbeat period: the deadline gives a loaded machine 15
    # periods of margin. Watched for two deadlines: a dump armed once, never re-armed, fires.
    stall_dump_s = round(15 * DEMO_HEARTBEAT_S, 3)
    daemon = daemon_factory(extra=["--stall-dump-s", str(stall_dump_s)])
    deadline = time.monotonic() + 2 * stall_dump_s
    while time.monotonic() < deadline:
        assert probe(daemon.socket, "health", 10.0).body.ready
        time.sleep(0.5)
    assert daemon.stop() == 0
    assert "Timeout (" not in daemon.log()
