"""Sizes in log lines: decimal units, never 0.00 GB for a table of megabytes."""

from engramd.server.units import size


def test_sizes_pick_the_unit_that_keeps_three_figures():
    assert [size(n) for n in (0, 999, 1000, 4_692_336, 8_400_000, 101_380_000_000, 2e14)] == [
        "0 B", "999 B", "1.00 kB", "4.69 MB", "8.40 MB", "101.4 GB", "200.0 TB"]
