"""A fifth round of attacks by a hostile local user on a real daemon (CPU backend, demo tables),
on whether it keeps serving everyone else and answers every bad input with a typed error: its
locks, its start, its settings. Each test here is one finding, and fails without its fix.

What this is not: the earlier rounds (test_hostile.py, test_round3.py, test_round4.py), access
by file modes (test_access.py), rows under faults.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import wait_until

# -- 1. the locks --------------------------------------------------------------------------------

# Runs as root, then as a member of the daemon's group (the engines' users are): opens each lock
# file it can and holds its flock as soon as it is free, as a process waiting for the daemon to
# go would.
LOCK_TAKER = textwrap.dedent("""
    import errno, fcntl, json, os, sys, time
    uid, gid, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    os.setgroups([gid])
    os.setgid(uid)
    os.setuid(uid)
    fds = {}
    for path in paths:
        try:
            fds[path] = os.open(path, os.O_RDONLY)
        except OSError as exc:
            print(json.dumps({"path": path, "open": errno.errorcode[exc.errno]}), flush=True)
    print(json.dumps({"opened": sorted(fds)}), flush=True)
    held, deadline = set(), time.monotonic() + 120
    while fds and len(held) < len(fds) and time.monotonic() < deadline:
        for path, fd in fds.items():
            try:
                if path not in held:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held.add(path)
                    print(json.dumps({"held": path}), flush=True)
            except BlockingIOError:
                pass
        time.sleep(0.001)
    sys.stdin.read()  # until the test lets go
""")

OTHER_USER = 65534  # nobody


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_member_of_the_daemons_group_cannot_hold_its_locks(daemon_factory):
    """The socket's lock (<socket>.lock, runtime folder) and the instance's (engramd.<instance>
    .lock, table folder) were made 0640 in folders of mode 0750: every member of the daemon's
    group (the engines' users, who may connect but not replace a socket) could open them, and
    flock needs no more than a descriptor. One that held them as soon as the daemon let go (a
    restart, an upgrade) kept every later daemon from starting (socket in use, exit 73) and a
    standby waiting for good: no daemon served anyone. The locks are the daemon's user's alone
    now (0600)."""
    from engramd.server.startup import EXIT_SOCKET_IN_USE

    first = daemon_factory()
    for folder in (first.workdir, first.shm_dir):
        os.chmod(folder, 0o755)  # as /run and /dev/shm are: only the daemon's own modes decide
    locks = [first.socket.with_name(first.socket.name + ".lock"),
             first.tables_dir / f"engramd.{'t'}.lock"]
    assert all(lock.exists() for lock in locks), list(first.socket.parent.iterdir())
    group = first.socket.stat().st_gid
    taker = subprocess.Popen([sys.executable, "-c", LOCK_TAKER, str(OTHER_USER), str(group),
                              *map(str, locks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        said = [json.loads(taker.stdout.readline())]
        while "opened" not in said[-1]:
            said.append(json.loads(taker.stdout.readline()))
        assert first.stop() == 0
        second = daemon_factory(workdir=first.workdir, shm_dir=first.shm_dir, ready=False)
        deadline = time.monotonic() + 120
        while not (second.health() or {}).get("ready"):
            status = second.proc.poll()
            assert status is None, (f"a second daemon exited {status} "
                                    f"({'socket in use' if status == EXIT_SOCKET_IN_USE else ''}); "
                                    f"the group member {said}:\n{second.log()[-2000:]}")
            assert time.monotonic() < deadline, second.log()[-2000:]
            time.sleep(0.1)
        assert said[-1] == {"opened": []}, said
        assert second.stop() == 0
    finally:
        taker.stdin.close()
        taker.wait(30)


# -- 2. signals ----------------------------------------------------------------------------------


def test_a_reload_signal_while_the_daemon_starts_does_not_end_it(daemon_factory):
    """SIGHUP asks for a reload (docs/operations.md), but the daemon installed its handler only
    once it listened: one that came while it imported, loaded or pinned its tables (seconds on
    a GPU node; `kill -HUP` after a table update, a reload sent to every instance) ended it
    with the signal's default action, no log line, and the socket's lock file left behind. A
    reload before the daemon serves has nothing to reload: it is ignored (with a warning once
    the daemon listens)."""
    daemon = daemon_factory(ready=False)
    lock = daemon.socket.with_name(daemon.socket.name + ".lock")
    wait_until(lambda: lock.exists() or daemon.proc.poll() is not None, timeout=120)
    sent, deadline = 0, time.monotonic() + 120
    while not (daemon.health(timeout=0.2) or {}).get("ready"):
        assert daemon.proc.poll() is None, \
            f"exit {daemon.proc.returncode} after {sent} SIGHUPs:\n{daemon.log()[-2000:]}"
        assert time.monotonic() < deadline, daemon.log()[-2000:]
        daemon.proc.send_signal(signal.SIGHUP)
        sent += 1
        time.sleep(0.02)
    assert sent > 0
    daemon.proc.send_signal(signal.SIGHUP)  # serving: a reload, of unchanged tables
    wait_until(lambda: "reload (asked by SIGHUP) unchanged" in daemon.log(), timeout=60)
    assert daemon.stop() == 0, daemon.log()[-2000:]
