"""SGLang's own Engram lookup held against engramd's, on the same table bytes (an H200).

On the GPU machine, after `bash benchmarks/sglang_gpu/setup_device.sh` (README.md):

    export PYTHONPATH=/tmp/sglang-gpu-site
    python3 benchmarks/sglang_gpu/bench_lookup.py --out DIR                # 8 GiB table
    python3 benchmarks/sglang_gpu/bench_lookup.py --mps both --out DIR     # no MPS, then MPS
    python3 benchmarks/sglang_gpu/bench_lookup.py --parts lookup --out DIR # the lookups alone
In SGLang's CPU environment (.ci/sglang_env.sh), every path but CUDA's, on the demo geometry:
    .venv-sglang/bin/python benchmarks/sglang_gpu/bench_lookup.py --dry-run --out DIR

SGLang 0.5.23 keeps a layer's Engram table in device memory (EngramEmbedding's `weight` and
`scale`; its host-table settings are off by default) and gathers from it with its Triton kernel;
with SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE the table is in pinned host memory instead, as it must
be for a table larger than HBM (V4.1-Flash's 189 GiB), read over PCIe by the same kernel.
The table has V4.1-Flash's shape (2 layers x 24 heads x 256) with its buckets scaled down to
--table-gib (common/tables.geometry_for), every byte a function of --seed (bench_tables.py).
SGLang's device copy and the daemon's /dev/shm copy fit beside each other at the default 8 GiB
(139 GiB of GPU memory, 128 GiB of host memory), but they do not meet: one process runs two
phases, one after the other, TP=1 on SGLang's own process groups (gloo):

1. sglang: SGLang's Engram layers (EngramLayout, Engram, EngramEmbedding) built as its model
   loader builds them (worker_gpu.py: under the device, bf16), their tables filled in device
   memory, and SGLang's EngramHasher over the DeepSeek-V4 tokenizer. The rows of one ID batch
   per T and the layers' outputs of one hashed step per T are kept (host memory), SGLang's
   kernel calls counted meanwhile (on the GPU each of its gather, gate and hash kernels must
   have run); then its lookup (sglang) and its model step (sglang) are timed, and its layers go,
   their device memory handed back. On a GPU the same again with SGLang's host table
   (--sglang-host-layout, per_rank by default: anonymous memory, which SGLang folds into huge
   pages; `shared` is its memfd layout for TP > 1): rows and outputs checked against the
   device table's, then timed (sglang_host). SGLang never lets a host table go (nor does this
   script): its 8 GiB stay mapped and pinned through phase 2.
2. engramd: the same bytes in /dev/shm, a `--backend cuda` daemon that re-attaches them
   (common/daemon.py), a mapped and a served EngramClient (lookups mapped, served); then the
   plugin, loaded as SGLang loads it (bench_plugin.py), and SGLang's Engram layers built again
   once per --plugin-modes mode (model steps plugin_mapped, plugin_served).
The variants and the step: bench_variants.py. Timing: common/timing.time_cell, as the vLLM benchmark's.

Rows, before anything of phase 2 is timed: each client's rows of the check batches, and, per
plugin mode, the layers' rows (EngramEmbedding.forward) and the outputs of the hashed check step
(Engram.forward, through the one lookup the plugin made for the step: checked too) must equal
SGLang's bit for bit, NaN equal to NaN (common/rows.py). What differs is not timed, and the
script exits 1. The check batches: uniform in each head's bucket, 5% DEAD (-1).

GPU memory: SGLang's table is in device memory, engramd's in host memory (the daemon's
/dev/shm files); what each variant holds on the GPU for the table, and for its hot-row cache
(the daemon's, or a mapped client's own), is reported per variant.

What it is not: the equality test of SGLang's modules and the plugin's (tests/gpu/test_sglang_gpu.py
also holds SGLang's hashes against engramd's hasher, and each step's one lookup against its IDs);
here rows and outputs are checked so that the timed paths are known to read the same table.

Output: DIR/bench_lookup.json (command, date, machine; every run and cell) and DIR/bench_lookup.md
(printed last), bench_report.py. --mps on|both (benchmarks/mps.py): each MPS mode in a child
process, a private MPS server around the `on` one (the daemon and the child its clients); with
both, each child's files are in DIR/mps_off and DIR/mps_on, the merged ones in DIR.

Cost on an H200 at the defaults, for one MPS mode (estimated from the vLLM benchmark's and the
SGLang GPU test's runs there; the script prints each phase's seconds and the JSON keeps them):
importing SGLang, its Engram module and the helpers, 20-40 s; phase 1, 30-60 s (filling 8 GiB of
device memory, the hasher's token map, SGLang's Triton compiles, the checks, 8 lookup cells and
24 model-step cells of 55 steps), and about as long again for the host table (not yet run: the
first runs, without it, took 11-13 s for phase 1); phase 2, 40-80 s (filling /dev/shm, the
daemon's start and pin, two clients' attach and 16 lookup cells, per plugin mode a build, the
checks and 24 cells). About 1.5-3 minutes in all, twice that with --mps both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import socket
import sys
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

# What a dry run needs set before torch, Triton and SGLang read it, as tests/sglang_plugin/worker.py
# sets it: so, before the imports below.
DRY_RUN_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
if "--dry-run" in sys.argv[1:]:
    os.environ.update(DRY_RUN_ENV)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_device  # noqa: E402
import bench_plugin  # noqa: E402
import bench_report  # noqa: E402
import torch  # noqa: E402
from bench_tables import fill_sglang_tables, table_bytes  # noqa: E402
from bench_variants import (  # noqa: E402
    DECODE_MAX_TOKENS,
    TIMED,
    EmbeddingLookup,
    ModelStep,
    TokenPools,
    history_slots,
)
from common import engine_bench  # noqa: E402
from common.cpu_use import CpuUse  # noqa: E402
from common.daemon import bench_folders, open_client, ready_pid, running_daemon  # noqa: E402
from common.ids import bucket_ids  # noqa: E402
from common.rows import bitwise_mismatches  # noqa: E402
from common.steps import ClientLookup, Matmuls, seed_projections, wait_warm  # noqa: E402
from common.tables import INSTANCE, fill_daemon_tables, geometry_for, reattach_flags  # noqa: E402
from common.timing import MODES, time_cell  # noqa: E402
from mps import gpu_processes, require_mps_state  # noqa: E402
from torch import Tensor  # noqa: E402

from engramd.client.geometry import TableGeometry  # noqa: E402
from engramd.client.shared.connection import probe  # noqa: E402

BENCHMARK = "sglang_gpu/bench_lookup"
# Defaults on the GPU and in a dry run (tiny: SGLang's torch paths; 300 tokens make an extend).
DEFAULTS = {
    False: {"tokens": [1, 16, 256, 4096], "lead": [1, 4, 12], "steps": 50, "warm": 5,
            "matmul_n": 4096, "hidden": 4096, "hc_mult": 4},
    True: {"tokens": [1, 16, 300], "lead": [1, 2], "steps": 3, "warm": 1,
           "matmul_n": 64, "hidden": 64, "hc_mult": 2},
}
CHECK_SEED = 7
DEAD_FRACTION = 0.05  # of the check batches' IDs
DAEMON_MAX_TOKENS = 16384  # at least the plugin's registration (SGLang's prefill ceiling, or 8192)


class Run:
    """One measurement in this process (one MPS mode): the phases and all they found."""

    def __init__(self, args: argparse.Namespace, device, geometry: TableGeometry, vocab: int,
                 mps: bool):
        self.args, self.device, self.geometry, self.mps = args, device, geometry, mps
        self.tokens = sorted(set(args.tokens))
        self.lookups: list[dict] = []
        self.steps: list[dict] = []
        self.cpu_use: list[dict] = []  # per variant's model steps: common/cpu_use.py
        self.daemon_pid: int | None = None  # while the engramd phase's daemon runs
        self.checks: list[dict] = []
        self.phases: dict[str, dict] = {}
        self.memory: dict[str, dict] = {}
        self.reference_rows: dict[int, Tensor] = {}  # T -> SGLang's rows of the check batch (host)
        self.reference_out: dict[int, Tensor] = {}  # T -> its layers' outputs of the check step
        # SGLang's host tables, kept to the end: SGLang never unregisters one, so one collected
        # would leave its range registered after it is unmapped (the next registration of that
        # address, a mapped client's, would fail).
        self.host_tables: list = []
        self.matmuls = Matmuls(args.matmul_n, device.device, args.seed)
        self.id_generator = torch.Generator(device=device.device).manual_seed(args.seed)
        self.token_pools = TokenPools(vocab, device.device, args.seed)

    @property
    def exact(self) -> bool:
        return all(check["mismatches"] == 0 for check in self.checks)

    # -- cells

    def time_lookups(self, variant) -> None:
        for tokens in self.tokens:
            line = []
            for mode in MODES:
                pool = bucket_ids(self.geometry, tokens, self.args.warm + self.args.steps,
                                  self.device.device, self.id_generator)
                cell = self._time(variant, pool, mode)
                self.lookups.append({"mps": self.mps, "variant": variant.name, "tokens": tokens,
                                     "mode": mode, **cell})
                line.append(f"{mode} gpu {cell['gpu_us']:.0f} host {cell['host_us']:.0f}")
            print(f"  {variant.name} T={tokens}: {', '.join(line)} us", flush=True)

    def time_model_steps(self, model: ModelStep) -> None:
        with CpuUse({"daemon": self.daemon_pid}) as use:  # what else was busy while its steps ran
            self._time_model_cells(model)
        self.cpu_use.append({"variant": model.name, **use.result()})
        engine_bench.profile_steps(self.args, self.device.clock, model, self.token_pools.pool,
                                   timed=TIMED)

    def _time_model_cells(self, model: ModelStep) -> None:
        for tokens in self.tokens:
            for lead in sorted(set(self.args.lead)):
                line = []
                for mode in MODES:
                    pool = self.token_pools.pool(tokens, self.args.warm + self.args.steps)
                    cell = self._time(model.step(lead), pool, mode)
                    self.steps.append({"mps": self.mps, "variant": model.name, "tokens": tokens,
                                       "lead": lead, "mode": mode, **cell})
                    line.append(f"{mode} {cell['step_us']:.0f}")
                print(f"  {model.name} T={tokens} lead={lead}: {', '.join(line)} us/step",
                      flush=True)

    def _time(self, step, pool: list[Tensor], mode: str) -> dict[str, Any]:
        return time_cell(self.device.clock, step, pool, self.args.warm, mode == "synced")

    # -- rows

    def check_ids(self, tokens: int) -> Tensor:
        """The check batch of `tokens` tokens, drawn on the CPU from its own seed."""
        generator = torch.Generator().manual_seed(CHECK_SEED * 100_003 + tokens)
        ids = bucket_ids(self.geometry, tokens, 1, torch.device("cpu"), generator, DEAD_FRACTION)
        return ids[0].to(self.device.device)

    def check_tokens(self, tokens: int) -> Tensor:
        generator = torch.Generator().manual_seed(CHECK_SEED * 100_003 + tokens)
        return torch.randint(0, self.token_pools.vocab, (tokens,), generator=generator).to(
            self.device.device)

    def compare(self, name: str, what: str, tokens: int, got: Tensor, want: Tensor) -> bool:
        # A copy: on the CPU, .cpu() of a client's rows is a view of the slot the next lookup fills.
        wrong, first = bitwise_mismatches(got.to("cpu", copy=True), want)
        self.checks.append({"variant": name, "what": what, "tokens": tokens, "against": "sglang",
                            "mismatches": wrong, **({"first": first} if wrong else {})})
        verdict = "exact" if wrong == 0 else f"{wrong} values DIFFER, first at {first}"
        print(f"  {what} {name} T={tokens}: {verdict}", flush=True)
        return wrong == 0

    def compare_rows(self, variant) -> bool:
        return all([self.compare(variant.name, "rows", tokens, variant.rows(self.check_ids(tokens)),
                                 self.reference_rows[tokens]) for tokens in self.tokens])

    def compare_steps(self, model: ModelStep, sglang_engram) -> bool:
        exact = True
        for tokens in self.tokens:
            got = model.outputs(self.check_tokens(tokens))
            if not bench_plugin.took_the_step_lookup(sglang_engram):
                raise SystemExit(f"{model.name} T={tokens}: the layers did not read the step's "
                                 "one lookup (the plugin's hasher hook submitted none?)")
            exact &= self.compare(model.name, "forward", tokens, got, self.reference_out[tokens])
        return exact

    # -- phase 1

    def sglang_phase(self, engram, hf, layout, hasher, host_layout: str | None = None) -> None:
        """SGLang's own lookup and step. Its tables in device memory (its default; `host_layout`
        None): the reference, whose layers, and with them the tables, go when it returns. Else in
        its host table of that layout (SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE): rows and outputs
        checked against the reference first; SGLang never lets a host table go, so its pinned
        memory stays until the process ends."""
        name = "sglang" if host_layout is None else "sglang_host"
        started = time.monotonic()
        phase = self.phases[name] = {"memory_before": self.device.memory()}
        with sglang_host_table(host_layout):
            layers = self.device.build_layers(engram, hf, layout)
        if host_layout is not None:
            self.host_tables += [layer.embed.host_table for layer in layers]
        phase["build_s"] = round(time.monotonic() - started, 1)
        phase["fill_s"] = round(fill_sglang_tables(layers, self.geometry, self.args.seed), 1)
        if host_layout is not None:
            finish_host_load(layers)
        phase["memory_filled"] = self.device.memory()
        print(f"[{name}] built in {phase['build_s']} s, filled in {phase['fill_s']} s", flush=True)
        self.memory[name] = sglang_memory(layers, engram)
        seed_projections(layers, self.args.seed)
        lookup = EmbeddingLookup(name, layers)
        model = ModelStep(name, layers, hasher, self.matmuls, self.args.seed)
        with bench_device.counting_kernels(engram) as calls:
            if host_layout is None:
                for tokens in self.tokens:
                    rows = lookup.rows(self.check_ids(tokens))
                    self.reference_rows[tokens] = rows.to("cpu", copy=True)
                    self.reference_out[tokens] = model.outputs(self.check_tokens(tokens)).cpu()
                exact = True
            else:
                exact = self.compare_rows(lookup) and all([
                    self.compare(name, "forward", tokens, model.outputs(self.check_tokens(tokens)),
                                 self.reference_out[tokens]) for tokens in self.tokens])
        phase["kernel_calls"] = dict(calls)
        self.device.check_kernel_calls(calls)
        if exact and "lookup" in self.args.parts:
            self.time_lookups(lookup)
        if exact and "step" in self.args.parts:
            self.time_model_steps(model)
        del layers, lookup, model
        self.device.free()
        phase["memory_after_free"] = self.device.memory()
        phase["seconds"] = round(time.monotonic() - started, 1)
        print(f"[{name}] done in {phase['seconds']} s", flush=True)

    def sglang_host_phase(self, engram, hf, layout, hasher, host_layout: str) -> None:
        """The host table's phase; its failure is reported, and phase 2 runs all the same."""
        try:
            self.sglang_phase(engram, hf, layout, hasher, host_layout)
        except (Exception, SystemExit) as exc:  # SystemExit: a check's (check_kernel_calls)
            self.phases["sglang_host"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"[sglang_host] FAILED, phase 2 goes on: {exc!r}", flush=True)
            try:
                self.device.free()
            except Exception as again:  # a CUDA error that stays: phase 2 will say so itself
                print(f"[sglang_host] freeing after the failure: {again!r}", flush=True)

    # -- phase 2

    def engramd_phase(self, work: Path, shm: Path, engram, hf, layout, hasher) -> None:
        started = time.monotonic()
        phase = self.phases["engramd"] = {}
        phase["fill_s"] = round(fill_daemon_tables(self.geometry, work / "ckpt", shm,
                                                   self.args.seed), 1)
        print(f"[engramd] filled /dev/shm in {phase['fill_s']} s", flush=True)
        begun = time.monotonic()
        with running_daemon(work, self.daemon_flags(work, shm), timeout=600) as sock:
            self.daemon_pid = ready_pid(sock)
            phase["daemon_start_s"] = round(time.monotonic() - begun, 1)
            print(f"[engramd] daemon ready in {phase['daemon_start_s']} s", flush=True)
            exact = self.client_lookups(sock, phase)
            if not exact:
                print("[engramd] rows differ from SGLang's: nothing of engramd is timed",
                      flush=True)
            elif "step" in self.args.parts:
                self.plugin_steps(sock, engram, hf, layout, hasher, phase)
        phase["seconds"] = round(time.monotonic() - started, 1)
        print(f"[engramd] done in {phase['seconds']} s", flush=True)

    def daemon_flags(self, work: Path, shm: Path) -> list[str]:
        return [*reattach_flags(work / "ckpt", shm, INSTANCE), "--backend", self.device.backend,
                "--max-tokens", str(max(DAEMON_MAX_TOKENS, *self.tokens)),
                "--metrics-address", "127.0.0.1:0",  # no port that another run could hold
                *shlex.split(self.args.daemon_args)]  # last: the caller's flags win

    def client_lookups(self, sock: Path, phase: dict) -> bool:
        """A mapped and a served client: their rows checked, then, if exact, their lookups timed."""
        variants, phase["attach_s"], phase["client_mps"] = [], {}, {}
        try:
            for mode in engine_bench.CLIENT_MODES:
                client, attach_s = open_client(sock, self.device.client_device, max(self.tokens),
                                               mode)
                variants.append(ClientLookup(client, self.device.stream()))
                wait_warm(client)
                phase["attach_s"][mode], phase["client_mps"][mode] = round(attach_s, 2), client.mps
                self.memory[mode] = engramd_memory(client, sock, layers=None)
            phase["gpu_processes"] = gpu_processes()  # the daemon and this process hold the GPU
            exact = all([self.compare_rows(variant) for variant in variants])
            if exact and "lookup" in self.args.parts:
                for variant in variants:
                    self.time_lookups(variant)
            return exact
        finally:
            for variant in variants:
                variant.client.close()

    def plugin_steps(self, sock: Path, engram, hf, layout, hasher, phase: dict) -> None:
        """SGLang's Engram layers built with the plugin loaded, once per mode: rows, outputs of
        the hashed check step, model step."""
        sglang_engram = bench_plugin.load_plugin(engram, sock, self.args.plugin_modes[0])
        for mode in self.args.plugin_modes:
            bench_plugin.forget_client(sglang_engram, mode)
            begun = time.monotonic()
            layers = self.device.build_layers(engram, hf, layout)
            client = sglang_engram._process_client.client
            if client.mode != mode:
                raise SystemExit(f"the plugin's client was granted {client.mode}, not {mode}")
            wait_warm(client)
            phase[f"plugin_{mode}_build_s"] = round(time.monotonic() - begun, 1)
            seed_projections(layers, self.args.seed)
            name = f"plugin_{mode}"
            self.memory[name] = engramd_memory(client, sock, layers)
            model = ModelStep(name, layers, hasher, self.matmuls, self.args.seed)
            exact = [self.compare_rows(EmbeddingLookup(name, layers)),
                     self.compare_steps(model, sglang_engram)]
            if all(exact):
                self.time_model_steps(model)
            del layers, client, model  # before the next mode closes the client
        bench_plugin.forget_client(sglang_engram, None)


def sglang_memory(layers: list, engram) -> dict[str, Any]:
    table = layers[0].embed
    nbytes = table_bytes(layers)
    if table.host_table is not None:
        resident_kb = huge_kb = 0
        for layer in layers:
            kb = engram._huge_pages_backing(layer.embed.host_table.bytes.data_ptr())
            resident_kb, huge_kb = resident_kb + kb[0], huge_kb + kb[1]
        where = (f"SGLang's host table ({table.host_table.layout} layout, pinned, {nbytes} bytes; "
                 f"{100 * huge_kb / max(resident_kb, 1):.0f}% of it in huge pages; "
                 f"{'sorted' if table._sort_host_reads else 'unsorted'} reads)")
        return {"table_gpu_bytes": 0, "table_at": where, "cache_gpu_bytes": 0, "cache_of": "none"}
    device = table.weight.device
    return {"table_gpu_bytes": nbytes if device.type == "cuda" else 0,
            "table_at": f"SGLang's EngramEmbedding parameters on {device} ({nbytes} bytes)",
            "cache_gpu_bytes": 0, "cache_of": "none"}


@contextlib.contextmanager
def sglang_host_table(layout: str | None) -> Iterator[None]:
    """SGLang's settings for its host table of `layout` (none: its default, device memory) while
    its layers are built: they read them at construction."""
    if layout is None:
        yield
        return
    with mock.patch.dict(os.environ, {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "true",
                                      "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": layout}):
        yield


def finish_host_load(layers: list) -> None:
    """What SGLang's loader does after a host table's rows came in (its weight loader marks the
    table written; fill_sglang_tables writes the same bytes past it): EngramEmbedding.finish_load,
    which folds the table into huge pages where the kernel allows."""
    for layer in layers:
        layer.embed.host_table.dirty = True
        layer.embed.finish_load(f"layer {layer.layer_hash_index}")


def engramd_memory(client, sock: Path, layers: list | None) -> dict[str, Any]:
    """A client's table bytes on the GPU (none: the daemon's host tables; the plugin's layers,
    if given, hold zero-row parameters, counted) and the hot-row cache its lookups read."""
    held = table_bytes(layers) if layers is not None else 0
    if client.mode == "mapped":
        cache = client.hot_cache_stats() or {}
        cache_bytes, whose = cache.get("bytes", 0), "this process's (the mapped client's own)"
        where = "the daemon's /dev/shm files, mapped into this process (host memory)"
    else:
        caches = probe(sock, "stats", 10.0).body.hot_cache or {}
        cache_bytes, whose = sum(c.get("bytes", 0) for c in caches.values()), "the daemon's"
        where = "the daemon's /dev/shm files (host memory); the daemon gathers"
    return {"table_gpu_bytes": held, "table_at": where, "cache_gpu_bytes": cache_bytes,
            "cache_of": whose if cache_bytes else "none"}


def free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


def model_config(args: argparse.Namespace, geometry: TableGeometry) -> types.SimpleNamespace:
    """The fields of the model's config that SGLang's Engram modules read: the table's geometry,
    and a hidden size and hyper-connection count of this benchmark's choosing."""
    return types.SimpleNamespace(**geometry.to_config(), hidden_size=args.hidden,
                                 hc_mult=args.hc_mult, rms_norm_eps=1e-6)


def check_layout(layout, geometry: TableGeometry) -> None:
    """SGLang's layout (rows, each hash column's bucket) must be the daemon's table's."""
    for index in range(geometry.n_layers):
        ours = (geometry.rows[index], (*geometry.offsets[index], geometry.rows[index]))
        theirs = (layout.num_embeddings[index], layout.column_bounds(index))
        if ours != theirs:
            raise SystemExit(f"layer {index}: SGLang's layout has {theirs[0]} rows in buckets "
                             f"{theirs[1][:4]}..., the table {ours[0]} in {ours[1][:4]}...")


def measure(args: argparse.Namespace) -> dict:
    """Both phases in this process (one MPS mode); the run's report."""
    started = time.monotonic()
    device = bench_device.open_device(args.dry_run)  # first: it brings SGLang's tree in
    mps = require_mps_state(args.mps == "on")
    geometry = TableGeometry.named("demo") if args.dry_run else geometry_for(args.table_gib)
    hf = model_config(args, geometry)
    engram = device.engram_module()
    setup = {"import_s": round(time.monotonic() - started, 1)}
    print(f"SGLang's Engram module imported ({setup['import_s']:.0f} s)", flush=True)
    place = types.SimpleNamespace(rank=0, world=1, port=free_port())
    with bench_folders() as (work, shm), device.helpers.parallel_state(place):
        layout = engram.EngramLayout.from_config(hf)
        check_layout(layout, geometry)
        begun = time.monotonic()
        hasher = device.helpers.sglang_hasher(engram, layout, hf, device.device)
        hasher.init_history(history_slots(args.tokens), device.device)
        setup["hasher_s"] = round(time.monotonic() - begun, 1)
        print(f"SGLang's EngramHasher built in {setup['hasher_s']} s", flush=True)
        run = Run(args, device, geometry, hasher.token_map.shape[0], mps["mps"])
        run.sglang_phase(engram, hf, layout, hasher)
        if args.sglang_host_layout != "none" and not args.dry_run:  # cudaHostRegister: a GPU's
            run.sglang_host_phase(engram, hf, layout, hasher, args.sglang_host_layout)
        run.engramd_phase(work, shm, engram, hf, layout, hasher)
    return {"meta": engine_bench.header(BENCHMARK), "runs": [describe(run, mps, setup, started)],
            "lookups": run.lookups, "steps": run.steps}


def describe(run: Run, mps: dict, setup: dict, started: float) -> dict:
    import sglang
    import triton  # imported by now, after the dry run's settings

    args, geometry = run.args, run.geometry
    shape = "demo" if args.dry_run else f"v4.1-flash, buckets scaled to {args.table_gib} GiB"
    return {**mps, **run.device.describe(), "torch": torch.__version__,
            "triton": triton.__version__, "sglang": sglang.__version__, "dry_run": args.dry_run,
            "geometry": shape, "table_gib": round(geometry.total_bytes / 2**30, 3),
            "rows": list(geometry.rows), "seed": args.seed, "steps": args.steps,
            "warm": args.warm, "parts": args.parts,
            "tokens_note": (f"uniform token IDs hashed by SGLang's EngramHasher, a decode step of "
                            f"T requests for T <= {DECODE_MAX_TOKENS}, else an extend of one "
                            "request's T tokens"),
            "model": {"hidden": args.hidden, "hc_mult": args.hc_mult,
                      "matmul": f"bf16 [{args.matmul_n} x {args.matmul_n}] squared, torch.mm"},
            "plugin_modes": args.plugin_modes, "daemon_args": args.daemon_args,
            "sglang_host_layout": args.sglang_host_layout,
            "memory": run.memory, "setup": setup, "phases": run.phases,
            "seconds": round(time.monotonic() - started, 1), "rows_exact": run.exact,
            "checks": run.checks, "cpu_use": run.cpu_use}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_bench.add_arguments(parser, "SGLang", table_gib=8.0)
    parser.add_argument("--plugin-modes", nargs="+", choices=engine_bench.CLIENT_MODES,
                        default=list(engine_bench.CLIENT_MODES),
                        help="the plugin's ENGRAMD_MODE, in turn")
    parser.add_argument("--sglang-host-layout", choices=["per_rank", "shared", "none"],
                        default="per_rank",
                        help="SGLang's host table too, of this layout (none: its device table "
                             "alone; on a GPU only)")
    args = engine_bench.finish_arguments(parser, parser.parse_args(argv), DEFAULTS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return engine_bench.main(Path(__file__).resolve(), parse_args(argv), measure, BENCHMARK,
                             bench_report.markdown)


if __name__ == "__main__":
    sys.exit(main())
