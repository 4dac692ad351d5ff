"""The plain-torch gather + dequantize reference against independent numpy oracles.

The dequantization oracle decodes E4M3 and UE8M0 from their bit fields in float64 and rounds to
BF16 by hand (round half to even), without torch's float8 or bfloat16 conversions. The gather
oracle is a per-element Python loop over (layer, token, local head).
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

from engramd.client.geometry import DEAD_ID, ShardView, TableGeometry
from engramd.kernels import gather_ref
from engramd.kernels.gather_ref import (
    dequantize_rows,
    gather,
    gather_layer,
    gather_packed_layer,
)

SHARD_COUNTS = (1, 2, 4, 5, 7)


# ---------------------------------------------------------------- float64 oracle


def e4m3_to_float64(raw: np.ndarray) -> np.ndarray:
    """E4M3 (bias 7, no inf, S.1111.111 is NaN) decoded from its bits."""
    b = raw.astype(np.int64)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    subnormal = np.ldexp(mantissa.astype(np.float64), -9)  # 0.mmm * 2^-6
    normal = np.ldexp(1.0 + mantissa / 8.0, exponent - 7)
    value = np.where(exponent == 0, subnormal, normal)
    value = np.where(b & 0x80, -value, value)
    return np.where((exponent == 15) & (mantissa == 7), np.nan, value)


def ue8m0_to_float64(raw: np.ndarray) -> np.ndarray:
    """UE8M0: 2^(s - 127); 0xFF is NaN."""
    s = raw.astype(np.int64)
    return np.where(s == 255, np.nan, np.ldexp(1.0, s - 127))


def float64_to_bf16_bits(value: np.ndarray) -> np.ndarray:
    """Round float64 to BF16 (nearest, ties to even, overflow to inf) and return the bit patterns.

    NaN positions get 0x7FC0; callers compare NaN by position, not by payload.
    """
    magnitude = np.abs(np.nan_to_num(value, nan=0.0))
    _, frexp_exp = np.frexp(magnitude)  # magnitude in [2^(e-1), 2^e)
    # 8 significant bits in the normal range; a fixed step of 2^-133 below 2^-126.
    step_exp = np.maximum(frexp_exp - 1, -126) - 7
    rounded = np.ldexp(np.rint(np.ldexp(magnitude, -step_exp)), step_exp)
    rounded = np.where(rounded >= 2.0**128, np.inf, rounded)
    bits = (rounded.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits |= np.signbit(value).astype(np.uint16) << 15
    return np.where(np.isnan(value), np.uint16(0x7FC0), bits)


def oracle_dequantize(packed: np.ndarray, head_dim: int) -> np.ndarray:
    """uint8 [..., row_bytes] -> BF16 bit patterns uint16 [..., head_dim]."""
    weights = e4m3_to_float64(packed[..., :head_dim])
    scales = np.repeat(ue8m0_to_float64(packed[..., head_dim:]), 32, axis=-1)
    return float64_to_bf16_bits(weights * scales)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    assert t.dtype == torch.bfloat16
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def is_bf16_nan(bits: np.ndarray) -> np.ndarray:
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)


def assert_same(actual: np.ndarray, expected: np.ndarray, what: str, nan_aware=False) -> None:
    """Exact equality; reports the first failing indices with both values."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if nan_aware:
        nan_a, nan_e = is_bf16_nan(actual), is_bf16_nan(expected)
        bad = (nan_a != nan_e) | (~nan_e & (actual != expected))
    else:
        bad = actual != expected
    if bad.any():
        where = np.argwhere(bad)
        shown = ", ".join(
            f"{tuple(int(i) for i in idx)}: got {actual[tuple(idx)]:#x} want {expected[tuple(idx)]:#x}"
            for idx in where[:8]
        )
        pytest.fail(f"{what}: {len(where)} of {bad.size} elements differ; first: {shown}")


# ---------------------------------------------------------------- dequantize_rows


def all_pattern_rows(head_dim: int) -> np.ndarray:
    """Every E4M3 byte (NaN included) under every scale byte, plus mixed per-block scales."""
    row_bytes = head_dim + head_dim // 32
    per_scale = max(1, 256 // head_dim)  # rows needed to show all 256 bytes under one scale
    weights = np.resize(np.arange(256, dtype=np.uint8), per_scale * head_dim)
    uniform = np.zeros((256, per_scale, row_bytes), dtype=np.uint8)
    uniform[:, :, :head_dim] = weights.reshape(per_scale, head_dim)
    uniform[:, :, head_dim:] = np.arange(256, dtype=np.uint8)[:, None, None]
    uniform = uniform.reshape(-1, row_bytes)
    mixed = np.random.default_rng(1).integers(0, 256, size=(64, row_bytes), dtype=np.uint8)
    return np.concatenate([uniform, mixed])


@pytest.mark.parametrize("head_dim", [256, 64, 32])
def test_dequantize_matches_float64_oracle_for_every_pattern(head_dim):
    packed = all_pattern_rows(head_dim)
    seen = set(zip(packed[:, :head_dim].ravel().tolist(),
                   np.repeat(packed[:, head_dim:], 32, axis=1).ravel().tolist(), strict=True))
    assert len(seen) == 256 * 256  # every (E4M3 byte, scale byte) pair occurs
    got = bf16_bits(dequantize_rows(torch.from_numpy(packed), head_dim))
    assert_same(got, oracle_dequantize(packed, head_dim), "dequantize_rows", nan_aware=True)


def test_dequantize_fixed_points():
    # Values known by definition of the formats, independent of any decoder.
    row = np.zeros(264, dtype=np.uint8)
    row[0], row[1], row[2], row[32], row[33] = 0x38, 0x7E, 0x01, 0x38, 0xB8  # 1, 448, 2^-9, 1, -1
    row[256], row[257] = 127, 0  # block 0 scale 1.0, block 1 scale 2^-127
    out = dequantize_rows(torch.from_numpy(row), 256).to(torch.float64).numpy()
    assert out[0] == 1.0 and out[1] == 448.0 and out[2] == 2.0**-9
    assert out[32] == 2.0**-127 and out[33] == -(2.0**-127)  # not flushed by a bitcast shortcut


def test_dequantize_keeps_leading_dims_and_accepts_strided_input():
    packed = np.random.default_rng(2).integers(0, 255, size=(3, 5, 264), dtype=np.uint8)
    packed[..., 256:] = np.minimum(packed[..., 256:], 254)
    strided = torch.from_numpy(packed).transpose(0, 1)  # not contiguous
    got = dequantize_rows(strided, 256)
    assert got.shape == (5, 3, 256) and got.dtype == torch.bfloat16
    want = oracle_dequantize(packed.transpose(1, 0, 2), 256)
    assert_same(bf16_bits(got), want, "strided dequantize", nan_aware=True)


def test_dequantize_rejects_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        dequantize_rows(torch.zeros(264, dtype=torch.int8), 256)
    with pytest.raises(ValueError, match="last dimension 264"):
        dequantize_rows(torch.zeros(4, 256, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize_rows(torch.zeros(4, 264, dtype=torch.uint8), 250)
    with pytest.raises(TypeError, match="torch.Tensor"):
        dequantize_rows(np.zeros(264, dtype=np.uint8), 256)


# ---------------------------------------------------------------- gather vs a Python loop


def small_geometry(head_dim: int = 256) -> TableGeometry:
    return TableGeometry.from_config({
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": head_dim,
        "engram_vocab_size": 20,
        "engram_compressed_vocab_size": 100,
        "engram_pad_token_id": 2,
    }, source="small test geometry")


def random_tables(geometry: TableGeometry, seed: int) -> list[np.ndarray]:
    """Random rows without NaN bytes, so gathered rows compare bit for bit."""
    rng = np.random.default_rng(seed)
    tables = []
    for rows in geometry.rows:
        table = rng.integers(0, 256, size=(rows, geometry.row_bytes), dtype=np.uint8)
        weights = table[:, :geometry.head_dim]
        weights[(weights & 0x7F) == 0x7F] -= 1
        table[:, geometry.head_dim:] = np.minimum(table[:, geometry.head_dim:], 254)
        tables.append(table)
    return tables


def mixed_ids(geometry: TableGeometry, tokens: int, seed: int) -> np.ndarray:
    """[T, L, H] IDs: own-bucket rows, any rows (other shards'), DEAD, >= rows, other negatives,
    with repeated tokens and one sorted column."""
    rng = np.random.default_rng(seed)
    ids = np.empty((tokens, geometry.n_layers, geometry.heads), dtype=np.int64)
    for layer in range(geometry.n_layers):
        rows = geometry.rows[layer]
        for col in range(geometry.heads):
            own = geometry.offsets[layer][col] + rng.integers(0, geometry.primes[layer][col], tokens)
            choices = [
                own, rng.integers(0, rows, tokens), np.full(tokens, DEAD_ID),
                rng.integers(rows, rows + 4, tokens), rng.integers(-5, -1, tokens),
                np.full(tokens, 2**31 + 7), np.full(tokens, -(2**31)),
            ]
            pick = rng.choice(len(choices), size=tokens, p=[.45, .2, .1, .1, .05, .05, .05])
            ids[:, layer, col] = np.choose(pick, choices)
    ids[1::3] = ids[0]  # repeated rows across tokens
    ids[:, :, 0] = np.sort(ids[:, :, 0], axis=0)
    return ids


def with_boundaries(ids: np.ndarray, shard: ShardView) -> np.ndarray:
    """Append one token whose owned heads hold lo - 1, lo, hi - 1, hi of each layer's range."""
    extra = np.full((1,) + ids.shape[1:], DEAD_ID, dtype=ids.dtype)
    for layer, (lo, hi) in enumerate(shard.row_ranges):
        for k, head in enumerate(range(shard.head_start, shard.head_end)):
            extra[0, layer, head] = (lo - 1, lo, hi - 1, hi)[k % 4]
    return np.concatenate([ids, extra])


def loop_gather(tables, ids, shard: ShardView, width: int, row_value) -> np.ndarray:
    """The contract spelled out element by element."""
    tokens, n_layers, _ = ids.shape
    out = np.zeros((n_layers, tokens, shard.local_heads, width), dtype=row_value(0, 0).dtype)
    for layer in range(n_layers):
        lo, hi = shard.row_ranges[layer]
        for t in range(tokens):
            for j in range(shard.local_heads):
                head = shard.head_start + j
                if head >= shard.head_end:
                    continue  # padded head
                row = int(ids[t, layer, head])
                if row != DEAD_ID and lo <= row < hi:
                    out[layer, t, j] = row_value(layer, row)
    return out


def loop_out_of_range(tables, ids, shard: ShardView) -> int:
    count = 0
    for layer, table in enumerate(tables):
        for row in ids[:, layer, shard.head_start:shard.head_end].ravel().tolist():
            count += row != DEAD_ID and not 0 <= row < len(table)
    return count


@pytest.fixture(scope="module")
def world():
    geometry = small_geometry()
    tables = random_tables(geometry, seed=3)
    dequantized = [oracle_dequantize(t, geometry.head_dim) for t in tables]
    return geometry, tables, dequantized


def shard_cases():
    return [(s, r) for s in SHARD_COUNTS for r in range(s)]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shards,rank", shard_cases())
def test_gather_matches_loop(world, shards, rank, id_dtype):
    geometry, tables, dequantized = world
    shard = geometry.shard(rank, shards)
    ids = with_boundaries(mixed_ids(geometry, tokens=19, seed=shards * 10 + rank), shard)
    if id_dtype == torch.int32:
        ids = np.clip(ids, -(2**31), 2**31 - 1)
    torch_ids = torch.from_numpy(ids).to(id_dtype)
    torch_tables = [torch.from_numpy(t) for t in tables]

    out, bad = gather(torch_tables, torch_ids, shard)
    want = loop_gather(tables, ids, shard, geometry.head_dim, lambda layer, r: dequantized[layer][r])
    assert out.shape == (geometry.n_layers, 20, shard.local_heads, geometry.head_dim)
    assert_same(bf16_bits(out), want, f"gather shard {rank}/{shards}")
    assert bad == loop_out_of_range(tables, ids, shard)

    packed, bad_packed = gather(torch_tables, torch_ids, shard, packed=True)
    want_packed = loop_gather(tables, ids, shard, geometry.row_bytes, lambda layer, r: tables[layer][r])
    assert packed.dtype == torch.uint8
    assert_same(packed.numpy(), want_packed, f"packed gather shard {rank}/{shards}")
    assert bad_packed == bad


def test_gather_layer_and_packed_layer_match_loop(world):
    geometry, tables, dequantized = world
    shard = geometry.shard(4, 5)  # 4 owned heads of 5: one padded head
    ids = with_boundaries(mixed_ids(geometry, tokens=23, seed=7), shard)
    lo, hi = shard.row_ranges[1]
    args = (shard.head_start, shard.head_end, shard.local_heads, lo, hi)
    layer_ids = torch.from_numpy(ids[:, 1].copy())

    out, bad = gather_layer(torch.from_numpy(tables[1]), layer_ids, *args)
    want = loop_gather(tables, ids, shard, geometry.head_dim, lambda layer, r: dequantized[layer][r])[1]
    assert_same(bf16_bits(out), want, "gather_layer")
    one_layer = ShardView(shard.rank, shard.shards, shard.head_start, shard.head_end,
                          shard.local_heads, (shard.row_ranges[1],))
    assert bad == loop_out_of_range(tables[1:], ids[:, 1:], one_layer)

    packed = gather_packed_layer(torch.from_numpy(tables[1]), layer_ids, *args)
    want_packed = loop_gather(tables, ids, shard, geometry.row_bytes, lambda layer, r: tables[layer][r])
    assert_same(packed.numpy(), want_packed[1], "gather_packed_layer")


def test_gather_writes_into_given_out_and_zeroes_masked(world):
    geometry, tables, dequantized = world
    shard = geometry.shard(1, 4)
    ids = mixed_ids(geometry, tokens=11, seed=8)
    out = torch.full((2, 11, shard.local_heads, geometry.head_dim), 7.0, dtype=torch.bfloat16)
    got, _ = gather([torch.from_numpy(t) for t in tables], torch.from_numpy(ids), shard, out=out)
    assert got is out
    want = loop_gather(tables, ids, shard, geometry.head_dim, lambda layer, r: dequantized[layer][r])
    assert_same(bf16_bits(out), want, "gather into out")


def test_gather_in_small_chunks_matches_loop(world, monkeypatch):
    geometry, tables, dequantized = world
    monkeypatch.setattr(gather_ref, "CHUNK_ROWS", 7)  # several chunks, a ragged last one
    shard = geometry.shard(0, 2)
    ids = with_boundaries(mixed_ids(geometry, tokens=13, seed=9), shard)
    out, bad = gather([torch.from_numpy(t) for t in tables], torch.from_numpy(ids), shard)
    want = loop_gather(tables, ids, shard, geometry.head_dim, lambda layer, r: dequantized[layer][r])
    assert_same(bf16_bits(out), want, "chunked gather")
    assert bad == loop_out_of_range(tables, ids, shard)


def test_gather_other_head_dim():
    geometry = small_geometry(head_dim=64)
    tables = random_tables(geometry, seed=4)
    dequantized = [oracle_dequantize(t, 64) for t in tables]
    shard = geometry.shard(2, 4)
    ids = mixed_ids(geometry, tokens=9, seed=10)
    out, _ = gather([torch.from_numpy(t) for t in tables], torch.from_numpy(ids), shard)
    want = loop_gather(tables, ids, shard, 64, lambda layer, r: dequantized[layer][r])
    assert_same(bf16_bits(out), want, "head_dim 64 gather")


def test_gather_no_tokens_and_shard_past_the_end(world):
    geometry, tables, _ = world
    torch_tables = [torch.from_numpy(t) for t in tables]
    empty, bad = gather(torch_tables, torch.zeros(0, 2, 24, dtype=torch.int64), geometry.shard(0, 1))
    assert empty.shape == (2, 0, 24, geometry.head_dim) and bad == 0
    past = geometry.shard(6, 7)
    assert past.head_start == past.head_end == 24
    ids = torch.from_numpy(mixed_ids(geometry, tokens=5, seed=11))
    out, bad = gather(torch_tables, ids, past)
    assert out.shape == (2, 5, 4, geometry.head_dim) and not out.any() and bad == 0


def test_gather_rejects_bad_arguments(world):
    geometry, tables, _ = world
    shard = geometry.shard(0, 2)
    good_tables = [torch.from_numpy(t) for t in tables]
    ids = torch.zeros(3, 2, 24, dtype=torch.int64)
    with pytest.raises(ValueError, match="2 tables"):
        gather(good_tables[:1], ids, shard)
    with pytest.raises(TypeError, match="int32 or int64"):
        gather(good_tables, ids.to(torch.int16), shard)
    with pytest.raises(TypeError, match="int32 or int64"):
        gather(good_tables, ids.to(torch.float32), shard)
    with pytest.raises(ValueError, match="3-D"):
        gather(good_tables, ids[:, 0], shard)
    with pytest.raises(ValueError, match="1 layers"):
        gather(good_tables, ids[:, :1], shard)
    with pytest.raises(TypeError, match=r"tables\[1\] must be uint8"):
        gather([good_tables[0], good_tables[1].to(torch.int8)], ids, shard)
    with pytest.raises(ValueError, match="row_bytes 100"):
        gather([t[:, :100] for t in good_tables], ids, shard)
    with pytest.raises(ValueError, match="must have shape"):
        gather(good_tables, ids, shard, out=torch.empty(2, 3, 12, 255, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out must be torch.uint8"):
        gather(good_tables, ids, shard, packed=True,
               out=torch.empty(2, 3, 12, 264, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="ids are on meta"):
        gather(good_tables, ids.to("meta"), shard)


def test_gather_layer_rejects_bad_ranges(world):
    _, tables, _ = world
    table = torch.from_numpy(tables[0])
    ids = torch.zeros(3, 24, dtype=torch.int32)
    with pytest.raises(ValueError, match="head range"):
        gather_layer(table, ids, 20, 25, 5, 0, 10)
    with pytest.raises(ValueError, match="local_heads 2"):
        gather_layer(table, ids, 0, 4, 2, 0, 10)
    with pytest.raises(ValueError, match="row range"):
        gather_layer(table, ids, 0, 4, 4, 0, len(table) + 1)


def test_triton_module_imports_without_triton_and_fails_clearly(monkeypatch):
    # The CPU backend imports engramd.kernels without Triton installed.
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    origin = importlib.util.find_spec("engramd.kernels.gather_triton").origin
    spec = importlib.util.spec_from_file_location("engramd_gather_triton_no_triton", origin)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert module.triton is None
    with pytest.raises(module.TritonUnavailableError, match="pip install triton"):
        module.GatherPlan([], ShardView(0, 1, 0, 0, 0, ()))
    with pytest.raises(module.TritonUnavailableError, match="pip install triton"):
        module.gather([], torch.zeros(1, 0, 0, dtype=torch.int64), ShardView(0, 1, 0, 0, 0, ()))
