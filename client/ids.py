"""Hash-ID normalisation shared by the client library and the daemon.

Slots hold row IDs as int32 (every table has fewer than 2^31 - 1 rows). An int64 ID that does not
fit must not be truncated into a valid-looking row, so it is mapped to OUT_OF_RANGE_ID, which every
table treats as out of range (a zero row, counted in stats). -1 (DEAD) passes unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

OUT_OF_RANGE_ID = np.iinfo(np.int32).max
ID_DTYPES = {"int32": torch.int32, "int64": torch.int64}


def dtype_name(dtype: torch.dtype) -> str | None:
    for name, candidate in ID_DTYPES.items():
        if candidate == dtype:
            return name
    return None


def to_int32_ids(ids: torch.Tensor) -> torch.Tensor:
    """int32 copy/view of `ids` (int32 or int64) with unrepresentable IDs mapped out of range."""
    if ids.dtype == torch.int32:
        return ids
    if ids.dtype != torch.int64:
        raise TypeError(f"hash IDs must be int32 or int64, got {ids.dtype}")
    fits = (ids >= -1) & (ids < OUT_OF_RANGE_ID)
    return torch.where(fits, ids, OUT_OF_RANGE_ID).to(torch.int32)


def int32_ids_from_bytes(data: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Decode an inline little-endian ID frame into int32, mapping like `to_int32_ids`."""
    array = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    if array.dtype.itemsize == 4:
        return array.astype(np.int32, copy=False)
    fits = (array >= -1) & (array < OUT_OF_RANGE_ID)
    return np.where(fits, array, OUT_OF_RANGE_ID).astype(np.int32)
