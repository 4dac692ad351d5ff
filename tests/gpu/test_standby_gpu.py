"""A standby on the CUDA backend (server/standby_tables.py): the tables it pins while it waits
are let go of and pinned again when the serving daemon reloads, and at the takeover the daemon
serves GPU clients of both modes exact rows through the registration the standby made."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import point, reload, rows_match, wait_until
from reference import random_ids
from test_reload_gpu import CUDA, rows_of

from engramd.client import EngramClient

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STANDING_BY_S = 180.0  # imports and torch's EAGER CUDA start


def test_a_standby_pins_ahead_follows_a_reload_and_serves_through_its_pins(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path):
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    serving = daemon_factory(tables=current, extra=CUDA)
    standby = daemon_factory(tables=current, shm_dir=serving.shm_dir, start=False,
                             extra=[*CUDA, "--standby", "--socket", str(serving.socket)])
    standby.socket = serving.socket
    standby.start()
    wait_until(lambda: "mapped and pinned ahead" in standby.log(), timeout=STANDING_BY_S, step=0.05)
    ids = random_ids(np.random.default_rng(21), 96, reference.rows, reference.heads)
    clients = {mode: EngramClient(serving.socket, device="cuda", mode=mode, max_tokens=128,
                                  reconnect_timeout=120) for mode in ("served", "mapped")}
    try:
        for mode, client in clients.items():
            assert rows_match(rows_of(client, ids), reference, ids), mode
        point(current, second_checkpoint)
        status = reload(serving)
        assert (status["exit"], status["state"]) == (0, "done"), status
        # The standby unpins the replaced tables and pins the new ones.
        wait_until(lambda: standby.log().count("mapped and pinned ahead") == 2, timeout=60, step=0.05)
        assert "letting go of tables" in standby.log()
        serving.proc.kill()
        serving.proc.wait()
        standby.wait_ready()
        log = standby.log()
        assert "tables pinned ahead by the standby" in log, log
        assert "of host tables in" not in log.split("holding the lock")[1], "pinned again"
        for mode, client in clients.items():
            deadline = 200
            while not rows_match(rows := rows_of(client, ids), second_reference, ids):
                assert rows_match(rows, reference, ids), f"{mode}: rows of neither checkpoint"
                deadline -= 1
                assert deadline, f"{mode}: never read the reloaded tables"
    finally:
        for client in clients.values():
            client.close()
    assert standby.stop() == 0, standby.log()
    assert "Traceback" not in standby.log(), standby.log()
