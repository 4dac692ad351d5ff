"""A GPU's hot-row cache: device state, its hash functions, and the choice of what to keep.

Real text is Zipf-like, so a few million (layer, row) pairs take most lookups. The cache keeps
those rows, packed exactly as in the host table (264 B), in HBM; the gather kernel
(gather_triton) probes it per row and reads a hit from HBM instead of host memory.

Layout, all on one device:

    keys    int64 [sets, WAYS]          resident key per way, EMPTY_KEY when free
    pool    uint8 [sets * WAYS, row_bytes]  the row of way w of set s at slot s * WAYS + w
    sketch  int32 [SKETCH_DEPTH, 2^bits]  count-min sketch of lookups, incremented by the kernel
    log     int64 [2^k]                  ring of missed keys whose count reached `admit_min`
    cursor  int64 [1]                    total entries ever appended to the log
    counters int64 [2, n_layers]         rows read per layer since start, and of them cache hits

A key is (layer << KEY_LAYER_SHIFT) | row. A row may only live in the set its key hashes to, so a
probe reads one 64-byte line of keys. What to keep is decided per set: the WAYS keys of highest
estimated count among the residents and the logged candidates (`choose_admissions`), and a
candidate must beat a resident by a clear lead (`ratio`, `margin`), so that under uniform traffic,
where every estimate is noise around the same value, nothing is replaced back and forth.

This module holds state and pure tensor functions; it does not decide when to refresh, and it
never writes keys or rows itself. The protocol that changes a way under running gathers
(invalidate, wait out readers, fill, publish) is client/shared/cache_keeper.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

WAYS = 8  # 8 int64 keys: one 64-byte line per probe
SKETCH_DEPTH = 2
EMPTY_KEY = -1
KEY_LAYER_SHIFT = 40  # rows < 2^40; layers < 2^23
# Odd 64-bit multipliers for multiply-shift hashing (as signed int64, the kernel's arithmetic).
SET_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15
SKETCH_MULTIPLIERS = (-4658895280553007687, -7723592293110705685)  # 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MIN_SKETCH_BITS = 16
MAX_SKETCH_BITS = 26
META_FIELDS = ("keys", "pool", "sets", "sketch", "log", "cursor", "counters", "log_mask",
               "admit_min", "sketch_bits")


class CacheConfigError(ValueError):
    """A cache size or parameter that cannot work (names the value)."""


@dataclass(frozen=True)
class CacheLayout:
    """Sizes of one cache, derived from a byte budget that covers every array above."""

    sets: int
    row_bytes: int
    sketch_bits: int
    log_entries: int

    @classmethod
    def from_budget(cls, budget_bytes: int, row_bytes: int) -> CacheLayout:
        """The most sets that fit in `budget_bytes` next to a sketch of ~2 counters per slot."""
        if row_bytes <= 0 or row_bytes % 8:
            raise CacheConfigError(f"row_bytes must be a positive multiple of 8, got {row_bytes}")
        per_slot = row_bytes + 8  # the row and its key
        slots = budget_bytes // per_slot
        sketch_bits = min(MAX_SKETCH_BITS, max(MIN_SKETCH_BITS, (2 * max(slots, 1)).bit_length() - 1))
        # A quarter of the slots' worth of candidates between refreshes before writers overrun
        # a window (a refresh weighs the newest 2^18 of them: cache_keeper.MAX_REFRESH_ENTRIES).
        log_entries = 1 << min(22, max(12, (max(slots, 1) // 4).bit_length()))
        fixed = SKETCH_DEPTH * (4 << sketch_bits) + 8 * log_entries
        sets = (budget_bytes - fixed) // (per_slot * WAYS)
        if sets < 1:
            raise CacheConfigError(
                f"a hot-row cache of {budget_bytes} bytes is too small: it needs at least "
                f"{fixed + per_slot * WAYS} bytes for one set beside its sketch and log")
        return cls(sets, row_bytes, sketch_bits, log_entries)

    @property
    def slots(self) -> int:
        return self.sets * WAYS

    @property
    def nbytes(self) -> int:
        return (self.slots * (self.row_bytes + 8) + SKETCH_DEPTH * (4 << self.sketch_bits)
                + 8 * self.log_entries + 8)


def row_keys(layers: Tensor, rows: Tensor) -> Tensor:
    return (layers.to(torch.int64) << KEY_LAYER_SHIFT) | rows.to(torch.int64)


def key_layers(keys: Tensor) -> Tensor:
    return keys >> KEY_LAYER_SHIFT


def key_rows(keys: Tensor) -> Tensor:
    return keys & ((1 << KEY_LAYER_SHIFT) - 1)


def _high32(x: Tensor) -> Tensor:
    return (x >> 32) & 0xFFFFFFFF  # a logical shift: int64 >> is arithmetic


def set_index(keys: Tensor, sets: int) -> Tensor:
    """Multiply-shift: the top 32 bits of key * SET_MULTIPLIER, scaled onto [0, sets)."""
    return (_high32(keys * SET_MULTIPLIER) * sets) >> 32


def sketch_index(keys: Tensor, depth: int, bits: int) -> Tensor:
    return (keys * SKETCH_MULTIPLIERS[depth] >> (64 - bits)) & ((1 << bits) - 1)


class HotCache:
    """One device's cache arrays and the int64 `meta` row the gather kernel reads them through."""

    def __init__(self, layout: CacheLayout, n_layers: int, device: torch.device | str,
                 admit_min: int = 3):
        if admit_min < 0:
            raise CacheConfigError(f"admit_min must be >= 0, got {admit_min}")
        self.layout = layout
        self.n_layers = n_layers
        self.device = torch.device(device)
        self.admit_min = admit_min
        self.keys = torch.full((layout.sets, WAYS), EMPTY_KEY, dtype=torch.int64, device=self.device)
        self.pool = torch.zeros((layout.slots, layout.row_bytes), dtype=torch.uint8, device=self.device)
        self.sketch = torch.zeros((SKETCH_DEPTH, 1 << layout.sketch_bits), dtype=torch.int32,
                                  device=self.device)
        self.log = torch.full((layout.log_entries,), EMPTY_KEY, dtype=torch.int64, device=self.device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.counters = torch.zeros((2, n_layers), dtype=torch.int64, device=self.device)
        fields = {"keys": self.keys.data_ptr(), "pool": self.pool.data_ptr(), "sets": layout.sets,
                  "sketch": self.sketch.data_ptr(), "log": self.log.data_ptr(),
                  "cursor": self.cursor.data_ptr(), "counters": self.counters.data_ptr(),
                  "log_mask": layout.log_entries - 1, "admit_min": admit_min,
                  "sketch_bits": layout.sketch_bits}
        self.meta_words = tuple(fields[name] for name in META_FIELDS)
        self.meta = torch.tensor(self.meta_words, dtype=torch.int64, device=self.device)

    def estimate(self, keys: Tensor) -> Tensor:
        """Count-min estimate (never below the true count since the last aging) of each key."""
        bits = self.layout.sketch_bits
        counts = [self.sketch[d][sketch_index(keys, d, bits)] for d in range(SKETCH_DEPTH)]
        return torch.stack(counts).amin(0)

    def age(self) -> None:
        """Halve every count, so that what was hot long ago can be displaced (racy by design:
        an increment lost to a concurrent gather only makes an estimate one lower)."""
        self.sketch.bitwise_right_shift_(1)

    def resident(self, keys: Tensor) -> Tensor:
        """bool per key: is it in its set now."""
        sets = set_index(keys, self.layout.sets)
        return (self.keys[sets] == keys[:, None]).any(dim=1)

    def logged_since(self, start: int, end: int) -> Tensor:
        """Log entries appended in [start, end); all of the ring when it wrapped since `start`."""
        size = self.layout.log_entries
        if end - start >= size:
            return self.log.clone()
        first, last = start % size, end % size
        if first <= last:
            return self.log[first:last].clone()
        return torch.cat([self.log[first:], self.log[:last]])


def valid_keys(keys: Tensor, table_rows: Tensor) -> Tensor:
    """bool per key: a real (layer, row) of these tables (the log is written racily)."""
    layers, rows = key_layers(keys), key_rows(keys)
    in_layers = (keys >= 0) & (layers < table_rows.numel())
    return in_layers & (rows < table_rows[layers.clamp(0, table_rows.numel() - 1)])


@dataclass
class Admissions:
    """Ways to refill: slot (set, way) gets the row of `keys`."""

    sets: Tensor
    ways: Tensor
    keys: Tensor

    def __len__(self) -> int:
        return int(self.keys.numel())

    @property
    def slots(self) -> Tensor:
        return self.sets * WAYS + self.ways

    def part(self, where: slice | Tensor) -> Admissions:
        return Admissions(self.sets[where], self.ways[where], self.keys[where])


@dataclass
class AdmissionPlan:
    """Admissions before the one step that depends on the values: `won` marks the real ones.
    Every shape is known on the host, so that planning never waits for the device."""

    sets: Tensor
    ways: Tensor
    keys: Tensor
    won: Tensor  # bool

    def compact(self) -> Admissions:
        """The admissions themselves (on a GPU, a wait for the device: boolean indexing)."""
        return Admissions(self.sets, self.ways, self.keys).part(self.won)


def choose_admissions(cache: HotCache, candidates: Tensor, margin: int = 1,
                      ratio: float = 1.5, limit: int | None = None) -> Admissions:
    """plan_admissions of distinct, non-resident `candidates`, compacted."""
    return plan_admissions(cache, candidates, None, margin, ratio, limit).compact()


def plan_admissions(cache: HotCache, candidates: Tensor, eligible: Tensor | None = None,
                    margin: int = 1, ratio: float = 1.5, limit: int | None = None) -> AdmissionPlan:
    """Per set, keep the WAYS keys of highest estimate among residents and candidates.

    `candidates` are keys not resident now, distinct where `eligible` (bool, default all): the
    others take part in nothing. Each way has a bar: `ratio` x its resident's estimate plus
    `margin`, or for an empty way `cache.admit_min` (filling a way costs one host read, so a row
    must be likely to come back). In a set, the best candidate is paired with the way of the
    lowest bar, the second best with the second lowest, and so on; a pair swaps when the
    candidate's estimate exceeds the bar. Because candidates fall and bars rise along the
    pairing, the swaps stop at the first pair that does not, which leaves exactly the top WAYS
    of the union (ratio 1, margin 0, admit_min 0). The default demands a clear lead, so
    estimates that differ only by sketch noise swap nothing. At most `limit` swaps, the hottest
    first.

    Fixed shapes throughout (no unique, nonzero or boolean indexing): the plan has min(limit, N)
    entries, the winners hottest first (equal estimates by set, then in `candidates`' order),
    then losers that `won` marks. Its memory grows with N x WAYS: the caller bounds N.
    """
    n, sets = candidates.numel(), cache.layout.sets
    if eligible is None:
        eligible = torch.ones(n, dtype=torch.bool, device=candidates.device)
    cand_est = cache.estimate(candidates.clamp(min=0))
    # Ineligible entries sort after every set, in a group of their own.
    cand_set = torch.where(eligible, set_index(candidates, sets), sets)
    order = torch.argsort(cand_est, descending=True, stable=True)
    order = order[torch.argsort(cand_set[order], stable=True)]
    cand_set, cand_est, cand_key = cand_set[order], cand_est[order], candidates[order]
    first = torch.searchsorted(cand_set, cand_set)  # each entry's set's first entry
    everyone = torch.arange(n, device=candidates.device)
    rank = everyone - first
    paired = rank.clamp(max=WAYS - 1)
    # Each entry reads its set's line of keys and orders its ways, but only the line of the
    # set's first entry is used: gathers count on while this runs, so two reads of one set may
    # order its ways apart and pair two winners with one way.
    keys = cache.keys[cand_set.clamp(max=sets - 1)]
    way_bars = torch.where(keys == EMPTY_KEY, float(cache.admit_min),
                           cache.estimate(keys.clamp(min=0)) * ratio + margin)
    lowest_bar, ways_by_bar = torch.sort(way_bars, dim=1)
    bar = lowest_bar[first, paired]
    won = (cand_set < sets) & (rank < WAYS) & (cand_est > bar)
    # Estimates are never negative: a loser's -1 here puts every winner before it; winners of
    # one estimate keep their order (by set, then as given), so the cut at `limit` is stable.
    hottest = torch.argsort(torch.where(won, cand_est, -1), descending=True, stable=True)
    hottest = hottest[:n if limit is None else min(limit, n)]
    return AdmissionPlan(cand_set[hottest], ways_by_bar[first[hottest], paired[hottest]],
                         cand_key[hottest], won[hottest])
