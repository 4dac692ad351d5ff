"""The engine-neutral parts of the vLLM benchmark (benchmarks/vllm_gpu/) that bench_lookup.py
shares: its cell timing (bench_timing: time_cell, MODES), its table fill of the daemon's /dev/shm
files (bench_tables: fill_daemon_tables, in_parts) and its client variant and matmuls
(bench_variants: ClientLookup, wait_warm, Matmuls), so that both benchmarks time and fill alike.

They are loaded from their files under names of their own, read-only: that folder is not put on
sys.path, since its stubs.py and worker_gpu.py share their names with this folder's. What this is
not: anything of vLLM (none of these modules imports it).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

VLLM_BENCH = Path(__file__).resolve().parents[1] / "vllm_gpu"


def load(name: str) -> types.ModuleType:
    """benchmarks/vllm_gpu/NAME.py as module `vllm_gpu_NAME` (once per process)."""
    qualified = f"vllm_gpu_{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    path = VLLM_BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(qualified, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


timing = load("bench_timing")
tables = load("bench_tables")
variants = load("bench_variants")
