"""An engine plugin's CPU test worker (tests/vllm_plugin/worker.py, tests/sglang_plugin/worker.py)
loaded as a module, for its helpers, by the engines' GPU workers and benchmarks.

The test worker sets CPU-only variables when it is imported (CUDA_VISIBLE_DEVICES="",
TRITON_INTERPRET=1). On a GPU they are undone before CUDA or any of the engine's kernels is
touched: CUDA reads the one at its first use, Triton the other when the engine's modules define
their kernels, both later. A CPU dry run keeps them.
"""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"


def load(engine: str, keep_cpu_settings: bool = False) -> types.ModuleType:
    """tests/<engine>_plugin/worker.py as module `<engine>_plugin_worker`."""
    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location(f"{engine}_plugin_worker",
                                                  TESTS / f"{engine}_plugin" / "worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        if not keep_cpu_settings:
            os.environ.clear()
            os.environ.update(saved)
    return module
