"""Where bench_lookup.py runs: the GPU machine (`Gpu`), or a CPU machine for --dry-run
(`CpuDryRun`). What differs between the two is here and nowhere else, so every line of
bench_lookup.py runs in a dry run and `Gpu` holds the only lines that a dry run cannot reach.

Gpu: vLLM's Python tree installed by setup_device.sh, imported through worker_gpu.py (which puts
stubs.py's stand-ins in place first). Its config is worker_gpu's: EngramConfig(cpu_offload=True),
so vLLM's tables sit in pinned host memory and its Triton kernel reads them through UVA; the
Engram layers share one prefetch stream, as vLLM's DeepseekV4Model gives them. CUDA events time
the device (common/timing.Clock), the daemon runs `--backend cuda`, clients use cuda:0. A graph
variant's step is recorded in a torch.cuda.CUDAGraph and replayed (`capture`).

CpuDryRun: vLLM's CPU install (.ci/vllm_env.sh), through tests/vllm_plugin/worker.py's helpers
with the device queries mocked as that worker mocks them. vLLM's kernels run under Triton's
interpreter; its tables are in ordinary memory (cpu_offload=False: the offload needs UVA), so
Engram layers have no prefetch stream and the background variant is a foreground lookup; clocks
are host clocks, the daemon runs `--backend cpu`, clients are CPU clients. There are no CUDA
graphs: a graph variant's step runs eagerly at every "replay", the same function the GPU records
(`capture`), and is labelled so. The plugin's captured lookup is made for the CPU client, whose
capturable_lookup refuses (CPU clients cannot be captured), as tests/vllm_plugin/worker.py makes
it: its kernel then runs under Triton's interpreter at each step.
"""

from __future__ import annotations

import gc
import os
import sys
import types
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common import plugin_worker  # noqa: E402
from common.timing import Clock  # noqa: E402

SAMPLE_ROWS = 4096  # rows at each end of a table whose UVA view is compared with the host bytes


class CpuDryRun:
    """This CPU machine: every path of the benchmark but CUDA's, on a tiny table."""

    backend = "cpu"
    client_device = "cpu"
    cuda = False
    graphs = "none (dry run): the graph variants' steps run eagerly, the same code a GPU records"
    graph_note = "eager, no graph: dry run"
    dot_dir: Path | None = None  # --graph-dot: nothing is recorded, so nothing is written

    def __init__(self):
        settings = (os.environ.get("TRITON_INTERPRET"), os.environ.get("VLLM_TARGET_DEVICE"))
        if settings != ("1", "cpu"):
            raise SystemExit("a dry run needs TRITON_INTERPRET=1 and VLLM_TARGET_DEVICE=cpu before "
                             "Triton is imported: run bench_lookup.py --dry-run as a script")
        self.helpers = plugin_worker.load("vllm", keep_cpu_settings=True)
        self.device = torch.device("cpu")
        self.clock = Clock(self.device)

    def vllm_scope(self):
        """The device queries vLLM's Engram code makes, answered as tests/vllm_plugin/worker.py
        answers them (4 SMs: the lookup's persistent grid then loops), and, as that worker does
        for ENGRAMD_CAPTURE=on, a captured lookup for a CPU client past its refusal."""
        from engramd.client import EngramClient

        def capturable(client, ids, slot=None, sm_fraction=None):
            return client._captures.make(ids, slot, sm_fraction)

        stack = ExitStack()
        properties = types.SimpleNamespace(multi_processor_count=4)
        stack.enter_context(mock.patch("torch.cuda.get_device_properties", lambda *_: properties))
        stack.enter_context(mock.patch("torch.accelerator.current_device_index", lambda: 0))
        stack.enter_context(mock.patch.object(EngramClient, "capturable_lookup", capturable))
        return stack

    def capture(self, body: Callable[[], object], label: str) -> Callable[[], object]:
        """No graphs on a CPU: each "replay" runs `body` again, eagerly (and no DOT for `label`)."""
        return body

    def vllm_config(self):
        return self.helpers.vllm_config()

    def build_layers(self, engram, hf, layout) -> list:
        return self.helpers.build_layers(engram, hf, layout, sp=False)

    def check_offloaded(self, layers) -> None:
        pass  # no offload without UVA

    def stream(self) -> None:
        return None

    def release_host_memory(self) -> dict[str, Any]:
        gc.collect()
        return {}

    def describe(self) -> dict[str, Any]:
        return {"gpu": None, "device": "CPU dry run (vLLM's kernels under Triton's interpreter)"}


class Gpu:
    """The GPU machine: vLLM's offloaded Engram path and a CUDA daemon."""

    backend = "cuda"
    cuda = True
    graphs = "torch.cuda.CUDAGraph, captured once per (T, lead) with capture_error_mode='thread_local'"
    graph_note = ""
    dot_dir: Path | None = None  # bench_lookup --graph-dot: where capture() writes each graph's DOT

    def __init__(self):
        # Kernels launched behind a wait on another stream must not load lazily there (docs/architecture.md).
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        import worker_gpu  # stubs.install() before vLLM, or an exit naming setup_device.sh

        self.worker = worker_gpu
        self.helpers = worker_gpu.cpu
        self.device = worker_gpu.DEVICE
        torch.cuda.set_device(self.device)
        self.client_device = f"cuda:{self.device.index}"
        self.clock = Clock(self.device)

    def vllm_scope(self):
        return nullcontext()

    def vllm_config(self):
        return self.worker.vllm_config()

    def build_layers(self, engram, hf, layout) -> list:
        layers = self.worker.build_layers(engram, hf, layout)
        # vLLM's DeepseekV4Model gives all its Engram layers one prefetch stream, so that their
        # lookups take turns (nvidia/model.py); built one by one, each made its own.
        for layer in layers[1:]:
            layer._prefetch_stream = layers[0]._prefetch_stream
        return layers

    def check_offloaded(self, layers) -> None:
        """worker_gpu.check_offloaded's checks, the view's bytes compared on rows at both ends of
        each table: it compares whole tables, through a host copy as large as the table."""
        for layer in layers:
            table = layer.embed_tokens
            assert table.cpu_offload and table.weight.is_pinned(), \
                f"layer {layer.layer_hash_index}: the table is not in pinned host memory"
            assert layer._prefetch_stream is not None, \
                f"layer {layer.layer_hash_index}: no prefetch stream"
            weight, scales = table._storage()
            for view, host in ((weight, table.weight), (scales, table.weight_scale_inv)):
                assert view.device.type == "cuda" and view.shape == host.shape
                for rows in (slice(0, SAMPLE_ROWS), slice(-SAMPLE_ROWS, None)):
                    assert torch.equal(view[rows].view(torch.uint8).cpu(),
                                       host.data[rows].view(torch.uint8)), \
                        "the UVA view does not read the host table"

    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def capture(self, body: Callable[[], object], label: str) -> Callable[[], None]:
        """`body` recorded in a CUDA graph; returns the graph's replay (which keeps the graph).
        One eager run first, so that every kernel it launches is compiled and loaded outside the
        capture (as benchmarks/captured_step.py does). With `dot_dir`, the graph's nodes and edges
        (cudaGraphDebugDotPrint, verbose: each kernel's name, grid and arguments) go to
        dot_dir/<label>.dot."""
        body()
        torch.cuda.synchronize(self.device)
        # keep_graph: the graph outlives the capture's end (the dump reads it), instantiated below
        graph = torch.cuda.CUDAGraph(keep_graph=self.dot_dir is not None)
        # thread_local: the plugin's client has threads of its own (its hot-row cache's keeper,
        # the captured lookup's upkeep) whose CUDA calls "global" would turn into a failed capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            body()
        if self.dot_dir is not None:
            self.dot_dir.mkdir(parents=True, exist_ok=True)
            graph.debug_dump(str(self.dot_dir / f"{label}.dot"))
            graph.instantiate()
        return graph.replay

    def release_host_memory(self) -> dict[str, Any]:
        """Hand freed pinned memory back to the system: torch's host allocator caches it."""
        torch.cuda.synchronize(self.device)
        gc.collect()
        empty = getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache
        empty()
        stats: dict[str, Any] = getattr(torch.cuda, "host_memory_stats", dict)()  # older: none
        return {key: stats[key] for key in ("allocated_bytes.current", "active_bytes.current")
                if key in stats}

    def describe(self) -> dict[str, Any]:
        return {"gpu": torch.cuda.get_device_name(self.device), "device": str(self.device)}


def open_device(dry_run: bool) -> CpuDryRun | Gpu:
    return CpuDryRun() if dry_run else Gpu()
