"""Re-attach checksum beside a thread that holds the GIL (what a restart's import of torch does).

    python benchmarks/experiments/checksum_gil.py [--gib 2] [--repeat 3] [--out FILE]

The re-attach check (server/table_file.sampled_checksum) reads 256 blocks of 64 KiB per layer.
Computed one zlib.crc32 call per block, each call gives the GIL back (CPython does for inputs over
5 KiB) and must take it back from the other thread, which keeps it for a switch interval (5 ms).
Joined first, the check gives it back about twice. This times both ways over an anonymous array of
--gib GiB, alone and beside a pure-Python busy loop on another thread, and checks that both give
the same CRC. Results: a JSON object on stdout, or in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from engramd.server.table_file import (
    SAMPLE_BLOCK_BYTES,
    SAMPLE_BLOCKS,
    sample_ranges,
    sampled_checksum,
)

ROW_BYTES = 264


def per_range(flat: np.ndarray) -> int:
    """The check as it was: one crc32 call per range, chained."""
    crc = 0
    for lo, hi in sample_ranges(flat.size, ROW_BYTES, SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES):
        crc = zlib.crc32(flat[lo:hi], crc)
    return crc


def joined(flat: np.ndarray) -> int:
    return sampled_checksum(flat, ROW_BYTES, SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES)


class BusyThread:
    """A thread that runs Python bytecode (and so holds the GIL) until stopped."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timed(fn, flat: np.ndarray, repeat: int) -> tuple[list[float], int]:
    seconds, crc = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        crc = fn(flat)
        seconds.append(time.perf_counter() - started)
    return seconds, crc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="array size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    flat = np.random.default_rng(0).integers(0, 256, size=int(args.gib * 2**30), dtype=np.uint8)
    results, crcs = {}, set()
    for beside in ("alone", "busy thread"):
        for name, fn in (("per range", per_range), ("joined", joined)):
            if beside == "alone":
                seconds, crc = timed(fn, flat, args.repeat)
            else:
                with BusyThread():
                    seconds, crc = timed(fn, flat, args.repeat)
            crcs.add(crc)
            results[f"{name}, {beside}"] = {"median_s": round(statistics.median(seconds), 4),
                                            "all_s": [round(s, 4) for s in seconds]}
    report = {"command": "python benchmarks/experiments/checksum_gil.py " + " ".join(sys.argv[1:]),
              "gib": args.gib, "switch_interval_s": sys.getswitchinterval(),
              "ranges": len(sample_ranges(flat.size, ROW_BYTES, SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES)),
              "same_crc": len(crcs) == 1, "results": results}
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if report["same_crc"] else 1


if __name__ == "__main__":
    sys.exit(main())
