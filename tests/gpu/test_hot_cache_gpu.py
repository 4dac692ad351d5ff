"""The hot-row cache on a GPU: gathers stay exact while the keeper changes ways under them.

Two streams gather skewed IDs (with and without dedupe) from a pinned host table through UVA
while a CacheKeeper refreshes every few milliseconds; every output is compared bit for bit
with the plain-torch reference on the CPU, and every resident slot with its table row.
"""

from __future__ import annotations

import time

import pytest
import torch
from reference import assert_same

from engramd.client.geometry import DEAD_ID, TableGeometry
from engramd.client.shared import cuda
from engramd.kernels import gather_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from engramd.client.shared.cache_keeper import CacheKeeper  # noqa: E402
from engramd.kernels import hot_cache  # noqa: E402
from engramd.kernels.gather_triton import GatherPlan  # noqa: E402

TOKENS = 256


@pytest.fixture(scope="module")
def world():
    geo = TableGeometry.from_config({
        "engram_layer_ids": [1, 14], "engram_max_ngram_size": 3, "engram_n_heads": 24,
        "engram_head_dim": 256, "engram_vocab_size": 4000, "engram_compressed_vocab_size": 100,
        "engram_pad_token_id": 2}, source="GPU cache test geometry")
    gen = torch.Generator().manual_seed(0)
    host = [torch.randint(0, 256, (rows, geo.row_bytes), dtype=torch.uint8, generator=gen).pin_memory()
            for rows in geo.rows]
    uva = [cuda.tensor_view(t.data_ptr(), t.numel(), torch.device("cuda", 0)).view(t.shape)
           for t in host]
    return geo, host, uva


def skewed_ids(geo: TableGeometry, gen: torch.Generator) -> torch.Tensor:
    """Mostly a few hundred hot rows per layer, some cold ones, some DEAD."""
    rows = torch.tensor(geo.rows).view(1, -1, 1)
    hot = (torch.rand((TOKENS, geo.n_layers, geo.heads), generator=gen) ** 6 * rows).long()
    cold = (torch.rand((TOKENS, geo.n_layers, geo.heads), generator=gen) * rows).long()
    pick = torch.rand(hot.shape, generator=gen)
    ids = torch.where(pick < 0.8, hot, cold)
    return torch.where(pick > 0.97, DEAD_ID, ids)


def test_gathers_stay_exact_while_the_keeper_refreshes(world):
    geo, host, uva = world
    device = torch.device("cuda", 0)
    layout = hot_cache.CacheLayout.from_budget(24 << 20, geo.row_bytes)
    cache = hot_cache.HotCache(layout, geo.n_layers, device)
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    keeper = CacheKeeper(cache, uva, gather_streams=lambda: streams, interval=0.002,
                         age_rows=200_000).start()
    plan = GatherPlan(host, geo.shard(0, 1), device)
    plan.warm_up(caches=[cache])  # every dedupe and sort variant
    gen = torch.Generator().manual_seed(1)
    try:
        for round_ in range(12):
            batch = []
            for i in range(20):
                ids = skewed_ids(geo, gen)
                stream = streams[i % 2]
                with torch.cuda.stream(stream):
                    on_gpu = ids.to(device, non_blocking=False)
                    out = plan(on_gpu, stream=stream, cache=cache, dedupe=i % 4 == 0, sort=i % 3 == 0)
                batch.append((ids, out))
            torch.cuda.synchronize()
            for k, (ids, out) in enumerate(batch):
                want, _ = gather_ref.gather(host, ids, geo.shard(0, 1))
                assert_same(out.cpu(), want, f"round {round_} lookup {k}")
    finally:
        keeper.close()
    stats = keeper.stats
    keeper.refresh()
    assert stats.refreshes > 10 and stats.admitted > 0, stats
    assert sum(stats.hits) > 0.3 * sum(stats.reads), f"skewed traffic should hit: {stats}"
    keys = cache.keys.view(-1).cpu()
    pool = cache.pool.cpu()
    for slot in (keys != hot_cache.EMPTY_KEY).nonzero().view(-1).tolist():
        layer, row = int(hot_cache.key_layers(keys[slot])), int(hot_cache.key_rows(keys[slot]))
        assert torch.equal(pool[slot], host[layer][row]), f"slot {slot}: not the row of its key"


def test_uniform_traffic_admits_almost_nothing(world):
    geo, host, uva = world
    device = torch.device("cuda", 0)
    layout = hot_cache.CacheLayout.from_budget(24 << 20, geo.row_bytes)
    cache = hot_cache.HotCache(layout, geo.n_layers, device)
    keeper = CacheKeeper(cache, uva, gather_streams=lambda: [torch.cuda.current_stream()])
    plan = GatherPlan(host, geo.shard(0, 1), device)
    rows = torch.tensor(geo.rows, device=device).view(1, -1, 1)
    reads = 0
    for _ in range(8):  # fewer reads than rows: each row about once
        ids = (torch.rand((64, geo.n_layers, geo.heads), device=device) * rows).long()
        plan(ids, cache=cache)
        reads += ids.numel()
        keeper.refresh()
    assert keeper.stats.admitted <= 0.01 * reads, keeper.stats


def test_a_refresh_waiting_for_the_device_sleeps_instead_of_spinning(world):
    """A refresh waits for its copies of the counters behind whatever its stream holds (here
    a kernel that sleeps about 0.5 s; the log is empty, so that copy is the refresh's only
    wait): its thread sleeps through the wait instead of spinning a core."""
    geo, host, uva = world
    device = torch.device("cuda", 0)
    cache = hot_cache.HotCache(hot_cache.CacheLayout.from_budget(24 << 20, geo.row_bytes),
                               geo.n_layers, device)
    keeper = CacheKeeper(cache, uva, gather_streams=list)
    for _ in range(2):
        with torch.cuda.stream(keeper.stream):
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s at 2 GHz
        wall, cpu = time.perf_counter(), time.thread_time()
        keeper.refresh()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        assert wall > 0.25, f"the refresh did not wait for its stream ({wall:.3f} s)"
        assert cpu < 0.2 * wall, f"{cpu:.3f} s of CPU in a wait of {wall:.3f} s: it spins"


def test_a_refresh_that_admits_rows_never_waits_for_the_device_spinning(world):
    """A refresh that chooses and admits rows makes no call that waits for the device
    implicitly (torch's sync debug mode raises on each: unique, nonzero, boolean indexing,
    .item(), a copy through pageable memory), each of which would spin a core until the
    device got to it; its waits are its own events', which sleep."""
    geo, host, uva = world
    device = torch.device("cuda", 0)
    cache = hot_cache.HotCache(hot_cache.CacheLayout.from_budget(24 << 20, geo.row_bytes),
                               geo.n_layers, device)
    keeper = CacheKeeper(cache, uva, gather_streams=lambda: [torch.cuda.current_stream()])
    plan = GatherPlan(host, geo.shard(0, 1), device)
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):  # hot rows pass admit_min and are logged
        plan(skewed_ids(geo, gen).to(device), cache=cache)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        admitted = keeper.refresh()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert admitted > 0, keeper.report()
    keys = cache.keys.view(-1).cpu()
    for slot in (keys != hot_cache.EMPTY_KEY).nonzero().view(-1).tolist():
        layer, row = int(hot_cache.key_layers(keys[slot])), int(hot_cache.key_rows(keys[slot]))
        assert torch.equal(cache.pool[slot].cpu(), host[layer][row]), f"slot {slot}: not its key's row"
