"""The hot-row cache's sizing, hashing and choice of what to keep (plain torch on the CPU).

The kernel side (probe, sketch, log, counters) is tested against the gather reference in
test_gather_triton_interp.py; the refresh protocol on a GPU in tests/gpu/.
"""

from __future__ import annotations

import time

import pytest
import torch

from engramd.kernels import hot_cache
from engramd.kernels.hot_cache import WAYS, CacheConfigError, CacheLayout, HotCache


def small_cache(sets: int = 16, bits: int = 10, admit_min: int = 3) -> HotCache:
    return HotCache(CacheLayout(sets, 264, bits, 64), n_layers=2, device="cpu", admit_min=admit_min)


@pytest.mark.parametrize("budget_gib", [0.05, 1, 4])
def test_layout_fits_its_budget_and_uses_most_of_it(budget_gib):
    budget = int(budget_gib * 2**30)
    layout = CacheLayout.from_budget(budget, 264)
    assert layout.nbytes <= budget
    assert layout.slots * 264 >= 0.8 * budget, "most of the budget holds rows"
    assert (1 << layout.sketch_bits) >= min(layout.slots, 1 << hot_cache.MAX_SKETCH_BITS)


def test_too_small_a_budget_is_refused_with_the_size():
    with pytest.raises(CacheConfigError, match="1000 bytes"):
        CacheLayout.from_budget(1000, 264)


def test_set_index_spreads_keys_over_every_set():
    keys = hot_cache.row_keys(torch.arange(2).repeat_interleave(50_000), torch.arange(100_000) * 7919)
    sets = hot_cache.set_index(keys, 1000)
    assert int(sets.min()) >= 0 and int(sets.max()) < 1000
    counts = torch.bincount(sets, minlength=1000).double()
    assert counts.std() / counts.mean() < 0.1  # binomial spread is ~0.03 for 100 per set


def test_estimates_never_undercount():
    cache = small_cache(bits=8)  # 256 counters per row: collisions are certain
    gen = torch.Generator().manual_seed(1)
    keys = hot_cache.row_keys(torch.randint(0, 2, (3000,), generator=gen),
                              torch.randint(0, 500, (3000,), generator=gen))
    for d in range(hot_cache.SKETCH_DEPTH):
        cache.sketch[d].index_add_(0, hot_cache.sketch_index(keys, d, 8),
                                   torch.ones_like(keys, dtype=torch.int32))
    distinct, true_counts = torch.unique(keys, return_counts=True)
    assert (cache.estimate(distinct) >= true_counts).all()


def test_admissions_keep_the_top_ways_of_residents_and_candidates():
    cache = small_cache(sets=16, admit_min=0)
    gen = torch.Generator().manual_seed(2)
    cache.sketch.copy_(torch.randint(0, 50, cache.sketch.shape, generator=gen, dtype=torch.int32))
    pool_keys = torch.unique(hot_cache.row_keys(torch.randint(0, 2, (600,), generator=gen),
                                                torch.randint(0, 10**6, (600,), generator=gen)))
    sets = hot_cache.set_index(pool_keys, 16)
    # fill about half of each set's ways; the rest of the keys are candidates
    residents = []
    for s in range(16):
        mine = pool_keys[sets == s][: WAYS // 2 + s % 3]
        cache.keys[s, : len(mine)] = mine
        residents += mine.tolist()
    candidates = pool_keys[~torch.isin(pool_keys, torch.tensor(residents))]
    before = cache.keys.clone()
    chosen = hot_cache.choose_admissions(cache, candidates, margin=0, ratio=1.0)
    cache.keys[chosen.sets, chosen.ways] = chosen.keys
    assert torch.isin(chosen.keys, candidates).all()
    assert len(set(chosen.slots.tolist())) == len(chosen), "one admission per way"
    for s in range(16):
        union = torch.cat([before[s][before[s] >= 0], candidates[hot_cache.set_index(candidates, 16) == s]])
        best = cache.estimate(union).sort(descending=True).values[:WAYS]
        kept = cache.keys[s][cache.keys[s] >= 0]
        assert sorted(cache.estimate(kept).tolist()) == sorted(best.tolist()), f"set {s}"


def test_noise_level_differences_replace_nothing():
    cache = small_cache(sets=8, bits=16)
    gen = torch.Generator().manual_seed(3)
    # every key about as frequent (uniform traffic): counts 8..11
    cache.sketch.copy_(torch.randint(8, 12, cache.sketch.shape, generator=gen, dtype=torch.int32))
    keys = hot_cache.row_keys(torch.zeros(2000, dtype=torch.int64), torch.arange(2000))
    sets = hot_cache.set_index(keys, 8)
    for s in range(8):
        cache.keys[s] = keys[sets == s][:WAYS]
    others = keys[~hot_cache.HotCache.resident(cache, keys)]
    assert len(hot_cache.choose_admissions(cache, others)) == 0
    cache.sketch[:, hot_cache.sketch_index(others[:1], 0, 16)] = 100  # one clearly hotter key
    cache.sketch[1, hot_cache.sketch_index(others[:1], 1, 16)] = 100
    assert hot_cache.choose_admissions(cache, others).keys.tolist() == others[:1].tolist()


def reference_admissions(cache: HotCache, candidates: list[int], margin: float, ratio: float,
                         limit: int | None) -> list[tuple[int, int, int, float]]:
    """The choice of choose_admissions written plainly, a set at a time: (estimate, set, key,
    bar of the way it takes) per admission, hottest first, equal estimates by set, then key."""
    def estimate(key: int) -> int:
        return int(cache.estimate(torch.tensor([key]))[0])

    by_set: dict[int, list[int]] = {}
    for key in candidates:
        by_set.setdefault(int(hot_cache.set_index(torch.tensor([key]), cache.layout.sets)[0]), []).append(key)
    won = []
    for s, keys in by_set.items():
        keys.sort(key=lambda k: (-estimate(k), k))
        bars = sorted(way_bar(cache, k, margin, ratio) for k in cache.keys[s].tolist())
        for key, bar in zip(keys, bars, strict=False):  # the i-th best, the i-th lowest bar
            if estimate(key) > bar:
                won.append((estimate(key), s, key, bar))
    won.sort(key=lambda w: (-w[0], w[1], w[2]))
    return won if limit is None else won[:limit]


def way_bar(cache: HotCache, resident: int, margin: float, ratio: float) -> float:
    """What a candidate must exceed to take the way of `resident` (EMPTY_KEY: a free way)."""
    if resident == hot_cache.EMPTY_KEY:
        return float(cache.admit_min)
    return float(torch.tensor(int(cache.estimate(torch.tensor([resident]))[0]), dtype=torch.int32)
                 * ratio + margin)


@pytest.mark.parametrize("seed", range(6))
def test_admissions_equal_the_plain_choice_ties_and_limits_included(seed):
    gen = torch.Generator().manual_seed(seed)
    cache = small_cache(sets=6, bits=12, admit_min=seed % 3)
    # Few distinct counts: ties among candidates, among residents and at the limit's cut; cold
    # residents (0) whose bars fall below an empty way's admit_min.
    cache.sketch.copy_(torch.randint(0, 7, cache.sketch.shape, generator=gen, dtype=torch.int32))
    keys = torch.unique(hot_cache.row_keys(torch.randint(0, 2, (120,), generator=gen),
                                           torch.randint(0, 5000, (120,), generator=gen)))
    sets = hot_cache.set_index(keys, 6)
    for s in range(6):
        mine = keys[sets == s][: (s + seed) % (WAYS + 1)]
        cache.keys[s, : len(mine)] = mine
    candidates = keys[~cache.resident(keys)]
    for margin, ratio in ((0, 1.0), (1, 1.5)):
        for limit in (None, 1, 3, 10):
            want = reference_admissions(cache, candidates.tolist(), margin, ratio, limit)
            got = hot_cache.choose_admissions(cache, candidates, margin, ratio, limit)
            assert len(set(got.slots.tolist())) == len(got), "one admission per way"
            bars = [way_bar(cache, k, margin, ratio) for k in cache.keys[got.sets, got.ways].tolist()]
            mine = [(int(e), s, k, b) for e, s, k, b in zip(cache.estimate(got.keys).tolist(),
                                                            got.sets.tolist(), got.keys.tolist(),
                                                            bars, strict=True)]
            assert mine == want, f"margin {margin}, ratio {ratio}, limit {limit}"


def test_a_cold_resident_goes_before_an_empty_way_takes_a_rarely_seen_row():
    """Bars, not estimates, order the ways: a resident read 0 times (bar 0 x 1.5 + 1) goes to
    the hotter candidate (3 > 1), and the empty way's admit_min (3) keeps the colder one (2)
    out. Ordered by estimate, the empty way (-1) would come first: the hotter candidate would
    fail its admit_min and the colder one would take the resident's way."""
    cache = small_cache(sets=1, bits=12, admit_min=3)
    keys = hot_cache.row_keys(torch.zeros(10, dtype=torch.int64), torch.arange(10))
    counts = torch.tensor([0, *[50] * 6, 0, 3, 2], dtype=torch.int32)
    for d in range(hot_cache.SKETCH_DEPTH):
        cache.sketch[d][hot_cache.sketch_index(keys, d, 12)] = counts
    cache.keys[0, :7] = keys[:7]  # way 7 empty
    chosen = hot_cache.choose_admissions(cache, keys[8:])
    assert chosen.keys.tolist() == [int(keys[8])] and chosen.ways.tolist() == [0]


def test_two_winners_of_a_set_never_take_one_way_while_its_counts_move():
    """Gathers count on while a plan is made, so each candidate's read of its set's line may
    see other counts: here the second candidate's read sees the weakest resident two higher,
    which orders the two weakest ways the other way round. Both winners must still get ways
    of their own (two on one way would fill one slot with two rows)."""
    cache = small_cache(sets=1, bits=12, admit_min=0)
    keys = hot_cache.row_keys(torch.zeros(10, dtype=torch.int64), torch.arange(10))
    # The second candidate beats the second weakest by one in the set's first read (12 > 11)
    # and not at all in its own (12 against the first resident's 10 + 2).
    counts = torch.tensor([10, 11, *[1000] * 6, 100, 12], dtype=torch.int32)
    for d in range(hot_cache.SKETCH_DEPTH):
        cache.sketch[d][hot_cache.sketch_index(keys, d, 12)] = counts
    cache.keys[0] = keys[:WAYS]
    counted = cache.estimate

    def moving(k: torch.Tensor) -> torch.Tensor:
        if k.dim() < 2:
            return counted(k)
        later = torch.arange(k.shape[0]).view(-1, 1) >= 1  # each candidate reads its own line
        return counted(k) + 2 * (later & (k == keys[0]))

    cache.estimate = moving
    chosen = hot_cache.choose_admissions(cache, keys[WAYS:], margin=0, ratio=1.0)
    assert sorted(chosen.keys.tolist()) == sorted(keys[WAYS:].tolist())
    assert sorted(chosen.ways.tolist()) == [0, 1], "the two weakest ways, one each"


def test_log_window_wraps_around_the_ring():
    cache = small_cache()
    cache.log.copy_(torch.arange(64))
    assert cache.logged_since(60, 66).tolist() == [60, 61, 62, 63, 0, 1]
    assert cache.logged_since(5, 5 + 64).tolist() == list(range(64))
    assert cache.logged_since(3, 7).tolist() == [3, 4, 5, 6]


def test_valid_keys_rejects_torn_or_foreign_entries():
    rows = torch.tensor([100, 50])
    keys = torch.tensor([hot_cache.row_keys(torch.tensor(0), torch.tensor(99)).item(),
                         hot_cache.row_keys(torch.tensor(1), torch.tensor(50)).item(),
                         hot_cache.row_keys(torch.tensor(2), torch.tensor(0)).item(), -1, -(2**62)])
    assert hot_cache.valid_keys(keys, rows).tolist() == [True, False, False, False, False]


def test_empty_ways_take_only_rows_seen_more_than_admit_min_times_and_at_most_limit():
    cache = small_cache(sets=4, bits=16, admit_min=3)
    keys = hot_cache.row_keys(torch.zeros(64, dtype=torch.int64), torch.arange(64))
    counts = torch.arange(64, dtype=torch.int32) % 6  # 0..5 lookups each
    for d in range(hot_cache.SKETCH_DEPTH):
        cache.sketch[d].index_put_((hot_cache.sketch_index(keys, d, 16),), counts, accumulate=True)
    chosen = hot_cache.choose_admissions(cache, keys)
    estimates = cache.estimate(chosen.keys)
    assert len(chosen) > 0 and (estimates > 3).all()
    assert set(keys[cache.estimate(keys) > 3].tolist()) >= set(chosen.keys.tolist())
    capped = hot_cache.choose_admissions(cache, keys, limit=2)
    assert len(capped) == 2 and (cache.estimate(capped.keys) == 5).all()


def test_warm_file_loads_integer_row_ids_and_names_the_file_when_wrong(tmp_path):
    import numpy as np

    from engramd.client.errors import ConfigError
    from engramd.client.shared.cache_keeper import load_warm_ids

    good = tmp_path / "warm.npy"
    np.save(good, np.arange(2 * 2 * 3, dtype=np.int32).reshape(2, 2, 3))
    ids = load_warm_ids(str(good), n_layers=2, heads=3)
    assert ids.dtype == torch.int64 and ids.tolist() == np.arange(12).reshape(2, 2, 3).tolist()
    wrong_shape, floats, text = tmp_path / "shape.npy", tmp_path / "floats.npy", tmp_path / "t.npy"
    np.save(wrong_shape, np.zeros((4, 3, 3), dtype=np.int64))
    np.save(floats, np.zeros((4, 2, 3), dtype=np.float32))
    text.write_text("not an array")
    for path in (wrong_shape, floats, text, tmp_path / "missing.npy"):
        with pytest.raises(ConfigError, match=path.name):
            load_warm_ids(str(path), n_layers=2, heads=3)
    import os

    fd = os.open(good, os.O_RDONLY)
    try:  # through a descriptor (a mapped client's), whatever its file offset
        os.lseek(fd, 7, os.SEEK_SET)
        assert load_warm_ids(fd, n_layers=2, heads=3).tolist() == ids.tolist()
        assert os.lseek(fd, 0, os.SEEK_CUR) == 7
    finally:
        os.close(fd)


def test_a_keeper_over_new_tables_sizes_its_cache_from_the_budget_and_reports_it():
    from engramd.client.shared.cache_keeper import CacheKeeper

    tables = [torch.zeros((100, 264), dtype=torch.uint8), torch.zeros((50, 264), dtype=torch.uint8)]
    budget = 3 << 20
    keeper = CacheKeeper.over(tables, budget, lambda: [], interval=0.05)
    expected = CacheLayout.from_budget(budget, 264)
    assert keeper.cache.layout == expected and keeper.cache.n_layers == 2
    assert keeper.table_rows.tolist() == [100, 50]
    report = keeper.report()
    assert (report["slots"], report["bytes"]) == (expected.slots, expected.nbytes)
    assert report["reads"] == report["hits"] == [0, 0] and report["admitted"] == 0
    with pytest.raises(CacheConfigError):
        CacheKeeper.over(tables, 1000, lambda: [], interval=0.05)


def test_a_keeper_warms_on_its_own_thread_and_a_trace_it_cannot_read_leaves_it_cold(tmp_path, caplog):
    """start(trace) returns before the trace is read; the keeper's thread then counts it, admits
    its hot rows (in parts of a refresh's size) and closes the trace's descriptor, and report()
    says "warming" until then. A trace that cannot be read is logged and the keeper goes on
    refreshing; one given to a keeper stopped first is closed unread."""
    import os
    import threading

    import numpy as np

    from engramd.client.shared.cache_keeper import CacheKeeper, WarmUpTrace

    tables = [torch.randint(0, 256, (100, 264), dtype=torch.uint8),
              torch.randint(0, 256, (50, 264), dtype=torch.uint8)]
    hot = torch.stack([torch.arange(0, 40, 5), torch.arange(1, 41, 5)], dim=1)  # [8 tokens, 2 layers]
    np.save(tmp_path / "warm.npy", hot.unsqueeze(-1).repeat(12, 1, 3).numpy())  # each row 36 times
    (tmp_path / "bad.npy").write_bytes(b"not an array")
    release = threading.Event()

    class HeldTrace(WarmUpTrace):
        def read(self):
            assert release.wait(10.0)
            return super().read()

    def trace(name: str, kind: type = WarmUpTrace) -> WarmUpTrace:
        return kind(os.open(tmp_path / name, os.O_RDONLY), 2, 3, slice(0, 3))

    def closed(fd: int) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return True
        return False

    def settle(keeper: CacheKeeper, done) -> None:
        deadline = time.monotonic() + 10.0
        while not done(keeper.report()) and time.monotonic() < deadline:
            time.sleep(0.01)

    held = trace("warm.npy", HeldTrace)
    fd = held._fd
    keeper = CacheKeeper.over(tables, 3 << 20, lambda: [], interval=0.01)
    keeper.max_admissions = 3  # 16 rows (8 tokens x 2 layers): six parts
    parts, change = [], keeper._change
    keeper._change = lambda chosen: parts.append(len(chosen)) or change(chosen)
    keeper.start(held)
    try:
        assert keeper.report()["admitted"] == 0 and keeper.report()["warming"]  # not read yet
        release.set()
        settle(keeper, lambda r: not r["warming"])
        layers = torch.arange(2).view(1, 2).expand_as(hot)
        keys = hot_cache.row_keys(layers, hot).reshape(-1)
        assert keeper.report()["admitted"] == keys.numel() and not keeper.report()["warming"]
        assert bool(keeper.cache.resident(keys).all()) and closed(fd) and parts == [3, 3, 3, 3, 3, 1]
    finally:
        keeper.close()

    broken = trace("bad.npy")
    fd = broken._fd
    keeper = CacheKeeper.over(tables, 3 << 20, lambda: [], interval=0.01).start(broken)
    try:
        settle(keeper, lambda r: r["refreshes"] > 0)
        assert keeper.report()["refreshes"] > 0 and keeper.report()["admitted"] == 0
        assert "starts cold" in caplog.text and closed(fd) and not keeper.report()["warming"]
    finally:
        keeper.close()

    unread = trace("warm.npy", HeldTrace)
    fd = unread._fd
    keeper = CacheKeeper.over(tables, 3 << 20, lambda: [], interval=0.01)
    keeper.stop()
    keeper.start(unread)
    keeper.close()
    assert closed(fd) and keeper.report()["admitted"] == 0 and not keeper.report()["warming"]


def test_a_refresh_takes_the_counters_into_its_stats_and_the_log_up_to_the_cursor():
    """What the gathers counted (reads, hits per layer) reaches the stats, and the candidates
    logged before the cursor are weighed, those after it not yet: a hot row logged first is
    admitted, a hotter one written past the cursor waits for the next refresh."""
    from engramd.client.shared.cache_keeper import CacheKeeper

    tables = [torch.randint(0, 256, (100, 264), dtype=torch.uint8),
              torch.randint(0, 256, (50, 264), dtype=torch.uint8)]
    keeper = CacheKeeper(HotCache(CacheLayout(16, 264, 10, 64), 2, "cpu"), tables, lambda: [])
    cache = keeper.cache
    logged, later = hot_cache.row_keys(torch.tensor([1, 0]), torch.tensor([7, 9]))
    for key, count in ((logged, 10), (later, 20)):
        for d in range(hot_cache.SKETCH_DEPTH):
            cache.sketch[d][hot_cache.sketch_index(key, d, 10)] = count
    cache.log[:2] = torch.stack([logged, later])
    cache.cursor[0] = 1
    cache.counters.copy_(torch.tensor([[500, 70], [40, 3]]))
    assert keeper.refresh() == 1
    assert (keeper.stats.reads, keeper.stats.hits) == ([500, 70], [40, 3])
    assert cache.resident(torch.stack([logged, later])).tolist() == [True, False]
    first = keeper.report()
    cache.cursor[0] = 2
    assert keeper.refresh() == 1 and bool(cache.resident(later.view(1)))
    # Each refresh's wall and CPU time adds to the totals (the CPU's within the wall's).
    report = keeper.report()
    assert report["refreshes"] == 2
    assert report["refresh_ms_total"] >= first["refresh_ms_total"] + report["refresh_ms"] - 0.002
    assert 0 < report["refresh_cpu_ms_total"] <= report["refresh_ms_total"] + 0.01
    assert torch.equal(cache.pool[(cache.keys.view(-1) == later).nonzero().item()], tables[0][9])


def test_a_refresh_admits_what_choose_admissions_picks_from_the_logs_distinct_candidates():
    """The refresh's fixed-shape choice (sorted entries, the first of each run, no unique or
    boolean indexing until the host has them) against choose_admissions of the candidates
    taken the plain way: the log's real keys, distinct, not resident. The log repeats keys,
    holds torn and out-of-table entries and residents, and the limit cuts the winners."""
    from engramd.client.shared.cache_keeper import CacheKeeper

    gen = torch.Generator().manual_seed(5)
    tables = [torch.randint(0, 256, (300, 264), dtype=torch.uint8, generator=gen),
              torch.randint(0, 256, (200, 264), dtype=torch.uint8, generator=gen)]
    cache = HotCache(CacheLayout(4, 264, 12, 256), 2, "cpu", admit_min=1)
    keeper = CacheKeeper(cache, tables, lambda: [])
    keeper.max_admissions = 12
    layers = torch.randint(0, 2, (120,), generator=gen)
    keys = torch.unique(hot_cache.row_keys(layers, torch.randint(1, 200, (120,), generator=gen)))
    # Distinct counts, so that the limit's cut does not depend on how ties are ordered.
    counts = torch.randperm(keys.numel(), generator=gen).to(torch.int32) + 2
    for d in range(hot_cache.SKETCH_DEPTH):
        cache.sketch[d][hot_cache.sketch_index(keys, d, 12)] = counts
        # Key 0, never logged, is what a torn entry (-1) would be counted as: the hottest.
        cache.sketch[d][hot_cache.sketch_index(torch.tensor([0]), d, 12)] = 10_000
    sets = hot_cache.set_index(keys, 4)
    for s in range(4):  # two residents a set
        cache.keys[s, :2] = keys[sets == s][:2]
    # The set a torn entry (-1) hashes to has no empty way, whose EMPTY_KEY would hide it.
    torn = int(hot_cache.set_index(torch.tensor([-1]), 4)[0])
    cache.keys[torn] = keys[sets == torn][:WAYS]
    foreign = torch.tensor([-1, hot_cache.row_keys(torch.tensor(2), torch.tensor(0)).item(),
                            hot_cache.row_keys(torch.tensor(1), torch.tensor(250)).item()])
    logged = torch.cat([keys, keys[::3], foreign])
    logged = logged[torch.randperm(logged.numel(), generator=gen)]
    cache.log[:logged.numel()] = logged
    cache.cursor[0] = logged.numel()

    plain = keys[~cache.resident(keys)]
    want = hot_cache.choose_admissions(cache, plain, keeper.margin, limit=keeper.max_admissions)
    before = cache.keys.clone()
    assert 0 < len(want) == keeper.max_admissions < plain.numel()
    assert keeper.refresh() == len(want)
    changed = (cache.keys != before).nonzero().tolist()
    assert sorted(changed) == sorted(map(list, zip(want.sets.tolist(), want.ways.tolist(), strict=True)))
    assert sorted(cache.keys[want.sets, want.ways].tolist()) == sorted(want.keys.tolist())
    for key, slot in zip(want.keys.tolist(), want.slots.tolist(), strict=True):
        layer, row = key >> hot_cache.KEY_LAYER_SHIFT, key & ((1 << hot_cache.KEY_LAYER_SHIFT) - 1)
        assert torch.equal(cache.pool[slot], tables[layer][row]), f"slot {slot}: not its key's row"


def test_a_refresh_weighs_only_the_newest_entries_of_a_long_window(monkeypatch):
    """A window longer than MAX_REFRESH_ENTRIES (here 2) is cut to its newest entries, which
    bounds the memory of the refresh's choice; the older ones are dropped, not kept for later."""
    from engramd.client.shared import cache_keeper

    monkeypatch.setattr(cache_keeper, "MAX_REFRESH_ENTRIES", 2)
    tables = [torch.randint(0, 256, (100, 264), dtype=torch.uint8)]
    keeper = cache_keeper.CacheKeeper(HotCache(CacheLayout(16, 264, 10, 64), 1, "cpu", admit_min=0),
                                      tables, lambda: [])
    cache = keeper.cache
    logged = hot_cache.row_keys(torch.zeros(4, dtype=torch.int64), torch.tensor([1, 2, 3, 4]))
    for d in range(hot_cache.SKETCH_DEPTH):
        cache.sketch[d][hot_cache.sketch_index(logged, d, 10)] = 50
    cache.log[:4] = logged
    cache.cursor[0] = 4
    assert keeper.refresh() == 2
    assert cache.resident(logged).tolist() == [False, False, True, True]
    assert keeper.refresh() == 0, "the cut entries are not weighed later"


@pytest.mark.parametrize("most", [7, 40])
def test_a_warm_up_chooses_in_parts_what_it_would_choose_at_once(monkeypatch, most):
    """A warm-up's candidates are weighed MAX_REFRESH_ENTRIES at a time (here 7: every set has
    more, so each part is a whole set; 40: cuts fall inside sets and move back to where one
    begins): the same admissions as one choice over all of them."""
    from engramd.client.shared import cache_keeper

    gen = torch.Generator().manual_seed(11)
    cache = HotCache(CacheLayout(16, 264, 14, 64), 2, "cpu", admit_min=1)
    keeper = cache_keeper.CacheKeeper(cache, [torch.zeros((5000, 264), dtype=torch.uint8)] * 2,
                                      lambda: [])
    keys = torch.unique(hot_cache.row_keys(torch.randint(0, 2, (400,), generator=gen),
                                           torch.randint(0, 5000, (400,), generator=gen)))
    counts = torch.randperm(keys.numel(), generator=gen).to(torch.int32) + 1  # no ties
    for d in range(hot_cache.SKETCH_DEPTH):
        cache.sketch[d][hot_cache.sketch_index(keys, d, 14)] = counts
    sets = hot_cache.set_index(keys, 16)
    for s in range(16):
        cache.keys[s, :5] = keys[sets == s][:5]
    candidates = keys[~cache.resident(keys)]
    whole = hot_cache.choose_admissions(cache, candidates, keeper.margin)
    monkeypatch.setattr(cache_keeper, "MAX_REFRESH_ENTRIES", most)
    parts = keeper._choose_by_sets(candidates)
    assert len(whole) > 16

    def triples(a):
        return sorted(zip(a.sets.tolist(), a.ways.tolist(), a.keys.tolist(), strict=True))

    assert triples(parts) == triples(whole)
