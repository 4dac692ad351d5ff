"""A fifth round of attacks on the hasher a model runner calls every step (EngramHasher.hash,
hash_batch, HashState), without a daemon: bad input must raise HashInputError, never give a row
ID other than the one the hasher written apart from engramd's computes (tests/test_hashing.py).
Each test here is one finding, and fails without its fix.

What this is not: the adapter against a daemon (tests/reliability/test_round5_adapter.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_hashing import GEOMETRIES, VOCAB, assert_rows_equal, random_token_map, slow_rows

from engramd.client.geometry import TableGeometry
from engramd.client.hashing import EngramHasher, HashInputError


@pytest.fixture
def hasher() -> EngramHasher:
    config = GEOMETRIES["v41-shape"]
    token_map = random_token_map(np.random.default_rng(5), VOCAB, config["engram_compressed_vocab_size"])
    return EngramHasher(TableGeometry.from_config(config, source="v41-shape"), token_map)


@pytest.mark.parametrize("token_ids", [[1, 2, 3], np.arange(3), torch.tensor(3)],
                         ids=["list", "numpy", "0-d tensor"])
def test_token_ids_that_are_no_1d_tensor_raise_hash_input_error(hasher, token_ids):
    """hash() and hash_batch() without cu_seqlens read token_ids.device and .shape[0] before
    any check: a list failed as AttributeError, a numpy array as AttributeError ('str' object
    has no attribute 'type'), a 0-d tensor as IndexError. HashInputError names the argument."""
    with pytest.raises(HashInputError, match="token_ids must be a 1-D torch.Tensor"):
        hasher.hash(token_ids)
    with pytest.raises(HashInputError, match="token_ids must be a 1-D torch.Tensor"):
        hasher.hash_batch(token_ids)


def test_a_state_that_is_no_hash_state_raises_hash_input_error(hasher):
    """A carry rebuilt by hand as a tuple failed as AttributeError ('tuple' object has no
    attribute 'ids')."""
    state = (torch.full((1, 3), -1), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(HashInputError, match="state must be a HashState"):
        hasher.hash_batch(torch.arange(4), state=state)


def test_the_token_map_is_the_hashers_own_once_checked(hasher):
    """The hasher kept the caller's token map array (np.ascontiguousarray copies nothing, nor
    does torch.from_numpy): a caller that reused its array afterwards (another model's map
    loaded into it, or values the constructor's check refuses, negative IDs) changed every row
    ID the hasher gave from then on, without a word. The hasher copies the map it checked."""
    config = GEOMETRIES["v41-shape"]
    token_map = random_token_map(np.random.default_rng(6), VOCAB, config["engram_compressed_vocab_size"])
    own = EngramHasher(TableGeometry.from_config(config, source="v41-shape"), token_map)
    raw = np.random.default_rng(7).integers(0, VOCAB, 40).tolist()
    want = slow_rows(own, raw, [False] * len(raw))  # from the map as it was checked
    token_map[:] = -5
    assert_rows_equal(own.hash(torch.tensor(raw)), want, "after the caller reused its array")
