"""The Triton gather kernel under Triton's CPU interpreter, against the plain-torch reference.

Runs wherever Triton is installed, GPU or not: the module is loaded afresh with TRITON_INTERPRET=1
(triton.jit picks the interpreter when a kernel is defined), so a compiled copy imported by the GPU
tests in the same session is left alone. The reference itself is checked against float64 oracles
in test_gather_ref.py; here the kernel must reproduce it bit for bit (NaN compared by position).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from reference import (
    StandInKernel,
    assert_same,
    interpreted_gather,
    launch_then_keep,
    record_launches,
    small_geometry,
)

from engramd.client.geometry import DEAD_ID, ShardView, TableGeometry
from engramd.kernels import gather_ref

pytest.importorskip("triton")

BLOCK_ROWS = 64  # the interpreter's cost is per block; big blocks keep the file fast
SHARD_COUNTS = (1, 2, 4, 5, 7)


@pytest.fixture(scope="module")
def kt():
    """A private copy of engramd.kernels.gather_triton whose kernel runs in the interpreter."""
    name = "engramd_gather_triton_interpreted"
    module = interpreted_gather(name)
    _skip_if_interpreter_too_old(module)
    yield module
    sys.modules.pop(name, None)


def _skip_if_interpreter_too_old(module) -> None:
    # Older interpreters (seen with Triton 3.6) turn a program id into a 1-element array that
    # NumPy 2 refuses as a loop bound; the compiled kernel is unaffected.
    table = torch.zeros(1, 264, dtype=torch.uint8)
    try:
        module.GatherPlan([table], ShardView(0, 1, 0, 1, 1, ((0, 1),)))(
            torch.zeros(1, 1, 1, dtype=torch.int64))
    except Exception as exc:  # the interpreter wraps the NumPy error in its own type
        if "0-dimensional" not in str(exc):
            raise
        pytest.skip(f"this Triton's interpreter cannot run the kernel: {exc}")


@pytest.fixture(scope="module")
def world():
    geo = small_geometry()
    gen = torch.Generator().manual_seed(5)
    tables = [torch.randint(0, 256, (rows, geo.row_bytes), dtype=torch.uint8, generator=gen)
              for rows in geo.rows]
    return geo, tables


def mixed_ids(geo: TableGeometry, tokens: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    """Valid rows, other shards' rows, DEAD, >= rows, other negatives; repeated and sorted."""
    gen = torch.Generator().manual_seed(seed)
    top = max(geo.rows)
    ids = torch.randint(-4, top + 8, (tokens, geo.n_layers, geo.heads), generator=gen)
    ids[torch.rand(ids.shape, generator=gen) < 0.15] = DEAD_ID
    ids[1::3] = ids[0]
    ids[:, :, 1] = ids[:, :, 1].sort(dim=0).values
    if dtype == torch.int64:
        ids[-1, :, :3] = torch.tensor([2**31 + 5, -(2**40), 2**33])
    return ids.to(dtype)


def with_boundaries(ids: torch.Tensor, shard: ShardView) -> torch.Tensor:
    """Append one token whose owned heads hold lo - 1, lo, hi - 1, hi of each layer's range."""
    extra = torch.full((1,) + tuple(ids.shape[1:]), DEAD_ID, dtype=ids.dtype)
    for layer, (lo, hi) in enumerate(shard.row_ranges):
        for k, head in enumerate(range(shard.head_start, shard.head_end)):
            extra[0, layer, head] = (lo - 1, lo, hi - 1, hi)[k % 4]
    return torch.cat([ids, extra])


def one_layer_shard(rows: int, heads: int) -> ShardView:
    return ShardView(0, 1, 0, heads, heads, ((0, rows),))


def test_dequantizes_every_pattern_like_the_reference(kt):
    # Row s: all 256 E4M3 bytes (NaN included) under scale byte s, for every s.
    table = torch.empty(256, 264, dtype=torch.uint8)
    table[:, :256] = torch.arange(256, dtype=torch.uint8)
    table[:, 256:] = torch.arange(256, dtype=torch.uint8)[:, None]
    ids = torch.arange(256, dtype=torch.int32).reshape(32, 1, 8)
    out = kt.GatherPlan([table], one_layer_shard(256, 8))(ids, block_rows=BLOCK_ROWS)
    want = gather_ref.dequantize_rows(table, 256).reshape(1, 32, 8, 256)
    assert_same(out, want, "every E4M3 byte x every scale byte")


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shards", SHARD_COUNTS)
def test_matches_reference_for_every_shard(kt, world, shards, id_dtype):
    geo, tables = world
    for rank in range(shards):
        shard = geo.shard(rank, shards)
        ids = with_boundaries(mixed_ids(geo, tokens=6, seed=shards * 10 + rank, dtype=id_dtype),
                              shard)
        counter = torch.zeros(1, dtype=torch.int64)
        plan = kt.GatherPlan(tables, shard)
        out = plan(ids, block_rows=BLOCK_ROWS, out_of_range=counter)
        want, bad = gather_ref.gather(tables, ids, shard)
        assert_same(out, want, f"bf16 shard {rank}/{shards}")
        assert counter.item() == bad
        packed = plan(ids, packed=True, block_rows=BLOCK_ROWS)
        want_packed, _ = gather_ref.gather(tables, ids, shard, packed=True)
        assert_same(packed, want_packed, f"packed shard {rank}/{shards}")


@pytest.mark.parametrize("num_programs,block_rows", [(1, 64), (3, 8), (1000, 16)])
def test_any_grid_size_gives_the_same_rows(kt, world, num_programs, block_rows):
    geo, tables = world
    shard = geo.shard(1, 5)
    ids = with_boundaries(mixed_ids(geo, tokens=9, seed=3), shard)
    out = kt.GatherPlan(tables, shard)(ids, num_programs=num_programs, block_rows=block_rows)
    want, _ = gather_ref.gather(tables, ids, shard)
    assert_same(out, want, f"{num_programs} programs of {block_rows} rows")


def test_one_shot_gather_function(kt, world):
    geo, tables = world
    shard = geo.shard(3, 4)
    ids = mixed_ids(geo, tokens=4, seed=12, dtype=torch.int32)
    want, _ = gather_ref.gather(tables, ids, shard, packed=True)
    assert_same(kt.gather(tables, ids, shard, packed=True), want, "one-shot packed gather")


def test_writes_every_element_of_a_strided_slot(kt, world):
    geo, tables = world
    shard = geo.shard(0, 4)
    ids = mixed_ids(geo, tokens=5, seed=4)
    slab = torch.full((2, 8, shard.local_heads, 256), float("nan"), dtype=torch.bfloat16)
    slot = slab[:, 2:7]  # a token window of a larger slab: strided, rows contiguous
    out = kt.GatherPlan(tables, shard)(ids, slot, block_rows=BLOCK_ROWS)
    assert out is slot
    want, _ = gather_ref.gather(tables, ids, shard)
    assert_same(slot, want, "strided slot")
    assert torch.isnan(slab[:, :2]).all() and torch.isnan(slab[:, 7:]).all()


def test_strided_ids_and_raw_address_tables(kt, world):
    geo, tables = world
    shard = geo.shard(2, 4)
    wide = mixed_ids(geo, tokens=7, seed=6)
    ids = torch.cat([wide, wide], dim=2)[:, :, ::2]  # non-unit head stride
    raw = [kt.LayerTable(t.data_ptr(), t.shape[0], t.shape[1], owner=t) for t in tables]
    out = kt.GatherPlan(raw, shard)(ids, block_rows=BLOCK_ROWS)
    want, _ = gather_ref.gather(tables, ids.contiguous(), shard)
    assert_same(out, want, "strided ids, raw addresses")


def test_unaligned_table_base(kt, world):
    geo, tables = world
    backing = torch.empty(tables[0].numel() + 3, dtype=torch.uint8)
    table = backing[3:].view(tables[0].shape)
    table.copy_(tables[0])
    shard = ShardView(0, 1, 0, 24, 24, ((0, len(table)),))
    ids = mixed_ids(geo, tokens=5, seed=13)[:, :1]
    plan = kt.GatherPlan([table], shard)
    assert not plan.aligned
    want, _ = gather_ref.gather([tables[0]], ids, shard)
    assert_same(plan(ids, block_rows=BLOCK_ROWS), want, "unaligned table base")


def test_row_offsets_past_2_to_the_31(kt, world):
    # A table whose owned rows start 10 M rows (2.6 GB) after its base address: the address of
    # row r is base + r * 264, far past int32, and only the last rows are real memory.
    geo, tables = world
    real = tables[0]
    skip = 10_000_000
    fake = kt.LayerTable(real.data_ptr() - skip * real.shape[1], skip + real.shape[0],
                         real.shape[1], owner=real)
    shard = ShardView(0, 1, 0, 4, 4, ((skip, skip + real.shape[0]),))
    local = torch.randint(0, real.shape[0], (6, 1, 4), generator=torch.Generator().manual_seed(8))
    local[0, 0, 0] = -1 - skip  # becomes DEAD_ID
    local[1, 0, 1] = -2  # below the owned range: zeros
    out = kt.GatherPlan([fake], shard)(local + skip, block_rows=BLOCK_ROWS)
    want, _ = gather_ref.gather([real], local.clamp(min=-1),
                                ShardView(0, 1, 0, 4, 4, ((0, real.shape[0]),)))
    assert_same(out, want, "rows past 2^31 bytes")


def test_warm_up_runs_every_variant(kt, world, monkeypatch):
    """Every variant a lookup can launch (ID dtype, packed rows, counter, dedupe, sort, and the
    sorted lookups' wide blocks) runs once, on DEAD IDs, which read and count nothing."""
    geo, tables = world
    launched, call = [], kt.GatherPlan.__call__

    def recording(plan, ids, **kw):
        launched.append((ids.dtype, kw["packed"], kw["out_of_range"] is not None, kw["dedupe"],
                         kw["sort"], kw["block_rows"]))
        out = call(plan, ids, **kw)
        assert not out.any(), "DEAD IDs gather zeros"
        if kw["out_of_range"] is not None:
            assert int(kw["out_of_range"]) == 0, "DEAD IDs count as out of range"
        return out

    monkeypatch.setattr(kt.GatherPlan, "__call__", recording)
    kt.GatherPlan(tables, geo.shard(6, 7)).warm_up()  # a shard that owns no heads, too
    kt.GatherPlan(tables, geo.shard(0, 1)).warm_up()
    sorted_rows = (kt.DEFAULT_BLOCK_ROWS, kt.WIDE_BLOCK_ROWS)
    every = {(dtype, packed, counted, dedupe, ordered, rows)
             for dtype in (torch.int32, torch.int64) for packed in (False, True)
             for counted in (False, True) for dedupe in (False, True) for ordered in (False, True)
             for rows in (sorted_rows if ordered else (kt.DEFAULT_BLOCK_ROWS,))}
    assert launched[:len(every)] == launched[len(every):], "both plans warm the same variants"
    assert set(launched[:len(every)]) == every and len(launched) == 2 * len(every)


def test_no_tokens_launches_nothing(kt, world):
    geo, tables = world
    out = kt.GatherPlan(tables, geo.shard(0, 2))(torch.zeros(0, 2, 24, dtype=torch.int32))
    assert out.shape == (2, 0, 12, 256)


def test_rejects_bad_arguments(kt, world):
    geo, tables = world
    shard = geo.shard(0, 2)
    plan = kt.GatherPlan(tables, shard)
    ids = torch.zeros(3, 2, 24, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_programs must be an int >= 1"):
        plan(ids, num_programs=0)
    with pytest.raises(ValueError, match="powers of two"):
        plan(ids, block_rows=6)
    with pytest.raises(TypeError, match="int32 or int64"):
        plan(ids.to(torch.int16))
    with pytest.raises(ValueError, match=r"ids must be \[T, 2, heads >= 12\]"):
        plan(ids[:, :1])
    with pytest.raises(TypeError, match="out must be torch.bfloat16"):
        plan(ids, torch.empty(2, 3, 12, 256, dtype=torch.float32))
    with pytest.raises(ValueError, match="must have shape"):
        plan(ids, torch.empty(2, 3, 12, 264, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        plan(ids, torch.empty(2, 3, 256, 12, dtype=torch.bfloat16).transpose(2, 3))
    with pytest.raises(ValueError, match="row-aligned"):
        plan(ids, torch.empty(2, 3 * 12 * 256 + 8, dtype=torch.bfloat16)[:, :-8]
             .view(2, 3, 12, 256))
    with pytest.raises(ValueError, match="out_of_range"):
        plan(ids, out_of_range=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="ids are on meta"):
        plan(ids.to("meta"))
    with pytest.raises(ValueError, match="one table per layer"):
        kt.GatherPlan(tables[:1], shard)
    with pytest.raises(ValueError, match=r"tables\[1\] must be contiguous"):
        kt.GatherPlan([tables[0], tables[1].t().contiguous().t()], shard)
    with pytest.raises(ValueError, match="row_bytes 100"):
        kt.GatherPlan([t[:100].reshape(-1, 100) for t in tables], shard)
    with pytest.raises(ValueError, match="owns rows"):
        kt.GatherPlan([tables[0], tables[1][:10]], shard)
    with pytest.raises(ValueError, match="runs on cpu"):
        kt.GatherPlan(tables, shard, device="cuda")


def test_matches_reference_at_prefill_scale(kt, world):
    # One larger launch: 2 layers x 128 tokens x 24 heads, random IDs over the whole tables.
    geo, tables = world
    shard = geo.shard(0, 1)
    ids = torch.from_numpy(
        np.random.default_rng(9).integers(-1, max(geo.rows), size=(128, 2, 24))
    )
    out = kt.GatherPlan(tables, shard)(ids, block_rows=256, num_programs=4)
    want, _ = gather_ref.gather(tables, ids, shard)
    assert_same(out, want, "128 tokens")


# ---- hot-row cache and in-request dedupe (kernels/hot_cache.py) ----

def cached_world(kt, geo, tables, resident_fraction: float, seed: int, admit_min: int = 0):
    """A cache holding a random fraction of each layer's rows, its pool filled from the tables."""
    from engramd.kernels import hot_cache

    layout = hot_cache.CacheLayout(sets=4, row_bytes=geo.row_bytes, sketch_bits=12, log_entries=4096)
    cache = hot_cache.HotCache(layout, geo.n_layers, "cpu", admit_min=admit_min)
    gen = torch.Generator().manual_seed(seed)
    for layer, table in enumerate(tables):
        for row in range(table.shape[0]):
            if torch.rand((), generator=gen) >= resident_fraction:
                continue
            key = int(hot_cache.row_keys(torch.tensor(layer), torch.tensor(row)))
            s = int(hot_cache.set_index(torch.tensor([key]), layout.sets))
            free = (cache.keys[s] == hot_cache.EMPTY_KEY).nonzero()
            if len(free):
                cache.keys[s, free[0, 0]] = key
                cache.pool[s * hot_cache.WAYS + free[0, 0]] = table[row]
    return cache


def reads_of(geo, ids: torch.Tensor, shard: ShardView) -> list[list[int]]:
    """Per layer, the rows a lookup of `ids` reads (owned heads, inside the shard's rows)."""
    out = []
    for layer, (lo, hi) in enumerate(shard.row_ranges):
        rows = ids[:, layer, shard.head_start:shard.head_end].reshape(-1).tolist()
        out.append([r for r in rows if lo <= r < hi])
    return out


@pytest.mark.parametrize("shards", [1, 2, 5])
@pytest.mark.parametrize("dedupe", [False, True])
@pytest.mark.parametrize("sort", [False, True])
def test_cached_and_deduped_gathers_equal_the_reference(kt, world, shards, dedupe, sort):
    from engramd.kernels import hot_cache

    geo, tables = world
    shard = geo.shard(shards - 1, shards)
    ids = with_boundaries(mixed_ids(geo, 23, seed=40 + shards), shard)
    cache = cached_world(kt, geo, tables, 0.5, seed=shards)
    want, want_bad = gather_ref.gather(tables, ids, shard)
    bad = torch.zeros(1, dtype=torch.int64)
    got = kt.GatherPlan(tables, shard)(ids, cache=cache, dedupe=dedupe, sort=sort, out_of_range=bad,
                                       block_rows=BLOCK_ROWS)
    assert_same(got, want, f"cache, dedupe={dedupe}, sort={sort}, shard {shard.rank}/{shards}")
    assert int(bad) == want_bad
    resident = set(cache.keys.view(-1).tolist())
    for layer, rows in enumerate(reads_of(geo, ids, shard)):
        read = sorted(set(rows)) if dedupe else rows
        hits = [r for r in read if int(hot_cache.row_keys(torch.tensor(layer), torch.tensor(r))) in resident]
        assert int(cache.counters[0, layer]) == len(read), f"layer {layer} reads"
        assert int(cache.counters[1, layer]) == len(hits), f"layer {layer} hits"


def test_cache_hits_come_from_the_pool_not_the_table(kt, world):
    geo, tables = world
    shard = geo.shard(0, 1)
    cache = cached_world(kt, geo, tables, 0.6, seed=9)
    cache.pool[:, :256] ^= 0x01  # resident rows now differ from the table's
    poisoned = [t.clone() for t in tables]
    from engramd.kernels import hot_cache
    for slot, key in enumerate(cache.keys.view(-1).tolist()):
        if key != hot_cache.EMPTY_KEY:
            layer, row = key >> hot_cache.KEY_LAYER_SHIFT, key & ((1 << hot_cache.KEY_LAYER_SHIFT) - 1)
            poisoned[layer][row] = cache.pool[slot]
    ids = mixed_ids(geo, 17, seed=3)
    want, _ = gather_ref.gather(poisoned, ids, shard)
    got = kt.GatherPlan(tables, shard)(ids, cache=cache, block_rows=BLOCK_ROWS)
    assert_same(got, want, "rows of resident keys read from the pool")
    assert not torch.equal(want, gather_ref.gather(tables, ids, shard)[0])


def test_sketch_and_miss_log_account_for_every_read(kt, world):
    from engramd.kernels import hot_cache

    geo, tables = world
    shard = geo.shard(0, 1)
    cache = cached_world(kt, geo, tables, 0.3, seed=4, admit_min=0)
    ids = mixed_ids(geo, 29, seed=11)
    kt.GatherPlan(tables, shard)(ids, cache=cache, block_rows=BLOCK_ROWS)
    resident = set(cache.keys.view(-1).tolist())
    keys = [int(hot_cache.row_keys(torch.tensor(layer), torch.tensor(r)))
            for layer, rows in enumerate(reads_of(geo, ids, shard)) for r in rows]
    assert cache.sketch.sum(dim=1).tolist() == [len(keys)] * hot_cache.SKETCH_DEPTH
    counts = {k: keys.count(k) for k in set(keys)}
    estimates = cache.estimate(torch.tensor(list(counts)))
    assert all(int(e) >= c for e, c in zip(estimates, counts.values(), strict=True))
    missed = sorted(k for k in keys if k not in resident)
    assert int(cache.cursor) == len(missed)
    assert sorted(cache.log[:len(missed)].tolist()) == missed


def test_dedupe_leaders_point_at_the_first_equal_read(kt, world):
    geo, tables = world
    shard = geo.shard(1, 2)
    ids = mixed_ids(geo, 19, seed=8)
    plan = kt.GatherPlan(tables, shard)
    leaders = plan.leaders(ids).long()
    items = torch.arange(leaders.numel())
    assert torch.equal(leaders[leaders], leaders), "a leader leads itself"
    layer = items // (19 * shard.local_heads)
    token = items % (19 * shard.local_heads) // shard.local_heads
    j = items % shard.local_heads
    lo = torch.tensor([r[0] for r in shard.row_ranges])[layer]
    hi = torch.tensor([r[1] for r in shard.row_ranges])[layer]
    row = torch.where(j < shard.owned_heads,
                      ids[token, layer, (shard.head_start + j).clamp(max=geo.heads - 1)], -1)
    reads = (j < shard.owned_heads) & (row >= lo) & (row < hi)
    follows = leaders != items
    assert not follows[~reads].any(), "only real reads share a leader"
    assert torch.equal(row[leaders][follows], row[follows])
    assert torch.equal(layer[leaders][follows], layer[follows])
    distinct = len({(int(a), int(b)) for a, b, r in zip(layer, row, reads, strict=True) if r})
    assert int((~follows & reads).sum()) == distinct


def test_keeper_admits_repeated_rows_and_keeps_every_slot_equal_to_its_row(kt, world):
    from engramd.client.shared.cache_keeper import CacheKeeper
    from engramd.kernels import hot_cache

    geo, tables = world
    shard = geo.shard(0, 1)
    layout = hot_cache.CacheLayout(sets=4, row_bytes=geo.row_bytes, sketch_bits=12, log_entries=1024)
    cache = hot_cache.HotCache(layout, geo.n_layers, "cpu", admit_min=1)
    keeper = CacheKeeper(cache, tables, gather_streams=list, margin=0)
    plan = kt.GatherPlan(tables, shard)
    gen = torch.Generator().manual_seed(6)
    hot_ids = torch.randint(0, 3, (12, geo.n_layers, geo.heads), generator=gen)  # 3 rows per layer
    for _ in range(3):
        plan(hot_ids, cache=cache, block_rows=BLOCK_ROWS)
        keeper.refresh()
    hot_keys = {int(hot_cache.row_keys(torch.tensor(layer), torch.tensor(row)))
                for layer in range(geo.n_layers) for row in range(3)}
    resident = cache.keys.view(-1).tolist()
    assert hot_keys <= set(resident), "every repeated row was admitted"
    for slot, key in enumerate(resident):
        if key != hot_cache.EMPTY_KEY:
            layer, row = key >> hot_cache.KEY_LAYER_SHIFT, key & ((1 << hot_cache.KEY_LAYER_SHIFT) - 1)
            assert torch.equal(cache.pool[slot], tables[layer][row]), f"slot {slot} (key {key})"
    reads_before, hits_before = cache.counters.sum(dim=1).tolist()
    got = plan(hot_ids, cache=cache, block_rows=BLOCK_ROWS)
    assert_same(got, gather_ref.gather(tables, hot_ids, shard)[0], "rows served from the cache")
    reads, hits = cache.counters.sum(dim=1).tolist()
    assert hits - hits_before == reads - reads_before == hot_ids.numel()
    assert keeper.stats.admitted >= len(hot_keys)


@pytest.mark.parametrize("shards", [1, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_sorted_reads_equal_the_reference(kt, world, shards, packed):
    geo, tables = world
    shard = geo.shard(shards - 1, shards)
    ids = with_boundaries(mixed_ids(geo, 21, seed=70 + shards), shard)
    want, want_bad = gather_ref.gather(tables, ids, shard, packed=packed)
    bad = torch.zeros(1, dtype=torch.int64)
    got = kt.GatherPlan(tables, shard)(ids, sort=True, packed=packed, out_of_range=bad,
                                       block_rows=BLOCK_ROWS)
    assert_same(got, want, f"sorted, packed={packed}, shard {shard.rank}/{shards}")
    assert int(bad) == want_bad


@pytest.mark.parametrize("sort", [False, True])
def test_a_launch_of_some_layers_writes_theirs_and_counts_theirs(kt, world, sort):
    """Each layer's launch gives that layer's rows of the reference, packed or not, counts its
    own out-of-range IDs, and leaves the other layers' rows as they were."""
    geo, tables = world
    shard = geo.shard(1, 2)
    ids = with_boundaries(mixed_ids(geo, 13, seed=90), shard)
    plan = kt.GatherPlan(tables, shard)
    for packed in (False, True):
        want, _ = gather_ref.gather(tables, ids, shard, packed=packed)
        out = torch.full_like(want, 3)
        for layer in range(geo.n_layers):
            bad = torch.zeros(1, dtype=torch.int64)
            plan(ids, out, packed=packed, sort=sort, out_of_range=bad, block_rows=BLOCK_ROWS,
                 layers=range(layer, layer + 1))
            assert_same(out[:layer + 1], want[:layer + 1], f"layers up to {layer}, packed={packed}")
            assert (out[layer + 1:] == 3).all(), f"the launch of layer {layer} wrote another"
            one = ids.clone()
            one[:, [other for other in range(geo.n_layers) if other != layer]] = DEAD_ID
            assert int(bad) == gather_ref.gather(tables, one, shard)[1], f"layer {layer}'s count"


def test_sorted_lookups_take_wide_blocks_from_enough_rows_a_program(kt):
    for programs in (1, 66, 132):
        assert kt.sorted_block_rows(kt.WIDE_FROM_ROWS * programs - 1, programs) == kt.DEFAULT_BLOCK_ROWS
        assert kt.sorted_block_rows(kt.WIDE_FROM_ROWS * programs, programs) == kt.WIDE_BLOCK_ROWS


def test_a_captured_lookup_takes_wide_blocks_where_one_round_of_them_covers_it(kt):
    for programs in (1, 17, 66):
        most = kt.WIDE_BLOCK_ROWS * programs
        assert kt.captured_block_rows(1, programs, False) == kt.WIDE_BLOCK_ROWS
        assert kt.captured_block_rows(most, programs, False) == kt.WIDE_BLOCK_ROWS
        assert kt.captured_block_rows(most + 1, programs, False) == kt.DEFAULT_BLOCK_ROWS
        for items in (1, most + 1, kt.WIDE_FROM_ROWS * programs):
            assert kt.captured_block_rows(items, programs, True) == kt.sorted_block_rows(items, programs)


def test_a_sorted_lookup_in_wide_blocks_equals_the_reference(kt, world, monkeypatch):
    """The default blocks of a sorted lookup widen with its rows per program (sorted_block_rows):
    the wide variant must give the reference's rows too."""
    geo, tables = world
    shard = geo.shard(0, 1)
    tokens = -(-kt.WIDE_FROM_ROWS // (geo.n_layers * shard.local_heads)) + 1
    ids = with_boundaries(mixed_ids(geo, tokens, seed=91), shard)
    launched = record_launches(kt, monkeypatch)
    want, want_bad = gather_ref.gather(tables, ids, shard)
    bad = torch.zeros(1, dtype=torch.int64)
    got = kt.GatherPlan(tables, shard)(ids, sort=True, out_of_range=bad, num_programs=1)
    assert [launch.block_rows for launch in launched] == [kt.WIDE_BLOCK_ROWS]
    assert_same(got, want, "sorted in wide blocks")
    assert int(bad) == want_bad


def test_warming_from_a_trace_admits_its_repeated_rows_only(kt, world):
    from engramd.client.shared.cache_keeper import CacheKeeper
    from engramd.kernels import hot_cache

    geo, tables = world
    layout = hot_cache.CacheLayout(sets=8, row_bytes=geo.row_bytes, sketch_bits=14, log_entries=1024)
    cache = hot_cache.HotCache(layout, geo.n_layers, "cpu", admit_min=3)
    keeper = CacheKeeper(cache, tables, gather_streams=list)
    trace = torch.full((10, geo.n_layers, geo.heads), DEAD_ID)
    trace[:, :, 0] = 1  # row 1 of each layer: 10 lookups
    trace[0, :, 1] = 2  # row 2: once
    trace[0, 0, 2] = geo.rows[0] + 5  # past the table: skipped
    assert keeper.warm(trace) == geo.n_layers
    resident = set(cache.keys.view(-1).tolist()) - {hot_cache.EMPTY_KEY}
    assert resident == {int(hot_cache.row_keys(torch.tensor(layer), torch.tensor(1)))
                        for layer in range(geo.n_layers)}
    ids = torch.ones((4, geo.n_layers, geo.heads), dtype=torch.int64)
    got = kt.GatherPlan(tables, geo.shard(0, 1))(ids, cache=cache, block_rows=BLOCK_ROWS)
    assert_same(got, gather_ref.gather(tables, ids, geo.shard(0, 1))[0], "rows of the warmed cache")
    assert cache.counters[1].sum() == cache.counters[0].sum() == ids.numel()


def slot_world(kt, world, shards: int, cached: bool):
    """The last of `shards` shards, a two-slot slab's views of up to 9 tokens, a hot-row cache
    holding half the rows (when `cached`), an out-of-range counter."""
    from engramd.client.shared.slab import SlabLayout, SlotViews

    geo, tables = world
    shard = geo.shard(shards - 1, shards)
    layout = SlabLayout(slots=2, max_tokens=9, n_layers=geo.n_layers, heads=geo.heads,
                        local_heads=shard.local_heads, head_dim=geo.head_dim)
    views = SlotViews(layout, torch.zeros(layout.size, dtype=torch.uint8))
    cache = cached_world(kt, geo, tables, 0.5, seed=3) if cached else None
    return shard, views, cache, torch.zeros(1, dtype=torch.int64)


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("cached", [False, True])
def test_slot_gather_fills_slab_slots_like_the_reference(kt, world, shards, cached):
    """The served hot path's launcher (kernels.gather_triton.SlotGather) over a slab's slots:
    every size and dtype in a row, rows and out-of-range counts equal to the reference."""
    geo, tables = world
    shard, views, cache, bad = slot_world(kt, world, shards, cached)
    launch = kt.SlotGather(kt.GatherPlan(tables, shard), bad, cache, num_programs=4,
                           block_rows=BLOCK_ROWS)
    expected_bad = 0
    for step, (tokens, dtype) in enumerate([(1, torch.int64), (9, torch.int64), (4, torch.int32),
                                            (9, torch.int32), (2, torch.int64)]):
        slot = step % 2
        ids = mixed_ids(geo, tokens, seed=70 + step, dtype=dtype)
        views.ids(slot, tokens, dtype).copy_(ids)
        launch(views.ids(slot, tokens, dtype), views.rows(slot, tokens), stream=None)
        want, want_bad = gather_ref.gather(tables, ids, shard)
        expected_bad += want_bad
        assert_same(views.rows(slot, tokens), want, f"step {step}: {tokens} tokens of {dtype}")
    assert int(bad) == expected_bad


def test_slot_gather_takes_a_grid_per_call(kt, world, monkeypatch):
    """A mapped lookup's own share of the SMs reaches SlotGather as a grid for that call; the
    launcher's own grid stays the default."""
    geo, tables = world
    shard = geo.shard(0, 1)
    launched = record_launches(kt, monkeypatch)
    bad = torch.zeros(1, dtype=torch.int64)
    launch = kt.SlotGather(kt.GatherPlan(tables, shard), bad, None, num_programs=4,
                           block_rows=BLOCK_ROWS)
    ids = mixed_ids(geo, 9, seed=77)
    want, _ = gather_ref.gather(tables, ids, shard)
    for programs, grid in ((None, 4), (1, 1), (3, 3), (None, 4)):
        out = torch.zeros(want.shape, dtype=torch.bfloat16)
        launched.clear()
        launch(ids, out, stream=None, num_programs=programs)
        assert [one.grid for one in launched] == [grid], programs
        assert_same(out, want, f"{programs} programs")


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("cached", [False, True])
def test_a_direct_launch_passes_the_checked_paths_arguments(kt, world, monkeypatch, shards, cached):
    """After the first launch of a dtype, SlotGather hands the compiled kernel a kept argument
    list with each call's IDs, rows and sizes filled in: argument for argument what the plan's
    kernel_args gives for that call (the same tensors, the same numbers), on the call's grid
    and stream. The interpreter compiles nothing, so a recording kernel stands for it."""
    geo, tables = world
    shard, views, cache, bad = slot_world(kt, world, shards, cached)
    plan = kt.GatherPlan(tables, shard)
    launched: list = []
    monkeypatch.setattr(kt.GatherPlan, "_launch", launch_then_keep(kt, StandInKernel(launched)))
    gather = kt.SlotGather(plan, bad, cache, num_programs=4, block_rows=BLOCK_ROWS)
    gather._direct = True  # as on a GPU
    stream = SimpleNamespace(cuda_stream=0x5EED)
    for step, (tokens, dtype, programs) in enumerate([(9, torch.int64, None), (1, torch.int64, 2),
                                                      (7, torch.int64, None), (4, torch.int32, 1),
                                                      (9, torch.int32, 3)]):
        slot = step % 2
        ids, out = views.ids(slot, tokens, dtype), views.rows(slot, tokens)
        launched.clear()
        gather(ids, out, stream, programs)
        if step in (0, 3):  # a dtype's first launch: the checked path, the interpreter's rows
            assert launched == [] and dtype in gather._launches, f"step {step}"
            continue
        n_items = geo.n_layers * tokens * shard.local_heads
        grid = min(programs or 4, -(-n_items // BLOCK_ROWS))
        want = plan.kernel_args(ids.data_ptr(), out.data_ptr(), bad, cache, plan.meta, plan.meta,
                                kt._Launch(grid, n_items, False, BLOCK_ROWS, kt.DEFAULT_NUM_WARPS,
                                          range(geo.n_layers)),
                                tokens, ids.stride(),
                                (out.stride(0) // geo.head_dim, out.stride(1) // geo.head_dim),
                                False, False)
        assert len(launched) == 1, f"step {step}: {len(launched)} launches"
        got_grid, got, got_stream = launched[0]
        assert (got_grid, got_stream) == ((grid, 1, 1), 0x5EED), f"step {step}"
        names = kt._gather_kernel.arg_names
        assert len(got) == len(names)
        for name, value in zip(names, got, strict=True):
            expected = want[name]
            same = value is expected if isinstance(expected, torch.Tensor) else value == expected
            assert same, f"step {step}: {name} is {value!r}, the checked path passes {expected!r}"


def test_slot_views_are_the_layouts_views_made_once():
    from engramd.client.shared.slab import SlabLayout, SlotViews

    layout = SlabLayout(slots=3, max_tokens=5, n_layers=2, heads=24, local_heads=6, head_dim=256)
    buffer = torch.arange(layout.size, dtype=torch.int64).to(torch.uint8)
    views = SlotViews(layout, buffer)
    for slot in range(3):
        for tokens in (1, 5):
            rows = views.rows(slot, tokens)
            assert rows is views.rows(slot, tokens)
            want = layout.rows_view(buffer, slot, tokens)
            assert rows.shape == want.shape and rows.data_ptr() == want.data_ptr()
            ids = views.ids(slot, tokens, torch.int32)
            assert ids is views.ids(slot, tokens, torch.int32)
            assert ids.data_ptr() == layout.ids_view(buffer, slot, tokens, torch.int32).data_ptr()
    views.MAX_VIEWS = 2
    first = views.rows(0, 2)
    views.rows(0, 3), views.rows(0, 4)  # past the bound: the cache starts over
    again = views.rows(0, 2)
    assert again is not first and (again.shape, again.data_ptr()) == (first.shape, first.data_ptr())
