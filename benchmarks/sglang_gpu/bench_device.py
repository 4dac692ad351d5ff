"""Where bench_lookup.py runs: the GPU machine (`Gpu`), or a CPU machine for --dry-run
(`CpuDryRun`). What differs between the two is here and nowhere else, so every line of
bench_lookup.py runs in a dry run and `Gpu` holds the only lines that a dry run cannot reach.

Gpu: SGLang's Python tree installed by setup_device.sh, imported after stubs.py's stand-ins, with
tests/sglang_plugin/worker.py's helpers loaded as worker_gpu.py loads them (their CPU-only
settings undone before CUDA is touched). SGLang's modules are built under the CUDA device, so its
Engram tables are in device memory and it takes its CUDA path (its Triton gather, hash and gate
kernels: checked, and their calls counted while the rows are checked). CUDA events time the
device (common/timing.Clock), the daemon runs `--backend cuda`, clients use cuda:0.

CpuDryRun: SGLang's CPU install (.ci/sglang_env.sh), with tests/sglang_plugin's torchvision
stand-in where there is no torchvision. SGLang takes its torch paths (its Triton kernels run on
CUDA only), its tables are in ordinary memory, clocks are host clocks, the daemon runs
`--backend cpu`, clients are CPU clients.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STAND_INS = REPO / "tests" / "sglang_plugin" / "stand_ins"  # torchvision, for the CPU env
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import worker_gpu  # noqa: E402  (imports stubs; installs nothing yet)
from common import plugin_worker  # noqa: E402
from common.timing import Clock  # noqa: E402

# SGLang's CUDA kernels that must have run on the reference side of the row checks.
REQUIRED_KERNELS = ("engram_gather", "fused_engram_gate")
HASH_KERNELS = ("engram_hash_ids", "engram_hash_ids_and_commit", "engram_hash_extend_and_commit")


class CpuDryRun:
    """This CPU machine: every path of the benchmark but CUDA's, on a tiny table."""

    backend = "cpu"
    client_device = "cpu"
    cuda = False

    def __init__(self):
        settings = (os.environ.get("TRITON_INTERPRET"), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if settings != ("1", ""):
            raise SystemExit("a dry run needs TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES='' "
                             "before torch and Triton are imported: run bench_lookup.py "
                             "--dry-run as a script")
        if importlib.util.find_spec("torchvision") is None:
            sys.path.insert(0, str(STAND_INS))  # SGLang imports it; its Engram code does not use it
        self.helpers = plugin_worker.load("sglang", keep_cpu_settings=True)
        self.device = torch.device("cpu")
        self.clock = Clock(self.device)

    def engram_module(self):
        from sglang.srt.layers import engram

        if engram._cuda_kernels(torch.empty(1)):
            raise SystemExit("SGLang's Engram code takes its CUDA path in a dry run")
        return engram

    def build_layers(self, engram, hf, layout) -> list:
        return worker_gpu.build_layers(self.helpers, engram, hf, layout, self.device)

    def stream(self) -> None:
        return None

    def check_kernel_calls(self, calls: Counter) -> None:
        pass  # the torch paths call none

    def memory(self) -> dict[str, Any]:
        return {}

    def free(self) -> None:
        gc.collect()

    def describe(self) -> dict[str, Any]:
        return {"gpu": None, "device": "CPU dry run (SGLang's torch paths, a CPU daemon)"}


class Gpu:
    """The GPU machine: SGLang's device tables and CUDA kernels, and a CUDA daemon."""

    backend = "cuda"
    cuda = True

    def __init__(self):
        # Kernels launched behind a wait on another stream must not load lazily there (docs/architecture.md).
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        if not worker_gpu.stubs.install():
            raise SystemExit("SGLang's carried tree is not importable here, or is a full install "
                             "(run benchmarks/sglang_gpu/setup_device.sh, then set PYTHONPATH)")
        self.helpers = plugin_worker.load("sglang")
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        self.client_device = f"cuda:{self.device.index}"
        self.clock = Clock(self.device)

    def engram_module(self):
        from sglang.srt.layers import engram

        if not engram._cuda_kernels(torch.empty(1, device=self.device)):
            raise SystemExit("SGLang's Engram code would take its torch path on this GPU")
        return engram

    def build_layers(self, engram, hf, layout) -> list:
        """Under the CUDA device, in bf16, as SGLang's model loader builds them: SGLang's own
        tables are then in device memory."""
        return worker_gpu.build_layers(self.helpers, engram, hf, layout, self.device)

    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def check_kernel_calls(self, calls: Counter) -> None:
        missing = [name for name in REQUIRED_KERNELS if not calls[name]]
        if not any(calls[name] for name in HASH_KERNELS):
            missing.append(" or ".join(HASH_KERNELS))
        if missing:
            raise SystemExit(f"SGLang's reference made no call of {missing} (calls: "
                             f"{dict(calls)}): it did not take its CUDA path")

    def memory(self) -> dict[str, Any]:
        """This process's device memory as torch's allocator sees it."""
        torch.cuda.synchronize(self.device)
        return {"allocated_bytes": torch.cuda.memory_allocated(self.device),
                "reserved_bytes": torch.cuda.memory_reserved(self.device)}

    def free(self) -> None:
        """Hand memory freed by SGLang's tables back to the driver (torch's allocator caches it)."""
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()

    def describe(self) -> dict[str, Any]:
        return {"gpu": torch.cuda.get_device_name(self.device), "device": str(self.device)}


def open_device(dry_run: bool) -> CpuDryRun | Gpu:
    return CpuDryRun() if dry_run else Gpu()


@contextmanager
def counting_kernels(engram) -> Iterator[Counter]:
    """Count the calls sglang.srt.layers.engram makes to its Triton ops inside the block (it
    looks each name up in its own namespace at call time). The names are given back at the end,
    so that nothing timed pays for the counting."""
    calls: Counter = Counter()
    originals = {name: getattr(engram, name) for name in worker_gpu.CUDA_KERNELS}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    try:
        for name, fn in originals.items():
            setattr(engram, name, counted(name, fn))
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(engram, name, fn)
