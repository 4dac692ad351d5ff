"""What the kernels take: the row format's constants and the shape of a TP shard.

The kernels are the bottom of the package (server -> client -> kernels, checked by ruff's
banned-api rule in pyproject.toml): they import nothing of the client or the daemon, and take
a shard as any object with these fields (engramd.client.geometry.ShardView is the one in use).
"""

from __future__ import annotations

from typing import Protocol

DEAD_ID = -1  # a hash ID that names no row: its rows come back as zeros
SCALE_BLOCK = 32  # values per UE8M0 scale byte of a stored row


class Shard(Protocol):
    """One TP rank's part of a lookup: the heads it returns and the rows it owns per layer."""

    # Read-only members, so that a frozen dataclass (ShardView) is one.
    @property
    def rank(self) -> int: ...
    @property
    def shards(self) -> int: ...
    @property
    def head_start(self) -> int: ...
    @property
    def head_end(self) -> int: ...
    @property
    def local_heads(self) -> int: ...
    @property
    def row_ranges(self) -> tuple[tuple[int, int], ...]: ...
    @property
    def owned_heads(self) -> int: ...
