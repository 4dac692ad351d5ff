"""A standby daemon (`engramd serve --standby`, server/standby.py) beside a serving one: two real
daemon processes on one socket and one shm folder, and a client process's view of the handover.

Covered: while it waits, the standby binds nothing and maps no table, and the serving daemon goes
on as before; when that one dies (kill -9) or stops (SIGTERM, the upgrade path), the standby
takes the socket, re-attaches the same tables and serves exact rows to the client, which
re-registers by itself; a standby stopped while it waits exits 0, and SIGHUP (a reload, meant for
the serving daemon) does not end it.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from conftest import wait_until
from reference import random_ids
from test_daemon_lookups import assert_rows_equal
from test_reload import mapped_names, table_files

from engramd.client import EngramClient

STANDING_BY_S = 120.0  # its imports on a loaded CI machine; the wait needs no more


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


@pytest.mark.parametrize("end", ["kill", "sigterm"])
def test_a_standby_takes_over_when_the_serving_daemon_goes(daemon_factory, reference, end):
    serving = daemon_factory()
    ids = random_ids(np.random.default_rng(12), 24, reference.rows, reference.heads)
    with EngramClient(serving.socket, max_tokens=32, reconnect_timeout=60) as client:
        assert_rows_equal(rows_of(client, ids), reference.expected(ids), "before the standby")
        files = {path.name: path.stat().st_ino for path in serving.tables_dir.glob("*.tbl")}
        standby = standby_for(daemon_factory, serving)
        # Waiting: nothing bound, no table mapped, the serving daemon untouched.
        assert serving.health()["pid"] == serving.proc.pid
        assert "listening" not in standby.log()
        assert not mapped_names(standby.proc.pid) & table_files(serving)
        assert_rows_equal(rows_of(client, ids), reference.expected(ids), "beside the standby")
        epoch = client.epoch
        if end == "kill":
            serving.proc.kill()
            serving.proc.wait()
        else:
            assert serving.stop() == 0
        standby.wait_ready()
        assert standby.health()["pid"] == standby.proc.pid
        assert "re-attached" in standby.log(), "the tables were loaded again"
        assert {path.name: path.stat().st_ino for path in serving.tables_dir.glob("*.tbl")} == files
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
