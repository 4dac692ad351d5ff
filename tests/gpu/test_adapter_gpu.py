"""The runner adapter on the GPU: hashing on the device, lookup through the CUDA daemon."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engramd.client.adapter import EngramRunnerAdapter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_gpu_adapter_matches_the_cpu_hash_and_reference_rows(daemon_factory, reference):
    daemon = daemon_factory(extra=["--backend", "cuda"])
    rng = np.random.default_rng(0)
    extra = rng.integers(0, 99_092, size=129_280 - 99_092)
    token_map = rng.permutation(np.concatenate([np.arange(99_092), extra])).astype(np.int32)
    tokens = torch.from_numpy(rng.integers(0, 129_280, size=700)).cuda()
    with EngramRunnerAdapter(daemon.socket, device="cuda", max_tokens=700, token_map=token_map) as runner:
        whole = runner.hasher.hash(tokens.cpu()).numpy()  # CPU reference hash of the whole sequence
        state = None
        for lo, hi in ((0, 333), (333, 700)):
            state = runner.prefetch(tokens[lo:hi], state=state)
            expected = reference.expected(whole[lo:hi])
            for index, layer_id in enumerate(runner.geometry.layer_ids):
                rows = runner.rows(layer_id)
                torch.cuda.current_stream().synchronize()
                assert np.array_equal(rows.double().cpu().numpy(), expected[index]), (lo, layer_id)
