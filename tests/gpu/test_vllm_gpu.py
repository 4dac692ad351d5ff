"""The vLLM plugin on the GPU against vLLM 0.33.0's own offloaded Engram modules.

tests/vllm_plugin runs vLLM's Engram code on the CPU under Triton's interpreter; here it runs as
vLLM runs it on a GPU: EngramConfig(cpu_offload=True), tables in pinned host memory, vLLM's
Triton lookup kernel reading them through UVA on its prefetch stream (TP=1). The same modules
served by a real daemon (the CUDA backend, the plugin's client mapped, the default, and served)
must give the same rows, `embed`, `forward` and `embed_tokens`, bit for bit; and, on a
checkpoint whose scale blocks take every byte 0..255, the same rows for every scale byte.

vLLM travels to the GPU machine as its Python tree without compiled parts
(benchmarks/vllm_gpu/README.md); benchmarks/vllm_gpu/stubs.py stands in for those. The
comparisons run in worker processes (benchmarks/vllm_gpu/worker_gpu.py), as in tests/vllm_plugin.
Skipped without CUDA or without vLLM's tree on the path.
"""

from __future__ import annotations

import json
import mmap
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import engine_tree, free_port, run_engine_worker

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "benchmarks" / "vllm_gpu" / "worker_gpu.py"
ENGRAM_FILE = Path("models", "deepseek_v41", "common", "engram.py")
WORKER_TIMEOUT_S = 240


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(engine_tree("vllm", ENGRAM_FILE) is None,
                       reason="needs vLLM 0.33.0's tree on the path (benchmarks/vllm_gpu/setup_device.sh)"),
]




def run_worker(daemon, checkpoint: Path, mode: str, check: str, report: Path,
               capture: bool = False) -> dict:
    cmd = [sys.executable, str(WORKER), "--socket", str(daemon.socket), "--checkpoint", str(checkpoint),
           "--port", str(free_port()), "--mode", mode, "--check", check, "--report", str(report),
           *(["--capture"] if capture else [])]
    return run_engine_worker(cmd, report, daemon, WORKER_TIMEOUT_S)


def every_scale_byte(checkpoint: Path) -> Path:
    """Rewrite the scale tensors of a synthetic checkpoint in place so that the scale blocks
    take every byte 0..255 (server/synthetic.py draws them from 127 +- 20): block b of row r
    gets (r * 8 + b) * 37 + 11 mod 256 (37 is odd, so every 256 blocks hold each byte once),
    each scale byte then meets all kinds of FP8 values."""
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    for name, shard in index.items():
        if not (name.endswith(".engram.embed.scale")):
            continue
        with open(checkpoint / shard, "r+b") as file, mmap.mmap(file.fileno(), 0) as data:
            header_len = struct.unpack("<Q", data[:8])[0]
            entry = json.loads(data[8:8 + header_len])[name]
            start, stop = (8 + header_len + offset for offset in entry["data_offsets"])
            blocks = np.arange(stop - start, dtype=np.int64)
            data[start:stop] = ((blocks * 37 + 11) % 256).astype(np.uint8).tobytes()
    return checkpoint


@pytest.fixture(scope="module")
def all_scales_checkpoint(tmp_path_factory) -> Path:
    from engramd.client.geometry import TableGeometry
    from engramd.server.synthetic import write_synthetic_checkpoint

    folder = write_synthetic_checkpoint(TableGeometry.named("demo"),
                                        tmp_path_factory.mktemp("all-scales-ckpt"), seed=9)
    return every_scale_byte(folder)


@pytest.mark.parametrize("mode, capture", [("mapped", False), ("served", False), ("mapped", True)],
                         ids=["mapped", "served", "mapped-captured"])
def test_rows_embed_and_forward_are_vllms_offloaded_ones(daemon_factory, demo_checkpoint, tmp_path,
                                                         mode, capture):
    """mapped-captured: ENGRAMD_CAPTURE=on, the staged rows a captured lookup's, launched eagerly,
    then recorded in CUDA graphs as an engine's own capture, vLLM's full graphs (one launch a
    step, and a launch a layer) and its breakable ones in pieces record them, and replayed on
    new IDs (worker_gpu.check_replays)."""
    daemon = daemon_factory(extra=["--backend", "cuda"])
    report = run_worker(daemon, demo_checkpoint, mode, "flow", tmp_path / "report.json", capture)
    assert report["client_mode"] == mode
    paths = ["pieces", "plain", "plain, a launch per layer", "runner_v2", "runner_v2, a launch per layer"]
    assert sorted(report.get("replays", {})) == (paths if capture else []), report


def test_every_scale_byte_gives_vllms_rows(daemon_factory, all_scales_checkpoint, tmp_path):
    """Bit for bit on scale bytes 1..254. Bytes 0 and 255 are where vLLM's kernel (the float32
    bit-cast `s << 23`: 0.0 and inf) and the exact 2^(s - 127) engramd serves (2^-127, and
    UE8M0's NaN) part by design: there every value of vLLM's must be a zero or an inf/NaN and
    engramd's the nonzero product or NaN (worker_gpu.convention_difference); the report counts
    them per byte."""
    daemon = daemon_factory(tables=all_scales_checkpoint, extra=["--backend", "cuda"])
    report = run_worker(daemon, all_scales_checkpoint, "mapped", "scales", tmp_path / "report.json")
    assert report["scale_bytes_seen"] == 256 and report["unexplained"] == 0, report
    assert set(report["by_scale_byte"]) <= {"0", "255"}, report["by_scale_byte"]
