"""Here, on a CPU machine: would SGLang's carried tree import its Engram code on the GPU machine?

    .venv-sglang/bin/python benchmarks/sglang_gpu/probe_imports.py [--carry .sglang-gpu]

Run in the environment of .ci/sglang_env.sh (Python 3.11, the same pins as the carry). It unpacks
the carried, stripped SGLang tree into a temporary folder, puts it first on the path (ahead of the
full SGLang installed here), and imports what setup_device.sh checks and worker_gpu.py uses, in
a process where:
- torch says CUDA is there (torch.version.cuda, and the device queries answered as an H200 would
  answer them), so that SGLang's module-level `is_cuda()` branches take their CUDA side, as they
  will on the GPU machine; nothing touches a GPU (nothing here is run, only imported);
- a package installed here that is neither in the GPU machine's image (IMAGE, the list in the
  lending workplace's notes, read on 2026-11-17) nor a pin of requirements.txt is refused
  (ModuleNotFoundError); every refusal is printed. A refusal that breaks the import names a
  package to add to requirements.txt; one that does not is an optional import SGLang guards.

What it cannot tell: the carried wheels are cp312 and this is 3.11, so the carried packages come
from this environment (same pins where .ci/sglang-requirements.txt has them; a differing version
is printed). The cp312 wheels themselves are checked by installing them under a CPython 3.12
(README.md).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.metadata as md
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# The GPU machine's image, 'cuda' (distribution names).
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()

# Allowed here though not in the image: what this environment's own version of an image package
# needs where the image's version does not.
HERE_ONLY = {
    "httpx2": "huggingface-hub 2.x here; the image's 1.33.0 uses httpx, which it has",
    "httpcore2": "httpx2's",
    "truststore": "httpx2's",
}

# Imported in the child, in this order: setup_device.sh's checks and worker_gpu.py's imports.
# The device communicators are what SGLang's GroupCoordinator imports when it is built.
MODULES = ("sglang", "sglang.srt.layers.engram", "sglang.srt.plugins",
           "sglang.srt.distributed.parallel_state", "sglang.srt.model_executor.forward_batch_info",
           "sglang.srt.runtime_context",
           *(f"sglang.srt.distributed.device_communicators.{name}" for name in (
               "custom_all_reduce", "pymscclpp", "pynccl", "pynccl_allocator", "torch_symm_mem")),
           "engramd.client.engines.sglang", "engramd.client.engines.sglang_engram",
           "engramd.client.token_map", "transformers", "safetensors")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    out = {}
    for line in (HERE / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[norm(name)] = version
    return out


def top_level_names(dist: md.Distribution) -> set[str]:
    names = set()
    for file in dist.files or ():
        parts = file.parts
        if not parts or parts[0].endswith((".dist-info", ".egg-info", ".data")) or parts[0] == "..":
            continue
        first = parts[0]
        if len(parts) == 1:
            if not first.endswith((".py", ".so", ".pyd")):
                continue
            first = first.split(".")[0]
        names.add(first)
    top = dist.read_text("top_level.txt")
    return names | set((top or "").split())


def refused_modules(allowed: set[str]) -> dict[str, str]:
    """Top-level module name -> distribution, for every installed distribution not allowed."""
    refused, kept = {}, set()
    for dist in md.distributions():
        name = norm(dist.metadata["Name"] or "")
        if not name:
            continue
        names = top_level_names(dist)
        if name in allowed:
            kept |= names
        else:
            refused.update({module: name for module in names})
    return {module: dist for module, dist in refused.items() if module not in kept}


class Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, refused: dict[str, str]):
        self.refused, self.seen = refused, {}

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in self.refused:
            self.seen.setdefault(top, self.refused[top])
            raise ModuleNotFoundError(f"No module named {name!r} (refused: not on the GPU machine)",
                                      name=name)
        return None


def pretend_cuda() -> None:
    """torch as the GPU machine's: CUDA 13.0, one H200 (compute capability 9.0)."""
    import types

    import torch

    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                                  total_memory=143771 << 20, L2_cache_size=60 << 20,
                                  gcnArchName="", uuid="0", warp_size=32)
    torch.version.cuda = "13.0"
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.get_device_capability = lambda device=None: (9, 0)
    cuda.get_device_name = lambda device=None: props.name
    cuda.get_device_properties = lambda device=None: props
    cuda.mem_get_info = lambda device=None: (props.total_memory, props.total_memory)


def child(tree: str) -> int:
    sys.path.insert(0, tree)
    sys.path.insert(0, str(HERE))
    allowed = set(map(norm, IMAGE)) | set(pins()) | set(HERE_ONLY) | {"engramd-daemon", "sglang"}
    refuse = Refuse(refused_modules(allowed))
    sys.meta_path.insert(0, refuse)
    pretend_cuda()
    import stubs

    assert stubs.install(), "the carried tree is not the one on the path, or is a full install"
    import importlib

    failed = None
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # report which import broke, and on what
            failed = f"{name}: {type(exc).__name__}: {exc}"
            break
        origin = getattr(module, "__file__", "") or ""
        where = "carried tree" if origin.startswith(tree) else origin.split("site-packages/")[-1]
        print(f"imported {name} ({where})")
    if failed is None:
        from sglang.srt.layers import engram
        from sglang.version import __version__

        from engramd.client.engines import sglang as plugin

        plugin.check_version(__version__)
        plugin.check_seams(engram)
        print(f"SGLang {__version__}: the plugin's version and seam checks pass; is_cuda() is "
              f"{engram.is_cuda()}")
    stood = sorted(name for name, module in list(sys.modules.items()) if stubs.is_stand_in(module))
    print(f"stand-ins loaded: {', '.join(stood) or 'none'}")
    print("refused (guarded by SGLang where the import went on): "
          + (", ".join(f"{m} [{d}]" for m, d in sorted(refuse.seen.items())) or "none"))
    versions = {name: md.version(name) for name in pins() if name != "sglang" and _installed(name)}
    differ = {n: f"{v} here, {pins()[n]} carried" for n, v in versions.items() if v != pins()[n]}
    print(f"carried pins at another version here: {differ or 'none'}")
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


def _installed(name: str) -> bool:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--carry", default=str(REPO / ".sglang-gpu"))
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    tarballs = sorted(Path(args.carry).glob("sglang-*-py.tar.gz"))
    if not tarballs:
        sys.exit(f"no sglang-*-py.tar.gz in {args.carry}: run benchmarks/sglang_gpu/fetch.sh")
    with tempfile.TemporaryDirectory(prefix="sglang-tree-") as tree:
        with tarfile.open(tarballs[-1]) as tar:
            tar.extractall(tree, filter="data")
        # A child of its own: nothing of this process's imports leaks into the probe.
        return subprocess.call([sys.executable, __file__, "--child", tree], cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
