"""A reload on the CUDA backend (server/cuda_backend.py replace_tables): the switch in each GPU
worker's order, a new hot-row cache, the old tables unregistered only after the gathers that
read them, and mapped GPU clients re-mapping on their own stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import point, reload, rows_match, wait_until
from reference import random_ids

from engramd.client import EngramClient
from engramd.client.errors import TablesChangedError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = ["--backend", "cuda", "--hot-cache-gib", "0.25", "--hot-cache-refresh-ms", "5"]


def rows_of(client: EngramClient, ids: np.ndarray) -> np.ndarray:
    rows = client.lookup(torch.from_numpy(ids).cuda()).wait()
    torch.cuda.current_stream().synchronize()
    return rows.double().cpu().numpy()


def test_served_and_mapped_gpu_clients_across_a_reload(daemon_factory, demo_checkpoint, reference,
                                                       second_checkpoint, second_reference, tmp_path):
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current, extra=CUDA)
    rng = np.random.default_rng(11)
    hot = random_ids(rng, 64, reference.rows, reference.heads, dead=0.0, out_of_range=0.0)
    ids = np.concatenate([hot] * 4)  # repeated rows: the hot-row cache takes them in
    clients = {mode: EngramClient(daemon.socket, device="cuda", mode=mode, max_tokens=256)
               for mode in ("served", "mapped")}
    pinned = EngramClient(daemon.socket, device="cuda", mode="served", max_tokens=256, pin_tables=True)
    try:
        for _ in range(50):  # long enough for the keeper to admit rows of the old tables
            for client in (*clients.values(), pinned):
                assert rows_match(rows_of(client, ids), reference, ids), client.mode
        point(current, second_checkpoint)
        status = reload(daemon)
        assert (status["exit"], status["state"]) == (0, "done"), status
        for _ in range(50):  # never an old row, from the tables or from the cache
            assert rows_match(rows_of(clients["served"], ids), second_reference, ids), "served"
        for _ in range(200):
            rows = rows_of(clients["mapped"], ids)
            assert rows_match(rows, reference, ids) or rows_match(rows, second_reference, ids)
            if rows_match(rows, second_reference, ids):
                break
        else:
            raise AssertionError("the mapped client never re-mapped")
        with pytest.raises(TablesChangedError):
            rows_of(pinned, ids)
    finally:
        for client in (*clients.values(), pinned):
            client.close()
    assert daemon.stop() == 0, daemon.log()


def test_a_gather_in_flight_across_the_switch_reads_the_old_tables(daemon_factory, demo_checkpoint,
                                                                   reference, second_checkpoint,
                                                                   second_reference, tmp_path):
    """Every gather waits 3 s on the GPU first: the lookup submitted before the reload is still
    queued on its daemon stream when the switch happens, so the old tables must stay registered
    (an early unregister faults the kernel) and its rows are the old ones; the next one's new."""
    current = tmp_path / "current"
    point(current, demo_checkpoint)
    daemon = daemon_factory(tables=current, extra=CUDA, env={"ENGRAMD_DEBUG_GATHER_DELAY_MS": "3000"})
    ids = random_ids(np.random.default_rng(12), 32, reference.rows, reference.heads)
    with EngramClient(daemon.socket, device="cuda", mode="served", max_tokens=32, slots=2) as client:
        before = client.lookup(torch.from_numpy(ids).cuda())
        point(current, second_checkpoint)
        status = reload(daemon)
        assert (status["exit"], status["state"]) == (0, "done"), status
        after = client.lookup(torch.from_numpy(ids).cuda())
        old_rows, new_rows = before.result(copy=True), after.result(copy=True)
        assert rows_match(old_rows.double().cpu().numpy(), reference, ids)
        assert rows_match(new_rows.double().cpu().numpy(), second_reference, ids)
    wait_until(lambda: "the replaced tables are unregistered" in daemon.log(), timeout=30)
    assert daemon.stop() == 0, daemon.log()
