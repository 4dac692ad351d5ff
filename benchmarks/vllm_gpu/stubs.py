"""Lets vLLM 0.33.0's Python tree, carried without its compiled parts, import over another torch.

    sys.path.insert(0, "benchmarks/vllm_gpu"); import stubs; stubs.install()   # before `import vllm`
                                       # (worker_gpu.py and check_imports.py do this)

vLLM's wheel holds 633 MB of compiled extensions built against torch 2.14; the GPU machine has
torch 2.11 and room for none of it (benchmarks/vllm_gpu/fetch.sh leaves it out). What stands in:

1. Empty modules for the compiled extensions named in vLLM's own RECORD (every `*.so` of the
   wheel), and for nothing else: `import vllm._C_stable_libtorch` then succeeds but registers no
   ops, so any kernel of theirs that is called at run time fails loudly (`torch.ops._C.<name>`
   does not exist), never silently.
2. The import-time calls into those ops, each answered as the missing library would have it
   answered on a machine without it (IMPORT_TIME_ANSWERS below; each says who calls it).
3. One op the Engram path does run: `_C::get_cuda_view_from_cpu_tensor`, vLLM's UVA view of its
   pinned host tables (csrc/cuda_view.cu: cudaHostGetDevicePointer, then a tensor over that
   pointer with the host tensor's sizes, strides and dtype, freeing nothing). It is re-done here
   with the same two steps (`cuda_view_from_cpu_tensor`); its shared library alone packs to
   65 MB, over the carry's limit. tests/gpu/test_vllm_gpu.py checks the view against the host
   tensor before trusting it.

Nothing else on the Engram path is stood in for: ParallelEngramEmbedding, its Triton lookup
kernel, Engram's prefetch stream, its events, `embed`, `forward` and the fused post-WKV Triton
kernel are vLLM's own code, run as they are.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

STAND_IN = "__vllm_gpu_stand_in__"  # set on every module made here

# vLLM's Python wrappers (vllm._custom_ops.<name>) that are called while modules import, with the
# answer a machine without the compiled kernels gives. Each is a capability query, not a kernel.
IMPORT_TIME_ANSWERS: dict[str, object] = {
    # vllm/model_executor/layers/quantization/utils/w8a8_utils.py sets CUTLASS_BLOCK_FP8_SUPPORTED
    # at import (reached from vllm.models.deepseek_v41's quant config): no CUTLASS kernels here,
    # so vLLM's block-FP8 GEMMs would take their Triton path. Engram's wkv is not FP8 in the test.
    "cutlass_scaled_mm_supports_block_fp8": lambda cuda_device_capability: False,
    # vllm/model_executor/layers/quantization/online/fp8.py asks cutlass_fp8_supported() in a
    # class body (w8a8_utils.py), reached when Engram's modules are built on a CUDA platform.
    # The other CUTLASS capability queries get the same answer, so that a path reached later
    # takes vLLM's non-CUTLASS kernels rather than failing on a missing op.
    "cutlass_scaled_mm_supports_fp8": lambda cuda_device_capability: False,
    "cutlass_scaled_mm_supports_fp4": lambda cuda_device_capability: False,
    "cutlass_group_gemm_supported": lambda cuda_device_capability: False,
}

_installed = False


def compiled_modules(vllm_dir: Path) -> set[str]:
    """Module names of the compiled extensions vLLM's wheel shipped (from its RECORD)."""
    records = sorted(vllm_dir.parent.glob("vllm-*.dist-info/RECORD"))
    if not records:
        raise RuntimeError(f"no vllm-*.dist-info/RECORD beside {vllm_dir}")
    names = set()
    for line in records[-1].read_text().splitlines():
        path = line.split(",")[0]
        if path.startswith("vllm/") and path.endswith(".so"):
            names.add(path[: -len(".so")].split(".")[0].replace("/", "."))
    return names


class _Empty(importlib.abc.Loader):
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        setattr(module, STAND_IN, True)
        return module

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    """Empty modules for the missing compiled names; answers patched into vllm._custom_ops."""

    def __init__(self, compiled: set[str]):
        self.compiled = compiled

    def find_spec(self, name, path=None, target=None):
        if name in self.compiled:
            real = importlib.machinery.PathFinder.find_spec(name, path)
            if real is not None:  # the compiled module is there after all: use it
                return None
            return importlib.util.spec_from_loader(name, _Empty())
        if name == "vllm._custom_ops":
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _AnswerAfterExec(spec.loader)
            return spec
        return None


class _AnswerAfterExec(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        for name, answer in IMPORT_TIME_ANSWERS.items():
            if not hasattr(module, name):
                raise RuntimeError(f"vllm._custom_ops has no {name}: update benchmarks/vllm_gpu/stubs.py")
            setattr(module, name, answer)


def cuda_view_from_cpu_tensor(cpu_tensor):
    """vLLM's `get_cuda_view_from_cpu_tensor`: the device's view of pinned host memory (UVA)."""
    import torch
    from cuda.bindings import runtime

    if cpu_tensor.device.type != "cpu":
        raise ValueError("Input tensor must be on CPU")  # as vLLM's TORCH_CHECK
    if cpu_tensor.numel() == 0:
        return torch.empty_strided(cpu_tensor.shape, cpu_tensor.stride(), dtype=cpu_tensor.dtype,
                                   device="cuda")
    err, device_ptr = runtime.cudaHostGetDevicePointer(cpu_tensor.data_ptr(), 0)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaHostGetDevicePointer failed: {err!r} (is the tensor pinned?)")
    size = cpu_tensor.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(cpu_tensor.shape, cpu_tensor.stride(), strict=True))
    raw = torch.as_tensor(_DeviceBytes(int(device_ptr), span * size, cpu_tensor), device="cuda")
    return raw.view(cpu_tensor.dtype).as_strided(cpu_tensor.shape, cpu_tensor.stride())


class _DeviceBytes:
    """Bytes at a device address for torch.as_tensor; holds the host tensor (vLLM's view holds
    nothing: its caller keeps the table alive, as ParallelEngramEmbedding does)."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.ptr, self.nbytes, self.owner = ptr, nbytes, owner

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


def _register_cuda_view() -> None:
    import torch

    if hasattr(torch.ops._C, "get_cuda_view_from_cpu_tensor"):  # the compiled op is there
        return
    library = torch.library.Library("_C", "FRAGMENT")
    library.define("get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor")
    library.impl("get_cuda_view_from_cpu_tensor", cuda_view_from_cpu_tensor, "CPU")
    _keep.append(library)  # a Library object unregisters its ops when collected


_keep: list = []


def install() -> bool:
    """Put the stand-ins in place; False (and nothing done) when vLLM's compiled extensions are
    present, or vLLM is not importable."""
    global _installed
    if _installed:
        return True
    spec = importlib.machinery.PathFinder.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    vllm_dir = Path(next(iter(spec.submodule_search_locations)))
    if any(vllm_dir.glob("_C_stable_libtorch*.so")):
        return False
    sys.meta_path.insert(0, _Finder(compiled_modules(vllm_dir)))
    try:
        _register_cuda_view()
    except ImportError:  # no torch in this interpreter: the view is registered by no one
        pass
    _installed = True
    return True


def is_stand_in(module) -> bool:
    return bool(getattr(module, STAND_IN, False))
