"""The Triton hashing kernel in Triton's CPU interpreter (TRITON_INTERPRET=1), against the torch
reference. Skipped when Triton is not installed; the real GPU test is tests/gpu/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from engramd.kernels import hashing_ref as ref  # noqa: E402
from engramd.kernels.hashing_ref import HashInputError, NgramHashParams  # noqa: E402

KERNEL_FILE = Path(__file__).resolve().parents[1] / "kernels" / "hashing_triton.py"


@pytest.fixture(scope="module")
def interp():
    """A private copy of the module loaded with TRITON_INTERPRET=1: `triton.jit` reads it when
    the kernel is defined, so the copy already imported elsewhere (compiled mode) is no use."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.spec_from_file_location("hashing_triton_interp", KERNEL_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


def make_params(rng, vocab, compressed, layers, max_ngram, per_order, pad):
    heads = (max_ngram - 1) * per_order
    bound = (2**63 - 1) // compressed // 2
    primes = rng.integers(50, 5000, (layers, heads))
    return NgramHashParams(
        token_map=torch.from_numpy(rng.integers(0, compressed, vocab).astype(np.int32)),
        multipliers=torch.from_numpy(rng.integers(0, bound, (layers, max_ngram)) * 2 + 1),
        primes=torch.from_numpy(primes),
        offsets=torch.from_numpy(np.cumsum(primes, axis=1) - primes),
        pad_id=pad,
        heads_per_order=per_order,
    )


SHAPES = [  # layers, N, heads per order, pad
    (2, 4, 8, 2),
    (3, 3, 2, 1),
    (1, 2, 3, 0),
    (5, 5, 1, 7),
]


def random_batch(rng, lengths, vocab, max_ngram, dead_rate, int32):
    total = int(sum(lengths))
    ids = rng.integers(0, vocab, total)
    dead = rng.random(total) < dead_rate
    ids[dead] = -1  # never read
    hist_ids = rng.integers(0, vocab, (len(lengths), max_ngram - 1))
    hist_dead = rng.random(hist_ids.shape) < 0.3
    cu = np.concatenate([[0], np.cumsum(lengths)])
    dtype = torch.int32 if int32 else torch.int64
    return (torch.tensor(ids, dtype=dtype), torch.tensor(cu, dtype=dtype), torch.tensor(dead),
            torch.tensor(hist_ids, dtype=dtype), torch.tensor(hist_dead))


def assert_same(got, want, what):
    diff = (got != want).nonzero()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert diff.shape[0] == 0, f"{what}: differ at {diff[:5].tolist()}"


@pytest.mark.parametrize("shape", SHAPES, ids=[f"L{s[0]}N{s[1]}K{s[2]}" for s in SHAPES])
@pytest.mark.parametrize("lengths", [[1], [0, 5, 0, 130, 1, 0], [3, 3, 3, 3, 3, 3, 3, 3, 3]])
def test_interpreter_matches_reference(interp, shape, lengths):
    layers, max_ngram, per_order, pad = shape
    rng = np.random.default_rng(sum(lengths) + layers)
    params = make_params(rng, 300, 60, layers, max_ngram, per_order, pad)
    ids, cu, dead, hist_ids, hist_dead = random_batch(rng, lengths, 300, max_ngram, 0.1,
                                                      int32=len(lengths) % 2 == 0)
    ids_no_dead = ids.clone()
    ids_no_dead[ids_no_dead < 0] = 0
    variants = {  # optional inputs given or left out (the kernel's HAS_* paths)
        "all": (ids, dead, hist_ids, hist_dead),
        "fresh": (ids, dead, None, None),
        "no-dead": (ids_no_dead, None, hist_ids, hist_dead),
        "bare": (ids_no_dead, None, None, None),
    }
    for name, (tokens, *rest) in variants.items():
        want = ref.hash_and_carry_ref(tokens, cu, params, *rest)
        got = interp.hash_and_carry_triton(tokens, cu, params, *rest)
        for part, g, w in zip(("rows", "next ids", "next dead"), got, want, strict=True):
            assert_same(g, w, f"{name} {part}")
        assert_same(interp.hash_ngrams_triton(tokens, cu, params, *rest),
                    ref.hash_ngrams_ref(tokens, cu, params, *rest), f"{name} rows only")


def test_interpreter_all_dead_and_empty(interp):
    rng = np.random.default_rng(0)
    params = make_params(rng, 100, 20, 2, 4, 8, 2)
    ids, cu = torch.full((9,), -1), torch.tensor([0, 4, 9])
    dead = torch.ones(9, dtype=torch.bool)
    assert_same(interp.hash_ngrams_triton(ids, cu, params, dead),
                ref.hash_ngrams_ref(ids, cu, params, dead), "all dead")
    empty = interp.hash_ngrams_triton(torch.empty(0, dtype=torch.int64), torch.tensor([0, 0]),
                                      params)
    assert empty.shape == (0, 2, 24)
    # No tokens but two requests: only the carry programs run, passing the history through.
    args = (torch.empty(0, dtype=torch.int64), torch.tensor([0, 0, 0]), params, None,
            torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[True, False, False]] * 2))
    for part, g, w in zip(("rows", "ids", "dead"), interp.hash_and_carry_triton(*args),
                          ref.hash_and_carry_ref(*args), strict=True):
        assert_same(g, w, f"empty {part}")


def test_interpreter_validate_raises_like_reference(interp):
    params = make_params(np.random.default_rng(1), 100, 20, 2, 4, 8, 2)
    ids, cu = torch.tensor([1, 100, 3]), torch.tensor([0, 3])
    with pytest.raises(HashInputError, match="outside the token map"):
        interp.hash_ngrams_triton(ids, cu, params, validate=True)


def guarded(values: torch.Tensor, fill: int, pad: int = 64) -> torch.Tensor:
    """`values` as a view into a larger buffer whose rest holds `fill`: a kernel reading past
    the tensor's ends reads `fill`."""
    flat = values.reshape(-1)
    buf = torch.full((pad + flat.numel() + pad,), fill, dtype=values.dtype)
    buf[pad:pad + flat.numel()] = flat
    return buf[pad:pad + flat.numel()].view(values.shape)


@pytest.mark.parametrize("cu", [[0, 7, 3, 12], [-40, 4, 12], [0, 4, 60], [30, 31, 12], [0, 12, 12, -9]],
                         ids=["decreasing", "negative", "past-the-end", "start-past-the-end", "negative-end"])
def test_bad_cu_seqlens_read_nothing_outside_the_inputs_without_validate(interp, cu):
    """Without validate=True a bad cu_seqlens gives rows of no meaning, but the kernel reads only
    its inputs: the same rows whatever lies around them in memory."""
    params = make_params(np.random.default_rng(2), 100, 20, 2, 4, 8, 2)
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.integers(0, 100, 12))
    batch = len(cu) - 1
    hist_ids = torch.from_numpy(rng.integers(0, 100, (batch, 3)))
    dead, hist_dead = torch.zeros(12, dtype=torch.bool), torch.zeros((batch, 3), dtype=torch.bool)
    results = []
    for fill_id, fill_dead in ((1, 0), (97, 1)):  # what lies around: another ID, other flags
        args = (guarded(ids, fill_id), torch.tensor(cu), params,
                guarded(dead.view(torch.uint8), fill_dead).view(torch.bool),
                guarded(hist_ids, fill_id), guarded(hist_dead.view(torch.uint8), fill_dead).view(torch.bool))
        results.append(interp.hash_and_carry_triton(*args))
    for part, first, second in zip(("rows", "next ids", "next dead"), *results, strict=True):
        assert_same(first, second, f"{part} with cu_seqlens {cu}")
    with pytest.raises(HashInputError, match="cu_seqlens"):
        interp.hash_ngrams_triton(ids, torch.tensor(cu), params, validate=True)
