"""A standby daemon (`engramd serve --standby`, server/standby.py) beside a serving one: two real
daemon processes on one socket and one shm folder, and a client process's view of the handover.

Covered: while it waits, the standby binds nothing and maps the tables ahead (server/
standby_tables.py) without changing a file, and the serving daemon goes on as before; when that
one dies (kill -9) or stops (SIGTERM, the upgrade path), the standby takes the socket, adopts
the tables it mapped (the same files) and serves exact rows to the client, which re-registers by
itself; a reload of the serving daemon makes the standby let go of the old tables and map the
new ones, which it then serves; it maps tables only once the serving daemon serves them; a standby stopped while it waits exits 0, and SIGHUP (a reload,
meant for the serving daemon) does not end it; under systemd it says READY=1 once it can take over fast.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import torch
from helpers import engramd_command, point, reload, wait_until
from reference import random_ids
from test_daemon_lookups import assert_rows_equal
from test_reload import mapped_names, table_files

from engramd.client import EngramClient
from engramd.client.shared.connection import probe
from engramd.server.standby_tables import WATCH_S
from engramd.server.table_loader import LOAD_DELAY_ENV

STANDING_BY_S = 120.0  # its imports on a loaded CI machine; the wait needs no more
# A replaced table is let go of at the standby's next look (WATCH_S); the margin is for a
# loaded CI machine.
LET_GO_S = 40 * WATCH_S
SERVING_STARTS_S = 25  # a serving daemon held back this long at its start (its tables' load)


def standby_for(daemon_factory, serving):
    """A standby on `serving`'s socket, tables and shm folder, with a log of its own."""
    standby = daemon_factory(shm_dir=serving.shm_dir, extra=["--standby", "--socket", str(serving.socket)],
                             start=False)
    standby.socket = serving.socket
    standby.start()
    wait_until(lambda: "standing by for" in standby.log(), timeout=STANDING_BY_S, step=0.05)
    return standby


def rows_of(client: EngramClient, ids: np.ndarray) -> np.ndarray:
    return client.lookup(torch.from_numpy(ids)).result().double().numpy()


def inodes(daemon) -> dict[str, int]:
    return {path.name: path.stat().st_ino for path in daemon.tables_dir.glob("*.tbl")}


def maps_exactly(standby, files: set[str]) -> bool:
    """Whether the standby maps `files` and no other table file of the instance."""
    return {n for n in mapped_names(standby.proc.pid) if n.endswith(".tbl")} == files


@pytest.mark.parametrize("end", ["kill", "sigterm"])
def test_a_standby_takes_over_when_the_serving_daemon_goes(daemon_factory, reference, end):
    serving = daemon_factory()
    ids = random_ids(np.random.default_rng(12), 24, reference.rows, reference.heads)
    with EngramClient(serving.socket, max_tokens=32, reconnect_timeout=60) as client:
        assert_rows_equal(rows_of(client, ids), reference.expected(ids), "before the standby")
        files = inodes(serving)
        standby = standby_for(daemon_factory, serving)
        # Waiting: nothing bound, the tables mapped ahead, no file changed, the serving daemon
        # untouched.
        wait_until(lambda: "mapped ahead" in standby.log(), timeout=LET_GO_S)  # said once done
        assert maps_exactly(standby, set(files))
        assert serving.health()["pid"] == serving.proc.pid
        assert "listening" not in standby.log()
        assert inodes(serving) == files
        assert_rows_equal(rows_of(client, ids), reference.expected(ids), "beside the standby")
        epoch = client.epoch
        if end == "kill":
            serving.proc.kill()
            serving.proc.wait()
        else:
            assert serving.stop() == 0
        standby.wait_ready()
        assert standby.health()["pid"] == standby.proc.pid
        assert standby.log().count("mapped ahead by the standby") == len(files), standby.log()
        assert inodes(serving) == files
        assert_rows_equal(rows_of(client, ids), reference.expected(ids), "after the takeover")
        assert client.epoch != epoch
    assert standby.stop() == 0, standby.log()


def test_a_standby_stopped_while_it_waits_exits_zero_and_sighup_does_not_end_it(daemon_factory):
    serving = daemon_factory()
    standby = standby_for(daemon_factory, serving)
    os.kill(standby.proc.pid, signal.SIGHUP)  # a reload sent to every engramd: not for it
    assert standby.stop() == 0, standby.log()
    assert "stopped while standing by" in standby.log()
    assert serving.health()["ready"] and serving.health()["pid"] == serving.proc.pid
    assert serving.stop() == 0


def test_a_standby_follows_a_reload_and_serves_the_new_tables(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path):
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    serving = daemon_factory(tables=current)
    old = set(table_files(serving))
    standby = daemon_factory(tables=current, shm_dir=serving.shm_dir,
                             extra=["--standby", "--socket", str(serving.socket)], start=False)
    standby.socket = serving.socket
    standby.start()
    wait_until(lambda: maps_exactly(standby, old), timeout=STANDING_BY_S)
    # Several of the watch's looks at the checkpoint, each reusing its open while its files stay
    # as they are: the symlink repointed next leaves the old revision's files untouched.
    time.sleep(4 * WATCH_S)
    point(current, second_checkpoint)
    status = reload(serving)
    assert (status["exit"], status["state"]) == (0, "done"), status
    new = set(table_files(serving))
    assert new and not new & old
    # The old files are gone from the folder; their memory goes once the standby lets go too.
    wait_until(lambda: maps_exactly(standby, new), timeout=LET_GO_S)
    assert "letting go of tables" in standby.log()
    ids = random_ids(np.random.default_rng(13), 24, reference.rows, reference.heads)
    serving.proc.kill()
    serving.proc.wait()
    standby.wait_ready()
    assert standby.log().count("mapped ahead by the standby") == len(new), standby.log()
    assert set(table_files(serving)) == new
    with EngramClient(standby.socket, max_tokens=32) as client:
        assert client.tables_id == status["tables"]
        assert_rows_equal(rows_of(client, ids), second_reference.expected(ids), "after the takeover")
    assert standby.stop() == 0, standby.log()


def test_a_standby_maps_the_tables_only_once_the_serving_daemon_serves_them(daemon_factory):
    """A standby's pin taken before the serving daemon's would keep the pages in 4 KiB (pinned
    pages cannot be collapsed into 2 MiB folios): complete files of a daemon that is still
    starting are left alone until its health says it serves them."""
    first = daemon_factory()
    files = set(table_files(first))
    assert first.stop() == 0  # the files stay, complete
    serving = daemon_factory(shm_dir=first.shm_dir, ready=False,
                             env={LOAD_DELAY_ENV: str(SERVING_STARTS_S)})
    # A standby that finds the socket free starts at once: the serving daemon takes it first.
    lock = serving.socket.with_name(serving.socket.name + ".lock")
    wait_until(lambda: lock.exists() and lock.read_text().strip() == str(serving.proc.pid),
               timeout=STANDING_BY_S, step=0.05)
    standby = standby_for(daemon_factory, serving)
    wait_until(lambda: "waiting for the serving daemon to serve tables" in standby.log(),
               timeout=STANDING_BY_S)
    assert not maps_exactly(standby, files) and maps_exactly(standby, set())
    health = serving.health()  # None: not answering yet (still importing)
    assert health is None or not health["ready"], "the serving daemon was ready before the check"
    serving.wait_ready()
    wait_until(lambda: maps_exactly(standby, files), timeout=LET_GO_S)
    assert standby.stop() == 0, standby.log()
    assert serving.stop() == 0


def test_systemd_sees_a_standby_ready_once_it_can_take_over_fast(daemon_factory, tmp_path):
    """Under Type=notify a standby says READY=1 once its tables are mapped ahead (so that
    `systemctl start` of a new instance returns when stopping the old one is safe and fast),
    says where it stands in STATUS=, and pets the watchdog while it waits; after the takeover
    the daemon's own READY=1 follows."""
    serving = daemon_factory()
    address = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(address)
    listener.settimeout(STANDING_BY_S)
    standby = daemon_factory(shm_dir=serving.shm_dir, extra=["--standby", "--socket", str(serving.socket)],
                             start=False, env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"})
    standby.socket = serving.socket
    standby.start()
    messages = [listener.recv(4096).decode()]
    while not messages[-1].startswith("READY=1"):
        messages.append(listener.recv(4096).decode())
    assert messages[0] == "STATUS=standby: starting ahead", messages
    assert "mapped ahead; takes over" in messages[-1] and f"MAINPID={standby.proc.pid}" in messages[-1]
    assert "listening" not in standby.log() and serving.health()["pid"] == serving.proc.pid
    pets = 0
    while pets < 3:  # every 0.2 s (half WATCHDOG_USEC) while it waits
        pets += listener.recv(4096).decode() == "WATCHDOG=1"
    assert serving.stop() == 0
    while not messages[-1].startswith("READY=1") or "standby" in messages[-1]:
        messages.append(listener.recv(4096).decode())
    assert "ready: cpu backend" in messages[-1], messages[-1]
    assert standby.health()["pid"] == standby.proc.pid
    assert standby.stop() == 0, standby.log()
    listener.close()


def test_a_standby_on_a_free_socket_starts_at_once_as_a_plain_start(daemon_factory):
    """Every instance of engramd@.service runs --standby; the first one on a node (or one
    restarted alone) must start as engramd.service does, its tables' pin beside its imports,
    not after them."""
    daemon = daemon_factory(extra=["--standby"])
    assert daemon.health()["ready"]
    log = daemon.log()
    assert "is free; starting at once" in log and "standing by" not in log, log
    assert "daemon modules and CUDA ready" not in log and "standby: daemon modules" not in log
    assert daemon.stop() == 0


def test_a_drain_returns_once_a_standby_has_taken_over(daemon_factory):
    """`engramd drain` waits for the daemon it drained to exit. With a standby on the socket, the
    socket is gone only for the moment between the two: the drain also counts another daemon's
    answer there as the exit, and names it (tests/test_cli_drain.py covers each answer)."""
    serving = daemon_factory()
    standby = standby_for(daemon_factory, serving)
    drained_epoch = probe(serving.socket, "health", 10.0).epoch
    drain = subprocess.run([*engramd_command(), "drain", "--socket", str(serving.socket), "--json",
                            "--wait", "120"], capture_output=True, text=True, timeout=180)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    assert serving.proc.wait(60) == 0, serving.log()
    standby.wait_ready()
    answer = json.loads(drain.stdout)
    assert answer["drained"] and answer["epoch"] == drained_epoch
    standby_epoch = probe(standby.socket, "health", 10.0).epoch
    assert standby_epoch != drained_epoch and answer["serving_now"] in (None, standby_epoch)
    assert standby.stop() == 0, standby.log()
