"""Hash-ID dtypes shared by the client library and the daemon.

IDs travel and sit in slots in the caller's dtype (int32 or int64), so the client launches no
conversion kernel; the gather kernels treat any ID outside the owned rows (past the table,
negative other than -1) as out of range: a zero row, counted in stats.
"""

from __future__ import annotations

import numpy as np
import torch

ID_DTYPES = {"int32": torch.int32, "int64": torch.int64}


def dtype_name(dtype: torch.dtype) -> str | None:
    for name, candidate in ID_DTYPES.items():
        if candidate == dtype:
            return name
    return None


def ids_from_bytes(data: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only view of an inline little-endian ID frame."""
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
