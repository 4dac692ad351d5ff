"""engramd client library: the public contract (geometry, wire protocol, errors) and the client.

    from engramd.client import EngramClient
"""

from engramd.client.client import EngramClient, LookupFuture
from engramd.client.errors import (
    BadIdsError,
    BadRequestError,
    DaemonUnavailableError,
    EngramError,
    NotReadyError,
    NotRegisteredError,
    ProtocolError,
    ReplyTimeoutError,
)
from engramd.client.geometry import DEAD_ID, ShardView, TableGeometry
from engramd.client.hashing import EngramHasher, HashState

__all__ = [
    "DEAD_ID",
    "BadIdsError",
    "BadRequestError",
    "DaemonUnavailableError",
    "EngramClient",
    "EngramError",
    "EngramHasher",
    "HashState",
    "LookupFuture",
    "NotReadyError",
    "NotRegisteredError",
    "ProtocolError",
    "ReplyTimeoutError",
    "ShardView",
    "TableGeometry",
]
