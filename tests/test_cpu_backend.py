"""The CPU backend's table switch (a reload): lookups read the tables they were submitted with,
and the replaced tables are let go of only once the last lookup that reads them is done."""

from __future__ import annotations

import threading

import numpy as np
import torch

from engramd.client.geometry import TableGeometry
from engramd.client.shared.slab import SlabLayout
from engramd.server.backend import LookupJob
from engramd.server.cpu_backend import CpuBackend, MemfdSlab

HANG_S = 120.0  # waits for a gather of a few tokens: only a hang lasts this long


class Table:
    """What replace_tables takes (a HostTable's `tensor`)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class GatedSlab(MemfdSlab):
    """A slab whose first gather waits at `gate`: a lookup held in flight by the test."""

    def __init__(self, layout: SlabLayout):
        super().__init__("test-slab", layout)
        self.gate, self.entered = threading.Event(), threading.Event()

    def rows(self, slot: int, tokens: int) -> torch.Tensor:
        if not self.entered.is_set():
            self.entered.set()
            assert self.gate.wait(10), "the test never opened the gate"
        return super().rows(slot, tokens)


def tables_of(geometry: TableGeometry, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 120, (rows, geometry.row_bytes), dtype=torch.uint8, generator=gen)
            for rows in geometry.rows]  # FP8 bytes below 0x78 and scales near 1: finite rows


def test_a_lookup_in_flight_reads_the_tables_it_was_submitted_with():
    from engramd.kernels.gather_ref import gather

    geometry = TableGeometry.named("demo")
    old, new = tables_of(geometry, 1), tables_of(geometry, 2)
    backend = CpuBackend(old, geometry, workers=1)
    shard = geometry.shard(0, 1)
    layout = SlabLayout(slots=2, max_tokens=8, n_layers=geometry.n_layers, heads=geometry.heads,
                        local_heads=shard.local_heads, head_dim=geometry.head_dim)
    slab = GatedSlab(layout)
    ids = np.stack([np.arange(8)[:, None].repeat(geometry.heads, 1) * 7 % r for r in geometry.rows], axis=1)
    finished: list[int] = []
    retired = threading.Event()
    try:
        for slot in (0, 1):
            slab.ids(slot, 8, torch.int64).copy_(torch.from_numpy(ids))
        done = threading.Semaphore(0)

        def complete(job: LookupJob) -> None:
            assert job.error is None, job.error
            finished.append(job.slot)
            done.release()

        backend.submit(LookupJob(0, slab, shard, 0, 1, 8), complete)  # held at the gate
        assert slab.entered.wait(10)
        backend.replace_tables([Table(t) for t in new], None, retired.set)
        backend.submit(LookupJob(0, slab, shard, 1, 1, 8), complete)  # behind it, on the new ones
        assert not retired.wait(0.2), "retired while a lookup still reads the old tables"
        slab.gate.set()
        assert done.acquire(timeout=10) and done.acquire(timeout=10)
        assert retired.wait(10) and backend.tables[0] is new[0]
        for slot, tables in ((0, old), (1, new)):
            expected = gather(tables, torch.from_numpy(ids), shard)[0]
            assert torch.equal(slab.rows(slot, 8).view(torch.int16), expected.view(torch.int16)), slot
    finally:
        slab.gate.set()
        backend.close()
        slab.close()


def test_gathering_is_true_from_submit_until_the_lookup_is_done():
    geometry = TableGeometry.named("demo")
    backend = CpuBackend(tables_of(geometry, 1), geometry, workers=1)
    shard = geometry.shard(0, 1)
    layout = SlabLayout(slots=1, max_tokens=8, n_layers=geometry.n_layers, heads=geometry.heads,
                        local_heads=shard.local_heads, head_dim=geometry.head_dim)
    slab = GatedSlab(layout)
    done = threading.Event()
    try:
        assert not backend.gathering
        backend.submit(LookupJob(0, slab, shard, 0, 1, 8), lambda job: done.set())
        assert backend.gathering  # queued or held at the gate
        assert slab.entered.wait(10)
        assert backend.gathering and not done.is_set()
        slab.gate.set()
        assert done.wait(10)
        assert not backend.gathering
    finally:
        slab.gate.set()
        backend.close()


def test_long_lookups_go_in_pieces_short_ones_whole_and_rows_match_the_reference():
    from engramd.kernels.gather_ref import gather
    from engramd.server.cpu_backend import PIECE_TOKENS, WHOLE_TOKENS

    geometry = TableGeometry.named("demo")
    tables = tables_of(geometry, 3)
    backend = CpuBackend(tables, geometry, workers=2)
    shard = geometry.shard(0, 1)
    long = 165
    layout = SlabLayout(slots=2, max_tokens=long, n_layers=geometry.n_layers, heads=geometry.heads,
                        local_heads=shard.local_heads, head_dim=geometry.head_dim)
    slab = MemfdSlab("test-slab", layout)
    rng = np.random.default_rng(4)
    try:
        assert (WHOLE_TOKENS, PIECE_TOKENS) == (128, 32)  # the counts below are for these
        for tokens, pieces in ((1, 1), (128, 1), (129, 5), (long, 6)):
            ids = np.stack([rng.integers(0, r, size=(tokens, geometry.heads)) for r in geometry.rows], axis=1)
            slab.ids(0, tokens, torch.int64).copy_(torch.from_numpy(ids))
            job = LookupJob(0, slab, shard, 0, 1, tokens)
            planned = backend._pieces(job, lambda job: None)
            assert [(start, stop) for _, start, stop in planned][-1][1] == tokens
            assert len(planned) == pieces
            backend._let_go(planned[0][0].tables)  # planned only, never queued
            done = threading.Event()
            backend.submit(LookupJob(0, slab, shard, 0, 2, tokens), lambda job, done=done: done.set())
            assert done.wait(30)
            expected = gather(tables, torch.from_numpy(ids), shard)[0]
            assert torch.equal(slab.rows(0, tokens).view(torch.int16), expected.view(torch.int16)), tokens
        assert not backend.gathering
    finally:
        slab.close()
        backend.close()


def test_a_retired_clients_lookups_not_begun_are_dropped_and_the_others_served():
    """What a client that is gone had queued is completed as skipped (no rows written, nobody
    reads them), so its slab can be freed once the piece running ends; another client's lookup
    behind them is served, rows exact."""
    from engramd.kernels.gather_ref import gather
    from engramd.server.cpu_backend import PIECE_TOKENS

    geometry = TableGeometry.named("demo")
    tables = tables_of(geometry, 5)
    backend = CpuBackend(tables, geometry, workers=1)
    shard = geometry.shard(0, 1)
    long = 8 * PIECE_TOKENS  # in pieces: the first held at the gate, 7 queued
    layout = SlabLayout(slots=2, max_tokens=long, n_layers=geometry.n_layers, heads=geometry.heads,
                        local_heads=shard.local_heads, head_dim=geometry.head_dim)
    gone, live = GatedSlab(layout), MemfdSlab("test-live", layout)
    rng = np.random.default_rng(6)
    ids = np.stack([rng.integers(0, r, size=(long, geometry.heads)) for r in geometry.rows], axis=1)
    finished: dict[tuple[int, int], LookupJob] = {}
    all_done = threading.Semaphore(0)

    def complete(job: LookupJob) -> None:
        finished[job.client_id, job.slot] = job
        all_done.release()

    try:
        for slab in (gone, live):
            for slot in (0, 1):
                slab.ids(slot, long, torch.int64).copy_(torch.from_numpy(ids))
        backend.submit(LookupJob(1, gone, shard, 0, 1, long), complete)  # its first piece held
        assert gone.entered.wait(HANG_S)
        backend.submit(LookupJob(1, gone, shard, 1, 1, 16), complete)  # whole, queued
        backend.submit(LookupJob(2, live, shard, 0, 1, 16), complete)  # another client's
        assert backend.drop_queued(1) == 2
        # The whole one completed within drop_queued, on this thread; the pieced one's piece runs.
        assert all_done.acquire(blocking=False)
        assert list(finished) == [(1, 1)] and finished[1, 1].skip and finished[1, 1].context.silent
        gone.gate.set()
        assert all_done.acquire(timeout=HANG_S) and all_done.acquire(timeout=HANG_S)
        assert finished[1, 0].skip and finished[1, 0].context.silent  # done when its piece ended
        assert not finished[2, 0].skip and not finished[2, 0].context.silent
        assert finished[2, 0].error is None
        rows = MemfdSlab.rows(gone, 0, long).view(torch.int16)
        assert not rows[:, PIECE_TOKENS:].any(), "a dropped piece wrote rows"
        assert not MemfdSlab.rows(gone, 1, 16).view(torch.int16).any(), "a dropped lookup wrote rows"
        expected = gather(tables, torch.from_numpy(ids[:16]), shard)[0]
        assert torch.equal(live.rows(0, 16).view(torch.int16), expected.view(torch.int16))
        assert not backend.gathering and backend.drop_queued(1) == 0
    finally:
        gone.gate.set()
        live.close()
        backend.close()
