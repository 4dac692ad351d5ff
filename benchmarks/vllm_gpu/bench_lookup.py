"""vLLM's own Engram lookup held against engramd's, on the same table bytes (an H200).

On the GPU machine, after `bash benchmarks/vllm_gpu/setup_device.sh` (README.md):

    export PYTHONPATH=/tmp/vllm-gpu-site
    python benchmarks/vllm_gpu/bench_lookup.py --out DIR                # 16 GiB table, uniform IDs
    python benchmarks/vllm_gpu/bench_lookup.py --ids text --traces .traces --out DIR
    python benchmarks/vllm_gpu/bench_lookup.py --mps both --out DIR     # without MPS, then under it
    python benchmarks/vllm_gpu/bench_lookup.py --parts lookup --out DIR # the lookups alone
    python benchmarks/vllm_gpu/bench_lookup.py --mps both --rounds 3 --plugin-gather-at wait lookup \
        --out DIR                       # every plugin variant, each cell 3 times (README.md)
In vLLM's CPU environment (.ci/vllm_env.sh), every path but CUDA's, on the demo geometry:
    .venv-vllm/bin/python benchmarks/vllm_gpu/bench_lookup.py --dry-run --out DIR

The table has V4.1-Flash's shape (v4.1-flash: 2 layers x 24 heads x 256) with its buckets scaled
down to --table-gib (common/tables.geometry_for), every byte a function of --seed
(bench_tables.py). vLLM's pinned copy and the daemon's /dev/shm copy of a 64 GiB table do not fit
in the machine's 128 GiB together, so one process runs two phases, one after the other, each
with a copy of its own:

1. vLLM: its Engram layers (EngramLayout, Engram, ParallelEngramEmbedding) built as worker_gpu.py
   builds them, with EngramConfig(cpu_offload=True): pinned host tables, filled here, read by
   vLLM's Triton kernel through UVA. The rows of the check batches are kept (host memory), the
   lookups (vllm_fg, vllm_bg) and the model step (vllm) timed; then the layers go and their
   pinned memory is handed back (bench_device.Gpu.release_host_memory; the host's MemAvailable
   is printed before and after, and phase 2 refuses to start without room for its table).
2. engramd: the same bytes in /dev/shm, a `--backend cuda` daemon that re-attaches them
   (common/daemon.py), a mapped and a served EngramClient (lookups mapped, served); then the
   plugin, loaded as vLLM loads it (bench_plugin.py), and vLLM's Engram layers built again once
   per plugin setting, in this process (bench_plugin.py says why that is sound, and not a child
   process per setting): model steps plugin_mapped and plugin_mapped_at_lookup (--plugin-modes
   mapped, one per --plugin-gather-at: ENGRAMD_GATHER_AT), plugin_served, and plugin_captured
   with its floor compute_graph (--plugin-modes captured: mapped with ENGRAMD_CAPTURE=on), last.
With --paired (where both copies fit: 16 GiB), phase 1's layers stay, bound to vLLM's own
methods, and vLLM's step is timed next to each cell of each plugin variant on the same IDs, and
alone in phase 2 before the first client opens and after the last closes (Run.bracket).
The variants: bench_variants.py. IDs (--ids uniform | text): bench_ids.py. Timing: common/timing.time_cell.

What plugin_captured captures, and what it is held against: the whole step (every layer's
prepare_embeddings, the last layer's forking the gather to the plugin's side stream, where
it reads the hashes in place; the LEAD matmuls;
each layer's forward, the first joining the gather) is recorded once per (T, lead) in a
torch.cuda.CUDAGraph (capture_error_mode="thread_local") and replayed at each step, after the
step's hash IDs are copied into the persistent buffer the graph reads, as an engine writes its
graph's inputs.
vllm_graph records vLLM's own step the same way in phase 1, as vLLM's full graphs do: outside a
breakable capture its eager breaks run in line, so its prefetch (on its prefetch stream,
background=True) and the wait for it are in the graph.
plugin_captured is held against both, vllm_graph and `vllm` (vLLM's eager step). With --paired
its partner is vllm_graph recorded again in phase 2 over the kept layers: a graph held against a
graph, cell by cell, so that the machine's drift between the phases stays out of that ratio too.
compute_graph, the same graph without the lookup (matmuls and forward), is the floor a
captured step could reach, and plugin_captured less compute_graph in host time is what the
captured lookup costs the host. In a dry run nothing is captured: the same step function runs
eagerly at every "replay" (bench_device.CpuDryRun.capture), labelled so.

Rows: one batch per T (bench_ids.check_ids, 5% DEAD). vLLM's foreground rows are the reference;
its background rows must equal them, and so must, before anything of phase 2 is timed, the rows
of each client and of the plugin's layers in each setting (plugin_captured's: the staged rows
after a replay of each (T, lead) graph with the check batch in its IDs buffer): bit for bit, NaN
equal to NaN (common/rows.py). What differs is not timed (the clients' rows differing, nothing
of phase 2 is), and the script exits 1. After plugin_captured's cells, its captured lookup's
check() must pass (no replay wrote NaN rows); its counts go into the report. A plugin setting
that raises is printed and recorded (`failures`), the others keep their cells, and the script
exits 1.

--rounds N: each variant's grid of cells runs N times over (its repeats of a cell seconds apart,
fresh IDs each time); the JSON keeps every round, the markdown the median and spread.

What it is not: the equality test of vLLM's modules and the plugin's (tests/gpu/test_vllm_gpu.py
compares embed, forward and embed_tokens too); here rows are checked so that the timed paths are
known to read the same table.

Output: DIR/bench_lookup.json (command, date, machine; every run and cell) and DIR/bench_lookup.md
(printed last), bench_report.py. --mps on|both (benchmarks/mps.py): each MPS mode in a child
process, a private MPS server around the `on` one (the daemon and the child its clients); with
both, each child's files are in DIR/mps_off and DIR/mps_on, the merged ones in DIR.

Cost on an H200 at the defaults, for one MPS mode (the run of 2026-12-05, README.md; the script
prints each phase's seconds and the JSON keeps them): importing vLLM, its Engram module and the
plugin, 19 s; phase 1, 26 s (pinning and filling 16 GiB 17 s, the checks; its timing, 16 lookup
cells and 24 model-step cells of 55 steps, about 7 s a round); phase 2, 31 s with plugin_mapped
and plugin_served (filling /dev/shm 12 s, the daemon's start and pin 7 s, two clients' attach
and lookups 2-3 s, then each plugin setting a client's attach and 24 cells, about 5 s a round).
plugin_mapped_at_lookup costs what plugin_mapped does; plugin_captured with compute_graph about
twice that (24 graphs recorded, a few s, then 48 cells a round, the floor's cheaper). At the
defaults (with captured) about 90 s a mode, 180 s with --mps both; the README's next-run command
(--rounds 3, both gather_at) about 150 s a mode. The fills grow with --table-gib: at 64 GiB, one
MPS mode per command.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import time
import traceback
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What a dry run needs set before Triton (whose own @jit helpers are made when it is imported),
# vLLM and CUDA read it, as tests/vllm_plugin/worker.py sets it: so, before the imports below.
DRY_RUN_ENV = {"VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
if "--dry-run" in sys.argv[1:]:
    os.environ.update(DRY_RUN_ENV)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_device  # noqa: E402
import bench_plugin  # noqa: E402
import bench_report  # noqa: E402
import torch  # noqa: E402
from bench_ids import UniformIds, check_ids  # noqa: E402
from bench_tables import fill_vllm_tables  # noqa: E402
from bench_variants import (  # noqa: E402
    TIMED,
    EngramLayers,
    GraphStep,
    ModelStep,
    VllmForeground,
    init_projections,
)
from common import engine_bench  # noqa: E402
from common.cpu_use import CpuUse  # noqa: E402
from common.daemon import bench_folders, open_client, ready_pid, running_daemon  # noqa: E402
from common.rows import bitwise_mismatches  # noqa: E402
from common.steps import ClientLookup, Matmuls, wait_warm  # noqa: E402
from common.tables import INSTANCE, fill_daemon_tables, geometry_for, reattach_flags  # noqa: E402
from common.timing import MODES, time_cell  # noqa: E402
from mps import gpu_processes, require_mps_state  # noqa: E402
from torch import Tensor  # noqa: E402
from traces import TextIds  # noqa: E402

from engramd.client.geometry import TableGeometry  # noqa: E402

BENCHMARK = "vllm_gpu/bench_lookup"
# Defaults on the GPU and in a dry run (tiny: vLLM's kernels run under Triton's interpreter; every
# variant, so that every path runs).
DEFAULTS = {
    False: {"tokens": [1, 16, 256, 4096], "lead": [1, 4, 12], "steps": 50, "warm": 5,
            "matmul_n": 4096, "hidden": 4096, "hc_mult": 4, "trace_tokens": None,
            "plugin_gather_at": ["wait"]},
    True: {"tokens": [1, 16], "lead": [1, 2], "steps": 3, "warm": 1,
           "matmul_n": 64, "hidden": 64, "hc_mult": 2, "trace_tokens": 1 << 14,
           "plugin_gather_at": list(bench_plugin.GATHER_AT)},
}
CHECK_SEED = 7
BEFORE_CLIENTS, AFTER_CLIENTS = "phase 2, no client yet", "phase 2, clients closed"  # --paired
HOST_MARGIN_GIB = 4.0  # free host memory phase 2 wants beyond its table before it fills it


class Run:
    """One measurement in this process (one MPS mode): the phases and all they found."""

    def __init__(self, args: argparse.Namespace, device, geometry: TableGeometry, ids, mps: bool):
        self.args, self.device, self.geometry, self.ids, self.mps = args, device, geometry, ids, mps
        self.tokens = sorted(set(args.tokens))
        self.leads = sorted(set(args.lead))
        self.lookups: list[dict] = []
        self.steps: list[dict] = []
        self.cpu_use: list[dict] = []  # per variant's model steps: common/cpu_use.py
        self.daemon_pid: int | None = None  # while the engramd phase's daemon runs
        self.checks: list[dict] = []
        self.replays: list[dict] = []  # the captured lookups' check() after their cells
        self.failures: list[dict] = []  # plugin builds that raised (the others still timed)
        self.phases: dict[str, dict] = {}
        # --paired: vLLM's own step, its layers kept, timed next to each plugin variant's
        self.beside: ModelStep | None = None
        self.reference: dict[int, Tensor] = {}  # T -> vLLM's rows of the check batch (host)
        self.matmuls = Matmuls(args.matmul_n, device.device, args.seed)

    @property
    def exact(self) -> bool:
        """Every row check exact, every captured lookup's replays sound, no build failed."""
        return (all(check["mismatches"] == 0 for check in self.checks)
                and all(check["passed"] for check in self.replays) and not self.failures)

    # -- cells: --rounds times the whole grid of a variant, so that its repeats of a cell lie
    # apart in time (each round draws fresh pools)

    def round_label(self, number: int) -> str:
        rounds = self.args.rounds
        return f" [round {number + 1}/{rounds}]" if rounds > 1 else ""

    def time_lookups(self, variant) -> None:
        for number in range(self.args.rounds):
            for tokens in self.tokens:
                line = []
                for mode in MODES:
                    cell = self._time(variant, self._pool(tokens), mode)
                    self.lookups.append({"mps": self.mps, "variant": variant.name, "tokens": tokens,
                                         "mode": mode, "round": number, **cell})
                    line.append(f"{mode} gpu {cell['gpu_us']:.0f} host {cell['host_us']:.0f}")
                print(f"  {variant.name}{self.round_label(number)} T={tokens}: {', '.join(line)} us",
                      flush=True)

    def time_model_steps(self, model, profile: bool = True, paired: bool = False,
                         when: str | None = None, partner=None) -> None:
        """A ModelStep's or a GraphStep's cells: step time and the host's time per step; then,
        unless told not to, its --profile cells. `paired` (and --paired): vLLM's own step timed
        next to each cell of it, on the same IDs: `partner`, or its eager step (`beside`).
        `when`: kept with the cells (vLLM's own step timed again in phase 2, --paired's
        brackets)."""
        partner = partner if partner is not None else self.beside
        partners = [model, partner] if paired and partner is not None else [model]
        tags = {"when": when} if when else {}
        label = model.name + (" + vllm" if len(partners) > 1 else "") + (f" ({when})" if when else "")
        for number in range(self.args.rounds):
            with CpuUse({"daemon": self.daemon_pid}) as use:  # what else was busy meanwhile
                self._time_model_round(partners, number, tags)
            self.cpu_use.append({"variant": label, "round": number, **use.result()})
        if profile:
            engine_bench.profile_steps(self.args, self.device.clock, model, self.ids.pool,
                                       timed=TIMED)

    def _time_model_round(self, partners: list, number: int, tags: dict) -> None:
        """Every cell of partners[0] (with `tags`); with a partner (vLLM's own step, --paired),
        it too, on the same pool, who goes first as pair_order() says. The partner's cells are
        kept with `beside`: the variant they were timed next to."""
        model = partners[0]
        note = f" ({model.note})" if getattr(model, "note", "") else ""
        beside = {} if len(partners) == 1 else {"beside": model.name}
        for cell_pair, (tokens, lead) in enumerate((t, lead) for t in self.tokens for lead in self.leads):
            line, ratios = [], []
            for mode_index, mode in enumerate(MODES):
                step_us = {}
                pool = self._pool(tokens)  # the same IDs for both of a pair
                for partner in pair_order(partners, number + cell_pair + mode_index):
                    cell = self._time(partner.step(lead), pool, mode)
                    self.steps.append({"mps": self.mps, "variant": partner.name,
                                       "tokens": tokens, "lead": lead, "mode": mode,
                                       "round": number, **cell,
                                       **(tags if partner is model else beside)})
                    step_us[partner is model] = cell["step_us"]
                    if partner is model:
                        line.append(f"{mode} {cell['step_us']:.0f} (host {cell['host_us']:.0f})")
                if beside:
                    ratios.append(f"{mode} {step_us[True] / step_us[False]:.2f}x")
            when = f" ({tags['when']})" if tags else ""
            paired = f"; beside vLLM's: {', '.join(ratios)}" if ratios else ""
            print(f"  {model.name}{note}{when}{self.round_label(number)} T={tokens} lead={lead}: "
                  f"{', '.join(line)} us/step{paired}", flush=True)

    def _pool(self, tokens: int):
        """A fresh pool of IDs for one cell: its untimed and timed steps."""
        return self.ids.pool(tokens, self.args.warm + self.args.steps)

    def _time(self, step, pool, mode: str) -> dict[str, Any]:
        return time_cell(self.device.clock, step, pool, self.args.warm, mode == "synced")

    # -- rows

    def check_batch(self, tokens: int) -> Tensor:
        return check_ids(self.geometry, tokens, CHECK_SEED).to(self.device.device)

    def keep_reference(self, foreground: VllmForeground, background: EngramLayers) -> None:
        """vLLM's foreground rows of each check batch, kept on the host for phase 2; its
        background rows checked against them."""
        for tokens in self.tokens:
            ids = self.check_batch(tokens)
            # A copy: on the CPU, .cpu() would keep a view of the buffer the next lookup fills.
            self.reference[tokens] = foreground.rows(ids).to("cpu", copy=True)
            self.compare(background, tokens, ids)

    def compare(self, variant, tokens: int, ids: Tensor | None = None,
                lead: int | None = None) -> bool:
        """The variant's rows of the check batch against vLLM's; a graph variant's after a
        replay of its (T, lead) graph."""
        ids = self.check_batch(tokens) if ids is None else ids
        got = variant.rows(ids) if lead is None else variant.rows(ids, lead)
        wrong, first = bitwise_mismatches(got.cpu(), self.reference[tokens])
        where = {} if lead is None else {"lead": lead, "after": "a replay"}
        self.checks.append({"variant": variant.name, "tokens": tokens, **where,
                            "against": "vllm_fg", "mismatches": wrong,
                            **({"first": first} if wrong else {})})
        verdict = "exact" if wrong == 0 else f"{wrong} values DIFFER, first at {first}"
        graph = "" if lead is None else f" lead={lead}, after a replay"
        print(f"  rows {variant.name} T={tokens}{graph}: {verdict}", flush=True)
        return wrong == 0

    def compare_all(self, variant) -> bool:
        return all([self.compare(variant, tokens) for tokens in self.tokens])

    # -- phase 1

    def vllm_phase(self, engram, hf, layout) -> None:
        """vLLM's own lookup; its layers, and with them its pinned tables, go when it returns."""
        started = time.monotonic()
        phase = self.phases["vllm"] = {"host_available_gib_before": host_available_gib()}
        layers = self.device.build_layers(engram, hf, layout)
        phase["build_s"] = round(time.monotonic() - started, 1)
        phase["fill_s"] = round(fill_vllm_tables(layers, self.geometry, self.args.seed), 1)
        print(f"[vllm] built in {phase['build_s']} s, filled in {phase['fill_s']} s", flush=True)
        self.device.check_offloaded(layers)
        init_projections(layers, self.args.seed)
        foreground = VllmForeground(layers, max(self.tokens))
        background = EngramLayers("vllm_bg", layers)
        self.keep_reference(foreground, background)
        if "lookup" in self.args.parts:
            self.time_lookups(foreground)
            self.time_lookups(background)
        if "step" in self.args.parts:
            model = ModelStep("vllm", layers, self.matmuls, self.args.seed)
            self.time_model_steps(model)
            self.vllm_graph_steps(model)
            if self.args.paired:
                keep_own_methods(layers, engram.Engram)
                self.beside = model
        phase["seconds"] = round(time.monotonic() - started, 1)

    def vllm_graph_steps(self, model: ModelStep) -> None:
        """vllm_graph: vLLM's own step recorded whole, as its full CUDA graphs record it (outside
        a breakable capture its eager breaks run in line, so its prefetch stream's fork and join
        are in the graph), its rows checked (checked_vllm_graph), then timed. A capture that
        fails is recorded (`failures`) and the run goes on."""
        graph = self.checked_vllm_graph(model, "vllm_graph")
        if graph is None:
            return
        try:  # with its --profile cells, the plugin's captured step's to be held against
            self.time_model_steps(graph)
        except Exception as exc:  # vLLM's other cells stay
            self.failed("vllm", graph.name, exc)
        finally:
            graph.close()

    def checked_vllm_graph(self, model: ModelStep, label: str) -> GraphStep | None:
        """vLLM's step over `model`'s layers as a GraphStep named vllm_graph (its graphs, and
        their DOT files, `label`), each (T, lead) graph recorded and its rows checked after a
        replay; None, the graphs closed, if a row differs (the check records it) or a capture
        fails (recorded in `failures`)."""
        graph = GraphStep("vllm_graph", model, self.device.capture, max(self.tokens), True,
                          self.device.graph_note, label=label)
        try:
            if all([self.compare(graph, tokens, lead=lead)
                    for tokens in self.tokens for lead in self.leads]):
                return graph
        except Exception as exc:  # the run's other cells stay
            self.failed("vllm", label, exc)
        graph.close()
        return None

    def failed(self, phase: str, variant: str, exc: Exception) -> None:
        """A variant that raised: printed and recorded (`failures`), and the run exits 1."""
        traceback.print_exc()
        self.failures.append({"variant": variant, "error": repr(exc)})
        print(f"[{phase}] {variant} FAILED: {exc!r}", flush=True)

    def free_vllm(self) -> None:
        phase = self.phases["vllm"]
        if self.beside is not None:
            phase["kept"] = "--paired: vLLM's layers and pinned tables kept through phase 2"
            print(f"[vllm] done in {phase['seconds']} s; its layers kept (--paired)", flush=True)
            return
        phase["pinned_after_free"] = self.device.release_host_memory()
        phase["host_available_gib_after_free"] = host_available_gib()
        print(f"[vllm] done in {phase['seconds']} s; host memory available: "
              f"{phase['host_available_gib_before']} GiB before, "
              f"{phase['host_available_gib_after_free']} GiB after freeing", flush=True)

    # -- phase 2

    def engramd_phase(self, work: Path, shm: Path, engram, hf, layout) -> None:
        started = time.monotonic()
        phase = self.phases["engramd"] = {}
        require_host_memory(self.geometry)
        phase["fill_s"] = round(fill_daemon_tables(self.geometry, work / "ckpt", shm,
                                                   self.args.seed), 1)
        print(f"[engramd] filled /dev/shm in {phase['fill_s']} s", flush=True)
        begun = time.monotonic()
        with running_daemon(work, self.daemon_flags(work, shm), timeout=600) as sock:
            self.daemon_pid = ready_pid(sock)
            phase["daemon_start_s"] = round(time.monotonic() - begun, 1)
            print(f"[engramd] daemon ready in {phase['daemon_start_s']} s", flush=True)
            self.bracket(BEFORE_CLIENTS)
            exact = self.client_lookups(sock, phase)
            if not exact:
                print("[engramd] rows differ from vLLM's: nothing of engramd is timed", flush=True)
            elif "step" in self.args.parts:
                self.plugin_steps(sock, engram, hf, layout, phase)
                self.bracket(AFTER_CLIENTS)
        phase["seconds"] = round(time.monotonic() - started, 1)
        print(f"[engramd] done in {phase['seconds']} s", flush=True)

    def bracket(self, when: str) -> None:
        """--paired: vLLM's own step alone in phase 2, before the first engramd client opens
        and after the last closes. Beside those, vLLM's cells timed next to each plugin variant
        say whether an open client (its threads, its cache keeper's kernels) slows every step of
        the process, which the paired ratios cannot: both sides of a pair run with it."""
        if self.beside is not None:
            self.time_model_steps(self.beside, profile=False, when=when)

    def daemon_flags(self, work: Path, shm: Path) -> list[str]:
        extra = shlex.split(self.args.daemon_args)
        if isinstance(self.ids, TextIds):
            extra = ["--hot-cache-warm-file", str(work / "warm.npy"), *extra]
        return [*reattach_flags(work / "ckpt", shm, INSTANCE), "--backend", self.device.backend,
                "--max-tokens", str(max(self.tokens)),
                "--metrics-address", "127.0.0.1:0",  # no port that another run could hold
                *extra]  # last: the caller's flags win

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
            phase["gpu_processes"] = gpu_processes()  # the daemon and this process hold the GPU
            exact = all([self.compare_all(variant) for variant in variants])
            if exact and "lookup" in self.args.parts:
                for variant in variants:
                    self.time_lookups(variant)
            return exact
        finally:
            for variant in variants:
                variant.client.close()

    def plugin_steps(self, sock: Path, engram, hf, layout, phase: dict) -> None:
        """vLLM's Engram layers built with the plugin loaded, once per setting (bench_plugin.py:
        mode, gather_at, capture; in this process, and why): rows, model step. A setting that
        raises is recorded and printed, and the run exits 1; the others keep their cells."""
        settings = bench_plugin.settings(self.args.plugin_modes, self.args.plugin_gather_at)
        vllm_engram = bench_plugin.load_plugin(engram, sock, settings[0])
        try:
            for setting in settings:
                bench_plugin.use(vllm_engram, setting)
                try:
                    self.plugin_setting(vllm_engram, setting, engram, hf, layout, phase)
                except Exception as exc:  # the other settings keep their cells
                    self.failed("engramd", setting.name, exc)
        finally:
            bench_plugin.use(vllm_engram, None)

    def plugin_setting(self, vllm_engram, setting, engram, hf, layout, phase: dict) -> None:
        """One setting's layers: built, checked to be what it asked for, rows, cells."""
        begun = time.monotonic()
        layers = self.device.build_layers(engram, hf, layout)
        rows = bench_plugin.check_built(vllm_engram, setting)
        wait_warm(rows.client)
        phase[f"{setting.name}_build_s"] = round(time.monotonic() - begun, 1)
        init_projections(layers, self.args.seed)
        model = ModelStep(setting.name, layers, self.matmuls, self.args.seed)
        if rows.captured is not None:
            if self.args.side_priority == "greatest":
                greatest_priority_side(rows)
            rows.split_layers = self.args.captured_launches == "layer"
            self.graph_steps(model, rows.captured)
        elif self.compare_all(EngramLayers(setting.name, layers)):
            self.time_model_steps(model, paired=True)
        # The client's hot-row cache over the setting's cells: its refreshes' wall and CPU time
        # say whether the keeper's waits spin (the CPU table gives its thread's share).
        phase.setdefault("hot_cache", {})[setting.name] = rows.client.hot_cache_stats()
        # The layers (and graphs) go on return, before the next setting closes the client
        # whose memory their rows view.

    def graph_steps(self, model: ModelStep, captured) -> None:
        """plugin_captured and its floor, compute_graph (bench_variants.GraphStep): every
        (T, lead) graph recorded and plugin_captured's rows checked after a replay of each, then,
        if all are exact, both timed; then the captured lookup's check() (no NaN replays)."""
        device, most = self.device, max(self.tokens)
        graphs = [GraphStep("plugin_captured", model, device.capture, most, True, device.graph_note),
                  GraphStep("compute_graph", model, device.capture, most, False, device.graph_note)]
        partner = self.partner_graph()
        try:
            exact = True
            for tokens in self.tokens:
                for lead in self.leads:
                    exact = self.compare(graphs[0], tokens, lead=lead) and exact
                    # The floor recorded now, after a lookup of T tokens: the plugin's
                    # _ready_rows refuses more tokens than the last lookup had.
                    graphs[1].recorded(tokens, lead)
            if exact:
                for graph in graphs:  # the floor alone: it has no lookup to hold against vLLM's
                    self.time_model_steps(graph, profile=False, paired=graph.lookup, partner=partner)
                # The floor's first: in a dry run its steps run eagerly, and refuse more tokens
                # than the captured lookup's last (its last timed cell's, the grid's most).
                for graph in reversed(graphs):
                    engine_bench.profile_steps(self.args, self.device.clock, graph, self.ids.pool,
                                               timed=TIMED)
            self.check_replays(captured)
        finally:
            for graph in graphs if partner is None else [*graphs, partner]:
                graph.close()

    def partner_graph(self) -> GraphStep | None:
        """--paired: vLLM's own graph recorded again over the kept layers, as plugin_captured's
        partner (checked_vllm_graph). None without --paired, or where it fails: plugin_captured
        is then timed alone."""
        return None if self.beside is None else self.checked_vllm_graph(self.beside, "vllm_graph_beside")

    def check_replays(self, captured) -> None:
        """CapturedLookup.check() once the device is done: it raises if replays wrote NaN rows.
        Its counts are those of the last finished copy of the descriptor's words, so a copy is
        queued (counts()) after the last replay and waited for before they are read."""
        self.device.clock.sync()
        captured.counts()
        self.device.clock.sync()
        entry: dict[str, Any] = {"variant": "plugin_captured", "passed": True}
        try:
            captured.check()
        except Exception as exc:  # ReplayFailedError: recorded, and the run fails
            entry.update(passed=False, error=repr(exc))
        entry["counts"] = captured.counts()
        self.replays.append(entry)
        print(f"  replays plugin_captured: {entry['counts']}, check() "
              f"{'passed' if entry['passed'] else 'FAILED: ' + entry['error']}", flush=True)


def pair_order(partners: list, turn: int) -> list:
    """Who goes first in a pair: alternating with `turn` (round + (T, lead) cell + mode), so
    that over two rounds each cell has each side first once, and within a round each mode has
    each side first in every other cell."""
    return partners if turn % 2 == 0 else partners[::-1]


def keep_own_methods(layers: list, engram_class) -> None:
    """vLLM's Engram methods bound to each of `layers`, so that they keep running vLLM's code
    after the plugin replaces the class's (vllm_engram.REPLACED): the plugin's replacements
    fall back to them for layers it did not build, but through a wrapper that vLLM alone
    does not have."""
    from engramd.client.engines.vllm_engram import REPLACED

    for layer in layers:
        for name in REPLACED:
            setattr(layer, name, types.MethodType(getattr(engram_class, name), layer))


def host_available_gib() -> float | None:
    """MemAvailable of /proc/meminfo, GiB (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def require_host_memory(geometry: TableGeometry, tables: int = 1) -> None:
    """Refuse to fill /dev/shm where the table would not fit beside what is in use; `tables`
    2: before phase 1 of --paired, room for vLLM's pinned copy and the daemon's at once."""
    available = host_available_gib()
    need = tables * geometry.total_bytes / 2**30 + HOST_MARGIN_GIB
    if available is not None and available < need:
        if tables > 1:
            raise SystemExit(f"{available} GiB of host memory available, --paired keeps vLLM's "
                             f"pinned tables and the daemon's at once: {need:.1f} GiB with "
                             f"{HOST_MARGIN_GIB} to spare (a smaller --table-gib, or no --paired)")
        raise SystemExit(f"{available} GiB of host memory available, the daemon's tables need "
                         f"{need:.1f} (the table + {HOST_MARGIN_GIB} GiB): were vLLM's pinned "
                         "tables freed?")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def make_ids(args: argparse.Namespace, geometry: TableGeometry, device, work: Path):
    if args.ids == "text":
        return TextIds(Path(args.traces), geometry, work / "warm.npy", device.device, torch.int32,
                       args.trace_tokens)
    return UniformIds(geometry, device.device, args.seed)


def model_config(args: argparse.Namespace, geometry: TableGeometry) -> types.SimpleNamespace:
    """The fields of the model's config that vLLM's Engram modules read: the table's geometry,
    and a hidden size and hyper-connection count of this benchmark's choosing."""
    return types.SimpleNamespace(**geometry.to_config(), hidden_size=args.hidden,
                                 hc_mult=args.hc_mult, rms_norm_eps=1e-6)


def measure(args: argparse.Namespace) -> dict:
    """Both phases in this process (one MPS mode); the run's report."""
    started = time.monotonic()
    device = bench_device.open_device(args.dry_run)  # first: it brings vLLM's tree in
    if args.graph_dot:
        device.dot_dir = Path(args.out) / "graphs"
    mps = require_mps_state(args.mps == "on")
    geometry = TableGeometry.named("demo") if args.dry_run else geometry_for(args.table_gib)
    if args.paired:
        require_host_memory(geometry, tables=2)
    hf = model_config(args, geometry)
    with bench_folders() as (work, shm), device.vllm_scope():
        from vllm.config import set_current_vllm_config
        from vllm.models.deepseek_v41.common import engram

        print(f"vLLM's Engram module imported ({time.monotonic() - started:.0f} s)", flush=True)
        config = device.vllm_config()
        config.scheduler_config.max_num_batched_tokens = max(args.tokens)  # the layers' staging
        place = types.SimpleNamespace(rank=0, world=1, port=free_port())
        with set_current_vllm_config(config), device.helpers.parallel_state(place):
            layout = engram.EngramLayout(hf)
            run = Run(args, device, geometry, make_ids(args, geometry, device, work), mps["mps"])
            run.vllm_phase(engram, hf, layout)
            run.free_vllm()
            run.engramd_phase(work, shm, engram, hf, layout)
    return {"meta": engine_bench.header(BENCHMARK), "runs": [describe(run, mps, started)],
            "lookups": run.lookups, "steps": run.steps}


def describe(run: Run, mps: dict, started: float) -> dict:
    import triton  # imported by now, after the dry run's settings
    import vllm

    args, geometry = run.args, run.geometry
    shape = "demo" if args.dry_run else f"v4.1-flash, buckets scaled to {args.table_gib} GiB"
    return {**mps, **run.device.describe(), "torch": torch.__version__,
            "triton": triton.__version__, "vllm": vllm.__version__, "dry_run": args.dry_run,
            "geometry": shape,
            "table_gib": round(geometry.total_bytes / 2**30, 3), "rows": list(geometry.rows),
            "seed": args.seed, "ids": run.ids.name, "trace_tokens": run.ids.tokens,
            "steps": args.steps, "warm": args.warm, "parts": args.parts,
            "model": {"hidden": args.hidden, "hc_mult": args.hc_mult,
                      "matmul": f"bf16 [{args.matmul_n} x {args.matmul_n}] squared, torch.mm"},
            "rounds": args.rounds, "plugin_modes": args.plugin_modes,
            "plugin_gather_at": args.plugin_gather_at, "captured_launches": args.captured_launches,
            "side_priority": args.side_priority, "graphs": run.device.graphs,
            "daemon_args": args.daemon_args, "phases": run.phases,
            "seconds": round(time.monotonic() - started, 1), "rows_exact": run.exact,
            "checks": run.checks, "replays": run.replays, "failures": run.failures,
            "cpu_use": run.cpu_use}


def greatest_priority_side(rows) -> None:
    """--side-priority greatest: the stream the plugin forks its captured gather to (ProcessRows
    `_side`) swapped, before any graph records the fork, for a new stream of the device's
    greatest priority (torch's own streams take at most a few of the device's levels, and come
    from a pool the model's streams share). A graph records each kernel's priority, and torch
    instantiates graphs to honour it, so the gather's blocks then go before the model's pending
    ones. The stream lives as long as the process. (A CPU dry run has no side.)"""
    if rows._side is None:
        return
    from engramd.client.shared.cuda import check, cudart

    device = rows.client.device
    with torch.cuda.device(device):
        _, greatest = check("cudaDeviceGetStreamPriorityRange", cudart.cudaDeviceGetStreamPriorityRange())
        raw = check("cudaStreamCreateWithPriority",
                    cudart.cudaStreamCreateWithPriority(cudart.cudaStreamNonBlocking, greatest))
    rows._side = torch.cuda.ExternalStream(int(raw), device=device), rows._side[1]
    print(f"  plugin_captured: the gather's stream at priority {greatest}", flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_bench.add_arguments(parser, "vLLM", table_gib=16.0)
    parser.add_argument("--plugin-modes", nargs="+", choices=bench_plugin.PLUGIN_MODES,
                        default=list(bench_plugin.PLUGIN_MODES),
                        help="the plugin's ENGRAMD_MODE, in turn; captured: mapped with "
                             "ENGRAMD_CAPTURE=on, its step in a CUDA graph (and the floor)")
    parser.add_argument("--plugin-gather-at", nargs="+", choices=bench_plugin.GATHER_AT,
                        help="the mapped plugin's ENGRAMD_GATHER_AT, a variant each: wait "
                             "(plugin_mapped), lookup (plugin_mapped_at_lookup); default wait "
                             "(a dry run: both)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each variant's grid of cells runs; the report gives the "
                             "median and the spread")
    parser.add_argument("--paired", action="store_true",
                        help="keep vLLM's layers and pinned tables through phase 2 and time its "
                             "step next to each plugin variant's, cell by cell on the same IDs, "
                             "who goes first alternating, so that the machine's drift between "
                             "the phases stays out of the ratios (host memory for both tables)")
    parser.add_argument("--ids", choices=("uniform", "text"), default="uniform")
    parser.add_argument("--traces", default=".traces",
                        help="the trace folder of --ids text (benchmarks/traces.py build)")
    parser.add_argument("--trace-tokens", type=int, help="hash only the trace's first documents")
    parser.add_argument("--side-priority", choices=("normal", "greatest"), default="normal",
                        help="the stream of the plugin's captured gather: the plugin's own, or a "
                             "new one at the device's greatest priority (an experiment)")
    parser.add_argument("--captured-launches", choices=("layer", "step"), default="layer",
                        help="plugin_captured's forked gather: a launch per layer, each layer's "
                             "reader waiting for its own (the plugin's default), or one launch "
                             "for the step, which the first reader waits for whole")
    parser.add_argument("--graph-dot", action="store_true",
                        help="write each recorded graph's nodes and edges (cudaGraphDebugDotPrint, "
                             "verbose) to OUT/graphs/<variant>-T<T>-L<lead>.dot (vLLM's graph "
                             "beside plugin_captured: vllm_graph_beside)")
    args = engine_bench.finish_arguments(parser, parser.parse_args(argv), DEFAULTS)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.paired and "step" not in args.parts:
        parser.error("--paired pairs model steps: --parts must include step")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return engine_bench.main(Path(__file__).resolve(), parse_args(argv), measure, BENCHMARK,
                             bench_report.markdown)


if __name__ == "__main__":
    sys.exit(main())
