"""Engram table geometry: bucket primes, column offsets, rows per layer, head-wise shards.

This is the shared contract between the daemon, the client library and the hashing code. It is
computed from a model's config.json (DeepSeek field names) exactly as docs/engram.md states;
it holds no table data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

# The kernels' constants, re-exported: they are this module's contract too.
from engramd.kernels.contract import DEAD_ID as DEAD_ID
from engramd.kernels.contract import SCALE_BLOCK as SCALE_BLOCK

HEAD_DIM_BYTES_SCALE = 8  # one UE8M0 scale byte per block of 32 values (256 / 32)

# The config.json fields the geometry is computed from, with their types.
_CONFIG_FIELDS: dict[str, type] = {
    "engram_layer_ids": list,
    "engram_max_ngram_size": int,
    "engram_n_heads": int,
    "engram_head_dim": int,
    "engram_vocab_size": int,
    "engram_compressed_vocab_size": int,
    "engram_pad_token_id": int,
}


class GeometryError(ValueError):
    """A config does not describe a valid Engram geometry; the message names the field."""


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (far beyond any bucket size)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(vocab_size: int, count: int) -> list[int]:
    """The first `count` distinct primes greater than `vocab_size - 1`, in increasing order.

    Walking layers, orders and heads in order and giving each bucket the smallest untaken prime
    above the base size is the same as taking consecutive primes.
    """
    primes: list[int] = []
    candidate = vocab_size  # smallest integer > vocab_size - 1
    while len(primes) < count:
        if is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes


@dataclass(frozen=True)
class ShardView:
    """What one shard (TP rank, or TP x DP rank) owns: a contiguous range of heads.

    `local_heads` is ceil(heads / shards) for every shard, so all ranks return tensors of one shape;
    heads past `head_end - head_start` are padding and come back as zeros.
    """

    rank: int
    shards: int
    head_start: int
    head_end: int
    local_heads: int
    row_ranges: tuple[tuple[int, int], ...]  # per layer: [lo, hi) rows this shard owns

    @property
    def owned_heads(self) -> int:
        return self.head_end - self.head_start


@dataclass(frozen=True)
class TableGeometry:
    """Geometry of every Engram table of one model."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    heads_per_order: int
    head_dim: int
    vocab_size: int
    compressed_vocab_size: int
    pad_token_id: int
    primes: tuple[tuple[int, ...], ...]  # [layer][column], column = (n - 2) * heads_per_order + head

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def heads(self) -> int:
        """Hash columns per layer: (max_ngram - 1) orders x heads_per_order."""
        return (self.max_ngram - 1) * self.heads_per_order

    @property
    def scale_bytes(self) -> int:
        return self.head_dim // SCALE_BLOCK

    @property
    def row_bytes(self) -> int:
        """Packed row: head_dim FP8 bytes then head_dim/32 UE8M0 scale bytes (264 for V4.1)."""
        return self.head_dim + self.scale_bytes

    @cached_property
    def offsets(self) -> tuple[tuple[int, ...], ...]:
        """[layer][column]: first row of that column's bucket in the layer's table."""
        out = []
        for layer_primes in self.primes:
            acc, offs = 0, []
            for p in layer_primes:
                offs.append(acc)
                acc += p
            out.append(tuple(offs))
        return tuple(out)

    @cached_property
    def rows(self) -> tuple[int, ...]:
        """Rows of each layer's table (`engram_num_embeddings`)."""
        return tuple(sum(p) for p in self.primes)

    def table_bytes(self, layer_index: int) -> int:
        return self.rows[layer_index] * self.row_bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.table_bytes(i) for i in range(self.n_layers))

    def shard(self, rank: int, shards: int) -> ShardView:
        """Head-wise shard `rank` of `shards` (TP: rank=tp_rank, shards=tp_size)."""
        if shards < 1:
            raise GeometryError(f"shard count must be >= 1, got {shards}")
        if not 0 <= rank < shards:
            raise GeometryError(f"shard rank {rank} outside [0, {shards})")
        part = math.ceil(self.heads / shards)
        start = min(self.heads, rank * part)
        end = min(self.heads, (rank + 1) * part)
        ranges = []
        for layer in range(self.n_layers):
            offs, primes = self.offsets[layer], self.primes[layer]
            lo = offs[start] if start < self.heads else self.rows[layer]
            hi = offs[end - 1] + primes[end - 1] if end > start else lo
            ranges.append((lo, hi))
        return ShardView(rank, shards, start, end, part, tuple(ranges))

    def to_config(self) -> dict[str, Any]:
        """The config.json fields this geometry was made from, plus `engram_num_embeddings`."""
        return {
            "engram_layer_ids": list(self.layer_ids),
            "engram_max_ngram_size": self.max_ngram,
            "engram_n_heads": self.heads_per_order,
            "engram_head_dim": self.head_dim,
            "engram_vocab_size": self.vocab_size,
            "engram_compressed_vocab_size": self.compressed_vocab_size,
            "engram_pad_token_id": self.pad_token_id,
            "engram_num_embeddings": list(self.rows),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config") -> TableGeometry:
        """Build from a config.json mapping; errors name `source`, the key and the value."""
        for key, kind in _CONFIG_FIELDS.items():
            if key not in config:
                raise GeometryError(f"{source}: missing key {key!r}")
            value = config[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise GeometryError(
                    f"{source}: key {key!r} must be {kind.__name__}, got {value!r}"
                )
        layer_ids = config["engram_layer_ids"]
        if not layer_ids or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                    for x in layer_ids) or len(set(layer_ids)) != len(layer_ids):
            raise GeometryError(f"{source}: key 'engram_layer_ids' must be a non-empty list of "
                                f"distinct non-negative ints, got {layer_ids!r}")
        _require(source, config, "engram_max_ngram_size", lambda v: v >= 2)
        _require(source, config, "engram_n_heads", lambda v: v >= 1)
        _require(source, config, "engram_head_dim", lambda v: v > 0 and v % SCALE_BLOCK == 0)
        _require(source, config, "engram_vocab_size", lambda v: v >= 2)
        _require(source, config, "engram_compressed_vocab_size", lambda v: v >= 1)
        n_cols = (config["engram_max_ngram_size"] - 1) * config["engram_n_heads"]
        flat = bucket_primes(config["engram_vocab_size"], n_cols * len(layer_ids))
        primes = tuple(tuple(flat[i * n_cols:(i + 1) * n_cols]) for i in range(len(layer_ids)))
        geometry = cls(
            layer_ids=tuple(layer_ids),
            max_ngram=config["engram_max_ngram_size"],
            heads_per_order=config["engram_n_heads"],
            head_dim=config["engram_head_dim"],
            vocab_size=config["engram_vocab_size"],
            compressed_vocab_size=config["engram_compressed_vocab_size"],
            pad_token_id=config["engram_pad_token_id"],
            primes=primes,
        )
        declared = config.get("engram_num_embeddings")
        if declared is not None and list(declared) != list(geometry.rows):
            raise GeometryError(
                f"{source}: key 'engram_num_embeddings' is {declared!r} but the primes give "
                f"{list(geometry.rows)!r}"
            )
        return geometry

    @classmethod
    def from_file(cls, path: str | Path) -> TableGeometry:
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise GeometryError(f"{path}: cannot read config: {exc}") from exc
        return cls.from_config(config, source=str(path))

    @classmethod
    def named(cls, name: str) -> TableGeometry:
        """A built-in geometry: `demo` or `v4.1-flash`."""
        try:
            config = BUILTIN_CONFIGS[name]
        except KeyError:
            raise GeometryError(
                f"unknown geometry {name!r}; built-in: {sorted(BUILTIN_CONFIGS)}"
            ) from None
        return cls.from_config(config, source=f"geometry {name!r}")

    @classmethod
    def resolve(cls, spec: str | Path) -> TableGeometry:
        """A built-in name, or a path to a config.json."""
        if str(spec) in BUILTIN_CONFIGS:
            return cls.named(str(spec))
        if not Path(spec).exists():
            raise GeometryError(f"unknown geometry {str(spec)!r}: not a built-in "
                                f"({', '.join(sorted(BUILTIN_CONFIGS))}) and no such config file")
        return cls.from_file(spec)


def _require(source: str, config: dict[str, Any], key: str, ok) -> None:
    if not ok(config[key]):
        raise GeometryError(f"{source}: key {key!r} has invalid value {config[key]!r}")


V41_FLASH_CONFIG: dict[str, Any] = {
    "engram_layer_ids": [1, 14],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 16_000_000,
    "engram_compressed_vocab_size": 99_092,
    "engram_pad_token_id": 2,
    "engram_num_embeddings": [384_006_168, 384_016_682],
}

# Same shape as V4.1-Flash (2 layers x 24 heads x 256) with small buckets: 2 x ~12.7 K rows, ~7 MB.
DEMO_CONFIG: dict[str, Any] = {
    "engram_layer_ids": [1, 14],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 500,
    "engram_compressed_vocab_size": 99_092,
    "engram_pad_token_id": 2,
}

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {"demo": DEMO_CONFIG, "v4.1-flash": V41_FLASH_CONFIG}
