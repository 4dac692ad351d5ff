"""Independent expected rows for tests, computed straight from the checkpoint bytes.

Reads the Engram tensors with the `safetensors` library (not engramd's reader), decodes FP8 E4M3
and UE8M0 from their bit patterns in float64 numpy (not torch's float8), and gathers with plain
numpy indexing following the output contract of docs/engram.md ("What a lookup returns"). Shares
no code with engramd's kernels. Also the helpers the kernel tests share: bit-exact comparison with NaN by position, the
small two-layer geometry, and loading a module afresh under Triton's CPU interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from engramd.client.geometry import TableGeometry


def decode_e4m3(bits: np.ndarray) -> np.ndarray:
    """FP8 E4M3 (fn variant: no infinities, 0x7F/0xFF NaN) bit patterns -> float64."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0 ** -6
    value = sign * np.where(exponent == 0, subnormal, normal)
    return np.where((bits & 0x7F) == 0x7F, np.nan, value)


class ReferenceTables:
    """float64 dequantized tables of a checkpoint, one [rows, head_dim] array per Engram layer."""

    def __init__(self, checkpoint_dir: Path):
        config = json.loads((checkpoint_dir / "config.json").read_text())
        index = json.loads((checkpoint_dir / "model.safetensors.index.json").read_text())["weight_map"]
        self.layer_ids = config["engram_layer_ids"]
        self.heads = (config["engram_max_ngram_size"] - 1) * config["engram_n_heads"]
        self.values = [self._layer_values(checkpoint_dir, index, layer_id) for layer_id in self.layer_ids]
        self.rows = [v.shape[0] for v in self.values]
        self.bucket_sizes = _bucket_primes(config["engram_vocab_size"], len(self.layer_ids), self.heads)

    def _layer_values(self, checkpoint_dir: Path, index: dict[str, str], layer_id: int):
        """One layer's table as float64 [rows, head_dim] (subclasses may return a lazy view)."""
        weight = _load_bytes(checkpoint_dir, index, f"layers.{layer_id}.engram.embed.weight")
        scale = _load_bytes(checkpoint_dir, index, f"layers.{layer_id}.engram.embed.scale")
        block = weight.shape[1] // scale.shape[1]
        factors = np.exp2(scale.astype(np.float64) - 127.0)
        return decode_e4m3(weight) * np.repeat(factors, block, axis=1)

    def expected(self, ids: np.ndarray, rank: int = 0, shards: int = 1) -> np.ndarray:
        """[n_layers, T, local_heads, head_dim] float64 for ids [T, n_layers, heads]."""
        part = -(-self.heads // shards)
        start, end = min(self.heads, rank * part), min(self.heads, (rank + 1) * part)
        tokens = ids.shape[0]
        head_dim = self.values[0].shape[1]
        out = np.zeros((len(self.values), tokens, part, head_dim))
        for layer, table in enumerate(self.values):
            lo, hi = self._owned_rows(layer, start, end)
            for j, head in enumerate(range(start, end)):
                col = ids[:, layer, head].astype(np.int64)
                ok = (col >= lo) & (col < hi)
                out[layer, ok, j] = table[col[ok]]
        return out

    def _owned_rows(self, layer: int, start: int, end: int) -> tuple[int, int]:
        sizes = self.bucket_sizes[layer]
        return sum(sizes[:start]), sum(sizes[:end])


def _load_bytes(directory: Path, index: dict[str, str], name: str) -> np.ndarray:
    with safe_open(str(directory / index[name]), framework="pt") as f:
        return f.get_tensor(name).view(torch.uint8).numpy()


def _bucket_primes(vocab: int, layers: int, heads: int) -> list[list[int]]:
    """Bucket primes per layer, by trial division (independent of engramd's geometry code)."""
    def prime(n: int) -> bool:
        return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))

    found, n = [], vocab
    while len(found) < layers * heads:
        if prime(n):
            found.append(n)
        n += 1
    return [found[i * heads:(i + 1) * heads] for i in range(layers)]


def random_ids(rng: np.random.Generator, tokens: int, rows: list[int], heads: int,
               dead: float = 0.05, out_of_range: float = 0.02) -> np.ndarray:
    """[T, n_layers, heads] int64: uniform rows, some -1, some past the table or negative."""
    ids = np.stack([rng.integers(0, r, size=(tokens, heads)) for r in rows], axis=1)
    roll = rng.random(ids.shape)
    ids[roll < dead] = -1
    bad = (roll >= dead) & (roll < dead + out_of_range)
    ids[bad] = rng.choice([-7, max(rows) + 3, 2**40], size=int(bad.sum()))
    return ids.astype(np.int64)


def bucket_ids(rng: np.random.Generator, tokens: int, sizes: list[list[int]]) -> np.ndarray:
    """[T, n_layers, heads] int64 IDs the way hashing makes them: head h's ID in bucket h."""
    out = np.empty((tokens, len(sizes), len(sizes[0])), dtype=np.int64)
    for layer, layer_sizes in enumerate(sizes):
        offset = 0
        for head, size in enumerate(layer_sizes):
            out[:, layer, head] = offset + rng.integers(0, size, size=tokens)
            offset += size
    return out


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit equality (BF16 NaN by position: the reference may set a NaN's sign bit); a failure
    reports how many elements differ and the first indices."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if actual.dtype == torch.bfloat16:
        nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
        a, e = actual.view(torch.int16), expected.view(torch.int16)
        bad = (nan_a != nan_e) | (~nan_e & (a != e))
    else:
        a, e = actual, expected
        bad = a != e
    if bad.any():
        where = bad.nonzero()[:8].tolist()
        shown = ", ".join(f"{tuple(i)}: got {a[tuple(i)].item()} want {e[tuple(i)].item()}"
                          for i in where)
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first: {shown}")


def small_geometry() -> TableGeometry:
    """Two layers of 24 heads over tiny buckets: every row of the tables is cheap to check."""
    return TableGeometry.from_config({
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": 20,
        "engram_compressed_vocab_size": 100,
        "engram_pad_token_id": 2,
    }, source="small test geometry")


@contextmanager
def triton_interpreter() -> Iterator[None]:
    """TRITON_INTERPRET=1 while kernels are defined (triton.jit picks the interpreter then)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def exec_fresh(name: str, origin: str):
    """A private copy of the module at `origin`, registered as `name` (drop it when done)."""
    spec = importlib.util.spec_from_file_location(name, origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


class StandInKernel:
    """What Triton's compiled kernel offers a direct launch, kernel[grid](*args, stream=...),
    which the interpreter never makes: each launch appended to `launches` as (grid, args,
    stream), or, without a list, nothing done (to count a launch's Python work alone)."""

    def __init__(self, launches: list | None = None):
        self.launches = launches

    def __getitem__(self, grid):
        if self.launches is None:
            return self._skip
        return lambda *args, stream: self.launches.append((grid, args, stream))

    def _skip(self, *args, stream) -> None:
        pass


def launch_then_keep(module, kernel: StandInKernel):
    """A GatherPlan._launch for `module` (an interpreted gather_triton) that launches as the
    interpreter does, then keeps `kernel` as the plan's compiled kernel: SlotGather's direct
    launches go to it from then on."""
    interpreted = module.GatherPlan._launch

    def launch(self, *args, **kwargs):
        interpreted(self, *args, **kwargs)
        self._launched = kernel

    return launch


def interpreted_gather(name: str):
    """A private copy of engramd.kernels.gather_triton whose kernels run under Triton's
    interpreter, registered as `name` (drop it when done)."""
    with triton_interpreter():
        module = exec_fresh(name, importlib.util.find_spec("engramd.kernels.gather_triton").origin)
    assert module._kernel_is_interpreted()
    return module


def record_launches(module, monkeypatch) -> list:
    """Every launch of gather module `module`'s kernel from now on (its _Launch: grid, block
    rows, ...), in order."""
    original, launched = module._Launch, []

    def recording(*args):
        launched.append(original(*args))
        return launched[-1]

    monkeypatch.setattr(module, "_Launch", recording)
    return launched
