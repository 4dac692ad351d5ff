"""A lookup's arguments, checked before anything is sent: the hash IDs, the SM share, the slot;
and the client's time settings.

Each raises the client error that names the bad value (BadIdsError, BadRequestError). Not here:
the daemon's checks of a lookup request (server/lookup_checks.py).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

from engramd.client.errors import BadIdsError, BadRequestError
from engramd.client.geometry import TableGeometry
from engramd.client.shared.ids import dtype_name


def check_ids(ids: torch.Tensor, geometry: TableGeometry, max_tokens: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise BadIdsError(f"hash IDs must be a torch.Tensor, got {type(ids).__name__}")
    if dtype_name(ids.dtype) is None:
        raise BadIdsError(f"hash IDs must be int32 or int64, got {ids.dtype}")
    expected = (geometry.n_layers, geometry.heads)
    if ids.dim() != 3 or tuple(ids.shape[1:]) != expected:
        raise BadIdsError(f"hash IDs must have shape [T, {expected[0]}, {expected[1]}], "
                          f"got {list(ids.shape)}")
    if not 1 <= ids.shape[0] <= max_tokens:
        raise BadIdsError(f"{ids.shape[0]} tokens; this client registered 1..{max_tokens}")
    if ids.device.type not in ("cpu", "cuda"):  # a meta tensor has no values to look up
        raise BadIdsError(f"hash IDs on {ids.device}: they must be on the CPU or a CUDA device")
    return ids.detach()


def check_seconds(name: str, value: Any, zero: bool = False, endless: bool = False) -> float:
    """A client's time setting: a number of seconds above 0 (`zero`: 0 too), finite unless
    `endless` (math.inf: wait for ever)."""
    try:
        seconds = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int too large for a float
        seconds = math.nan
    if math.isnan(seconds) or (seconds == math.inf and not endless) or seconds < 0 \
            or (seconds == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise BadRequestError(f"{name} {value!r}: seconds, {bound}" + ("" if endless else ", finite"))
    return seconds


def check_int(name: str, value: Any) -> int:
    """A whole-number setting (numpy's integers too) that fits the wire's int64; its range is
    the daemon's to check, which names the bounds."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or not -(1 << 63) <= number < 1 << 63:
        raise BadRequestError(f"{name} {value!r}: a whole number expected")
    return number


def check_wait(timeout: Any) -> float | None:
    """One wait's own timeout: None (the client's), or seconds >= 0 (math.inf: for ever)."""
    return None if timeout is None else check_seconds("timeout", timeout, zero=True, endless=True)


def check_sm_fraction(fraction: Any) -> float | None:
    if fraction is None:
        return None
    # Compared as given (a huge int would overflow float()); NaN fails the range too. (numbers.Real
    # declares no comparison with an int on its right, which every real number has.)
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) \
            or not 0 < fraction <= 1:  # type: ignore[operator]
        raise BadRequestError(f"sm_fraction {fraction!r}: a share of the SMs, 0 < f <= 1")
    return float(fraction)


def check_slot(slot: Any, slots: int) -> int | None:
    if slot is None:
        return None
    try:
        index = operator.index(slot) if not isinstance(slot, bool) else None
    except TypeError:
        index = None
    if index is None:
        raise BadRequestError(f"slot {slot!r} is a {type(slot).__name__}, not a slot index: this "
                              f"client has slots 0..{slots - 1}")
    if not 0 <= index < slots:
        raise BadRequestError(f"slot {slot!r}: this client has slots 0..{slots - 1}")
    return index
