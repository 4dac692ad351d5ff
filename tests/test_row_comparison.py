"""How served rows are compared with the reference's: bit for bit, NaN by position
(kernels/gather_ref.py; the self-check and the engine plugins' checkpoint samples use it)."""

from __future__ import annotations

import pytest
import torch

from engramd.kernels.gather_ref import differing_values

BF16_NAN, REFERENCE_NAN, ONE, NEGATIVE_ZERO = 0x7FC0, -1, 0x3F80, -0x8000  # as int16 (-1: 0xFFFF)


def bf16(*bits: int) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16)


def test_nans_of_any_sign_match_by_position():
    """The Triton kernel writes 0x7FC0; the torch reference's NaN may have any sign and payload."""
    actual = bf16(BF16_NAN, ONE, BF16_NAN)
    expected = bf16(REFERENCE_NAN, ONE, BF16_NAN)
    assert not differing_values(actual, expected).any()


@pytest.mark.parametrize("actual, expected", [
    ((BF16_NAN, ONE), (ONE, ONE)),        # a NaN where a value belongs
    ((ONE, ONE), (ONE, BF16_NAN)),        # a value where a NaN belongs
    ((0, ONE), (NEGATIVE_ZERO, ONE)),     # the sign of zero is part of the contract
    ((ONE, ONE + 1), (ONE, ONE)),         # one unit in the last place
])
def test_any_other_difference_is_found(actual, expected):
    assert differing_values(bf16(*actual), bf16(*expected)).sum() == 1
