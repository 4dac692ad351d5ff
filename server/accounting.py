"""The registry's accounting: the daemon's totals (lookups, rows, out-of-range IDs,
registrations, reaped clients), its errors by code, its own dispatch latency, and the
statistics `stats` and the metrics report of them.

Kept by the registry (server/registry.py) on the loop's thread. Not the reports built from them
(server/report.py), nor the Prometheus endpoint (server/metrics.py).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from engramd.client.errors import BadRequestError
from engramd.server.backend import Backend, LookupJob, Slab

if TYPE_CHECKING:
    from engramd.server.registry import ClientRecord

# The counts a mapped client reports (heartbeat, release): cumulative, so each only grows. 2**53
# rows is 285 years at a billion rows a second, and stays exact as a float (Prometheus); a
# larger one is a lie that once overflowed the daemon's totals and broke `stats` until a restart.
COUNT_NAMES = ("lookups", "rows", "out_of_range")
MAX_COUNT = 2**53
# What `stats` reports of a total at most: the totals of every client since the start, released
# ones too, could pass what msgpack encodes (2**64 - 1) over a long life.
MAX_TOTAL = 2**63 - 1


class Accounting:
    def __init__(self, backend: Backend, heartbeat_interval: float):
        """`heartbeat_interval`: how often the GPUs' out-of-range counts are read at most."""
        self.backend = backend
        self.heartbeat_interval = heartbeat_interval
        self.totals: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._device_count = (-float("inf"), 0)  # (when read, out-of-range IDs counted on GPUs)
        # Request received -> GPU work enqueued, for the last lookups (the daemon's own latency).
        self.dispatch_us: deque[float] = deque(maxlen=4096)

    def count_error(self, code: str) -> None:
        self.errors[code] += 1

    def take_counts(self, record: ClientRecord, counts: dict[str, int]) -> None:
        """Checked cumulative counts (checked_counts), so a lost heartbeat loses nothing."""
        for name, value in counts.items():
            self.totals[name] += value - getattr(record, name)
            setattr(record, name, value)

    def count_lookup(self, record: ClientRecord | None, job: LookupJob, rows: int) -> None:
        """A lookup answered: its rows and out-of-range IDs, to the totals and its client's."""
        context = job.context  # `received` is set when the lookup starts (start_lookup)
        if context.enqueued is not None and context.received is not None:
            self.dispatch_us.append((context.enqueued - context.received) * 1e6)
        self.totals["lookups"] += 1
        self.totals["rows"] += rows
        self.totals["out_of_range"] += job.out_of_range
        if record is not None:
            record.lookups += 1
            record.rows += rows
            record.out_of_range += job.out_of_range

    def device_out_of_range(self, slabs: list[Slab]) -> int:
        """Out-of-range IDs a GPU backend counted on the device (never synchronised per lookup):
        by these live slabs and by those it freed. Reading them queues one counter copy per
        slab from the device and takes the last completed ones (the count lags by a read or
        so), at most once per heartbeat interval: a flood of `stats` requests must not become
        a flood of device copies on the request loop."""
        now = time.monotonic()
        if now - self._device_count[0] >= self.heartbeat_interval:
            self._device_count = (now, self.backend.out_of_range(slabs))
        return self._device_count[1]

    def stats(self, records: Iterable[ClientRecord]) -> dict[str, Any]:
        """The totals, and each live client's summary, of these registrations (releasing ones too)."""
        records = list(records)
        live = [c for c in records if not c.releasing]
        slabs = [c.slab for c in records if c.slab is not None]  # releasing ones too
        out_of_range = self.totals["out_of_range"] + self.device_out_of_range(slabs)
        return {"clients": [c.summary() for c in live],
                "slabs": len(slabs), "slab_bytes": sum(s.layout.size for s in slabs),
                "lookups": min(self.totals["lookups"], MAX_TOTAL),
                "rows": min(self.totals["rows"], MAX_TOTAL),
                "out_of_range": min(out_of_range, MAX_TOTAL),
                "registrations": self.totals["registrations"], "reaped": self.totals["reaped"],
                "errors": dict(self.errors), "dispatch_us": percentiles(self.dispatch_us)}


def checked_counts(record: ClientRecord, counts: Any) -> dict[str, int]:
    """A mapped client's cumulative counts, each an int in [0, MAX_COUNT] no lower than the
    last; BadRequestError, with nothing counted, for any other."""
    if not isinstance(counts, dict):
        raise BadRequestError(f"counts: expected a map of {', '.join(COUNT_NAMES)}")
    checked = {}
    for name in COUNT_NAMES:
        value, before = counts.get(name, getattr(record, name)), getattr(record, name)
        if type(value) is not int or not 0 <= value <= MAX_COUNT:
            raise BadRequestError(f"counts[{name!r}] = {printable(repr(value)[:40])}: expected "
                                  f"an int in [0, 2**53]")
        if value < before:
            raise BadRequestError(f"counts[{name!r}] = {value}, below the {before} reported "
                                  "before: the counts are cumulative")
        checked[name] = value
    return checked


def percentiles(samples: deque[float]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"p50": pick(0.50), "p99": pick(0.99), "n": len(ordered)}


def printable(text: str) -> str:
    """`text` with what a terminal would act on (escape sequences, control characters)
    written as escapes: client-supplied text reaches `engramd stats` and the log."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
