"""Run metadata the benchmarks write beside their results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def machine() -> str:
    """The architecture and CPU count, e.g. "x86_64, 16 CPUs"."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs"


def run_header() -> dict[str, str]:
    """Host name, date and command line, first in the JSON of the CPU-backend benchmarks."""
    return {"machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where it names none, as on many ARM hosts)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def mount_type(path: Path) -> str | None:
    """The file system type mounted at `path` (the last mount there: the one in effect), or
    None if nothing is mounted there."""
    kinds = [fields[2] for fields in (line.split() for line in
                                      Path("/proc/mounts").read_text().splitlines())
             if len(fields) > 2 and fields[1] == str(path)]
    return kinds[-1] if kinds else None


def cell(value: Any, digits: int = 3) -> str:
    """A markdown table cell: empty for None, floats to `digits` places."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def write_report(out: Path, report: dict, json_name: str, md_name: str, text: str) -> None:
    """`report` as out/json_name and its markdown `text` as out/md_name; `text` printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / json_name).write_text(json.dumps(report, indent=1) + "\n")
    (out / md_name).write_text(text)
    print(text, flush=True)


def median_and_range(values: list[float], digits: int) -> str:
    """"median (least-most)" of `values`."""
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def describe_paired(ratios: list[float]) -> str:
    """Ratios of two variants timed next to each other, one a round: their median, range, and
    in how many rounds the first was the slower."""
    over = sum(r > 1.0 for r in ratios)
    centre = median_and_range(ratios, 3) if len(ratios) > 1 else f"{ratios[0]:.3f}"
    return f"{centre}, {over} of {len(ratios)} over 1.00"
