"""A stand-in for torchvision in the SGLang plugin's test environment.

SGLang's Engram import chain passes through modules of vision models (sglang.srt.configs ->
InternVL's image transforms; transformers' processors) that import torchvision at module level.
The torchvision wheels on PyPI are CUDA builds whose extension cannot load beside the CPU build
of torch that CI carries, and torchvision then fails to import at all. Nothing of torchvision
runs in these tests: every `torchvision.*` module imports, every name in it is a callable that
raises when called (InterpolationMode, which modules read at import, excepted). The tests put
the folder above this one on the path of the processes that import SGLang.
"""

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+engramd.stand.in"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(module: str, name: str):
    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{module}.{name}: torchvision is a stand-in in this test "
                           "environment (tests/sglang_plugin/stand_ins)")

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


def _names_of(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        child = f"{module_name}.{name}"
        if name.islower() and name.isidentifier():  # a submodule, as `from torchvision import io`
            return importlib.import_module(child)
        return _unavailable(module_name, name)

    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any torchvision.X.Y imports as a module of stand-in names."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _names_of(spec.name)
        return module

    def exec_module(self, module):
        pass


__getattr__ = _names_of(__name__)
sys.meta_path.append(_Submodules())
