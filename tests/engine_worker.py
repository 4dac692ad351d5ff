"""What the engine plugins' worker processes share (tests/vllm_plugin/worker.py,
tests/sglang_plugin/worker.py): the model config, the checks of a plugin's table and rows, and
engramd's own hashes as the independent reference for an engine's. Imports no engine: each
worker runs in its engine's environment and adds this folder to its path."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

HIDDEN, HC_MULT = 64, 2
PREFIX = "model.layers.{}.engram"


def model_config(checkpoint: Path) -> types.SimpleNamespace:
    config = json.loads((checkpoint / "config.json").read_text())
    return types.SimpleNamespace(**config, hidden_size=HIDDEN, hc_mult=HC_MULT, rms_norm_eps=1e-6)


def refuses_other_table(param, head_dim: int, error: type[Exception]) -> None:
    """A checkpoint whose table is not the daemon's shape fails to load (fail closed)."""
    try:
        param.weight_loader(param, torch.zeros(7, head_dim, dtype=torch.float8_e4m3fn))
    except error:
        return
    raise AssertionError("a checkpoint table of 7 rows loaded against the daemon's")


def refuses_other_rows(load: Callable[[], None], error: type[Exception]) -> None:
    """Against a daemon on another checkpoint of the model's geometry (another revision: every
    shape the same), loading the model's checkpoint fails (fail closed), before any step."""
    try:
        load()
    except error as exc:
        assert "serves other rows than this checkpoint's Engram table" in str(exc), exc
        return
    raise AssertionError("the checkpoint loaded against a daemon serving another checkpoint's rows")


def copy_projections(reference, served) -> None:
    """The plugin replaces only the table: the same wkv, q and k weights on both."""
    generator = torch.Generator().manual_seed(11)
    for ref, ours in zip(reference, served, strict=True):
        for name in ("q_weight", "k_weight"):
            getattr(ref, name).data.copy_(torch.randn(getattr(ref, name).shape, generator=generator))
        ref.wkv.weight.data.copy_(torch.randn(ref.wkv.weight.shape, generator=generator) * 0.02)
        for name in ("q_weight", "k_weight"):
            getattr(ours, name).data.copy_(getattr(ref, name).data)
        ours.wkv.weight.data.copy_(ref.wkv.weight.data)


def same_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Exact equality, NaN included (a gather is a copy); names the first differing index."""
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    differ = (got.contiguous().view(bits) != want.contiguous().view(bits)).nonzero()
    assert differ.numel() == 0, f"{name}: {differ.shape[0]} values differ, first at {differ[:3].tolist()}"


def engramd_hashes(checkpoint: Path, tokens, starts, lookback) -> torch.Tensor:
    """A chunk through engramd's own hasher (an independent implementation). `lookback`: the
    engine's, newest first; engramd's carry is oldest first; -1 is "before the start"."""
    from engramd.client.geometry import TableGeometry
    from engramd.client.hashing import EngramHasher, HashState
    from engramd.client.token_map import build_token_map, default_tokenizer_path

    hasher = EngramHasher(TableGeometry.from_file(checkpoint / "config.json"),
                          build_token_map(default_tokenizer_path()))
    history = lookback.flip(1)
    state = HashState(history.clamp(min=0).to(torch.int64), history < 0)
    rows, _ = hasher.hash_batch(tokens.to(torch.int64), starts.to(torch.int64), state=state)
    return rows


def run(main: Callable[[], None]) -> None:
    """A worker's entry: an assertion's message on stderr and exit 1, for the test to show."""
    try:
        main()
    except AssertionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
