"""Engram n-gram hashing on the GPU: one Triton kernel, raw token IDs to row IDs.

What it is: the same functions as `hashing_ref.hash_ngrams_ref` and `hashing_ref.hash_and_carry_ref`
(same arguments, same results bit for bit) in one launch. Programs of the first part each hash a
block of tokens: find each token's chunk by a binary search of `cu_seqlens`, walk back N-1
positions through the chunk and its carried history, compress through the token map, mix in
int64 and reduce modulo every bucket prime. Programs of the second part (with the carry) write
each request's last N-1 tokens for its next chunk. No allocation besides the outputs and no host
synchronisation unless `validate=True`.

What it is not: it does not build parameters (`engramd.client.hashing` does) and does not check
values on its own: an ID outside the map at a non-DEAD position is read as the pad ID, and a bad
`cu_seqlens` gives rows of no meaning (both memory safe: every read is masked to its input, but
not what the CPU reference does, which raises); pass `validate=True` to get the reference's error
at the cost of a device synchronisation.

Importing this module works without Triton; calling the kernel then raises TritonUnavailable.
With TRITON_INTERPRET=1 set before import, the kernel runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import os

import torch

from engramd.kernels.hashing_ref import (
    HashBatch,
    HashInputError,
    NgramHashParams,
    check_batch,
    validate_values,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install has no Triton; the reference covers it
    triton = None
    tl = None

HAVE_TRITON = triton is not None
BLOCK_T = 128  # tokens per program
BLOCK_B = 128  # requests per carry program


class TritonUnavailable(RuntimeError):
    """The Triton kernel was called but the `triton` package is not installed."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if HAVE_TRITON:

    @triton.jit
    def _chunk_of(cu_ptr, t, live, batch, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
        """The largest b in [0, batch-1] with cu[b] <= t: taking the largest skips empty
        chunks, whose start equals the next chunk's start."""
        lo = tl.full([BLOCK], 0, dtype=tl.int32)
        hi = tl.full([BLOCK], 0, dtype=tl.int32) + (batch - 1)
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            go = tl.load(cu_ptr + mid, mask=live, other=0) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
        return lo.to(tl.int64)

    @triton.jit
    def _token_at(ids_ptr, dead_ptr, hist_ids_ptr, hist_dead_ptr, chunk_at, hist_at, in_chunk,
                  live, total, hist_len, HAS_DEAD: tl.constexpr, HAS_HISTORY: tl.constexpr):
        """Raw ID (int64) and DEAD flag (uint8) of a chunk position or a history slot. Without
        a history every slot is before the sequence start: -1 and dead. Reads stay inside the
        inputs (`total` tokens, `hist_len` history slots) whatever cu_seqlens holds: unchecked
        (validate=False), a bad one gives rows of no meaning, never a read of other memory."""
        chunk_ok = live & in_chunk & (chunk_at >= 0) & (chunk_at < total)
        raw = tl.load(ids_ptr + chunk_at, mask=chunk_ok, other=0).to(tl.int64)
        dead = tl.full(raw.shape, 0, dtype=tl.uint8)
        if HAS_DEAD:
            dead = tl.load(dead_ptr + chunk_at, mask=chunk_ok, other=0)
        raw_h = tl.full(raw.shape, -1, dtype=tl.int64)
        dead_h = tl.full(raw.shape, 1, dtype=tl.uint8)
        if HAS_HISTORY:
            hist_ok = live & ~in_chunk & (hist_at >= 0) & (hist_at < hist_len)
            raw_h = tl.load(hist_ids_ptr + hist_at, mask=hist_ok, other=-1).to(tl.int64)
            dead_h = tl.load(hist_dead_ptr + hist_at, mask=hist_ok, other=1)
        return tl.where(in_chunk, raw, raw_h), tl.where(in_chunk, dead, dead_h)

    @triton.jit
    def _hash_block(
        block, ids_ptr, dead_ptr, cu_ptr, hist_ids_ptr, hist_dead_ptr,
        map_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr,
        total, batch, vocab, pad_id,
        N: tl.constexpr, L: tl.constexpr, K: tl.constexpr, L_PAD: tl.constexpr,
        K_PAD: tl.constexpr, SEARCH_STEPS: tl.constexpr, HAS_DEAD: tl.constexpr,
        HAS_HISTORY: tl.constexpr, BLOCK: tl.constexpr,
    ):
        t = block * BLOCK + tl.arange(0, BLOCK)
        live = t < total
        seq = _chunk_of(cu_ptr, t, live, batch, SEARCH_STEPS, BLOCK)
        local = t - tl.load(cu_ptr + seq, mask=live, other=0)
        layer = tl.arange(0, L_PAD)
        head = tl.arange(0, K_PAD)
        mix = tl.full([BLOCK, L_PAD], 0, dtype=tl.int64)
        alive = live
        out_row = t.to(tl.int64) * (L * (N - 1) * K)
        for back in tl.static_range(N):
            pos = local - back
            raw, dead = _token_at(ids_ptr, dead_ptr, hist_ids_ptr, hist_dead_ptr, t - back,
                                  seq * (N - 1) + (pos + (N - 1)), pos >= 0, live,
                                  total, batch * (N - 1), HAS_DEAD, HAS_HISTORY)
            # A DEAD token (or the sequence start, carried as dead history) blocks all older ones.
            alive = alive & (dead == 0)
            usable = alive & (raw >= 0) & (raw < vocab)
            comp = tl.load(map_ptr + raw, mask=usable, other=0).to(tl.int64)
            v = tl.where(usable, comp, pad_id)
            mult = tl.load(mult_ptr + layer * N + back, mask=layer < L, other=0)
            mix = mix ^ (v[:, None] * mult[None, :])  # < 2^63 by the multipliers' bound
            if back >= 1:
                # Order n = back + 1 is complete: its K columns of every layer.
                at = layer[:, None] * ((N - 1) * K) + ((back - 1) * K + head)[None, :]
                keep = (layer[:, None] < L) & (head[None, :] < K)
                prime = tl.load(primes_ptr + at, mask=keep, other=1)
                offset = tl.load(offsets_ptr + at, mask=keep, other=0)
                rows = mix[:, :, None] % prime[None, :, :] + offset[None, :, :]
                dst = out_row[:, None, None] + at[None, :, :]
                tl.store(out_ptr + dst, rows.to(tl.int32), mask=live[:, None, None] & keep[None])

    @triton.jit
    def _carry_block(
        block, ids_ptr, dead_ptr, cu_ptr, hist_ids_ptr, hist_dead_ptr,
        next_ids_ptr, next_dead_ptr, total, batch,
        N: tl.constexpr, HAS_DEAD: tl.constexpr, HAS_HISTORY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = block * BLOCK + tl.arange(0, BLOCK)
        live = b < batch
        start = tl.load(cu_ptr + b, mask=live, other=0).to(tl.int64)
        length = tl.load(cu_ptr + b + 1, mask=live, other=0).to(tl.int64) - start
        for slot in tl.static_range(N - 1):
            local = length - (N - 1) + slot
            raw, dead = _token_at(ids_ptr, dead_ptr, hist_ids_ptr, hist_dead_ptr, start + local,
                                  b * (N - 1) + local + (N - 1), local >= 0, live,
                                  total, batch * (N - 1), HAS_DEAD, HAS_HISTORY)
            tl.store(next_ids_ptr + b * (N - 1) + slot, raw, mask=live)
            tl.store(next_dead_ptr + b * (N - 1) + slot, dead, mask=live)

    @triton.jit
    def _ngram_hash_kernel(
        ids_ptr, dead_ptr, cu_ptr, hist_ids_ptr, hist_dead_ptr,
        map_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, next_ids_ptr, next_dead_ptr,
        total, batch, vocab, pad_id, token_blocks,
        N: tl.constexpr, L: tl.constexpr, K: tl.constexpr, L_PAD: tl.constexpr,
        K_PAD: tl.constexpr, SEARCH_STEPS: tl.constexpr, HAS_DEAD: tl.constexpr,
        HAS_HISTORY: tl.constexpr, BLOCK: tl.constexpr, CARRY_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if pid < token_blocks:
            _hash_block(pid, ids_ptr, dead_ptr, cu_ptr, hist_ids_ptr, hist_dead_ptr,
                        map_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr,
                        total, batch, vocab, pad_id, N, L, K, L_PAD, K_PAD, SEARCH_STEPS,
                        HAS_DEAD, HAS_HISTORY, BLOCK)
        else:
            _carry_block(pid - token_blocks, ids_ptr, dead_ptr, cu_ptr, hist_ids_ptr,
                         hist_dead_ptr, next_ids_ptr, next_dead_ptr, total, batch,
                         N, HAS_DEAD, HAS_HISTORY, CARRY_BLOCK)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _checked(args, params: NgramHashParams, validate: bool) -> HashBatch:
    if not HAVE_TRITON:
        raise TritonUnavailable("hash_ngrams_triton needs the `triton` package, not installed")
    batch = check_batch(*args[:2], params, *args[2:])  # type: ignore[call-arg]  # mypy: a slice has any length
    device = batch.token_ids.device
    if device.type != "cuda" and not _interpreting():
        raise HashInputError(
            f"hash_ngrams_triton needs CUDA tensors (token_ids is on {device}); use "
            "hash_ngrams_ref on CPU, or set TRITON_INTERPRET=1 before import"
        )
    if validate:
        validate_values(batch, params)
    return batch


def _launch(batch: HashBatch, params: NgramHashParams, carry: bool):
    """Run the kernel; returns rows and, with `carry`, the next history (else None, None)."""
    device, total, n_req = batch.token_ids.device, batch.token_ids.shape[0], batch.batch
    hist = params.max_ngram - 1
    out = torch.empty((total, params.n_layers, params.heads), dtype=torch.int32, device=device)
    next_ids = next_dead = None
    if carry:
        next_ids = torch.empty((n_req, hist), dtype=torch.int64, device=device)
        next_dead = torch.empty((n_req, hist), dtype=torch.bool, device=device)
    token_blocks = triton.cdiv(total, BLOCK_T)
    grid = token_blocks + (triton.cdiv(n_req, BLOCK_B) if carry else 0)
    if grid == 0:
        return out, next_ids, next_dead
    ids = batch.token_ids.contiguous()
    # Absent optional inputs are never read (HAS_* are False); any tensor fills the pointer.
    dead = ids if batch.dead is None else batch.dead.contiguous().view(torch.uint8)
    hist_ids = ids if batch.history_ids is None else batch.history_ids.contiguous()
    hist_dead = ids if batch.history_dead is None else \
        batch.history_dead.contiguous().view(torch.uint8)
    _ngram_hash_kernel[(grid,)](
        ids, dead, batch.cu_seqlens.contiguous(), hist_ids, hist_dead,
        params.token_map, params.multipliers, params.primes, params.offsets, out,
        out if next_ids is None else next_ids,
        out if next_dead is None else next_dead.view(torch.uint8),
        total, n_req, params.vocab, params.pad_id, token_blocks,
        N=params.max_ngram, L=params.n_layers, K=params.heads_per_order,
        L_PAD=_next_pow2(params.n_layers), K_PAD=_next_pow2(params.heads_per_order),
        SEARCH_STEPS=max(1, n_req.bit_length()), HAS_DEAD=batch.dead is not None,
        HAS_HISTORY=batch.history_ids is not None, BLOCK=BLOCK_T, CARRY_BLOCK=BLOCK_B,
    )
    return out, next_ids, next_dead


def hash_ngrams_triton(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    params: NgramHashParams,
    dead: torch.Tensor | None = None,
    history_ids: torch.Tensor | None = None,
    history_dead: torch.Tensor | None = None,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """Row IDs [T, n_layers, heads] int32; arguments as in `hashing_ref.hash_ngrams_ref`."""
    args = (token_ids, cu_seqlens, dead, history_ids, history_dead)
    rows, _, _ = _launch(_checked(args, params, validate), params, carry=False)
    return rows


def hash_and_carry_triton(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    params: NgramHashParams,
    dead: torch.Tensor | None = None,
    history_ids: torch.Tensor | None = None,
    history_dead: torch.Tensor | None = None,
    *,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, next history ids, next history dead flags) in one launch; as
    `hashing_ref.hash_and_carry_ref`."""
    args = (token_ids, cu_seqlens, dead, history_ids, history_dead)
    return _launch(_checked(args, params, validate), params, carry=True)
