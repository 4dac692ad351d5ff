"""Lets SGLang 0.5.23's Python tree, carried without its compiled parts, import on the GPU machine.

    sys.path.insert(0, "benchmarks/sglang_gpu"); import stubs; stubs.install()   # before `import sglang`
                                       # (worker_gpu.py and check_imports.py do this)

SGLang's wheel holds five Rust extensions (45 MB: the Rust server front end, its gRPC and
benchmark clients, the multimodal processors and the radix cache's tree core); fetch.sh leaves them
out. And once torch reports CUDA, SGLang imports its compiled kernel package, sgl_kernel
(sglang-kernel, pinned beside torch 2.14.1, not carried), at module level. What stands in:

1. An empty module for each extension named in SGLang's own RECORD (every `*.so` of the wheel),
   and for nothing else. Importing one succeeds; any name read from it raises an ImportError that
   says it is a stand-in.
2. For the modules of ABSENT_KERNELS (`sgl_kernel`, `sgl_kernel.quantization`): a module whose
   every name is a function that raises when called.

So code that calls into any of them fails loudly, never silently, and the worker's run on the
GPU would show it (benchmarks/sglang_gpu/worker_gpu.py reports which stand-ins were loaded).

The Engram path calls none of them: EngramEmbedding (its weight loader, `_owned_rows` and the
`engram_gather` Triton kernel), EngramHasher (its Triton hash kernels), Engram (the wkv linear
and the `fused_engram_gate` Triton kernel) and SGLang's parallel state are SGLang's own Python
and Triton code, run as they are.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

# Modules of compiled-kernel packages that SGLang imports unguarded, at module level, once torch
# reports CUDA (not on the CPU, where its Engram tests run). Their distributions are not on the GPU
# machine and not carried (sglang-kernel 0.4.10: compiled CUDA kernels that SGLang 0.5.23 pins
# beside torch 2.14.1; the machine has torch 2.11). Each stands in as a module whose every name is
# a function that raises when called. Only these: where SGLang imports one of their other modules
# inside `try` (sgl_kernel.allreduce, sgl_kernel.scalar_type), it finds none and answers that
# itself, as on a machine without the package.
ABSENT_KERNELS = {
    # sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py
    # (int8_scaled_mm) and quantization/gguf.py (moe_sum), reached from the Engram module's
    # QuantizationConfig import. Engram's wkv is unquantized in the test: none is called.
    "sgl_kernel",
    # quantization/gguf.py (ggml_dequantize, ...), the same way.
    "sgl_kernel.quantization",
}

_installed = False


def compiled_modules(sglang_dir: Path) -> set[str]:
    """Module names of the compiled extensions SGLang's wheel shipped (from its RECORD)."""
    records = sorted(sglang_dir.parent.glob("sglang-*.dist-info/RECORD"))
    if not records:
        raise RuntimeError(f"no sglang-*.dist-info/RECORD beside {sglang_dir}")
    names = set()
    for line in records[-1].read_text().splitlines():
        path = line.split(",")[0]
        if path.startswith("sglang/") and path.endswith(".so"):
            names.add(path[: -len(".so")].split(".")[0].replace("/", "."))
    return names


class _StandIn(types.ModuleType):
    """A module with nothing in it: reading a name from it raises ImportError."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"{self.__name__}.{name}: {self.__name__} is a compiled extension that "
                          "benchmarks/sglang_gpu/fetch.sh leaves out (stubs.py stands in for it)")


class _KernelsStandIn(_StandIn):
    """A module of compiled kernels: every name in it is a function that raises when called
    (SGLang's modules import them by name at import time)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _uncallable(f"{self.__name__}.{name}")


def _uncallable(qualified: str):
    def uncallable(*args, **kwargs):
        raise RuntimeError(f"{qualified} was called: it is a compiled kernel not on the GPU "
                           "machine (benchmarks/sglang_gpu/stubs.py stands in for its package)")

    uncallable.__name__ = uncallable.__qualname__ = qualified.rpartition(".")[2]
    return uncallable


class _Empty(importlib.abc.Loader):
    def __init__(self, kind: type[_StandIn]):
        self.kind = kind

    def create_module(self, spec):
        module = self.kind(spec.name)
        if self.kind is _KernelsStandIn:
            module.__path__ = []  # a package: its submodules come from _Finder or are missing
        return module

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    """Empty modules for the compiled names missing from the tree, and for ABSENT_KERNELS."""

    def __init__(self, compiled: set[str]):
        self.compiled = compiled

    def find_spec(self, name, path=None, target=None):
        if name in self.compiled:
            kind = _StandIn
        elif name in ABSENT_KERNELS:
            kind = _KernelsStandIn
        else:
            return None
        if importlib.machinery.PathFinder.find_spec(name, path) is not None:
            return None  # the real package or extension is there after all: use it
        return importlib.util.spec_from_loader(name, _Empty(kind), is_package=kind is _KernelsStandIn)


def install() -> bool:
    """Put the stand-ins in place; False (and nothing done) when SGLang is not importable or is a
    full install (its compiled extensions present)."""
    global _installed
    if _installed:
        return True
    spec = importlib.machinery.PathFinder.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    sglang_dir = Path(next(iter(spec.submodule_search_locations)))
    compiled = compiled_modules(sglang_dir)
    if any(any(sglang_dir.parent.glob(name.replace(".", "/") + ".*.so")) for name in compiled):
        return False
    sys.meta_path.insert(0, _Finder(compiled))
    _installed = True
    return True


def is_stand_in(module) -> bool:
    return isinstance(module, _StandIn)
