"""Start-up self-check: sampled lookups through the serving kernel against the checkpoint bytes.

Before the daemon says it is ready, it looks up a sample of rows of every layer, drawn afresh
at every start (a fixed sample could be dodged by a table file crafted to pass it), through the
backend's own kernel (the Triton kernel on every GPU, or the CPU reference) and compares them
exactly with the same rows dequantized straight from the checkpoint files. This catches a table
file that does not hold the checkpoint (a corrupt or foreign re-attach), a broken registration,
and a kernel that does not run on this machine, before any client sees a wrong row.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from engramd.server.checkpoint import EngramCheckpoint
from engramd.server.table_file import HostTable
from engramd.server.table_loader import LoadedTables

log = logging.getLogger("engramd.selfcheck")

SAMPLE_TOKENS = 16


class SelfCheckError(RuntimeError):
    """The served rows differ from the checkpoint; the message names the layer and row."""


def sample_ids(rows: tuple[int, ...], heads: int, tokens: int = SAMPLE_TOKENS, seed: int = 0) -> np.ndarray:
    """[tokens, n_layers, heads] IDs: the first and last rows of each table plus random ones."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, n, size=(tokens, heads)) for n in rows], axis=1)
    ids[0, :, 0] = 0
    ids[-1, :, -1] = np.array(rows) - 1
    return ids


def expected_rows(checkpoint: EngramCheckpoint, ids: np.ndarray) -> torch.Tensor:
    """[n_layers, T, heads, head_dim] bf16 dequantized from the checkpoint's bytes."""
    from engramd.kernels.gather_ref import dequantize_rows

    geometry = checkpoint.geometry
    packed = np.empty((*ids.shape, geometry.row_bytes), dtype=np.uint8)  # [T, L, H, row_bytes]
    for (token, layer, head), row in np.ndenumerate(ids):
        checkpoint.read_packed(layer, int(row), packed[token, layer, head][None])
    rows = dequantize_rows(torch.from_numpy(packed), geometry.head_dim)
    return rows.permute(1, 0, 2, 3).contiguous()


def run_self_check(checkpoint: EngramCheckpoint, loaded: LoadedTables, seed: int | None = None) -> None:
    """The start-up check: sampled rows through the backend's kernel on every device."""
    _check_rows(checkpoint, loaded.backend.check_gather, seed)


def check_host_tables(checkpoint: EngramCheckpoint, tables: list[HostTable], seed: int | None = None) -> None:
    """A reload's check, before anything serves `tables`: sampled rows through the reference
    gather (the served kernel was checked at start; what is new is the bytes)."""
    from engramd.kernels.gather_ref import gather

    def reference(ids: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield "the reloaded tables", gather([t.tensor for t in tables], ids, checkpoint.geometry.shard(0, 1))[0]

    _check_rows(checkpoint, reference, seed)


def _check_rows(checkpoint: EngramCheckpoint, gathers: Callable[[torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                seed: int | None) -> None:
    """SelfCheckError unless every (where, rows) `gathers` yields for a fresh sample of IDs
    equals the checkpoint's rows exactly."""
    from engramd.kernels.gather_ref import differing_values

    started = time.monotonic()
    geometry = checkpoint.geometry
    seed = secrets.randbits(32) if seed is None else seed
    ids = sample_ids(geometry.rows, geometry.heads, seed=seed)
    expected = expected_rows(checkpoint, ids)
    for where, actual in gathers(torch.from_numpy(ids)):
        mismatch = differing_values(actual, expected).nonzero()
        if len(mismatch):
            layer, token, head, _ = mismatch[0].tolist()
            raise SelfCheckError(
                f"self-check failed on {where}: layer {geometry.layer_ids[layer]} row "
                f"{ids[token, layer, head]} differs from the checkpoint ({len(mismatch)} values); "
                "the table files do not hold this checkpoint or the kernel is broken here")
    log.info("self-check passed: %d rows per layer (sample seed %d) match the checkpoint (%.2f s)",
             ids.shape[0] * ids.shape[2], seed, time.monotonic() - started)
