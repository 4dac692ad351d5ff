"""Every test in this folder needs CUDA: each carries the `gpu` marker (`-m "not gpu"` leaves
them out), whatever its own module says."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.fspath).parent == HERE:
            item.add_marker(pytest.mark.gpu)
