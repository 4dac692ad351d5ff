"""Table geometry against the published DeepSeek-V4.1-Flash numbers and an independent prime walk."""

from __future__ import annotations

import json

import pytest

from engramd.client.geometry import (
    V41_FLASH_CONFIG,
    GeometryError,
    TableGeometry,
    bucket_primes,
    is_prime,
)


def trial_division_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


@pytest.fixture(scope="module")
def v41() -> TableGeometry:
    return TableGeometry.named("v4.1-flash")


def test_v41_rows_and_first_primes(v41):
    assert v41.rows == (384_006_168, 384_016_682)
    assert v41.primes[0][0] == 16_000_057 and v41.primes[0][-1] == 16_000_463
    assert v41.primes[1][0] == 16_000_477 and v41.primes[1][-1] == 16_000_889
    assert v41.heads == 24 and v41.row_bytes == 264 and v41.n_layers == 2
    assert v41.total_bytes == (384_006_168 + 384_016_682) * 264


def test_v41_primes_are_the_consecutive_primes_from_the_base(v41):
    flat = [p for layer in v41.primes for p in layer]
    assert len(set(flat)) == 48 and flat == sorted(flat)
    assert all(trial_division_prime(p) for p in flat)
    # No prime was skipped: every integer between consecutive buckets is composite.
    for n in range(16_000_000, flat[-1]):
        assert trial_division_prime(n) == (n in flat), n


def test_offsets_are_prefix_sums(v41):
    for layer in range(2):
        acc = 0
        for col in range(24):
            assert v41.offsets[layer][col] == acc
            acc += v41.primes[layer][col]
        assert acc == v41.rows[layer]


def test_tp4_ranges(v41):
    for rank in range(4):
        shard = v41.shard(rank, 4)
        assert (shard.head_start, shard.head_end, shard.local_heads) == (6 * rank, 6 * rank + 6, 6)
        for layer in range(2):
            lo, hi = shard.row_ranges[layer]
            assert lo == sum(v41.primes[layer][:6 * rank])
            assert hi == sum(v41.primes[layer][:6 * rank + 6])
    assert v41.shard(0, 4).row_ranges[0] == (0, 96_000_564)
    assert v41.shard(3, 4).row_ranges[1][1] == 384_016_682
    # About 96 M rows and 23.6 GiB per layer per rank, as the reference says.
    lo, hi = v41.shard(1, 4).row_ranges[0]
    assert abs((hi - lo) * 264 / 2**30 - 23.6) < 0.05


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 7, 13, 24, 25, 30])
def test_uneven_shards_cover_every_head_once(v41, shards):
    part = -(-24 // shards)
    seen = []
    for rank in range(shards):
        shard = v41.shard(rank, shards)
        assert shard.local_heads == part
        seen.extend(range(shard.head_start, shard.head_end))
        if shard.owned_heads == 0:
            assert all(lo == hi for lo, hi in shard.row_ranges)
    assert seen == list(range(24))


def test_shard_rank_errors(v41):
    with pytest.raises(GeometryError, match="rank 4"):
        v41.shard(4, 4)
    with pytest.raises(GeometryError, match="must be >= 1"):
        v41.shard(0, 0)


def test_is_prime_matches_trial_division():
    assert [n for n in range(2000) if is_prime(n)] == [n for n in range(2000) if trial_division_prime(n)]
    assert bucket_primes(10, 3) == [11, 13, 17]
    assert bucket_primes(11, 1) == [11]  # "greater than vocab_size - 1" includes vocab_size itself


def test_config_file_and_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**V41_FLASH_CONFIG, "hidden_size": 4096}))
    assert TableGeometry.from_file(path).rows == (384_006_168, 384_016_682)
    bad = {**V41_FLASH_CONFIG, "engram_num_embeddings": [1, 2]}
    path.write_text(json.dumps(bad))
    with pytest.raises(GeometryError, match="engram_num_embeddings"):
        TableGeometry.from_file(path)
    missing = {k: v for k, v in V41_FLASH_CONFIG.items() if k != "engram_n_heads"}
    with pytest.raises(GeometryError, match="engram_n_heads"):
        TableGeometry.from_config(missing, "x.json")
    with pytest.raises(GeometryError, match="engram_head_dim"):
        TableGeometry.from_config({**V41_FLASH_CONFIG, "engram_head_dim": 100}, "x.json")
    with pytest.raises(GeometryError, match="unknown geometry"):
        TableGeometry.resolve("v9")


def test_to_config_round_trip(v41):
    assert TableGeometry.from_config(v41.to_config()) == v41
    demo = TableGeometry.named("demo")
    assert demo.heads == 24 and demo.head_dim == 256 and demo.total_bytes < 16 * 2**20
