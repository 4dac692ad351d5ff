"""Every test in this folder, and in folders below it, needs CUDA: each carries the `gpu` marker
(`-m "not gpu"` leaves them out) and skips where CUDA is not available, whatever its own module
says, so a new GPU test cannot be missed by the one or fail on a machine without a GPU.

A module that touches CUDA when it is imported must still skip itself first (collection comes
before these marks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # This hook sees every test of the session, not only this folder's.
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            item.add_marker(needs_cuda)
