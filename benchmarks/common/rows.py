"""Bit-exact comparison of gathered BF16 rows. A gather is a copy, so rows must match bit for bit;
NaN is compared by position only (its payload is not part of the contract)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class NotExactError(RuntimeError):
    """Rows did not reproduce the reference bit for bit; the message names where."""


def _differ(actual: Tensor, expected: Tensor) -> Tensor:
    """Boolean mask of the values that differ (shapes must match)."""
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    bits_a, bits_e = actual.view(torch.int16), expected.view(torch.int16)
    return (nan_a != nan_e) | (~nan_e & (bits_a != bits_e))


def bitwise_mismatches(actual: Tensor, expected: Tensor) -> tuple[int, list]:
    """(values that differ, the first 5 indices); (-1, [why]) when the shapes differ."""
    if actual.shape != expected.shape:
        return -1, [f"shape {list(actual.shape)} != {list(expected.shape)}"]
    wrong = _differ(actual, expected).nonzero()
    return int(wrong.shape[0]), wrong[:5].tolist()


def assert_exact(actual: Tensor, expected: Tensor, what: str) -> None:
    """Bit equality, on the CPU; raises NotExactError naming the first differing indices."""
    actual, expected = actual.cpu(), expected.cpu()
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise NotExactError(f"{what}: got {actual.dtype} {tuple(actual.shape)}, "
                            f"want {expected.dtype} {tuple(expected.shape)}")
    bad = _differ(actual, expected)
    if bad.any():
        a, e = actual.view(torch.int16), expected.view(torch.int16)
        where = bad.nonzero()[:8].tolist()
        shown = ", ".join(f"{tuple(i)}: got {a[tuple(i)].item():#06x} want {e[tuple(i)].item():#06x}"
                          for i in where)
        raise NotExactError(f"{what}: {int(bad.sum())} of {bad.numel()} values differ; first: {shown}")


def poisoned(shape: Sequence[int], device: torch.device) -> Tensor:
    """An output buffer full of NaN, so that a row the kernel never writes cannot pass a check."""
    return torch.full(tuple(shape), float("nan"), dtype=torch.bfloat16, device=device)
