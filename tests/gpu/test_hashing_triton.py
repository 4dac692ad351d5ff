"""The Triton hashing kernel on a real GPU against the CPU torch reference: random batches of
mixed requests (prefill chunks, decode steps, empty chunks), DEAD tokens, carried history.
Skipped without CUDA or Triton."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engramd.client.geometry import TableGeometry  # noqa: E402
from engramd.client.hashing import EngramHasher  # noqa: E402
from engramd.kernels.hashing_ref import hash_and_carry_ref, hash_ngrams_ref  # noqa: E402
from engramd.kernels.hashing_triton import (  # noqa: E402
    hash_and_carry_triton,
    hash_ngrams_triton,
)

pytestmark = pytest.mark.gpu

VOCAB = 129_280  # the DeepSeek-V4 vocabulary size; the map itself is random here


def random_token_map(rng, vocab: int, compressed: int) -> np.ndarray:
    labels = rng.integers(0, compressed, vocab)
    labels[rng.choice(vocab, compressed, replace=False)] = np.arange(compressed)
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse].astype(np.int32)


@pytest.fixture(scope="module")
def hasher() -> EngramHasher:
    geometry = TableGeometry.named("v4.1-flash")
    token_map = random_token_map(np.random.default_rng(0), VOCAB, geometry.compressed_vocab_size)
    return EngramHasher(geometry, token_map)


def random_batch(rng, lengths, dead_rate, dtype):
    total = int(sum(lengths))
    ids = rng.integers(0, VOCAB, total)
    dead = rng.random(total) < dead_rate
    ids[dead] = -1
    hist_ids = rng.integers(0, VOCAB, (len(lengths), 3))
    hist_dead = rng.random(hist_ids.shape) < 0.25
    cu = np.concatenate([[0], np.cumsum(lengths)])
    return (torch.tensor(ids, dtype=dtype), torch.tensor(cu, dtype=dtype), torch.tensor(dead),
            torch.tensor(hist_ids, dtype=dtype), torch.tensor(hist_dead))


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = (got != want).nonzero()
    assert diff.shape[0] == 0, (f"{what}: {diff.shape[0]} differ, first {diff[:5].tolist()}: "
                                f"got {got[tuple(diff[:5].T)].tolist()} "
                                f"want {want[tuple(diff[:5].T)].tolist()}")


BATCHES = {
    "decode-256": [1] * 256,
    "prefill-8192": [8192],
    "mixed": [0, 1, 2, 3, 700, 0, 5, 4096, 1, 33],
    "many-small": list(range(0, 300)),
    "long": [150_000, 3],
}


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gpu_equals_cpu_reference(hasher, name, dtype):
    rng = np.random.default_rng(len(name))
    args = random_batch(rng, BATCHES[name], dead_rate=0.05, dtype=dtype)
    cpu_params, gpu_params = hasher.params("cpu"), hasher.params("cuda")
    gpu_args = [a.cuda() for a in args]
    want = hash_and_carry_ref(args[0], args[1], cpu_params, *args[2:])
    got = hash_and_carry_triton(gpu_args[0], gpu_args[1], gpu_params, *gpu_args[2:])
    for part, g, w in zip(("rows", "next ids", "next dead"), got, want, strict=True):
        assert_same(g, w, f"{name} {dtype} {part}")
    fresh = hash_ngrams_triton(gpu_args[0], gpu_args[1], gpu_params, gpu_args[2])
    assert_same(fresh, hash_ngrams_ref(args[0], args[1], cpu_params, args[2]), f"{name} fresh")
    clean = args[0].clamp(min=0)  # no DEAD tokens, no history: the kernel's bare path
    assert_same(hash_ngrams_triton(clean.cuda(), gpu_args[1], gpu_params),
                hash_ngrams_ref(clean, args[1], cpu_params), f"{name} bare")


def test_gpu_torch_reference_equals_cpu(hasher):
    args = random_batch(np.random.default_rng(1), BATCHES["mixed"], 0.05, torch.int64)
    want = hash_ngrams_ref(args[0], args[1], hasher.params("cpu"), *args[2:])
    got = hash_ngrams_ref(*(a.cuda() for a in args[:2]), hasher.params("cuda"),
                          *(a.cuda() for a in args[2:]))
    assert_same(got, want, "torch on GPU")


def test_hasher_chunked_on_gpu_equals_whole_on_cpu(hasher):
    rng = np.random.default_rng(2)
    lengths = [int(n) for n in rng.integers(1, 3000, 12)]
    seqs = [torch.tensor(rng.integers(0, VOCAB, n)) for n in lengths]
    deads = [torch.tensor(rng.random(n) < 0.02) for n in lengths]
    want = [hasher.hash(s, d) for s, d in zip(seqs, deads, strict=True)]
    state = hasher.new_state(len(seqs), device="cuda")
    done, got = [0] * len(seqs), [[] for _ in seqs]
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        sizes = [min(int(rng.integers(0, 600)), n - d) for d, n in zip(done, lengths, strict=True)]
        ids = torch.cat([s[d:d + k] for s, d, k in zip(seqs, done, sizes, strict=True)]).cuda()
        dead = torch.cat([x[d:d + k] for x, d, k in zip(deads, done, sizes, strict=True)]).cuda()
        cu = torch.tensor([0, *np.cumsum(sizes).tolist()], device="cuda")
        rows, state = hasher.hash_batch(ids, cu, dead, state, validate=False)
        assert rows.is_cuda
        for b, k in enumerate(sizes):
            got[b].append(rows[int(cu[b]):int(cu[b]) + k])
            done[b] += k
    for b in range(len(seqs)):
        assert_same(torch.cat(got[b]), want[b], f"request {b}")


def test_hasher_hash_on_cuda_returns_cuda_int32(hasher):
    ids = torch.tensor(np.random.default_rng(3).integers(0, VOCAB, 1000))
    got = hasher.hash(ids.cuda())
    assert got.device.type == "cuda" and got.dtype == torch.int32
    assert_same(got, hasher.hash(ids), "hash()")
