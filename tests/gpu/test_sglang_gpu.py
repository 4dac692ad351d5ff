"""The SGLang plugin on the GPU against SGLang 0.5.23's own Engram modules on CUDA.

tests/sglang_plugin runs SGLang's Engram code on the CPU, where it takes its torch paths; here it
runs as SGLang runs it on a GPU (TP=1): the table in device memory, rows through SGLang's Triton
gather, hashes through its Triton hash kernels, the gate through its fused Triton kernel. The
same modules served by a real daemon (the CUDA backend; the plugin's client mapped, the default,
and served) must give the same rows, `EngramEmbedding.forward` and `Engram.forward`, bit for bit,
and each step SGLang hashed must make one lookup of every layer's IDs.

SGLang travels to the GPU machine as its Python tree without compiled parts
(benchmarks/sglang_gpu/README.md); benchmarks/sglang_gpu/stubs.py stands in for those. The
comparisons run in worker processes (benchmarks/sglang_gpu/worker_gpu.py), as in
tests/sglang_plugin. Skipped without CUDA or without SGLang's tree on the path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import engine_tree, free_port, run_engine_worker

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "benchmarks" / "sglang_gpu" / "worker_gpu.py"
ENGRAM_FILE = Path("srt", "layers", "engram.py")
WORKER_TIMEOUT_S = 300


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(engine_tree("sglang", ENGRAM_FILE) is None,
                       reason="needs SGLang 0.5.23's tree on the path (benchmarks/sglang_gpu/setup_device.sh)"),
]


def run_worker(daemon, checkpoint: Path, mode: str, report: Path, extend_hash: bool = False) -> dict:
    cmd = [sys.executable, str(WORKER), "--socket", str(daemon.socket), "--checkpoint", str(checkpoint),
           "--port", str(free_port()), "--mode", mode, "--report", str(report),
           *(["--extend-hash"] if extend_hash else [])]
    return run_engine_worker(cmd, report, daemon, WORKER_TIMEOUT_S)


@pytest.mark.parametrize("mode, extend_hash", [("mapped", False), ("served", False), ("mapped", True)],
                         ids=["mapped", "served", "mapped-extend-hash"])
def test_rows_and_forward_are_sglangs_cuda_ones(daemon_factory, demo_checkpoint, tmp_path, mode,
                                                extend_hash):
    """mapped-extend-hash: SGLANG_OPT_ENGRAM_EXTEND_HASH=1, the extend step hashed by SGLang's
    fused hash-and-commit kernel."""
    daemon = daemon_factory(extra=["--backend", "cuda"])
    report = run_worker(daemon, demo_checkpoint, mode, tmp_path / "report.json", extend_hash)
    assert report["client_mode"] == mode and report["result"] == "equal", report
