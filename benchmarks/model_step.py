"""Model step: what an Engram lookup adds to a forward step that hides it behind matmuls (H200).

    python benchmarks/model_step.py --out DIR                  # without MPS
    python benchmarks/model_step.py --mps both --out DIR       # without, then with MPS, merged
    python benchmarks/model_step.py --variants compute mapped  # only some variants
    python benchmarks/model_step.py --mps both --steps 80 --rounds 3 --out DIR  # cells 3x, median
    python benchmarks/model_step.py --ids text --traces .traces --out DIR  # real-text row IDs
    python benchmarks/model_step.py --replot DIR               # model_step.md/.png again from JSON

One "model step" stands for a forward pass that prefetches its rows:
  submit a lookup of T tokens (fresh random row IDs [T, 2, 24] int64 every step, drawn on the GPU
  before timing) -> LEAD bf16 [4096 x 4096] @ [4096 x 4096] matmuls (torch.mm into preallocated
  tensors) -> wait for the rows -> consume them (each layer's column sum is written into the next
  matmul's operand, so the rows are on the critical path) -> 4 more matmuls.
Variants:
  compute  the matmuls alone, no lookup: the floor
  inproc   GatherPlan (kernels/gather_triton.py) in this process on a side stream, over its own
           registration of the same shared-memory table, sorted reads from 1,024 tokens on (the
           daemon's default sort_min_tokens) and one program per SM: the best in-process path.
           The main stream waits on an event recorded after the gather.
  engramd  EngramClient(socket, device="cuda:0", max_tokens=max T, slots=2, mode="served")
           against one `engramd serve` process (benchmarks/common/daemon.py; its defaults, plus
           --daemon-args): the daemon gathers; lookup() -> matmuls -> future.wait(stream)
  mapped   the same with mode="mapped", against the same daemon: this process maps the daemon's
           table files read-only (descriptors over the handle socket), registers them with CUDA
           and runs the gather on the client's own side stream (client/shared/mapped.py); the same
           lookup() -> matmuls -> future.wait(stream) (an event wait), the gather queued in the
           wait (the client's default, gather_at="wait")
  inproc_late     inproc with the gather queued behind the step's first matmul (its stream still
                  waits only for the work before the step): the same work in another launch order
  inproc_at_wait  the same, queued behind all LEAD matmuls, where the step waits for the rows
  mapped_at_lookup  mapped with gather_at="lookup": the gather queued in lookup(), in front of
                  the matmuls (a client of its own, with its own hot-row cache)
--variants picks some of them (default: compute, inproc, engramd, mapped; the launch-order
variants only when named). The in-process plan is built in every run: the row check below needs
it.
Modes:
  pipelined  the host runs ahead; one torch.cuda.synchronize() after N steps; reported: total / N
  synced     synchronize after every step; reported: p50 of the per-step wall times
Grid: T in {1, 16, 256, 4096} x LEAD in {1, 4, 12} (--tokens, --lead), each cell after 3 untimed
steps of its own. The host table (--table-gib of V4.1-width rows, random bytes in /dev/shm, a
sparse checkpoint that the daemon re-attaches) is built by common/tables.py. Every kernel this
process launches behind a wait on the daemon is warmed up first (lazy loading would otherwise
block the host there: docs/architecture.md, "Cross-process waits and lazy module loading").

IDs (--ids): `uniform` (the default) draws fresh random rows every step as above. `text` takes
them from a real-text trace (benchmarks/traces.py, built where the tokenizer is; --traces names
its folder), hashed on the GPU for this table's geometry: its first half is the daemon's hot-row
cache warm file (--hot-cache-warm-file), as a deployment would warm it; the steps walk its second
half (documents the cache has not counted), every variant and round the next stretch of it (the
half, about a million tokens, starts again once read through: at 4,096 tokens every third or
fourth pool), so the reuse the IDs carry is the text's, and the daemon's cache, which only served
lookups have, meets the n-gram skew it was built for.

Rows: at every T, one batch of IDs (5% of them -1) goes through engramd (served), the mapped
client (each where its variant runs) and the in-process gather; each must equal gather_ref (plain
torch, on the CPU, over the same /dev/shm bytes) and the in-process rows bit for bit (a gather is
a copy; NaN counts as equal to NaN). The script exits 1 if any differs.

--mps on|both (benchmarks/mps.py): each mode runs in a fresh child process, a private MPS server
around the `on` one (the daemon and the benchmark process are both its clients); every cell and
run in the JSON says which. Writes DIR/model_step.json (all cells, us), DIR/model_step.md (printed
last, with engramd/inproc and mapped/inproc ratios) and DIR/model_step.png (step time vs T per
lead and mode; solid: no MPS, dashed: MPS); with both modes, each child's own files are in
DIR/mps_off and DIR/mps_on. About 1-2 minutes per MPS mode on an H200 at the defaults (filling the
table is 10-20 s of it, the mapped client's attach a few s).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engramd.client import EngramClient
from engramd.client.geometry import TableGeometry
from engramd.kernels import gather_ref
from engramd.kernels.gather_triton import GatherPlan

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, open_client, running_daemon  # noqa: E402
from common.ids import layer_rows  # noqa: E402
from common.report import machine  # noqa: E402
from common.rows import bitwise_mismatches, poisoned  # noqa: E402
from common.tables import (  # noqa: E402
    INSTANCE,
    MappedTable,
    fill_tables,
    geometry_for,
    pin_as_reader,
    reattach_flags,
)
from mps import (  # noqa: E402
    child_reports,
    gpu_processes,
    mps_argument,
    mps_modes,
    needs_children,
    require_mps_state,
    run_children,
)
from traces import TextIds  # noqa: E402

TOKENS = (1, 16, 256, 4096)
LEADS = (1, 4, 12)
TAIL = 4  # matmuls after the rows are consumed
CONSUMER = "a column sum per layer"  # Bench.consume; results before it summed all layers at once
MATMUL_N = 4096
VARIANTS = ("compute", "inproc", "inproc_late", "inproc_at_wait", "engramd", "mapped",
            "mapped_at_lookup")
# Variants a run takes unless --variants names others; the launch-order ones are asked for.
DEFAULT_VARIANTS = ("compute", "inproc", "engramd", "mapped")
# EngramClient variants (their rows are checked): variant -> the client's options
CLIENT_OPTIONS = {"engramd": {"mode": "served"}, "mapped": {"mode": "mapped"},
                  "mapped_at_lookup": {"mode": "mapped", "gather_at": "lookup"}}
CLIENT_VARIANTS = tuple(CLIENT_OPTIONS)
AUTO_VARIANT = {"served": "engramd", "mapped": "mapped"}  # the mode `auto` grants -> its variant
MODES = ("pipelined", "synced")
DEFAULT_STEPS = 40  # timed steps per cell (4 variants x 40 take about what 3 x 50 took)
WARM_STEPS = 3  # untimed steps before every cell (first use of its IDs' sizes, slots, events)
SORT_MIN_TOKENS = 1024  # the daemon's default sort_min_tokens
DEAD_FRACTION = 0.05  # of the check IDs: -1
WARM_CACHE_S = 120.0  # at most, for a mapped client's keeper to warm its cache from the trace
SPIN_UP_S = 1.0  # matmuls before the first cell, so clocks and cuBLAS heuristics have settled
JSON_NAME, MD_NAME, PNG_NAME = "model_step.json", "model_step.md", "model_step.png"
COLORS = {"compute": "tab:gray", "inproc": "tab:blue", "inproc_late": "tab:cyan",
          "inproc_at_wait": "tab:purple", "engramd": "tab:red", "mapped": "tab:green",
          "mapped_at_lookup": "tab:olive"}
LABELS = {"engramd": "engramd", "mapped": "mapped", "mapped_at_lookup": "mapped (gather at lookup)",
          "inproc": "in-process"}  # in the row check's line


class Bench:
    """The matmul operands, the in-process plan, the clients of the variants that run (served
    and mapped) and one step per variant."""

    def __init__(self, geometry: TableGeometry, specs: list[dict], socket: Path, max_tokens: int,
                 variants: Sequence[str] = DEFAULT_VARIANTS, mapped_sm_fraction: dict[int, float] | None = None):
        self.geometry = geometry
        self.mapped_sm_fraction = mapped_sm_fraction or {}  # lead -> the mapped lookups' share
        self.shard = geometry.shard(0, 1)
        self.main = torch.cuda.current_stream()
        self.side = torch.cuda.Stream()
        self.ready = torch.cuda.Event()
        self.started = torch.cuda.Event()  # the in-process variants: the step's start on the main stream
        self.a = torch.randn(MATMUL_N, MATMUL_N, device="cuda").bfloat16()
        self.b = torch.randn(MATMUL_N, MATMUL_N, device="cuda").bfloat16()
        self.c = torch.empty_like(self.a)
        # This process maps and registers the daemon's table files itself (as an engine with its
        # own tables would); pinned pages are shared, nothing is copied.
        self.mapped = [MappedTable(s["path"], s["data_offset"], s["rows"], s["row_bytes"])
                       for s in specs]
        self.pinned = pin_as_reader(self.mapped)
        self.plan = GatherPlan(self.pinned.layer_tables(), self.shard, torch.device("cuda", 0))
        self.plan.warm_up(dedupe=(False,))
        self.outs: dict[int, Tensor] = {}
        self.variants = [v for v in VARIANTS if v in variants]
        # The clients, one per client variant that runs: "engramd" (served: the daemon gathers
        # into its slab) and "mapped" (this process gathers from its mapping of the daemon's
        # tables); the default mode is "auto" now, so each is asked for explicitly.
        self.clients: dict[str, EngramClient] = {}
        self.attach_s: dict[str, float] = {}  # client construction, end to end
        try:
            for variant in CLIENT_VARIANTS:
                if variant in self.variants:
                    self._add_client(variant, socket, max_tokens)
        except BaseException:
            self.close()
            raise
        self.steps: dict[str, Callable[[Tensor, int], None]] = {
            "compute": self.step_compute, "inproc": self.step_inproc,
            "inproc_late": lambda ids, lead: self.step_inproc(ids, lead, 1),
            "inproc_at_wait": lambda ids, lead: self.step_inproc(ids, lead, lead),
            "engramd": self.step_engramd, "mapped": self.step_mapped,
            "mapped_at_lookup": lambda ids, lead: self.step_mapped(ids, lead, "mapped_at_lookup")}

    def _add_client(self, variant: str, socket: Path, max_tokens: int) -> None:
        client, attach_s = open_client(socket, "cuda:0", max_tokens, **CLIENT_OPTIONS[variant])
        self.attach_s[variant] = round(attach_s, 3)
        self.clients[variant] = client
        # A mapped client's keeper warms its cache after the attach: every variant's cells are
        # timed with its cache warm, as the daemon's is before it serves.
        deadline = time.monotonic() + WARM_CACHE_S
        while (client.hot_cache_stats() or {}).get("warming") and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        torch.cuda.synchronize()  # no gather may still read the pages we unregister
        for client in self.clients.values():
            client.close()  # a mapped one unregisters its own mapping of the tables
        self.clients = {}
        self.pinned.close()
        for table in self.mapped:
            table.close()

    # -- the step ----------------------------------------------------------------------------

    def matmuls(self, count: int) -> None:
        for _ in range(count):
            torch.mm(self.a, self.b, out=self.c)

    def consume(self, rows: Tensor) -> None:
        """Sum each Engram layer's rows over tokens and heads into a row of the next matmul's
        first operand. Per layer, as a model reads them (the output contract's [T, local_heads,
        head_dim] per layer, each contiguous): a slot's layers lie max_tokens apart
        (client/shared/slab.py), and one sum over all of them at once took 86 us instead of 26 at
        16 tokens (step_profile.py, medians), a cost of this benchmark's reader, not of the rows."""
        head_dim = rows.shape[-1]
        for layer in range(rows.shape[0]):
            torch.sum(rows[layer], dim=(0, 1), out=self.a[layer, :head_dim])

    def step_compute(self, ids: Tensor, lead: int) -> None:
        self.matmuls(lead + TAIL)

    def step_inproc(self, ids: Tensor, lead: int, queued: int = 0) -> None:
        """The in-process gather on the side stream, queued behind the step's first `queued`
        matmuls on the host (0: in front of them; 1: after the first; `lead`: where the step
        waits for the rows), its dependency taken at the step's start either way: the previous
        step's reader of the output buffer is done before this gather overwrites it (as
        engramd's slot reuse guarantees)."""
        self.started.record(self.main)
        self.matmuls(queued)
        self.side.wait_event(self.started)
        rows = self.plan(ids, self.out(ids.shape[0]), stream=self.side,
                         sort=ids.shape[0] >= SORT_MIN_TOKENS)
        self.ready.record(self.side)
        self.matmuls(lead - queued)
        self.main.wait_event(self.ready)
        self.consume(rows)
        self.matmuls(TAIL)

    def step_engramd(self, ids: Tensor, lead: int) -> None:
        future = self.clients["engramd"].lookup(ids, self.main)
        self.matmuls(lead)
        rows = future.wait(self.main)
        self.consume(rows)
        self.matmuls(TAIL)

    def step_mapped(self, ids: Tensor, lead: int, variant: str = "mapped") -> None:
        # The client gathers on its own side stream after the main stream's earlier work (the
        # previous step's readers of the slot included), queued in wait() (gather_at="wait") or
        # in lookup() ("lookup"); wait() is an event wait.
        future = self.clients[variant].lookup(ids, self.main,
                                              sm_fraction=self.mapped_sm_fraction.get(lead))
        self.matmuls(lead)
        rows = future.wait(self.main)
        self.consume(rows)
        self.matmuls(TAIL)

    def out(self, tokens: int) -> Tensor:
        if tokens not in self.outs:
            self.outs[tokens] = torch.empty(self.plan.output_shape(tokens), dtype=torch.bfloat16,
                                            device="cuda")
        return self.outs[tokens]

    # -- warming up and checking ---------------------------------------------------------------

    def spin_up(self) -> None:
        """About SPIN_UP_S of matmuls: cuBLAS picks its kernel, the clocks rise."""
        self.matmuls(3)
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.matmuls(20)
        torch.cuda.synchronize()
        per = (time.perf_counter() - start) / 20
        self.matmuls(max(1, int(SPIN_UP_S / per)))
        torch.cuda.synchronize()

    def warm_consumers(self, tokens: int) -> None:
        """Load the kernels launched behind a wait for T tokens while no stream waits on anyone.

        The sum's kernel variant depends on the reduction's size, so each T gets its own.
        """
        self.consume(self.out(tokens).zero_())
        self.matmuls(1)
        torch.cuda.synchronize()

    def check_rows(self, tokens: int) -> dict[str, Any]:
        """engramd (served), mapped, in-process and gather_ref rows of one ID batch, compared bit
        for bit (the clients of the variants that run)."""
        ids = layer_rows(self.geometry, tokens, 1)[0]
        ids.masked_fill_(torch.rand(ids.shape, device="cuda") < DEAD_FRACTION, -1)
        torch.cuda.synchronize()
        got: dict[str, Tensor] = {}
        for variant, client in self.clients.items():
            view = client.lookup(ids, self.main).wait(self.main)
            torch.cuda.synchronize()
            got[variant] = view.cpu()
            # The sum's kernel may differ for the slot's alignment: load it now, while nothing
            # waits.
            self.consume(view)
            torch.cuda.synchronize()
        local = self.plan(ids, poisoned(self.plan.output_shape(tokens), torch.device("cuda")),
                          sort=tokens >= SORT_MIN_TOKENS)
        torch.cuda.synchronize()
        local = local.cpu()
        reference = [torch.from_numpy(t.array) for t in self.mapped]
        want, _ = gather_ref.gather(reference, ids.cpu(), self.shard)
        # The names of the original three pairs are kept (older JSON has just those).
        pairs: dict[str, tuple[Tensor, Tensor]] = {}
        if "engramd" in got:
            pairs["engramd_vs_ref"] = (got["engramd"], want)
        pairs["inproc_vs_ref"] = (local, want)
        if "engramd" in got:
            pairs["engramd_vs_inproc"] = (got["engramd"], local)
        for variant in ("mapped", "mapped_at_lookup"):
            if variant in got:
                pairs[f"{variant}_vs_ref"] = (got[variant], want)
                pairs[f"{variant}_vs_inproc"] = (got[variant], local)
        result: dict[str, Any] = {"tokens": tokens, "sorted_inproc": tokens >= SORT_MIN_TOKENS}
        for name, (actual, expected) in pairs.items():
            wrong, first = bitwise_mismatches(actual, expected)
            result[name] = wrong
            if wrong:
                result[f"{name}_first"] = first
        result["exact"] = all(result[name] == 0 for name in pairs)
        counts = ", ".join(f"{name} {result[name]}" for name in pairs)
        print(f"T={tokens}: rows {'exact' if result['exact'] else 'DIFFER'} (mismatches: {counts})",
              flush=True)
        return result


# -- timing --------------------------------------------------------------------------------------


def time_pipelined(step: Callable[[Tensor, int], None], pool: list[Tensor], lead: int) -> dict:
    for ids in pool[:WARM_STEPS]:
        step(ids, lead)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for ids in pool[WARM_STEPS:]:
        step(ids, lead)
    torch.cuda.synchronize()
    steps = len(pool) - WARM_STEPS
    return {"step_us": (time.perf_counter() - start) / steps * 1e6, "steps": steps}


def time_synced(step: Callable[[Tensor, int], None], pool: list[Tensor], lead: int) -> dict:
    for ids in pool[:WARM_STEPS]:
        step(ids, lead)
    torch.cuda.synchronize()
    samples = []
    for ids in pool[WARM_STEPS:]:
        start = time.perf_counter()
        step(ids, lead)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    lat = np.array(samples) * 1e6
    return {"step_us": float(np.percentile(lat, 50)), "p90_us": float(np.percentile(lat, 90)),
            "mean_us": float(lat.mean()), "steps": len(lat)}


TIMERS = {"pipelined": time_pipelined, "synced": time_synced}


def rotated(items: Sequence[str], by: int) -> list[str]:
    """`items` with the first `by` (mod its length) moved to the end."""
    k = by % len(items)
    return [*items[k:], *items[:k]]


class UniformIds:
    """Fresh uniform row IDs for every pool (common/ids.layer_rows)."""

    name = "uniform"
    tokens = None  # no trace behind them

    def __init__(self, geometry: TableGeometry):
        self.geometry = geometry

    def pool(self, tokens: int, count: int) -> list[Tensor]:
        return layer_rows(self.geometry, tokens, count)


def run_grid(bench: Bench, ids: UniformIds | TextIds, tokens: Sequence[int], leads: Sequence[int],
             steps: int, mps: bool, rounds: int = 1) -> tuple[list[dict], list[dict]]:
    """Every (T, lead, mode, variant) cell, variants interleaved so that drift hits them alike:
    `rounds` times each, the variants' order rotated every round; a cell's step time is the
    median of its rounds. Every timed pool of IDs is new (`ids`)."""
    cells, checks = [], []
    bench.spin_up()
    for t in tokens:
        bench.warm_consumers(t)
        checks.append(bench.check_rows(t))
        for lead in leads:
            line = []
            for mode in MODES:
                timed: dict[str, list[dict]] = {v: [] for v in bench.variants}
                for r in range(rounds):
                    for variant in rotated(bench.variants, r):
                        pool = ids.pool(t, steps + WARM_STEPS)
                        torch.cuda.synchronize()
                        timed[variant].append(TIMERS[mode](bench.steps[variant], pool, lead))
                for variant, runs in timed.items():
                    cell = {**runs[0], "step_us": float(np.median([c["step_us"] for c in runs])),
                            "rounds_us": [round(c["step_us"], 1) for c in runs]}
                    cells.append({"mps": mps, "mode": mode, "variant": variant, "tokens": t,
                                  "lead": lead, **cell})
                    line.append(f"{mode[:4]} {variant} {cell['step_us']:.0f}")
            print(f"{'MPS' if mps else 'no MPS'} T={t} lead={lead}: " + ", ".join(line) + " us",
                  flush=True)
    return cells, checks


# -- one run (one MPS mode, this process) -----------------------------------------------------


def step_ids(args: argparse.Namespace, geometry: TableGeometry,
             work: Path) -> tuple[UniformIds | TextIds, str]:
    """The timed steps' row IDs (--ids) and the daemon's extra flags (--daemon-args): for real
    text, the trace's first half warms the daemon's hot-row cache (a warm file in `work`)."""
    if args.ids == "uniform":
        return UniformIds(geometry), args.daemon_args
    warm = work / "warm.npy"
    ids = TextIds(Path(args.traces), geometry, warm)
    return ids, f"--hot-cache-warm-file {shlex.quote(str(warm))} {args.daemon_args}"


def daemon_flags(work: Path, shm: Path, max_tokens: int, extra: str) -> list[str]:
    return [*reattach_flags(work / "ckpt", shm, INSTANCE),
            "--backend", "cuda", "--max-tokens", str(max_tokens),
            "--metrics-address", "127.0.0.1:0",  # no port that another run could hold
            *shlex.split(extra)]  # last: the caller's flags win


def measure(args: argparse.Namespace) -> dict:
    """Fill the table, start the daemon, run the grid; one run's report (see merge)."""
    started = time.monotonic()
    mps = require_mps_state(args.mps == "on")
    tokens, leads = sorted(set(args.tokens)), sorted(set(args.lead))
    geometry = geometry_for(args.table_gib)
    with bench_folders() as (work, shm):
        specs = fill_tables(geometry, work / "ckpt", shm, INSTANCE)
        ids, extra = step_ids(args, geometry, work)
        flags = daemon_flags(work, shm, max(tokens), extra)
        with running_daemon(work, flags, timeout=300) as socket:
            bench = Bench(geometry, specs, socket, max(tokens), args.variants,
                          args.mapped_sm_fraction)
            try:
                processes = gpu_processes()  # while the daemon and this process both hold the GPU
                # the daemon's verdicts on MPS, per client (absent: its variant did not run)
                served_mps = getattr(bench.clients.get("engramd"), "mps", None)
                mapped = bench.clients.get("mapped")
                mapped_meta = None if mapped is None else {
                    "mode": mapped.mode, "mps": mapped.mps, "attach_s": bench.attach_s["mapped"]}
                attach_s = dict(bench.attach_s)
                auto_mode = granted_auto_mode(socket, max(tokens))
                if args.profile:
                    from step_profile import profile_grid

                    profiled, checks = profile_grid(bench, ids, tokens, leads, args.steps,
                                                    Path(args.out), WARM_STEPS)
                    cells = []
                else:
                    cells, checks = run_grid(bench, ids, tokens, leads, args.steps, mps["mps"],
                                             args.rounds)
                if mapped_meta is not None:  # what each cache served: the client's own, the daemon's
                    mapped_meta["hot_cache"] = _hit_rate(mapped.hot_cache_stats())
                    daemon_caches = list(mapped.stats().get("hot_cache", {}).values())
                    mapped_meta["daemon_hot_cache"] = _hit_rate(daemon_caches[0] if daemon_caches else None)
            finally:
                bench.close()
    run = {**mps, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": _triton_version(), "table_gib": round(geometry.total_bytes / 2**30, 2),
           "rows": list(geometry.rows), "steps": args.steps, "rounds": args.rounds,
           "ids": ids.name, "trace_tokens": ids.tokens,
           "warm_steps": WARM_STEPS, "auto_mode": auto_mode,
           "matmul": f"bf16 [{MATMUL_N} x {MATMUL_N}] @ [{MATMUL_N} x {MATMUL_N}], torch.mm",
           "tail_matmuls": TAIL, "consumer": CONSUMER,
           "daemon_args": args.daemon_args, "gpu_processes": processes,
           "engramd_mps": served_mps, "variants": list(args.variants), "mapped": mapped_meta,
           "mapped_sm_fraction": args.mapped_sm_fraction,
           "client_attach_s": attach_s,
           "machine": machine(),
           "command": _command(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "seconds": round(time.monotonic() - started, 1),
           "rows_exact": all(c["exact"] for c in checks), "checks": checks}
    report = {"meta": _top_meta(), "runs": [run], "cells": cells}
    if args.profile:
        report["profiled"] = profiled
    return report


def granted_auto_mode(socket: Path, max_tokens: int) -> str:
    """The mode the daemon grants a client that asks for "auto" on this GPU (mapped, unless the
    daemon's client_modes forbid it)."""
    client = EngramClient(socket, device="cuda:0", max_tokens=max_tokens, slots=2, timeout=120,
                          mode="auto")
    try:
        return client.mode
    finally:
        client.close()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _command() -> str:
    return "python benchmarks/model_step.py " + shlex.join(sys.argv[1:])


def _top_meta() -> dict:
    return {"benchmark": "model_step", "command": _command(), "date": time.strftime("%Y-%m-%d")}


def merge(reports: list[dict]) -> dict:
    """One report of several runs (one per MPS mode): runs and cells concatenated."""
    return {"meta": _top_meta(), "runs": [r for rep in reports for r in rep["runs"]],
            "cells": [c for rep in reports for c in rep["cells"]]}


# -- report --------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    runs, cells = report["runs"], report["cells"]
    first = runs[0] if runs else {}
    lines = [f"# Model step on {first.get('gpu', '?')} ({report['meta']['date']})", "",
             f"Step = lookup of T tokens -> LEAD {first.get('matmul', 'bf16 matmuls')} -> wait for "
             f"the rows -> consume them ({first.get('consumer', 'one column sum of all layers')} into the "
             "next matmul's operand) -> "
             f"{first.get('tail_matmuls', TAIL)} more matmuls. Host table {first.get('table_gib')} "
             f"GiB, {_ids_note(first)}, {first.get('steps')} timed steps per cell after "
             f"{first.get('warm_steps')} untimed ones"
             + (f", each cell {first['rounds']} times with the variants' order rotated, the median "
                "of them reported" if first.get("rounds", 1) > 1 else "") + ". pipelined: one synchronize after all steps, "
             "time / steps; synced: synchronize after every step, p50. Times in us; compute = "
             "matmuls alone, inproc = GatherPlan on a side stream in this process (sorted from "
             f"{SORT_MIN_TOKENS} tokens), engramd = daemon process, this process its served client "
             "(the daemon gathers), mapped = this process a mapped client of the same daemon (it "
             "gathers on its own side stream from its read-only mapping of the daemon's tables). "
             f"Command: `{report['meta']['command']}`.", ""]
    for run in runs:
        lines.append(f"- MPS {'on' if run['mps'] else 'off'}: {run['mps_server']}; GPU processes "
                     f"seen: {run.get('gpu_processes')}; daemon args `{run['daemon_args']}`; "
                     f"rows {_rows_verdict(run)}; {_attach_note(run)}{run['seconds']} s")
    # The variants present in the cells (older JSON: compute, inproc, engramd), each mode's
    # ratios to inproc after its step times.
    variants = [v for v in VARIANTS if any(c["variant"] == v for c in cells)]
    ratios = [v for v in CLIENT_VARIANTS if v in variants and "inproc" in variants]
    # auto's pick against the faster client mode, where the runs say what auto was granted
    auto = {run["mps"]: AUTO_VARIANT[run["auto_mode"]] for run in runs if run.get("auto_mode")}
    with_auto = bool(auto) and all(v in variants for v in AUTO_VARIANT.values())
    header = ["MPS", "T", "lead"]
    for mode in MODES:
        header += [f"{mode} {v}" for v in variants] + [f"{v} / inproc" for v in ratios]
        header += ["auto / faster"] if with_auto else []
    lines += ["", "| " + " | ".join(header) + " |",
              "|---|---:|---:|" + "---:|" * (len(header) - 3)]
    by = {(c["mps"], c["mode"], c["variant"], c["tokens"], c["lead"]): c["step_us"] for c in cells}
    for mps, t, lead in sorted({(c["mps"], c["tokens"], c["lead"]) for c in cells}):
        row = [("on" if mps else "off"), str(t), str(lead)]
        for mode in MODES:
            values = {v: by.get((mps, mode, v, t, lead)) for v in variants}
            row += [_us(values[v]) for v in variants]
            row += [_ratio(values[v], values["inproc"]) for v in ratios]
            if with_auto:
                faster = min((values[v] for v in AUTO_VARIANT.values() if values[v]), default=None)
                row.append(_ratio(values.get(auto.get(mps, "")), faster))
        lines.append("| " + " | ".join(row) + " |")
    if with_auto:
        lines += ["", "auto / faster: the step time of the mode an `auto` client was granted "
                  f"({', '.join(f'MPS {_on(m)}: {LABELS[v]}' for m, v in sorted(auto.items()))}) "
                  "over the faster of engramd (served) and mapped in that cell."]
    return "\n".join(lines) + "\n"


def _ids_note(run: dict) -> str:
    if run.get("ids") == "text":
        return (f"row IDs of real text (a trace of {run['trace_tokens']:,} tokens: the first half "
                "is the daemon's hot-row cache warm file; each variant's steps read the next stretch "
                "of the second half, which starts again once read through)")
    return "fresh random IDs every step"


def _rows_verdict(run: dict) -> str:
    """"exact (engramd = in-process = gather_ref at every T)", naming what was compared."""
    if not run["rows_exact"]:
        return "MISMATCH: " + json.dumps([c for c in run["checks"] if not c["exact"]])
    checks = run.get("checks") or [{}]
    compared = [k.removesuffix("_vs_ref") for k in checks[0] if k.endswith("_vs_ref")]
    compared.sort(key=lambda name: list(LABELS).index(name) if name in LABELS else len(LABELS))
    names = " = ".join(LABELS.get(name, name) for name in compared) or "nothing"
    return f"exact ({names} = gather_ref at every T)"


def _hit_rate(stats: dict | None) -> float | None:
    """Hits over rows read, all layers, of a hot-row cache's stats (None: no cache)."""
    if not stats or not sum(stats["reads"]):
        return None
    return round(sum(stats["hits"]) / sum(stats["reads"]), 4)


def _attach_note(run: dict) -> str:
    mapped = run.get("mapped")
    if not mapped:
        return ""
    hints = "".join(f"mapped lookups at lead {lead} pass sm_fraction={fraction}; "
                    for lead, fraction in sorted((run.get("mapped_sm_fraction") or {}).items(),
                                                 key=lambda item: int(item[0])))  # JSON: str keys
    caches = ""
    if "hot_cache" in mapped:
        caches = (f"hot-row cache hit rate over the run: the mapped client's own "
                  f"{mapped['hot_cache']}, the daemon's {mapped['daemon_hot_cache']}; ")
    return (f"mapped client attached in {mapped['attach_s']:.2f} s (granted mode {mapped['mode']}); "
            + caches + hints)


def _on(mps: bool) -> str:
    return "on" if mps else "off"


def _us(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or not b else f"{a / b:.2f}"


def plot(json_path: Path, png_path: Path) -> None:
    """Step time vs T, one panel per (mode, lead); a line per variant, dashed under MPS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(json_path.read_text())
    cells = report["cells"]
    leads = sorted({c["lead"] for c in cells})
    modes = [m for m in MODES if any(c["mode"] == m for c in cells)]
    fig, axes = plt.subplots(len(modes), len(leads), figsize=(4.2 * len(leads), 3.6 * len(modes)),
                             squeeze=False)
    for row, mode in enumerate(modes):
        for col, lead in enumerate(leads):
            _panel(axes[row][col], cells, mode, lead)
    axes[0][0].legend(fontsize=7)
    gpu = report["runs"][0]["gpu"] if report["runs"] else "?"
    fig.suptitle(f"Model step: lookup -> LEAD matmuls -> wait -> consume -> {TAIL} matmuls ({gpu})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _panel(ax, cells: list[dict], mode: str, lead: int) -> None:
    tokens = sorted({c["tokens"] for c in cells})
    for variant in VARIANTS:
        for mps in (False, True):
            points = sorted((c["tokens"], c["step_us"]) for c in cells
                            if (c["mode"], c["variant"], c["lead"], c["mps"]) == (mode, variant, lead, mps))
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", color=COLORS[variant], linestyle="--" if mps else "-",
                        label=f"{variant}{', MPS' if mps else ''}")
    ax.set_xscale("log")
    ax.set_xticks(tokens)
    ax.set_xticklabels([str(t) for t in tokens])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens per lookup")
    ax.set_ylabel("step time, us" + (" (p50)" if mode == "synced" else " (total / steps)"))
    ax.set_title(f"{mode}, lead {lead}", fontsize=9)
    ax.grid(True, alpha=0.3)


def write_report(out: Path, report: dict) -> None:
    """JSON, markdown and plot into `out`; the markdown is printed last."""
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(report, indent=2) + "\n")
    render(out)


def render(out: Path) -> None:
    report = json.loads((out / JSON_NAME).read_text())
    text = markdown(report)
    (out / MD_NAME).write_text(text)
    try:
        plot(out / JSON_NAME, out / PNG_NAME)
    except ImportError as exc:  # the numbers stand without the picture; --replot makes it later
        print(f"no plot ({exc}); `python benchmarks/model_step.py --replot {out}` makes it",
              flush=True)
    print(text, flush=True)


# -- entry ---------------------------------------------------------------------------------------


def run_parent(args: argparse.Namespace) -> int:
    """--mps on/both: a child process per mode (mps.run_children), their reports merged."""
    out = Path(args.out)
    children = run_children(Path(__file__).resolve(), mps_modes(args), out)
    reports = []
    for child, report in child_reports(children, JSON_NAME):
        for run in report["runs"]:
            run["mps_log_tail"] = child.mps_log
        reports.append(report)
    if reports:
        write_report(out, merge(reports))
    ok = len(reports) == len(children) and all(c.returncode == 0 for c in children)
    return 0 if ok else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=16.0)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed steps per cell")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each cell runs, variants rotated; reported: the median")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--lead", type=int, nargs="+", default=list(LEADS),
                        help="matmuls between the lookup and the wait for its rows")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS),
                        help="the variants to time (default: all four); the rows of each "
                             "client variant that runs (engramd, mapped) are checked against "
                             "gather_ref and the in-process gather")
    parser.add_argument("--ids", choices=("uniform", "text"), default="uniform",
                        help="row IDs: uniform random, or a real-text trace's (see above)")
    parser.add_argument("--traces", default=".traces",
                        help="the trace folder of --ids text (benchmarks/traces.py build)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--daemon-args", default="",
                        help="extra `engramd serve` flags, one string split like a shell's "
                             "(write it with '=': --daemon-args='--hot-cache-gib 0')")
    parser.add_argument("--mapped-sm-fraction", nargs="+", default=[], metavar="LEAD=F",
                        help="at these leads the mapped variant's lookups pass sm_fraction=F "
                             "(an engine that knows how soon it reads its rows); elsewhere the "
                             "daemon's grid")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, profile synced steps of every cell "
                             "(benchmarks/step_profile.py); without MPS only")
    parser.add_argument("--replot", metavar="DIR",
                        help=f"only re-make {MD_NAME} and {PNG_NAME} from DIR/{JSON_NAME}")
    mps_argument(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or min(args.tokens) < 1 or min(args.lead) < 0:
        parser.error("--steps and --tokens must be >= 1, --lead >= 0")
    if args.profile and args.mps != "off":
        parser.error("--profile runs without MPS only (one process, no children)")
    args.variants = [v for v in VARIANTS if v in args.variants]  # the table's order, once each
    args.mapped_sm_fraction = _lead_fractions(parser, args.mapped_sm_fraction, args.lead)
    return args


def _lead_fractions(parser: argparse.ArgumentParser, pairs: Sequence[str],
                    leads: Sequence[int]) -> dict[int, float]:
    """--mapped-sm-fraction's LEAD=F pairs: each lead once, one of --lead, 0 < F <= 1."""
    fractions: dict[int, float] = {}
    for pair in pairs:
        lead, _, fraction = pair.partition("=")
        try:
            lead_n, share = int(lead), float(fraction)
        except ValueError:
            parser.error(f"--mapped-sm-fraction {pair!r}: write LEAD=F, e.g. 1=1.0")
        if not 0 < share <= 1:
            parser.error(f"--mapped-sm-fraction {pair!r}: F is a share of the SMs, 0 < F <= 1")
        if lead_n not in leads or lead_n in fractions:
            parser.error(f"--mapped-sm-fraction {pair!r}: each LEAD once, one of --lead {list(leads)}")
        fractions[lead_n] = share
    return fractions


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        render(Path(args.replot))
        return 0
    if needs_children(args):
        return run_parent(args)  # this process never touches CUDA: MPS starts around a child
    report = measure(args)
    if args.profile:
        import step_profile

        print(step_profile.write(Path(args.out), report["runs"][0], report["profiled"]), flush=True)
    else:
        write_report(Path(args.out), report)
    return 0 if all(run["rows_exact"] for run in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
