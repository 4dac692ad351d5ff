"""One vLLM worker process of the plugin tests: vLLM's own Engram modules beside the plugin's.

    python worker.py --socket S --checkpoint DIR --rank R --world W --port P [--sp] [--mode M]
                     [--capture] [--other-rows]

Builds, on one TP rank (gloo, CPU, vLLM's kernels under Triton's interpreter), vLLM's Engram
modules with their tables loaded from the checkpoint (the reference), then loads the plugins as
vLLM does (`load_general_plugins`, with ENGRAMD_SOCKET set), builds the same modules again (now
served by the daemon), and checks step by step that the rows, `embed` and `forward` are the same
bits, and that the IDs the daemon got are the hashes vLLM's `NgramHashState` computed (and that
engramd's own hasher agrees). Exits non-zero with the first difference.

--other-rows: the daemon serves another checkpoint of the model's geometry, and loading the
model's checkpoint must fail (nothing else is checked).

--capture sets ENGRAMD_CAPTURE=on: the staging slot's lookup is a captured one (no graph here:
each step launches it eagerly, the kernel under Triton's interpreter like vLLM's); the CPU
client's refusal of capturable_lookup is the one thing stood in for.
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
from unittest import mock

os.environ.update(VLLM_TARGET_DEVICE="cpu", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")

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
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--capture", action="store_true", help="ENGRAMD_CAPTURE=on")
    return parser.parse_args()


def checkpoint_tensors(checkpoint: Path, layer_id: int) -> dict[str, torch.Tensor]:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for suffix, param in (("weight", "weight"), ("scale", "weight_scale_inv")):
        name = f"layers.{layer_id}.engram.embed.{suffix}"
        with safe_open(checkpoint / index[name], framework="pt") as shard:
            out[param] = shard.get_tensor(name)
    return out


def vllm_config():
    """The config vLLM's Engram modules read: in-process tables (the reference's)."""
    from vllm.config import VllmConfig
    from vllm.config.engram import EngramConfig

    config = VllmConfig()
    config.engram_config = EngramConfig(cpu_offload=False)
    return config


@contextmanager
def parallel_state(args: argparse.Namespace) -> Iterator[None]:
    """vLLM's parallel state over gloo, one TP group of all the processes."""
    from vllm.distributed import parallel_state as state

    state.init_distributed_environment(
        world_size=args.world, rank=args.rank, local_rank=args.rank, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{args.port}")
    try:
        state.initialize_model_parallel(args.world)
        yield
    finally:
        state.destroy_model_parallel()
        state.destroy_distributed_environment()


def build_layers(engram, hf, layout, sp: bool) -> list:
    """The model's Engram layers, in the model's dtype as vLLM's loader builds them."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return [engram.Engram(hf, None, layout, index, sp, PREFIX.format(layer_id))
                for index, layer_id in enumerate(layout.layer_ids)]
    finally:
        torch.set_default_dtype(default)


def load_tables(layers, layout, checkpoint: Path) -> None:
    """Through each parameter's own weight_loader, as vLLM's model loader calls it."""
    for layer, layer_id in zip(layers, layout.layer_ids, strict=True):
        for name, tensor in checkpoint_tensors(checkpoint, layer_id).items():
            param = getattr(layer.embed_tokens, name)
            param.weight_loader(param, tensor)


def copy_weights(reference, served) -> None:
    """The same projections on both (engine_worker.copy_projections), finished as vLLM's loader
    finishes every layer (CPU GEMM setup)."""
    copy_projections(reference, served)
    for layer in (*reference, *served):
        layer.wkv.quant_method.process_weights_after_loading(layer.wkv)


def vllm_hashes(engram, layout, tokenizer_dir: Path, device: str = "cpu"):
    """A chunk of two requests hashed by vLLM's NgramHashState (V2 runner: stateless): request 0
    starts its sequence, request 1 continues at position 100 with three look-back tokens. On
    `device` (a GPU runs vLLM's Triton hash kernel there); the chunk is returned on the CPU."""
    settings = types.SimpleNamespace(
        use_v2_model_runner=True,
        model_config=types.SimpleNamespace(tokenizer=str(tokenizer_dir), trust_remote_code=False,
                                           revision=None))
    hasher = engram.NgramHashState(settings, layout, types.SimpleNamespace(block_size=64)).to(device)
    generator = torch.Generator().manual_seed(5)
    lengths = (37, 23)
    tokens = torch.randint(0, 128_000, (sum(lengths),), generator=generator, dtype=torch.int32)
    positions = torch.cat([torch.arange(n) + start for n, start in zip(lengths, (0, 100), strict=True)])
    lookback = torch.tensor([[-1, -1, -1], torch.randint(0, 128_000, (3,), generator=generator).tolist()])
    starts = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    dead = torch.zeros(tokens.shape[0], dtype=torch.bool)
    inputs = (tokens, positions, starts, dead, lookback, torch.zeros_like(lookback, dtype=torch.bool))
    hashes = hasher(*(t.to(device) for t in inputs), None, None)
    return hashes, (tokens, starts, lookback)


def raw_ids(rows: tuple[int, ...], tokens: int) -> torch.Tensor:
    """Row IDs straight into the table, -1 (DEAD) and every shard's rows among them."""
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randint(-1, n, (tokens, 24), generator=generator) for n in rows], dim=1)
    return ids.to(torch.int32)


def compare_step(name: str, reference, served, ids: torch.Tensor, args, world: int) -> None:
    tokens = ids.shape[0]
    for ref, ours in zip(reference, served, strict=True):
        ref.prepare_embeddings(ids[:, ref.layer_hash_index])
        ours.prepare_embeddings(ids[:, ours.layer_hash_index])
    generator = torch.Generator().manual_seed(tokens)
    local = -(-tokens // world) if args.sp else tokens
    hidden = torch.randn((local, HC_MULT, HIDDEN), generator=generator).to(torch.bfloat16)
    mask = torch.rand(tokens, generator=generator) > 0.2
    for ref, ours in zip(reference, served, strict=True):
        layer_ids = ids[:, ref.layer_hash_index]
        where = f"{name}, layer {ref.layer_hash_index}, rank {args.rank}"
        same_bits(f"{where}: rows", ours._ready_rows(tokens), ref._ready_rows(tokens))
        same_bits(f"{where}: embed", ours.embed(layer_ids), ref.embed(layer_ids))
        same_bits(f"{where}: forward", ours(hidden, layer_ids, mask), ref(hidden, layer_ids, mask))
        if not args.sp:  # vLLM's own ParallelEngramEmbedding.forward, through the plugin's lookup
            same_bits(f"{where}: embed_tokens", ours.embed_tokens(layer_ids), ref.embed_tokens(layer_ids))


def main() -> None:
    args = parse()
    checkpoint = Path(args.checkpoint)
    hf = model_config(checkpoint)
    from engramd.client.token_map import default_tokenizer_path

    device = types.SimpleNamespace(multi_processor_count=4)
    from engramd.client import EngramClient

    def capturable(client, ids, slot=None, sm_fraction=None):  # past the refusal of a CPU client
        return client._captures.make(ids, slot, sm_fraction)

    with mock.patch("torch.cuda.get_device_properties", lambda *_: device), \
         mock.patch("torch.accelerator.current_device_index", lambda: 0), \
         mock.patch.object(EngramClient, "capturable_lookup", capturable):
        from vllm.config import set_current_vllm_config
        from vllm.models.deepseek_v41.common import engram

        with set_current_vllm_config(vllm_config()), parallel_state(args):
            layout = engram.EngramLayout(hf)
            reference = build_layers(engram, hf, layout, args.sp)
            load_tables(reference, layout, checkpoint)

            os.environ.update(ENGRAMD_SOCKET=args.socket, ENGRAMD_MODE=args.mode,
                              ENGRAMD_CAPTURE="on" if args.capture else "off")
            from vllm.plugins import load_general_plugins

            load_general_plugins()
            from engramd.client.engines import vllm_engram

            assert engram.Engram._ready_rows is vllm_engram._ready_rows, "the entry point did not install"
            served = build_layers(engram, hf, layout, args.sp)
            if args.other_rows:
                refuses_other_rows(lambda: load_tables(served, layout, checkpoint),
                                   vllm_engram.VllmPluginError)
                print(f"rank {args.rank}: the daemon's other rows were refused at load")
                return
            run_checks(engram, layout, checkpoint, reference, served, args, vllm_engram,
                       default_tokenizer_path().parent)
    captured = " captured" if vllm_engram._process_rows.captured is not None else ""
    print(f"rank {args.rank}: all equal ({vllm_engram._process_rows.client.mode} mode{captured})")


def run_checks(engram, layout, checkpoint, reference, served, args, vllm_engram, tokenizer_dir) -> None:
    rows = vllm_engram._process_rows
    load_tables(served, layout, checkpoint)  # skipped, but the checkpoint loads
    assert all(layer.embed_tokens.weight.shape[0] == 0 for layer in served), "a table was kept"
    refuses_other_table(served[0].embed_tokens.weight, layout.head_dim, vllm_engram.VllmPluginError)
    copy_weights(reference, served)

    staging = rows.client.slot_rows(vllm_engram.STAGED_SLOT)
    for layer in served:  # views of the client's staging slot, not buffers of their own
        assert layer.staged_rows.data_ptr() == staging[layer.layer_hash_index].data_ptr(), \
            f"layer {layer.layer_hash_index}: staged_rows is not the client's slot"
    assert (rows.captured is not None) == args.capture, "ENGRAMD_CAPTURE did not reach the worker"
    if args.capture:
        assert rows.captured.slot == vllm_engram.STAGED_SLOT
    sent = []
    lookup = rows.client.lookup
    rows.client.lookup = lambda ids, *rest, **kw: (sent.append((ids.clone(), kw.get("slot"))),
                                                    lookup(ids, *rest, **kw))[1]
    hashes, chunk = vllm_hashes(engram, layout, tokenizer_dir)
    same_bits("vLLM's hashes vs engramd's hasher", hashes, engramd_hashes(checkpoint, *chunk).to(hashes.dtype))
    compare_step("hashed chunk", reference, served, hashes, args, args.world)
    if args.capture:  # no lookup() for the staged rows: the IDs are in the captured lookup's buffer
        same_bits("IDs in the captured lookup's buffer, every layer's",
                  rows.captured.ids[:hashes.shape[0]], hashes)
        assert all(slot == vllm_engram.DIRECT_SLOT for _, slot in sent), \
            "a captured worker looked its staged rows up with lookup()"
    else:
        same_bits("IDs of the step's one lookup, every layer's", sent[0][0], hashes)
    for tokens in (5, 64, 1):  # decode-sized and prefill-sized steps reuse the staging slot
        compare_step(f"raw IDs x {tokens}", reference, served, raw_ids(layout.num_embeddings, tokens),
                     args, args.world)
    layers_of_other_token_counts_fail_closed(served, raw_ids(layout.num_embeddings, 5),
                                             vllm_engram.VllmPluginError)
    moved_rows_fail_closed(served[0], raw_ids(layout.num_embeddings, 3), vllm_engram.VllmPluginError)
    other_tables_fail_closed(served[0], raw_ids(layout.num_embeddings, 3), vllm_engram.VllmPluginError)
    if args.capture:  # last: a lost captured lookup stays lost
        replays_checked_every_step(rows, vllm_engram)


def replays_checked_every_step(rows, vllm_engram) -> None:
    """A captured worker's step (vLLM's Worker.execute_model, what a full graph's step still
    runs in Python) first checks the replays: it passes on to vLLM's own step while they are
    sound, and fails before it once the captured lookup is lost."""
    from vllm.v1.worker import gpu_worker

    from engramd.client.errors import ReplayFailedError

    step = gpu_worker.Worker.execute_model
    assert step.__wrapped__ is vllm_engram._originals["execute_model"], "the worker's step is not wrapped"
    not_a_worker = object()
    try:
        step(not_a_worker, None)
    except AttributeError:
        pass  # vLLM's own step ran (on an object that is no worker)
    else:
        raise AssertionError("vLLM's own step did not run")
    rows.captured.lose("its tables are gone (test)")
    try:
        step(not_a_worker, None)
    except ReplayFailedError as exc:
        assert "its tables are gone (test)" in str(exc), exc
    else:
        raise AssertionError("a step ran after the captured lookup was lost")


def other_tables_fail_closed(layer, ids: torch.Tensor, error: type[Exception]) -> None:
    """After a re-registration (client.registrations goes up), the same tables pass and other
    ones (client.tables_id: test_lifecycle.py shows a restarted daemon changes it) are refused."""
    client = layer.embed_tokens.rows.client
    assert client.pin_tables  # a reload to other tables is refused by the client itself (test_reload.py)
    served = client.tables_id
    try:
        client.registrations += 1  # as a re-registration with the same daemon's tables does
        layer.prepare_embeddings(ids[:, layer.layer_hash_index])
        layer._ready_rows(ids.shape[0])
        client.registrations += 1
        client.tables_id = "another checkpoint"
        # The daemon this stands for serves "another checkpoint": its heartbeats bring no news.
        client._tables_news = lambda: None
        step_is_refused(layer, ids, error, "restarted on other Engram tables")
    finally:
        client.tables_id = served
        del client._tables_news


def layers_of_other_token_counts_fail_closed(served, ids: torch.Tensor, error: type[Exception]) -> None:
    """A step's layers hand in IDs of one token count (columns of one hash tensor); a layer that
    hands in another count (a seam vLLM changed) is refused, not broadcast over the step's
    tokens or read past its own."""
    assert len(served) > 1
    try:
        for layer in served:
            count = 1 if layer is served[-1] else ids.shape[0]
            layer.prepare_embeddings(ids[:count, layer.layer_hash_index])
        for layer in served:
            layer._ready_rows(ids.shape[0])
    except error as exc:
        assert "handed in IDs of 1 tokens" in str(exc), exc
    else:
        raise AssertionError("a step whose layers handed in different token counts was served")


def moved_rows_fail_closed(layer, ids: torch.Tensor, error: type[Exception]) -> None:
    """Once the client says its rows moved (rows_generation: it re-registered in another mode
    or layout, test_lifecycle.py makes that happen), the staged views are refused, not read."""
    client = layer.embed_tokens.rows.client
    client.rows_generation += 1
    try:
        step_is_refused(layer, ids, error, "restart this vLLM server")
    finally:
        client.rows_generation -= 1


def step_is_refused(layer, ids: torch.Tensor, error: type[Exception], reason: str) -> None:
    layer.prepare_embeddings(ids[:, layer.layer_hash_index])
    try:
        layer._ready_rows(ids.shape[0])
    except error as exc:
        assert reason in str(exc), exc
    else:
        raise AssertionError(f"a step was served where the plugin should refuse it ({reason})")


if __name__ == "__main__":
    run(main)
