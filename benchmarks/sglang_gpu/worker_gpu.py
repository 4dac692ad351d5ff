"""One SGLang TP worker process on the GPU: SGLang's own Engram modules on CUDA beside the plugin's.

    python benchmarks/sglang_gpu/worker_gpu.py --socket S --checkpoint DIR --port P
        [--mode mapped|served|auto] [--extend-hash] [--report FILE] [--dry-run]

The GPU counterpart of tests/sglang_plugin/worker.py, whose helpers and checks it runs: TP=1,
SGLang's process groups over gloo, SGLang's Engram modules built as its model loader builds them
(under the CUDA device, in bf16) with their table in device memory. There SGLang takes its CUDA
path: rows through its Triton gather (`engram_gather`), hashes through its Triton hash kernels,
`Engram.forward` through the wkv linear and its fused gate kernel (`fused_engram_gate`); the
worker counts those calls and fails if any kind was not made. Then the plugin is loaded as
SGLang loads it (`load_plugins` with ENGRAMD_SOCKET set) and the same modules are built again,
served by the daemon. tests/sglang_plugin/worker.py's `run_checks` then compares, bit for bit,
this rank's rows, `EngramEmbedding.forward` and `Engram.forward` for three steps hashed by
SGLang's `EngramHasher` (engramd's hasher must agree, and each step must make one lookup of
every layer's IDs) and for raw IDs of 1, 5 and 64 tokens. Exits non-zero with the first
difference.

--extend-hash  SGLANG_OPT_ENGRAM_EXTEND_HASH=1: the extend step is hashed by SGLang's fused
               hash-and-commit kernel (`engram_hash_extend_and_commit`) instead of its hash kernel
               and a torch commit
--dry-run      the same on the CPU, where SGLang takes its torch paths (CUDA hidden, Triton's
               interpreter on, as in tests/sglang_plugin), against a CPU daemon: runs this
               worker's own code where there is no GPU; it says nothing of SGLang's CUDA path
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import stubs  # noqa: E402
from common import plugin_worker  # noqa: E402

# SGLang's CUDA path in sglang.srt.layers.engram: the names it calls them by there.
CUDA_KERNELS = ("engram_gather", "fused_engram_gate", "engram_hash_ids",
                "engram_hash_ids_and_commit", "engram_hash_extend_and_commit")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="mapped")
    parser.add_argument("--extend-hash", action="store_true")
    parser.add_argument("--report", default="")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    args.rank, args.world = 0, 1  # what tests/sglang_plugin/worker.py's helpers read
    return args


def build_layers(cpu, engram, hf, layout, device) -> list:
    with device:  # as SGLang's model loader builds the model
        return cpu.build_layers(engram, hf, layout)


def count_cuda_kernels(engram) -> Counter:
    """Count the calls sglang.srt.layers.engram makes to its Triton ops (it looks each name up in
    its own namespace at call time, so wrapping the name there sees every call)."""
    calls = Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    for name in CUDA_KERNELS:
        setattr(engram, name, counted(name, getattr(engram, name)))
    return calls


def check_reference(reference, device) -> None:
    """SGLang's own tables, whole (TP 1), on the device its kernels read them from."""
    for layer in reference:
        table = layer.embed
        assert table.host_table is None and table.peer is None and not table.staged_by_scheduler
        assert table.weight.device == device and table.scale.device == device, \
            f"layer {layer.layer_hash_index}: the reference table is on {table.weight.device}"
        assert table.row_start == 0 and table.rows == table.weight.shape[0] > 0


def check_cuda_path(engram, calls: Counter, extend_hash: bool) -> None:
    hashing = ("engram_hash_extend_and_commit" if extend_hash else "engram_hash_ids",
               "engram_hash_ids_and_commit")
    missing = [name for name in ("engram_gather", "fused_engram_gate", *hashing) if not calls[name]]
    assert not missing, f"SGLang's reference made no call of {missing} (calls: {dict(calls)})"


def main() -> None:
    args = parse()
    if not stubs.install() and not args.dry_run:
        sys.exit("SGLang's carried tree is not importable here, or is a full install "
                 "(benchmarks/sglang_gpu/setup_device.sh sets it up)")
    cpu = plugin_worker.load("sglang", keep_cpu_settings=args.dry_run)
    import torch

    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if not args.dry_run:
        torch.cuda.set_device(device)
    if args.extend_hash:
        os.environ["SGLANG_OPT_ENGRAM_EXTEND_HASH"] = "1"
    checkpoint = Path(args.checkpoint)
    hf = cpu.model_config(checkpoint)
    from sglang.srt.layers import engram

    cuda_path = engram._cuda_kernels(torch.empty(1, device=device))
    assert cuda_path != args.dry_run, f"SGLang's Engram code takes its {'CUDA' if cuda_path else 'torch'} path"
    calls = count_cuda_kernels(engram)
    report = {"mode": args.mode, "extend_hash": args.extend_hash, "dry_run": args.dry_run,
              "device": torch.cuda.get_device_name() if not args.dry_run else "cpu"}
    try:
        with cpu.parallel_state(args):
            layout = engram.EngramLayout.from_config(hf)
            reference = build_layers(cpu, engram, hf, layout, device)
            cpu.load_tables(reference, layout, checkpoint)
            check_reference(reference, device)

            os.environ.update(ENGRAMD_SOCKET=args.socket, ENGRAMD_MODE=args.mode)
            from sglang.srt.plugins import load_plugins

            load_plugins()
            from engramd.client.engines import sglang_engram

            assert engram.EngramEmbedding._owned_rows is sglang_engram._owned_rows, \
                "the entry point did not install"
            served = build_layers(cpu, engram, hf, layout, device)
            report["client_mode"] = sglang_engram._process_client.client.mode
            cpu.run_checks(engram, layout, hf, checkpoint, reference, served, args, sglang_engram,
                           device)
            report["sglang_cuda_calls"] = dict(calls)
            report["stand_ins"] = sorted(name for name, module in list(sys.modules.items())
                                         if stubs.is_stand_in(module))
            if not args.dry_run:
                check_cuda_path(engram, calls, args.extend_hash)
        report["result"] = "equal"
    except AssertionError as exc:
        report["result"] = f"FAILED: {exc}"
        raise
    finally:
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=1))
    print(f"all equal ({report['client_mode']} mode{', dry run' if args.dry_run else ''}): "
          f"{json.dumps(report)}")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
