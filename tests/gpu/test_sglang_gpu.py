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

import importlib.machinery
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "benchmarks" / "sglang_gpu" / "worker_gpu.py"
ENGRAM_FILE = Path("srt", "layers", "engram.py")
WORKER_TIMEOUT_S = 300


def _sglang_tree() -> Path | None:
    """SGLang's package folder, found without importing it (that takes seconds)."""
    spec = importlib.machinery.PathFinder.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / ENGRAM_FILE).is_file() else None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(_sglang_tree() is None,
                       reason="needs SGLang 0.5.23's tree on the path (benchmarks/sglang_gpu/setup_device.sh)"),
]


def run_worker(daemon, checkpoint: Path, mode: str, report: Path, extend_hash: bool = False) -> dict:
    cmd = [sys.executable, str(WORKER), "--socket", str(daemon.socket), "--checkpoint", str(checkpoint),
           "--port", str(free_port()), "--mode", mode, "--report", str(report),
           *(["--extend-hash"] if extend_hash else [])]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"worker timed out:\n{exc.stdout}\n{exc.stderr}") from None
    result = json.loads(report.read_text()) if report.exists() else {}
    print(json.dumps(result, indent=1))  # shown with -s, and kept in the failure report
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-8000:]}\n{daemon.log()[-2000:]}"
    return result


@pytest.mark.parametrize("mode, extend_hash", [("mapped", False), ("served", False), ("mapped", True)],
                         ids=["mapped", "served", "mapped-extend-hash"])
def test_rows_and_forward_are_sglangs_cuda_ones(daemon_factory, demo_checkpoint, tmp_path, mode,
                                                extend_hash):
    """mapped-extend-hash: SGLANG_OPT_ENGRAM_EXTEND_HASH=1, the extend step hashed by SGLang's
    fused hash-and-commit kernel."""
    daemon = daemon_factory(extra=["--backend", "cuda"])
    report = run_worker(daemon, demo_checkpoint, mode, tmp_path / "report.json", extend_hash)
    assert report["client_mode"] == mode and report["result"] == "equal", report
