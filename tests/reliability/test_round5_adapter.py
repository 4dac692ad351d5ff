"""A fifth round of attacks on the API a model runner calls every step, EngramRunnerAdapter's
prefetch() and rows(), against a real daemon (CPU backend, demo tables): bad input must raise a
clear typed error, never hand out a wrong row. Each test here is one finding, and fails without
its fix; rows are compared with the reference decoded from the checkpoint's bytes
(tests/reference.py), row IDs with the hasher written apart from engramd's (tests/test_hashing.py).

What this is not: the hasher without a daemon (tests/test_round5_api.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rows_match
from test_hashing import slow_rows

from engramd.client.adapter import EngramRunnerAdapter
from engramd.client.geometry import DEMO_CONFIG
from engramd.client.hashing import HashInputError, HashState

TOKEN_MAP = np.arange(DEMO_CONFIG["engram_compressed_vocab_size"], dtype=np.int32)


def step_rows(adapter: EngramRunnerAdapter) -> np.ndarray:
    """[n_layers, T, heads, 256] float64: every Engram layer's rows of the last prefetch."""
    return torch.stack([adapter.rows(layer) for layer in adapter.geometry.layer_ids]).double().numpy()


def expected_ids(adapter: EngramRunnerAdapter, tokens: torch.Tensor) -> np.ndarray:
    raw = tokens.tolist()
    return np.asarray(slow_rows(adapter.hasher, raw, [False] * len(raw)), dtype=np.int64)


BAD_STEPS = {
    "token past the map": dict(token_ids=torch.tensor([5, TOKEN_MAP.size, 7])),
    "negative token": dict(token_ids=torch.tensor([5, -3, 7])),
    "float tokens": dict(token_ids=torch.tensor([5.0, 6.0])),
    "cu_seqlens not ending at T": dict(token_ids=torch.arange(4), cu_seqlens=torch.tensor([0, 3])),
    "DEAD mask of another length": dict(token_ids=torch.arange(4), dead=torch.zeros(3, dtype=torch.bool)),
    "state of another batch": dict(token_ids=torch.arange(4), state=HashState.start(2, 4)),
}


@pytest.mark.parametrize("bad", sorted(BAD_STEPS))
def test_a_step_whose_tokens_are_refused_hands_out_no_rows_of_the_step_before(daemon_factory,
                                                                            reference, bad):
    """prefetch() hashed first and forgot the previous step's lookup only after: a step whose
    tokens the hasher refused (HashInputError) left the last step's lookup in place, and an
    engine that went on to rows() (its error caught and logged, say) got the previous step's
    rows as this step's, without a word. The refused step now leaves no lookup: rows() raises."""
    daemon = daemon_factory()
    tokens = torch.arange(100, 116)
    with EngramRunnerAdapter(daemon.socket, max_tokens=16, token_map=TOKEN_MAP, timeout=30) as adapter:
        adapter.prefetch(tokens)
        assert rows_match(step_rows(adapter), reference, expected_ids(adapter, tokens))
        with pytest.raises(HashInputError):
            adapter.prefetch(**BAD_STEPS[bad])
        with pytest.raises(RuntimeError, match="before prefetch"):
            adapter.rows(layer_id=1)
        adapter.prefetch(tokens[:5])  # and the next good step is looked up as ever
        assert rows_match(step_rows(adapter), reference, expected_ids(adapter, tokens[:5]))


@pytest.mark.parametrize("not_a_tensor", [[100, 101], np.arange(100, 102)],
                         ids=["list", "numpy"])
def test_token_ids_that_are_no_tensor_are_refused_with_a_typed_error(daemon_factory, not_a_tensor):
    """prefetch() moved its inputs to its device before anything checked them: a list or a
    numpy array of token IDs (or of chunk bounds) failed as AttributeError: 'list' object has
    no attribute 'to'. It raises HashInputError naming the argument now."""
    daemon = daemon_factory()
    with EngramRunnerAdapter(daemon.socket, max_tokens=16, token_map=TOKEN_MAP, timeout=30) as adapter:
        with pytest.raises(HashInputError, match="token_ids must be a 1-D torch.Tensor"):
            adapter.prefetch(not_a_tensor)
        with pytest.raises(HashInputError, match="cu_seqlens must be a torch.Tensor"):
            adapter.prefetch(torch.arange(2), cu_seqlens=[0, 2])
        with pytest.raises(HashInputError, match="state must be a HashState"):
            adapter.prefetch(torch.arange(2), state=(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool)))


@pytest.mark.parametrize("layer_id", [True, 1.0, 14.0, "1"])
def test_a_layer_id_that_is_no_integer_picks_no_layer(daemon_factory, layer_id):
    """rows() found the layer with list.index, which compares by ==: rows(True) returned Engram
    layer 1's rows (True == 1) and rows(14.0) layer 14's. A layer ID must be an integer; any
    other value raises the ValueError of a layer without a table."""
    daemon = daemon_factory()
    with EngramRunnerAdapter(daemon.socket, max_tokens=16, token_map=TOKEN_MAP, timeout=30) as adapter:
        adapter.prefetch(torch.arange(100, 104))
        with pytest.raises(ValueError, match="has no Engram table"):
            adapter.rows(layer_id)
        # Integers of other types still name their layer.
        assert torch.equal(adapter.rows(np.int64(14)), adapter.rows(14))
        assert torch.equal(adapter.rows(torch.tensor(1)), adapter.rows(1))
