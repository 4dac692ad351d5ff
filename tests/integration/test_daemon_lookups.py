"""The real daemon, on a real socket, driven by separate client processes; rows checked exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_client_processes
from reference import bucket_ids

from engramd.client import BadIdsError, EngramClient, NotRegisteredError

WORKER = Path(__file__).parent / "client_worker.py"


def assert_rows_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    wrong = np.argwhere(~((actual == expected) | (np.isnan(actual) & np.isnan(expected))))
    assert wrong.size == 0, f"{what}: {len(wrong)} wrong values, first at {wrong[:5].tolist()}"


def check_worker_output(path: Path, reference, rank: int, shards: int) -> int:
    data = np.load(path)
    n = sum(1 for k in data.files if k.startswith("ids"))
    assert n > 0
    for i in range(n):
        ids, rows = data[f"ids{i}"], data[f"rows{i}"]
        assert_rows_equal(rows.astype(np.float64), reference.expected(ids, rank, shards),
                          f"{path.name} lookup {i} (tp {rank}/{shards})")
    return n


@pytest.mark.parametrize("shards", [1, 2, 4, 7])
def test_concurrent_client_processes_get_exact_rows(daemon_factory, reference, tmp_path, shards):
    daemon = daemon_factory()
    ranks = list(range(shards)) if shards > 1 else [0, 0, 0]
    commands = []
    for i, rank in enumerate(ranks):
        out = tmp_path / f"client{i}.npz"
        commands.append([sys.executable, str(WORKER), "--socket", str(daemon.socket), "--out", str(out),
                         "--tp-rank", str(rank), "--tp-size", str(shards), "--seed", str(100 + i),
                         "--tokens", "1", "16", "256", "--rounds", "2",
                         "--dtype", "int32" if i % 2 else "int64"])
    run_client_processes(commands)
    total = sum(check_worker_output(tmp_path / f"client{i}.npz", reference, rank, shards)
                for i, rank in enumerate(ranks))
    assert total == 6 * len(ranks)
    assert daemon.stop() == 0


def test_tp_shards_concatenate_to_the_full_rows(daemon_factory, reference):
    """All-gathered over TP ranks, the shards' heads equal the unsharded lookup."""
    daemon = daemon_factory()
    rng = np.random.default_rng(5)
    ids = bucket_ids(rng, 33, reference.bucket_sizes)
    ids[rng.random(ids.shape) < 0.1] = -1
    ids = torch.from_numpy(ids)
    with EngramClient(daemon.socket) as full_client:
        full = full_client.lookup(ids).result(copy=True)
    wrong = np.argwhere(full.float().numpy().astype(np.float64) != reference.expected(ids.numpy()))
    assert wrong.size == 0, f"unsharded rows differ from the reference at {wrong[:5].tolist()}"
    for shards in (2, 4, 5):
        parts = []
        for rank in range(shards):
            with EngramClient(daemon.socket, tp_rank=rank, tp_size=shards) as client:
                parts.append(client.lookup(ids).result(copy=True))
        gathered = torch.cat(parts, dim=2)[:, :, :reference.heads]
        assert full.abs().sum() > 0 and torch.equal(gathered, full), f"tp {shards}"
        padded = torch.cat(parts, dim=2)[:, :, reference.heads:]
        assert not padded.any(), "padded heads must be zero"


def test_out_of_range_ids_are_zero_and_counted(daemon_factory, reference):
    daemon = daemon_factory()
    ids = np.zeros((4, 2, reference.heads), dtype=np.int64)
    ids[0] = -1
    ids[1] = max(reference.rows) + 5
    ids[2] = 2**40
    ids[3, :, 0] = -3
    with EngramClient(daemon.socket) as client:
        future = client.lookup(torch.from_numpy(ids))
        rows = future.result()
        assert not rows[:, :3].any()
        assert not rows[:, 3, 0].any()
        expected_oor = 2 * reference.heads * 2 + 2  # rows 1 and 2 of both layers, -3 in two layers
        assert future.out_of_range == expected_oor
        stats = client.stats()
    assert stats["out_of_range"] == expected_oor
    assert stats["lookups"] == 1 and stats["rows"] == 4 * 2 * reference.heads


def test_client_side_validation_and_release(daemon_factory, reference):
    daemon = daemon_factory()
    client = EngramClient(daemon.socket, max_tokens=8)
    with pytest.raises(BadIdsError, match="int32 or int64"):
        client.lookup(torch.zeros((2, 2, 24), dtype=torch.float32))
    with pytest.raises(BadIdsError, match=r"shape \[T, 2, 24\]"):
        client.lookup(torch.zeros((2, 24), dtype=torch.int64))
    with pytest.raises(BadIdsError, match="registered 1..8"):
        client.lookup(torch.zeros((9, 2, 24), dtype=torch.int64))
    client_id = client.client_id
    conn = client._conn
    client._conn = None  # keep the socket open to try a lookup after release
    conn.watch_daemon(lambda: None)  # the released lease closes: ask the daemon all the same
    conn.call("release", 5.0, client_id=client_id)
    with pytest.raises(NotRegisteredError):
        conn.call("lookup", 5.0, [b"\x00" * 4 * 48], client_id=client_id, slot=0, seq=1, tokens=1,
                  ids_dtype="int32", ids_shape=[1, 2, 24], inline=True)
    conn.close()
    client.client_id = None
    client.close()
