"""One SGLang TP worker process of the plugin tests: SGLang's own Engram modules beside the plugin's.

    python worker.py --socket S --checkpoint DIR --rank R --world W --port P [--mode M]
                     [--other-rows]

Builds, on one TP rank of W (SGLang's own process groups over gloo, CPU: SGLang's torch paths),
SGLang's Engram modules with their row shards loaded from the checkpoint (the reference), then
loads the plugins as SGLang does (`sglang.srt.plugins.load_plugins`, with ENGRAMD_SOCKET set),
builds the same modules again (now served by the daemon), and checks that this rank's own rows
(before SGLang's TP all-reduce), the rows and `forward` (after it) are the same bits; that the
daemon registered this rank's TP rank; that each step SGLang's `EngramHasher` hashed made exactly
one lookup, of every layer's IDs, and that those are the hashes (engramd's own hasher agrees),
while IDs that did not come from the hasher take one lookup per layer. Exits non-zero with the
first difference.

benchmarks/sglang_gpu/worker_gpu.py runs the same checks (`run_checks`, its steps on a device it
names) on a GPU, where SGLang takes its CUDA path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: engine_worker
from engine_worker import (  # noqa: E402
    HC_MULT,
    HIDDEN,
    PREFIX,
    copy_projections,
    engramd_hashes,
    model_config,
    refuses_other_rows,
    refuses_other_table,
    run,
    same_bits,
)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for flag in ("--socket", "--checkpoint", "--mode"):
        parser.add_argument(flag, default="auto")
    for flag in ("--rank", "--world", "--port"):
        parser.add_argument(flag, type=int, default=0)
    parser.add_argument("--other-rows", action="store_true",
                        help="the daemon serves another checkpoint of this geometry: loading fails")
    return parser.parse_args()


def checkpoint_tensors(checkpoint: Path, layer_id: int) -> dict[str, torch.Tensor]:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name in ("weight", "scale"):
        key = f"layers.{layer_id}.engram.embed.{name}"
        with safe_open(checkpoint / index[key], framework="pt") as shard:
            out[name] = shard.get_tensor(key)
    return out


@contextmanager
def parallel_state(args: argparse.Namespace) -> Iterator[None]:
    """SGLang's process groups over gloo, one TP group of all the processes. SGLang's
    initialize_model_parallel reads every width from its runtime context, which a server
    publishes from its arguments: here they are stated (TP only: no PP, DP attention, context
    or expert parallelism)."""
    from sglang.srt.distributed import parallel_state as state
    from sglang.srt.runtime_context import get_parallel

    state.init_distributed_environment(
        world_size=args.world, rank=args.rank, local_rank=args.rank, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{args.port}")
    widths = dict(tp_size=args.world, attn_tp_size=args.world, moe_tp_size=args.world, pp_size=1,
                  attn_dp_size=1, attn_cp_size=1, attn_dcp_size=1, moe_ep_size=1, moe_dp_size=1,
                  shared_experts_tp_size=None)
    try:
        with get_parallel().override(tp_rank=args.rank, **widths):
            state.initialize_model_parallel()
            try:
                yield
            finally:
                state.destroy_model_parallel()
    finally:
        state.destroy_distributed_environment()


def build_layers(engram, hf, layout) -> list:
    """The model's Engram layers, in the model's dtype as SGLang's loader builds them."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return [engram.Engram(hf, layer_id, layout, None, PREFIX.format(layer_id))
                for layer_id in layout.layer_ids]
    finally:
        torch.set_default_dtype(default)


def load_tables(layers, layout, checkpoint: Path) -> None:
    """Through each parameter's own weight_loader, as SGLang's model loader calls it, then the
    layer's finish_load (collective in some of SGLang's layouts)."""
    for layer, layer_id in zip(layers, layout.layer_ids, strict=True):
        for name, tensor in checkpoint_tensors(checkpoint, layer_id).items():
            param = getattr(layer.embed, name)
            param.weight_loader(param, tensor)
        layer.embed.finish_load(label=f"layer {layer_id}")


def sglang_hasher(engram, layout, hf, device: torch.device | str = "cpu"):
    """SGLang's EngramHasher over the official DeepSeek-V4 tokenizer (engramd's test tokenizer),
    its buffers and history on `device` (on CUDA SGLang hashes with its Triton kernels)."""
    from transformers import PreTrainedTokenizerFast

    from engramd.client.token_map import default_tokenizer_path

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(default_tokenizer_path()))
    hasher = engram.EngramHasher(layout, tokenizer, hf.engram_pad_token_id,
                                 hf.engram_compressed_vocab_size)
    hasher.to(device)
    hasher.init_history(num_req_slots=4, device=device)
    return hasher


def sglang_steps(hasher) -> Iterator[tuple[str, torch.Tensor, tuple]]:
    """Steps of two requests hashed by SGLang's EngramHasher (each step's hash IDs, and its chunk
    for engramd's hasher): an extend in which request 0 starts its sequence and request 1
    continues at position 100 with three tokens of history (its slot's), then two decode steps,
    whose look-back is the history the hasher committed. The batch is on the hasher's device;
    each real token has its KV cache slot, nonzero as in a server's batch (SGLang's CUDA decode
    hash needs them: slot 0 marks CUDA-graph padding, whose history is not committed)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    device = hasher.history.device
    generator = torch.Generator().manual_seed(5)
    lengths = (37, 23)
    tokens = torch.randint(0, 128_000, (sum(lengths),), generator=generator, dtype=torch.int64)
    positions = torch.cat([torch.arange(n) + start for n, start in zip(lengths, (0, 100), strict=True)])
    history = torch.randint(0, 128_000, (3,), generator=generator, dtype=torch.int32)
    hasher.history.zero_()
    hasher.history[1] = history  # oldest first
    batch = types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([0, 1], device=device),
        positions=positions.to(device), extend_seq_lens=torch.tensor(lengths, device=device),
        extend_start_loc=torch.tensor([0, lengths[0]], device=device),
        extend_seq_lens_cpu=list(lengths), engram_history=None,
        out_cache_loc=torch.arange(1, sum(lengths) + 1, device=device), engram_staged_rows=None)
    lookback = torch.stack([torch.full((3,), -1), history.flip(0).to(torch.int64)])
    yield ("extend", hasher(tokens.to(device), batch),
           (tokens, torch.tensor([0, lengths[0], sum(lengths)]), lookback))
    seqs = list(tokens.split(lengths))
    seqs[1] = torch.cat([history.to(torch.int64), seqs[1]])
    for step in range(2):
        last = torch.stack([seq[-3:].flip(0) for seq in seqs])  # newest first
        tokens = torch.randint(0, 128_000, (2,), generator=generator, dtype=torch.int64)
        batch = types.SimpleNamespace(
            forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor([0, 1], device=device),
            positions=torch.tensor([lengths[0] + step, 100 + lengths[1] + step], device=device),
            out_cache_loc=torch.tensor([1, 2], device=device) + sum(lengths) + 2 * step,
            engram_staged_rows=None)
        yield (f"decode {step}", hasher(tokens.to(device), batch),
               (tokens, torch.tensor([0, 1, 2]), last))
        seqs = [torch.cat([seq, token.view(1)]) for seq, token in zip(seqs, tokens, strict=True)]


def raw_ids(layout, tokens: int) -> torch.Tensor:
    """Row IDs straight into the table, as SGLang's int64: each column's in its own bucket, as a
    hash ID is (at TP > 1 SGLang's row shards would answer an ID in another column's bucket,
    which no hash makes, where engramd's head shards give zeros), every shard's rows among them,
    and some DEAD (-1: zeros on both sides)."""
    generator = torch.Generator().manual_seed(tokens)
    layers = []
    for index in range(len(layout.layer_ids)):
        bounds = torch.tensor(layout.column_bounds(index))
        offset = torch.rand((tokens, bounds.shape[0] - 1), generator=generator, dtype=torch.float64)
        ids = bounds[:-1] + (offset * (bounds[1:] - bounds[:-1])).to(torch.int64)
        dead = torch.rand(ids.shape, generator=generator) < 0.1
        layers.append(ids.masked_fill(dead, -1))
    return torch.stack(layers, dim=1)


def compare_step(name: str, reference, served, ids: torch.Tensor, rank: int) -> None:
    """This rank's own rows (SGLang's row shard, split on the same head boundaries as engramd's
    at TP 1 and 2), then the rows and forward after SGLang's all-reduce over the TP group. The
    step's tensors are on the IDs' device."""
    tokens = ids.shape[0]
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn((tokens, HC_MULT, HIDDEN), generator=generator).to(ids.device, torch.bfloat16)
    input_ids = torch.randint(0, 1000, (tokens,), generator=generator).to(ids.device)
    for ref, ours in zip(reference, served, strict=True):
        layer_ids = ids[:, ref.layer_hash_index]
        where = f"{name}, layer {ref.layer_hash_index}, rank {rank}"
        same_bits(f"{where}: this rank's rows", ours.embed._owned_rows(layer_ids),
                  ref.embed._owned_rows(layer_ids))
        same_bits(f"{where}: rows", ours.embed(layer_ids), ref.embed(layer_ids))
        same_bits(f"{where}: forward", ours(hidden, layer_ids, None, input_ids=input_ids),
                  ref(hidden, layer_ids, None, input_ids=input_ids))


def main() -> None:
    args = parse()
    checkpoint = Path(args.checkpoint)
    hf = model_config(checkpoint)
    from sglang.srt.layers import engram

    with parallel_state(args):
        layout = engram.EngramLayout.from_config(hf)
        reference = build_layers(engram, hf, layout)
        load_tables(reference, layout, checkpoint)

        os.environ.update(ENGRAMD_SOCKET=args.socket, ENGRAMD_MODE=args.mode)
        from sglang.srt.plugins import load_plugins

        load_plugins()
        from engramd.client.engines import sglang_engram

        assert engram.EngramEmbedding._owned_rows is sglang_engram._owned_rows, \
            "the entry point did not install"
        served = build_layers(engram, hf, layout)
        if args.other_rows:
            refuses_other_rows(lambda: load_tables(served, layout, checkpoint),
                               sglang_engram.SglangPluginError)
            print(f"rank {args.rank}: the daemon's other rows were refused at load")
            return
        run_checks(engram, layout, hf, checkpoint, reference, served, args, sglang_engram)
    print(f"rank {args.rank}: all equal ({sglang_engram._process_client.client.mode} mode)")


def run_checks(engram, layout, hf, checkpoint, reference, served, args, sglang_engram,
               device: torch.device | str = "cpu") -> None:
    """Every check of the module docstring; the steps' IDs and tensors on `device`."""
    daemon = sglang_engram._process_client
    load_tables(served, layout, checkpoint)  # skipped, but the checkpoint loads
    assert all(layer.embed.weight.shape[0] == 0 for layer in served), "a table was kept"
    refuses_other_table(served[0].embed.weight, layout.head_dim, sglang_engram.SglangPluginError)
    copy_projections(reference, served)

    the_daemon_sees_this_rank(daemon.client, args)
    sent = []
    lookup = daemon.client.lookup
    daemon.client.lookup = lambda ids, *rest, **kw: (sent.append(ids.clone()), lookup(ids, *rest, **kw))[1]
    for name, hashes, chunk in sglang_steps(sglang_hasher(engram, layout, hf, device)):
        same_bits(f"{name}: SGLang's hashes vs engramd's hasher", hashes,
                  engramd_hashes(checkpoint, *chunk).to(hashes.device, hashes.dtype))
        compare_step(name, reference, served, hashes, args.rank)
        assert len(sent) == 1, f"{name}: {len(sent)} lookups for one step hashed by SGLang"
        same_bits(f"{name}: IDs of the step's one lookup, every layer's", sent.pop(), hashes)
    for tokens in (5, 64, 1):  # IDs not from the hasher: a lookup per layer
        ids = raw_ids(layout, tokens).to(device)
        compare_step(f"raw IDs x {tokens}", reference, served, ids, args.rank)
        lookups_of_one_layer_each(sent, ids)
        sent.clear()
    with torch.inference_mode():  # SGLANG_ENABLE_TORCH_INFERENCE_MODE: the scheduler's steps
        name, hashes, _ = next(sglang_steps(sglang_hasher(engram, layout, hf, device)))
        compare_step(f"{name} in inference mode", reference, served, hashes, args.rank)
    lookups_of_one_layer_each(sent, hashes)  # no version counter to tell a rewrite: per layer
    sent.clear()
    staging_is_refused(served[0], sglang_engram.SglangPluginError)


def the_daemon_sees_this_rank(client, args: argparse.Namespace) -> None:
    """The daemon's own account of this rank's client: its TP rank and size, and so its heads."""
    from engramd.client.shared.connection import probe

    clients = {c["client_id"]: c for c in probe(client.socket_path, "stats", 10.0).body.clients}
    seen = clients[client.client_id]
    assert (seen["tp_rank"], seen["tp_size"]) == (args.rank, args.world), \
        f"the daemon registered TP rank {seen['tp_rank']} of {seen['tp_size']}"
    part = -(-24 // args.world)
    assert (client.shard.head_start, client.shard.head_end) == (args.rank * part, (args.rank + 1) * part)


def lookups_of_one_layer_each(sent: list[torch.Tensor], ids: torch.Tensor) -> None:
    """Each lookup carried one layer's IDs, and DEAD for the others; every layer was looked up."""
    looked_up = set()
    for lookup in sent:
        layer = int((lookup != -1).any(dim=(0, 2)).nonzero()[0])
        same_bits(f"IDs of a lookup of layer {layer}", lookup[:, layer], ids[:, layer])
        others = torch.arange(lookup.shape[1], device=lookup.device) != layer
        assert bool((lookup[:, others] == -1).all()), "other layers not DEAD"
        looked_up.add(layer)
    assert looked_up == set(range(ids.shape[1])), f"lookups of layers {looked_up} only"


def staging_is_refused(layer, error: type[Exception]) -> None:
    try:
        layer.embed.enable_scheduler_staging()
    except error as exc:
        assert "SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING" in str(exc), exc
    else:
        raise AssertionError("scheduler staging was enabled on a daemon-served layer")


if __name__ == "__main__":
    run(main)
