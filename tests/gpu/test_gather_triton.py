"""The compiled Triton gather kernel on a GPU, bit for bit against the plain-torch reference.

The reference runs on CPU copies of the same tables and IDs (it is itself checked against float64
oracles in tests/test_gather_ref.py). BF16 NaN is compared by position, every other bit exactly.
Covers random, repeated, sorted, DEAD, out-of-range and boundary IDs, int32/int64, every rank of
1, 2, 4, 5 and 7 shards, several T and grid sizes, packed output, slab-slot outputs, a side
stream, tables in pinned host memory read through UVA, and row offsets past 2^31 bytes.
"""

from __future__ import annotations

import pytest
import torch
from reference import assert_same, record_launches

from engramd.client.geometry import DEAD_ID, ShardView, TableGeometry
from engramd.kernels import gather_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("triton")

from engramd.kernels import gather_triton as gt  # noqa: E402  (after the skip checks)

if gt._kernel_is_interpreted():
    pytest.skip("TRITON_INTERPRET=1: the interpreter is covered by "
                "tests/test_gather_triton_interp.py", allow_module_level=True)

SHARD_COUNTS = (1, 2, 4, 5, 7)
TOKENS = (1, 16, 256, 4097)
CUDA = torch.device("cuda", 0) if torch.cuda.is_available() else None


# ---------------------------------------------------------------- helpers


class _CudaArray:
    """Device-visible memory at `address`, described by the CUDA Array Interface (v3).

    `owner` rides along so that the memory outlives the torch tensor made from this object
    (torch keeps the interface object alive for as long as the tensor lives).
    """

    def __init__(self, address: int, shape: tuple[int, ...], owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": "|u1", "data": (address, False),
            "strides": None, "version": 3,
        }


def uva_view(pinned: torch.Tensor) -> torch.Tensor:
    """A CUDA uint8 tensor over pinned host memory: under UVA the host address is the device one."""
    assert pinned.is_pinned() and pinned.dtype == torch.uint8 and pinned.is_contiguous()
    view = torch.as_tensor(_CudaArray(pinned.data_ptr(), tuple(pinned.shape), pinned),
                           device=CUDA)
    assert view.is_cuda and view.data_ptr() == pinned.data_ptr()
    return view


def mixed_ids(geo: TableGeometry, tokens: int, seed: int) -> torch.Tensor:
    """[T, L, H] int64: own-bucket rows, any rows (other shards'), DEAD, >= rows, negatives,
    huge values; repeated tokens and one sorted column."""
    gen = torch.Generator().manual_seed(seed)
    shape = (tokens, geo.n_layers, geo.heads)
    ids = torch.empty(shape, dtype=torch.int64)
    for layer in range(geo.n_layers):
        offsets = torch.tensor(geo.offsets[layer])
        primes = torch.tensor(geo.primes[layer])
        own = offsets + (torch.rand(tokens, geo.heads, generator=gen) * primes).long()
        ids[:, layer] = own
        anywhere = torch.randint(0, geo.rows[layer], (tokens, geo.heads), generator=gen)
        pick = torch.rand(tokens, geo.heads, generator=gen)
        ids[:, layer] = torch.where(pick < 0.25, anywhere, ids[:, layer])
        beyond = geo.rows[layer] + torch.randint(0, 4, (tokens, geo.heads), generator=gen)
        ids[:, layer] = torch.where((pick > 0.8) & (pick < 0.85), beyond, ids[:, layer])
    pick = torch.rand(shape, generator=gen)
    ids[pick > 0.9] = DEAD_ID
    ids[(pick > 0.85) & (pick <= 0.87)] = -7
    ids[(pick > 0.87) & (pick <= 0.88)] = 2**31 + 3
    ids[(pick > 0.88) & (pick <= 0.89)] = -(2**31)
    ids[1::3] = ids[0]
    ids[:, :, 2] = ids[:, :, 2].sort(dim=0).values
    return ids


def with_boundaries(ids: torch.Tensor, shard: ShardView) -> torch.Tensor:
    """Set the last token's owned heads to lo - 1, lo, hi - 1, hi of each layer's range."""
    ids = ids.clone()
    for layer, (lo, hi) in enumerate(shard.row_ranges):
        for k, head in enumerate(range(shard.head_start, shard.head_end)):
            ids[-1, layer, head] = (lo - 1, lo, hi - 1, hi)[k % 4]
    return ids


def reference(tables_cpu, ids: torch.Tensor, shard: ShardView, packed=False):
    return gather_ref.gather(tables_cpu, ids.cpu(), shard, packed=packed)


@pytest.fixture(scope="module")
def world():
    """The demo geometry (24 heads x 256, ~14-18 K rows a layer) with random tables on the GPU."""
    geo = TableGeometry.named("demo")
    gen = torch.Generator().manual_seed(11)
    tables_cpu = [torch.randint(0, 256, (rows, geo.row_bytes), dtype=torch.uint8, generator=gen)
                  for rows in geo.rows]
    tables_gpu = [t.to(CUDA) for t in tables_cpu]
    return geo, tables_cpu, tables_gpu


# ---------------------------------------------------------------- tests


def test_dequantizes_every_pattern_like_the_reference():
    table = torch.empty(256, 264, dtype=torch.uint8)
    table[:, :256] = torch.arange(256, dtype=torch.uint8)  # every E4M3 byte, NaN included
    table[:, 256:] = torch.arange(256, dtype=torch.uint8)[:, None]  # under every scale byte
    ids = torch.arange(256, dtype=torch.int32).reshape(32, 1, 8)
    shard = ShardView(0, 1, 0, 8, 8, ((0, 256),))
    out = gt.GatherPlan([table.to(CUDA)], shard)(ids.to(CUDA))
    want = gather_ref.dequantize_rows(table, 256).reshape(1, 32, 8, 256)
    assert_same(out, want, "every E4M3 byte x every scale byte")


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shards", SHARD_COUNTS)
def test_matches_reference_for_every_rank(world, shards, tokens):
    geo, tables_cpu, tables_gpu = world
    for rank in range(shards):
        shard = geo.shard(rank, shards)
        ids = with_boundaries(mixed_ids(geo, tokens, seed=1000 * shards + tokens + rank), shard)
        want, bad = reference(tables_cpu, ids, shard)
        want_packed, _ = reference(tables_cpu, ids, shard, packed=True)
        plan = gt.GatherPlan(tables_gpu, shard)
        for dtype in (torch.int32, torch.int64):
            ids_gpu = ids.clamp(-(2**31), 2**31 - 1).to(dtype).to(CUDA)
            counter = torch.zeros(1, dtype=torch.int64, device=CUDA)
            where = f"shard {rank}/{shards}, T={tokens}, {dtype}"
            assert_same(plan(ids_gpu, out_of_range=counter), want, where)
            assert counter.item() == bad, where
            assert_same(plan(ids_gpu, packed=True), want_packed, f"packed {where}")


def test_sorted_ids(world):
    geo, tables_cpu, tables_gpu = world
    shard = geo.shard(1, 4)
    ids = mixed_ids(geo, 4097, seed=5).sort(dim=0).values  # every column sorted
    want, _ = reference(tables_cpu, ids, shard)
    assert_same(gt.GatherPlan(tables_gpu, shard)(ids.to(CUDA)), want, "sorted ids")


@pytest.mark.parametrize("num_programs,block_rows", [(66, gt.WIDE_BLOCK_ROWS),
                                                     (1000, gt.DEFAULT_BLOCK_ROWS)])
def test_sorted_reads_in_the_default_blocks_equal_the_reference(world, num_programs, block_rows,
                                                                 monkeypatch):
    """At 66 programs a sorted lookup of 4,097 tokens takes wide blocks (sorted_block_rows), at
    1,000 narrow ones: both give the reference's rows and count."""
    geo, tables_cpu, tables_gpu = world
    shard = geo.shard(0, 1)
    ids = mixed_ids(geo, 4097, seed=8)
    want, want_bad = reference(tables_cpu, ids, shard)
    counter = torch.zeros(1, dtype=torch.int64, device=CUDA)
    launched = record_launches(gt, monkeypatch)
    got = gt.GatherPlan(tables_gpu, shard)(ids.to(CUDA), sort=True, num_programs=num_programs,
                                           out_of_range=counter)
    assert [launch.block_rows for launch in launched] == [block_rows]
    assert_same(got, want, f"sorted, {num_programs} programs")
    assert counter.item() == want_bad


@pytest.mark.parametrize("num_programs", [1, 7, None, 100_000])
@pytest.mark.parametrize("block_rows,num_warps", [(1, 1), (8, 4), (32, 8)])
def test_any_grid_gives_the_same_rows(world, num_programs, block_rows, num_warps):
    geo, tables_cpu, tables_gpu = world
    shard = geo.shard(2, 5)
    ids = mixed_ids(geo, 256, seed=6)
    want, _ = reference(tables_cpu, ids, shard)
    out = gt.GatherPlan(tables_gpu, shard)(ids.to(CUDA), num_programs=num_programs,
                                           block_rows=block_rows, num_warps=num_warps)
    assert_same(out, want, f"{num_programs} programs x {block_rows} rows x {num_warps} warps")


def test_writes_a_slab_slot_and_nothing_else(world):
    geo, tables_cpu, tables_gpu = world
    shard = geo.shard(0, 2)
    ids = mixed_ids(geo, 100, seed=7)
    slab = torch.full((2, 300, shard.local_heads, 256), float("nan"), dtype=torch.bfloat16,
                      device=CUDA)
    slot = slab[:, 150:250]
    out = gt.GatherPlan(tables_gpu, shard)(ids.to(CUDA), slot)
    assert out is slot
    assert_same(slot, reference(tables_cpu, ids, shard)[0], "slab slot")
    assert torch.isnan(slab[:, :150]).all() and torch.isnan(slab[:, 250:]).all()


def test_launches_on_the_given_stream(world):
    geo, tables_cpu, tables_gpu = world
    shard = geo.shard(0, 1)
    ids = mixed_ids(geo, 64, seed=8).to(CUDA)
    out = torch.full((2, 64, 24, 256), 3.0, dtype=torch.bfloat16, device=CUDA)
    plan = gt.GatherPlan(tables_gpu, shard)
    plan(ids, out)  # compile and warm outside the timed part
    out.fill_(3.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)  # keeps the side stream busy for a while
    plan(ids, out, stream=side)
    early = out.cpu()  # ordered on the current stream only: the gather has not run yet
    side.synchronize()
    assert (early == 3.0).all(), "the gather ran on the current stream, not the given one"
    assert_same(out, reference(tables_cpu, ids, shard)[0], "side stream")


def test_tables_in_pinned_host_memory(world):
    geo, tables_cpu, _ = world
    pinned = [t.pin_memory() for t in tables_cpu]
    shard = geo.shard(3, 4)
    ids = mixed_ids(geo, 256, seed=9)
    want, _ = reference(tables_cpu, ids, shard)
    variants = {
        "pinned tensors": pinned,
        "CUDA views through __cuda_array_interface__": [uva_view(t) for t in pinned],
        "raw addresses": [gt.LayerTable(t.data_ptr(), t.shape[0], t.shape[1], owner=t)
                          for t in pinned],
    }
    for name, tables in variants.items():
        assert_same(gt.GatherPlan(tables, shard)(ids.to(CUDA)), want, name)
        packed = gt.gather(tables, ids.to(CUDA), shard, packed=True)
        assert_same(packed, reference(tables_cpu, ids, shard, packed=True)[0], f"packed {name}")


def test_pageable_host_tables_are_refused(world):
    geo, tables_cpu, _ = world
    with pytest.raises(ValueError, match="pageable host memory"):
        gt.GatherPlan(tables_cpu, geo.shard(0, 1))


def test_unaligned_table_base(world):
    geo, tables_cpu, _ = world
    rows = tables_cpu[0].shape[0]
    backing = torch.empty(rows * 264 + 3, dtype=torch.uint8, device=CUDA)
    table = backing[3:].view(rows, 264)
    table.copy_(tables_cpu[0].to(CUDA))
    shard = ShardView(0, 1, 0, 24, 24, ((0, rows),))
    ids = mixed_ids(geo, 64, seed=10)[:, :1]
    plan = gt.GatherPlan([table], shard)
    assert not plan.aligned
    assert_same(plan(ids.to(CUDA)), reference(tables_cpu[:1], ids, shard)[0], "unaligned base")


def test_rows_past_2_to_the_31_bytes():
    # 9 M rows x 264 B = 2.4 GB: row 8.2 M starts past 2^31 bytes.
    rows = 9_000_000
    table = torch.randint(0, 256, (rows, 264), dtype=torch.uint8, device=CUDA)
    gen = torch.Generator().manual_seed(12)
    ids = torch.randint(rows - 1_000_000, rows + 2, (512, 1, 8), generator=gen)
    ids[::5] = torch.randint(0, rows, (1, 1, 8), generator=gen)
    ids[3, 0, 3] = DEAD_ID
    shard = ShardView(0, 1, 0, 8, 8, ((0, rows),))
    out = gt.GatherPlan([table], shard)(ids.to(CUDA))
    # Reference on a compact copy of just the rows asked for.
    valid = (ids >= 0) & (ids < rows)
    unique, inverse = torch.unique(ids[valid], return_inverse=True)
    compact_ids = torch.full_like(ids, DEAD_ID)
    compact_ids[valid] = inverse
    compact = table[unique.to(CUDA)].cpu()
    want, _ = gather_ref.gather([compact], compact_ids,
                                ShardView(0, 1, 0, 8, 8, ((0, len(unique)),)))
    assert_same(out, want, "rows past 2^31 bytes")
    del table


def test_rejects_bad_arguments(world):
    geo, _, tables_gpu = world
    plan = gt.GatherPlan(tables_gpu, geo.shard(0, 2))
    ids = torch.zeros(3, 2, 24, dtype=torch.int64, device=CUDA)
    with pytest.raises(ValueError, match="num_programs must be an int >= 1"):
        plan(ids, num_programs=0)
    with pytest.raises(ValueError, match="ids are on cpu"):
        plan(ids.cpu())
    with pytest.raises(ValueError, match="out is on cpu"):
        plan(ids, torch.empty(2, 3, 12, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        gt.GatherPlan(tables_gpu, geo.shard(0, 2), device="cpu")


@pytest.mark.parametrize("shards", [1, 4])
@pytest.mark.parametrize("cached", [False, True])
def test_slot_gather_direct_launches_equal_the_reference(world, shards, cached):
    """The served hot path launches the compiled kernel directly (SlotGather): after the first
    launch of each dtype it must really take that path, and give the reference's rows and
    out-of-range counts for every size."""
    from engramd.client.shared.slab import SlabLayout, SlotViews
    from engramd.kernels import hot_cache

    geo, tables_cpu, tables_gpu = world
    shard = geo.shard(shards - 1, shards)
    layout = SlabLayout(slots=2, max_tokens=4097, n_layers=geo.n_layers, heads=geo.heads,
                        local_heads=shard.local_heads, head_dim=geo.head_dim)
    views = SlotViews(layout, torch.zeros(layout.size, dtype=torch.uint8, device=CUDA))
    cache = (hot_cache.HotCache(hot_cache.CacheLayout.from_budget(8 << 20, geo.row_bytes),
                                geo.n_layers, CUDA) if cached else None)
    bad = torch.zeros(1, dtype=torch.int64, device=CUDA)
    launch = gt.SlotGather(gt.GatherPlan(tables_gpu, shard, CUDA), bad, cache, num_programs=66)
    stream = torch.cuda.Stream(CUDA)
    expected_bad = 0
    sizes = [(t, d) for d in (torch.int64, torch.int32) for t in (1, 16, 1, 256, 4097, 3)]
    for step, (tokens, dtype) in enumerate(sizes):
        slot = step % 2
        ids = with_boundaries(mixed_ids(geo, tokens, seed=300 + step), shard).to(dtype)
        views.ids(slot, tokens, dtype).copy_(ids.to(CUDA))
        torch.cuda.synchronize()
        launch(views.ids(slot, tokens, dtype), views.rows(slot, tokens), stream)
        stream.synchronize()
        want, want_bad = reference(tables_cpu, ids, shard)
        expected_bad += want_bad
        assert_same(views.rows(slot, tokens).cpu(), want, f"step {step}: {tokens} x {dtype}")
    assert launch._direct and set(launch._launches) == {torch.int32, torch.int64}, \
        "the direct launch path was not taken"
    assert int(bad) == expected_bad


KERNELS = (gt._gather_kernel, gt._fanout_kernel)


def compiled_variants() -> int:
    """How many variants of the gather kernels this process has compiled or loaded on GPU 0."""
    return sum(len(k.device_caches[0][0]) for k in KERNELS)  # Triton 3.x: (kernel cache, ...)


def test_the_daemons_warm_up_compiles_every_variant_its_lookups_launch(world):
    """CudaBackend warms only the variants _gather launches (GatherOptions.launched_variants):
    after that warm-up, lookups of every size and ID dtype, with dedupe and sort where the
    options turn them on, compile nothing in the hot path, while a variant it does not launch
    (packed rows) still would."""
    from engramd.client.shared.slab import SlabLayout, SlotViews
    from engramd.kernels import hot_cache
    from engramd.server.cuda_backend import GatherOptions

    geo, _, tables_gpu = world
    options = GatherOptions(dedupe_min_tokens=256, sort_min_tokens=64)
    cache = hot_cache.HotCache(hot_cache.CacheLayout.from_budget(8 << 20, geo.row_bytes),
                               geo.n_layers, CUDA)
    plan = gt.GatherPlan(tables_gpu, geo.shard(0, 1), CUDA)
    bad = torch.zeros(1, dtype=torch.int64, device=CUDA)
    launch = gt.SlotGather(plan, bad, cache, num_programs=66)
    for kernel in KERNELS:  # forget what earlier tests launched: only this warm-up counts
        kernel.device_caches[0][0].clear()
    plan.warm_up(**options.launched_variants(cache))
    warmed = compiled_variants()
    layout = SlabLayout(slots=1, max_tokens=4097, n_layers=geo.n_layers, heads=geo.heads,
                        local_heads=geo.heads, head_dim=geo.head_dim)
    views = SlotViews(layout, torch.zeros(layout.size, dtype=torch.uint8, device=CUDA))
    stream = torch.cuda.Stream(CUDA)
    for dtype in (torch.int64, torch.int32):
        for tokens in (1, 63, 64, 255, 256, 4097):
            ids, rows = views.ids(0, tokens, dtype), views.rows(0, tokens)
            ids.copy_(mixed_ids(geo, tokens, seed=tokens).to(dtype).to(CUDA))
            if options.dedupe(tokens) or options.sort(tokens):  # as server/cuda_backend.py _gather
                plan(ids, rows, stream=stream, out_of_range=bad, cache=cache, num_programs=66,
                     dedupe=options.dedupe(tokens), sort=options.sort(tokens))
            else:
                launch(ids, rows, stream)
    torch.cuda.synchronize()
    assert compiled_variants() == warmed, "a served lookup compiled a kernel variant in its hot path"
    plan(views.ids(0, 1, torch.int64), packed=True, out_of_range=bad)
    assert compiled_variants() == warmed + 1, "the count of compiled variants does not see a new one"
