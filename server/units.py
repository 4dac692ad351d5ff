"""Sizes for people: log lines say "8.4 MB" for the demo table and "101.38 GB" for a real one."""

from __future__ import annotations

_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def size(nbytes: float) -> str:
    """Decimal units (as the GB/s rates beside them), three significant figures or more."""
    for scale, unit in _UNITS:
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.2f} {unit}" if value < 100 else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"
