"""Engram n-gram hashing, plain torch reference: raw token IDs to row IDs.

What it is: docs/engram.md "Hashing", points 1 to 5, for a batch of request chunks laid end
to end, in int64 torch arithmetic that runs on any device (CPU or CUDA). The Triton kernel in
`hashing_triton.py` takes the same arguments and must return identical row IDs; this module also
holds what both share (the parameter bundle, input checks, the look-back carry).

What it is not: it does not build the compressed token map or the multipliers from a tokenizer
or a config (`engramd.client.hashing` does), and it knows nothing of tables or lookups.

The arguments, for B request chunks and n-gram size N:

- `token_ids` [T] int32/int64: raw token IDs, the chunks one after another. The map lookup
  (compression) is done here, so callers pass what the tokenizer produced.
- `cu_seqlens` [B+1] int32/int64: chunk b is `token_ids[cu_seqlens[b]:cu_seqlens[b+1]]`.
- `dead` [T] bool or None: DEAD tokens (image placeholders). Their raw ID is never read, so it
  may be anything (for example -1).
- `history_ids` [B, N-1] and `history_dead` [B, N-1] bool, or both None: the N-1 raw tokens before
  each chunk, oldest first, with their DEAD flags. A slot before the start of the sequence is
  marked dead: the reference treats the sequence start and a DEAD token alike (pad from there
  back), so one flag covers both. None means every chunk starts its sequence.

The result is int32 [T, n_layers, heads]: row indices into each layer's table, in column order
(`col = (n - 2) * heads_per_order + head`). The largest V4.1 row is below 2^29, so int32 holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


class HashInputError(ValueError):
    """An argument of the hashing functions has the wrong shape, dtype, device or value."""


@dataclass(frozen=True)
class NgramHashParams:
    """Everything the hash needs besides the tokens, as tensors on one device.

    `token_map` [vocab] int32 (raw -> compressed ID), `multipliers` [n_layers, N] int64 (one per
    look-back k = 0..N-1), `primes` and `offsets` [n_layers, heads] int64, `pad_id` the compressed
    ID used for look-backs that are blocked, and `heads_per_order` (columns per n-gram order).
    """

    token_map: torch.Tensor
    multipliers: torch.Tensor
    primes: torch.Tensor
    offsets: torch.Tensor
    pad_id: int
    heads_per_order: int

    def __post_init__(self) -> None:
        _check_params(self)

    @property
    def max_ngram(self) -> int:
        return self.multipliers.shape[1]

    @property
    def n_layers(self) -> int:
        return self.multipliers.shape[0]

    @property
    def heads(self) -> int:
        return self.primes.shape[1]

    @property
    def vocab(self) -> int:
        return self.token_map.shape[0]

    @property
    def device(self) -> torch.device:
        return self.token_map.device

    def to(self, device: torch.device | str) -> NgramHashParams:
        return NgramHashParams(
            token_map=self.token_map.to(device),
            multipliers=self.multipliers.to(device),
            primes=self.primes.to(device),
            offsets=self.offsets.to(device),
            pad_id=self.pad_id,
            heads_per_order=self.heads_per_order,
        )


def _check_params(p: NgramHashParams) -> None:
    expect = {
        "token_map": (p.token_map, torch.int32, 1),
        "multipliers": (p.multipliers, torch.int64, 2),
        "primes": (p.primes, torch.int64, 2),
        "offsets": (p.offsets, torch.int64, 2),
    }
    for name, (tensor, dtype, ndim) in expect.items():
        if tensor.dtype != dtype or tensor.dim() != ndim:
            raise HashInputError(
                f"params.{name} must be {ndim}-D {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        if tensor.device != p.token_map.device:
            raise HashInputError(
                f"params.{name} is on {tensor.device}, params.token_map on {p.token_map.device}"
            )
    n_layers, max_ngram = p.multipliers.shape
    if max_ngram < 2:
        raise HashInputError(f"params.multipliers has N={max_ngram} columns; N must be >= 2")
    expected_heads = (max_ngram - 1) * p.heads_per_order
    for name in ("primes", "offsets"):
        shape = tuple(getattr(p, name).shape)
        if shape != (n_layers, expected_heads):
            raise HashInputError(
                f"params.{name} has shape {shape}, expected ({n_layers}, {expected_heads}) for "
                f"N={max_ngram} and heads_per_order={p.heads_per_order}"
            )


@dataclass(frozen=True)
class HashBatch:
    """The per-call tensors (see the module docstring); `dead` and the history may be None."""

    token_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    dead: torch.Tensor | None
    history_ids: torch.Tensor | None
    history_dead: torch.Tensor | None

    @property
    def batch(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def with_defaults(self, max_ngram: int) -> HashBatch:
        """The same batch with no DEAD tokens and sequence starts filled in where None."""
        device = self.token_ids.device
        dead = self.dead
        if dead is None:
            dead = torch.zeros(self.token_ids.shape, dtype=torch.bool, device=device)
        history_ids, history_dead = self.history_ids, self.history_dead
        if history_ids is None:
            history_ids, history_dead = start_history(self.batch, max_ngram, device)
        return HashBatch(self.token_ids, self.cu_seqlens, dead, history_ids, history_dead)


def check_batch(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    params: NgramHashParams,
    dead: torch.Tensor | None = None,
    history_ids: torch.Tensor | None = None,
    history_dead: torch.Tensor | None = None,
) -> HashBatch:
    """Check shapes, dtypes and devices, without a device synchronisation or an allocation."""
    _check_index_tensor("token_ids", token_ids, 1)
    _check_index_tensor("cu_seqlens", cu_seqlens, 1)
    if cu_seqlens.shape[0] < 1:
        raise HashInputError("cu_seqlens must hold at least one value (B+1 with B >= 0)")
    batch, hist = cu_seqlens.shape[0] - 1, params.max_ngram - 1
    if batch == 0 and token_ids.shape[0] > 0:
        raise HashInputError(f"cu_seqlens describes no chunk but token_ids holds {token_ids.shape[0]}")
    if (history_ids is None) != (history_dead is None):
        raise HashInputError("history_ids and history_dead must be given together or both None")
    named = {"cu_seqlens": cu_seqlens, "params": params.token_map}
    if dead is not None:
        _check_shape("dead", dead, tuple(token_ids.shape), torch.bool)
        named["dead"] = dead
    if history_ids is not None:
        _check_index_tensor("history_ids", history_ids, 2)
        _check_shape("history_ids", history_ids, (batch, hist), history_ids.dtype)
        _check_shape("history_dead", history_dead, (batch, hist), torch.bool)
        named.update(history_ids=history_ids, history_dead=history_dead)
    for name, tensor in named.items():
        if tensor.device != token_ids.device:
            raise HashInputError(f"{name} is on {tensor.device} but token_ids on {token_ids.device}")
    return HashBatch(token_ids, cu_seqlens, dead, history_ids, history_dead)


def prepare_batch(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    params: NgramHashParams,
    dead: torch.Tensor | None = None,
    history_ids: torch.Tensor | None = None,
    history_dead: torch.Tensor | None = None,
) -> HashBatch:
    """`check_batch`, then defaults filled in."""
    batch = check_batch(token_ids, cu_seqlens, params, dead, history_ids, history_dead)
    return batch.with_defaults(params.max_ngram)


def _check_index_tensor(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise HashInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in INDEX_DTYPES or tensor.dim() != ndim:
        raise HashInputError(
            f"{name} must be a {ndim}-D int32 or int64 tensor, got shape {tuple(tensor.shape)} "
            f"dtype {tensor.dtype}"
        )


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise HashInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise HashInputError(
            f"{name} must have shape {shape} and dtype {dtype}, got {tuple(tensor.shape)} "
            f"{tensor.dtype}"
        )


def validate_values(batch: HashBatch, params: NgramHashParams) -> None:
    """Check the values (cu_seqlens boundaries, raw IDs in the map). Synchronises a GPU."""
    batch = batch.with_defaults(params.max_ngram)
    cu = batch.cu_seqlens.to("cpu", torch.int64)
    total = batch.token_ids.shape[0]
    if cu[0] != 0 or cu[-1] != total or bool((cu[1:] < cu[:-1]).any()):
        raise HashInputError(
            f"cu_seqlens must start at 0, never decrease and end at T={total}; got "
            f"{cu.tolist()[:8]}{' ...' if cu.shape[0] > 8 else ''}"
        )
    _check_ids_in_map("token_ids", batch.token_ids, batch.dead, params.vocab)
    _check_ids_in_map("history_ids", batch.history_ids, batch.history_dead, params.vocab)


def _check_ids_in_map(name: str, ids: torch.Tensor, dead: torch.Tensor, vocab: int) -> None:
    bad = ~dead & ((ids < 0) | (ids >= vocab))
    if bool(bad.any()):
        where = bad.nonzero()[:4].tolist()
        values = ids[bad][:4].tolist()
        raise HashInputError(
            f"{name} holds raw token IDs outside the token map [0, {vocab}) at non-DEAD "
            f"positions {where}: {values}"
        )


def start_history(batch: int, max_ngram: int, device: torch.device | str = "cpu"):
    """History for chunks that start their sequences: every slot is before the start (dead)."""
    ids = torch.full((batch, max_ngram - 1), -1, dtype=torch.int64, device=device)
    dead = torch.ones((batch, max_ngram - 1), dtype=torch.bool, device=device)
    return ids, dead


def _sequence_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] int64: which chunk each token belongs to (no host synchronisation)."""
    batch = cu_seqlens.shape[0] - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    chunks = torch.arange(batch, device=cu_seqlens.device)
    return torch.repeat_interleave(chunks, lengths, output_size=total)


def _window(batch: HashBatch, back: int):
    """Raw IDs and DEAD flags `back` positions before each token: [T] each, chunk or history."""
    total, hist = batch.token_ids.shape[0], batch.history_ids.shape[1]
    seq = _sequence_index(batch.cu_seqlens, total)
    positions = torch.arange(total, device=seq.device)
    local = positions - batch.cu_seqlens.to(torch.int64)[seq] - back
    in_chunk = local >= 0
    chunk_at = (positions - back).clamp(min=0)
    hist_at = (local + hist).clamp(min=0, max=hist - 1)
    raw = torch.where(in_chunk, batch.token_ids.to(torch.int64)[chunk_at],
                      batch.history_ids.to(torch.int64)[seq, hist_at])
    dead = torch.where(in_chunk, batch.dead[chunk_at], batch.history_dead[seq, hist_at])
    return raw, dead


def compressed_lookbacks(batch: HashBatch, params: NgramHashParams) -> torch.Tensor:
    """[T, N] int64: v_k, the compressed ID k positions back, pad once the walk is blocked."""
    if batch.token_ids.shape[0] == 0:
        return torch.empty((0, params.max_ngram), dtype=torch.int64, device=params.device)
    columns, alive = [], None
    for back in range(params.max_ngram):
        raw, dead = _window(batch, back)
        # A DEAD token (or the sequence start, encoded as dead history) blocks every older one.
        alive = ~dead if alive is None else alive & ~dead
        compressed = params.token_map[torch.where(alive, raw, 0)].to(torch.int64)
        columns.append(torch.where(alive, compressed, params.pad_id))
    return torch.stack(columns, dim=1)


def rows_from_lookbacks(v: torch.Tensor, params: NgramHashParams) -> torch.Tensor:
    """[T, N] compressed look-backs -> [T, n_layers, heads] int32 row IDs."""
    products = v[:, None, :] * params.multipliers[None, :, :]  # [T, L, N]; never overflows int64
    mix = products[:, :, 0]
    mixes = []
    for back in range(1, params.max_ngram):
        mix = mix ^ products[:, :, back]
        mixes.append(mix)  # order n = back + 1
    by_order = torch.stack(mixes, dim=2)  # [T, L, N-1]
    order_of_column = torch.arange(params.heads, device=v.device) // params.heads_per_order
    per_column = by_order[:, :, order_of_column]  # [T, L, heads]
    rows = per_column % params.primes[None] + params.offsets[None]
    return rows.to(torch.int32)


def hash_ngrams_ref(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    params: NgramHashParams,
    dead: torch.Tensor | None = None,
    history_ids: torch.Tensor | None = None,
    history_dead: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Row IDs [T, n_layers, heads] int32 for a batch of chunks; see the module docstring.

    With `validate` (the default) bad boundaries or raw IDs outside the map raise
    HashInputError; without it they give unspecified rows or an indexing error.
    """
    batch = prepare_batch(token_ids, cu_seqlens, params, dead, history_ids, history_dead)
    if validate:
        validate_values(batch, params)
    return rows_from_lookbacks(compressed_lookbacks(batch, params), params)


def next_history(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    params: NgramHashParams,
    dead: torch.Tensor | None = None,
    history_ids: torch.Tensor | None = None,
    history_dead: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The history to pass with each request's next chunk: ([B, N-1] int64, [B, N-1] bool).

    Slot s of request b is the token `N-1-s` positions before the end of this chunk, taken from
    the chunk or, for a chunk shorter than N-1, from the history it came with.
    """
    return _next_history(prepare_batch(token_ids, cu_seqlens, params, dead, history_ids,
                                       history_dead))


def _next_history(batch: HashBatch) -> tuple[torch.Tensor, torch.Tensor]:
    old_ids, old_dead = batch.history_ids.to(torch.int64), batch.history_dead
    total, hist = batch.token_ids.shape[0], old_ids.shape[1]
    if total == 0:
        return old_ids.clone(), old_dead.clone()
    cu = batch.cu_seqlens.to(torch.int64)
    lengths = (cu[1:] - cu[:-1])[:, None]  # [B, 1]
    slots = torch.arange(hist, device=cu.device)[None, :]
    local = lengths - hist + slots  # [B, N-1] position inside the chunk
    in_chunk = local >= 0
    chunk_at = (cu[:-1, None] + local).clamp(min=0, max=total - 1)
    hist_at = (local + hist).clamp(min=0, max=hist - 1)
    rows = torch.arange(batch.batch, device=cu.device)[:, None]
    ids = torch.where(in_chunk, batch.token_ids.to(torch.int64)[chunk_at], old_ids[rows, hist_at])
    dead_out = torch.where(in_chunk, batch.dead[chunk_at], old_dead[rows, hist_at])
    return ids, dead_out


def hash_and_carry_ref(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    params: NgramHashParams,
    dead: torch.Tensor | None = None,
    history_ids: torch.Tensor | None = None,
    history_dead: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hash_ngrams_ref` and `next_history` in one call: (rows, next ids, next dead flags)."""
    batch = prepare_batch(token_ids, cu_seqlens, params, dead, history_ids, history_dead)
    if validate:
        validate_values(batch, params)
    rows = rows_from_lookbacks(compressed_lookbacks(batch, params), params)
    return (rows, *_next_history(batch))
