"""engramd client library: the public contract (geometry, wire protocol, errors) and the client.

    from engramd.client import EngramClient

The public API is what this module exports (`__all__`): the client, its lookup future and the
lookup a CUDA graph records (CapturedLookup), the errors, the table geometry and the hasher;
beside it, `engramd.client.adapter` (a model runner's adapter) and the engine plugins in
`engramd.client.engines`, which engines load by their entry points. The other modules here are
the client's own machinery, and `engramd.client.shared` what the client and the daemon share
(the wire, the slab and its counters, the handle socket, CUDA and pinning helpers): not an API.

Names are imported on first use (PEP 562), so that a light user of the package (the CLI's
`health`, which must answer a probe in well under a second) never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "EngramClient": "client", "LookupFuture": "future", "CapturedLookup": "captured",
    "BadIdsError": "errors", "BadRequestError": "errors", "CudaUnavailableError": "errors",
    "CaptureUnsupportedError": "errors", "ReplayFailedError": "errors",
    "DaemonUnavailableError": "errors", "LookupFailedError": "errors",
    "EngramError": "errors", "NotReadyError": "errors", "NotRegisteredError": "errors",
    "PermissionDeniedError": "errors", "ProtocolError": "errors", "ReplyTimeoutError": "errors",
    "DEAD_ID": "geometry", "ShardView": "geometry", "TableGeometry": "geometry",
    "EngramHasher": "hashing", "HashState": "hashing",
}
__all__ = [
    "BadIdsError",
    "BadRequestError",
    "CaptureUnsupportedError",
    "CapturedLookup",
    "CudaUnavailableError",
    "DEAD_ID",
    "DaemonUnavailableError",
    "EngramClient",
    "EngramError",
    "EngramHasher",
    "HashState",
    "LookupFailedError",
    "LookupFuture",
    "NotReadyError",
    "NotRegisteredError",
    "PermissionDeniedError",
    "ProtocolError",
    "ReplayFailedError",
    "ReplyTimeoutError",
    "ShardView",
    "TableGeometry",
]

if TYPE_CHECKING:
    from engramd.client.captured import CapturedLookup
    from engramd.client.client import EngramClient
    from engramd.client.errors import (
        BadIdsError,
        BadRequestError,
        CaptureUnsupportedError,
        CudaUnavailableError,
        DaemonUnavailableError,
        EngramError,
        LookupFailedError,
        NotReadyError,
        NotRegisteredError,
        PermissionDeniedError,
        ProtocolError,
        ReplayFailedError,
        ReplyTimeoutError,
    )
    from engramd.client.future import LookupFuture
    from engramd.client.geometry import DEAD_ID, ShardView, TableGeometry
    from engramd.client.hashing import EngramHasher, HashState


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engramd.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"engramd.client.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
