"""Checks, after setup_device.sh installed the carry, that vLLM's Engram module and the engramd
plugin import on the GPU machine over the stand-ins of stubs.py, with vLLM on its CUDA platform,
the plugin's version and seam checks passing and its entry point registered.

    PYTHONPATH=/tmp/vllm-gpu-site python3 benchmarks/vllm_gpu/check_imports.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import stubs  # this file's folder is sys.path[0]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.plugin_check import check_plugin  # noqa: E402


def main() -> None:
    assert stubs.install(), "vLLM's tree is not on the path, or it is a full install"
    started = time.monotonic()
    import torch
    import triton
    import vllm
    from vllm.platforms import current_platform

    print(f"import vllm {vllm.__version__}: {time.monotonic() - started:.1f} s (torch {torch.__version__}, "
          f"triton {triton.__version__}, platform {type(current_platform).__name__})")
    assert torch.cuda.is_available() and current_platform.is_cuda(), "vLLM does not see CUDA here"
    import vllm.models.deepseek_v41.common.engram as engram

    from engramd.client.engines import vllm as plugin

    check_plugin(plugin, vllm.__version__, engram, "vllm.general_plugins", stubs, started,
                 "vllm.models.deepseek_v41.common.engram")


if __name__ == "__main__":
    main()
