"""Hashing throughput on the GPU next to the lookup of the same batch, on real text (H200).

    python benchmarks/hashing_throughput.py [--traces .traces] [--out DIR] [--table-gib 16] [--smoke]

Does hashing ever dominate a lookup? For T in {1, 16, 256, 1024, 4096, 16384} tokens, batches of
real text from a trace folder (`python benchmarks/traces.py build`): B = max(1, T // 512)
requests per batch, T / B tokens each. Each request is a contiguous stream of the shuffled corpus
whose HashState is carried from its previous chunk, so the chunked path (look-back through the
carry) is the one timed, and every iteration hashes a fresh batch (the streams move on). Columns:

  hash     `EngramHasher.hash_batch(..., validate=False)`, Triton kernel; tokens/s from host p50.
  lookup   the in-process GatherPlan (gather + dequant to BF16) of exactly the rows that hash
           produced, from a pinned host table of --table-gib GiB of random bytes, geometry from
           common.tables.geometry_for so that IDs hashed with its primes fall in that table.
  uniform  the same gather of uniform random IDs (traces.uniform_batches): what reuse in text buys.
  ratio    hash p50 / lookup p50 (host, and GPU).

Host time: wall clock from the call to `stream.synchronize()` returning. GPU time: CUDA events
around the call, queued behind a 1 ms GPU sleep so that they bracket the kernels and not the
host's launch; those samples use batches of their own, after the host-timed ones. Before timing,
the Triton hash must equal the torch reference (rows and carry, torch.equal) on two consecutive
batches of every size, or the script stops. Writes hashing_throughput.json and .md to --out.

--smoke runs the same code on CPU in seconds (it restarts itself with TRITON_INTERPRET=1): the
torch hash is timed, the Triton hash checked in Triton's interpreter, the gather interpreted on a
10 MB CPU table, T in {1, 16, 64} with 16-token chunks. Its timings mean nothing.

Not here: hashing inside the daemon, or the model; the GPU machine needs no tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from engramd.client.geometry import TableGeometry
from engramd.client.hashing import EngramHasher
from engramd.kernels.gather_triton import GatherPlan

sys.path.insert(0, str(Path(__file__).parent))
from common.tables import geometry_for  # noqa: E402
from traces import TextTrace, default_traces_dir, uniform_batches  # noqa: E402

PAGE = 4096
FILL_CHUNK_BYTES = 1 << 30
SLEEP_CYCLES = 2_000_000  # ~1 ms at the H200's ~2 GHz: longer than any launch sequence here
RESULTS = "hashing_throughput"


@dataclass(frozen=True)
class Settings:
    tokens: tuple[int, ...]
    iterations: dict[int, int]  # timed samples per loop (host loop and GPU loop each)
    chunk_tokens: int  # B = max(1, T // chunk_tokens)
    warm: int
    hash_backend: str  # the path timed
    table_gib: float
    trace_tokens: int | None  # None: the whole corpus
    gather_kwargs: dict


FULL = Settings(
    tokens=(1, 16, 256, 1024, 4096, 16384),
    iterations={1: 300, 16: 300, 256: 200, 1024: 100, 4096: 60, 16384: 30},
    chunk_tokens=512, warm=3, hash_backend="triton", table_gib=16.0, trace_tokens=None,
    gather_kwargs={},
)
# The interpreter's cost is per block of rows, so the smoke gathers take big blocks.
SMOKE = Settings(
    tokens=(1, 16, 64), iterations={1: 4, 16: 4, 64: 4}, chunk_tokens=16, warm=1,
    hash_backend="torch", table_gib=0.01, trace_tokens=1 << 14, gather_kwargs={"block_rows": 64},
)


class MismatchError(RuntimeError):
    """The Triton hash differs from the torch reference; nothing is timed."""


# ----------------------------------------------------------------------------------------------
# Inputs: request streams of real text


def chunk_lengths(tokens: int, requests: int) -> list[int]:
    return [tokens // requests + (b < tokens % requests) for b in range(requests)]


def token_batches(token_ids: torch.Tensor, lengths: list[int], count: int) -> list[torch.Tensor]:
    """`count` batches [sum(lengths)] of raw IDs: request b is the b-th contiguous stream of the
    trace, and batch i holds its chunk i (lengths[b] tokens), so each carry stays in order."""
    requests = len(lengths)
    stream = token_ids.shape[0] // requests
    if count * max(lengths) > stream:
        raise SystemExit(f"the trace's {token_ids.shape[0]:,} tokens make {requests} streams of "
                         f"{stream:,}, too short for {count} chunks of {max(lengths)}; "
                         "use a larger corpus or fewer iterations")
    streams = token_ids[:stream * requests].view(requests, stream)
    return [torch.cat([streams[b, i * n:(i + 1) * n] for b, n in enumerate(lengths)])
            for i in range(count)]


def cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------------
# Host table


class AlignedHostTable:
    """One layer's uint8 [rows, row_bytes] table in a page-aligned slice of a CPU tensor; it has
    the attributes PinnedTables registers (address, nbytes, rows, row_bytes)."""

    def __init__(self, rows: int, row_bytes: int):
        nbytes = rows * row_bytes
        self._storage = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
        start = -self._storage.data_ptr() % PAGE
        self.tensor = self._storage[start:start + nbytes].view(rows, row_bytes)
        self.address = self.tensor.data_ptr()
        self.rows, self.row_bytes = rows, row_bytes
        self.nbytes = -(-nbytes // PAGE) * PAGE  # registered in whole pages, inside _storage


class HostTables:
    """Random-byte tables for every layer; on CUDA registered (pinned, mapped) for UVA reads.

    The bytes are drawn on the device in 1 GiB chunks and copied down, which is far faster than
    a CPU generator for tens of GiB. close() unregisters; the memory goes with the object.
    """

    def __init__(self, geometry: TableGeometry, device: torch.device, seed: int = 0):
        self.tables = [AlignedHostTable(rows, geometry.row_bytes) for rows in geometry.rows]
        self._pinned = None
        try:
            if device.type == "cuda":
                from engramd.server.cuda_backend import PinnedTables

                self._pinned = PinnedTables(self.tables)
            self._fill(device, seed)
        except BaseException:
            self.close()
            raise

    def _fill(self, device: torch.device, seed: int) -> None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        for table in self.tables:
            step = max(1, FILL_CHUNK_BYTES // table.row_bytes)
            for start in range(0, table.rows, step):
                part = table.tensor[start:start + step]
                part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device=device,
                                         generator=generator))

    def layer_tables(self) -> list:
        """What GatherPlan takes: registered addresses on CUDA, CPU tensors for the interpreter."""
        if self._pinned is not None:
            return self._pinned.layer_tables()
        return [table.tensor for table in self.tables]

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None

    def __enter__(self) -> HostTables:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Host wall time from a call to its stream's sync; GPU time from events (CUDA only)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.late = 0  # GPU samples whose sleep ended before the work was queued
        if self.cuda:
            self.stream = torch.cuda.current_stream(device)
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        if self.cuda:
            self.stream.synchronize()

    def host(self, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.sync()
        return time.perf_counter() - start, result

    def device(self, fn, *args):
        """(seconds on the GPU, result); (None, result) on CPU."""
        if not self.cuda:
            return None, fn(*args)
        torch.cuda._sleep(SLEEP_CYCLES)  # the GPU is busy while the host queues the events and fn
        self.begin.record(self.stream)
        result = fn(*args)
        self.end.record(self.stream)
        if self.begin.query():
            self.late += 1  # the sleep was over already, so launch time leaked into the sample
        self.stream.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3, result


def percentiles(seconds: list[float | None]) -> tuple[float | None, float | None]:
    if not seconds or seconds[0] is None:
        return None, None
    us = np.array(seconds) * 1e6
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


@dataclass
class Samples:
    host: list[float]
    gpu: list[float | None]

    def summary(self, prefix: str, per_sample: int, unit: str) -> dict:
        host_p50, host_p99 = percentiles(self.host)
        gpu_p50, _ = percentiles(self.gpu)
        return {f"{prefix}_host_p50_us": host_p50, f"{prefix}_host_p99_us": host_p99,
                f"{prefix}_gpu_p50_us": gpu_p50,
                f"{prefix}_{unit}_per_s": per_sample / host_p50 * 1e6,
                f"{prefix}_gpu_{unit}_per_s": per_sample / gpu_p50 * 1e6 if gpu_p50 else None}


# ----------------------------------------------------------------------------------------------
# Check, then time


def verify_hashing(hasher: EngramHasher, batches: list[torch.Tensor], cu: torch.Tensor) -> None:
    """Triton == torch reference, rows and carry, over two consecutive chunks of every request;
    and every row inside its layer's table."""
    requests, device = cu.shape[0] - 1, cu.device
    tri = ref = hasher.new_state(requests, device)
    limits = torch.tensor(hasher.geometry.rows, device=device).view(1, -1, 1)
    for i, ids in enumerate(batches[:2]):
        rows_t, tri = hasher.hash_batch(ids, cu, state=tri, backend="triton")
        rows_r, ref = hasher.hash_batch(ids, cu, state=ref, backend="torch")
        for name, got, want in (("rows", rows_t, rows_r), ("carry ids", tri.ids, ref.ids),
                                ("carry dead flags", tri.dead, ref.dead)):
            if not torch.equal(got, want):
                where = (got != want).nonzero()[:4].tolist()
                raise MismatchError(f"T={ids.shape[0]} B={requests} batch {i}: Triton {name} "
                                    f"differ from the torch reference at {where}")
        if bool(((rows_r < 0) | (rows_r >= limits)).any()):
            raise MismatchError(f"T={ids.shape[0]} batch {i}: hashed rows outside the table")


def time_hashing(hasher: EngramHasher, batches: list[torch.Tensor], cu: torch.Tensor,
                 settings: Settings, clock: Clock, iters: int):
    """Hash every batch in order, one carry per request throughout: warm-up, then `iters`
    host-timed, then `iters` GPU-timed. Returns (samples, rows of every batch)."""
    state = hasher.new_state(cu.shape[0] - 1, cu.device)

    def call(ids: torch.Tensor) -> torch.Tensor:
        nonlocal state
        rows, state = hasher.hash_batch(ids, cu, state=state, validate=False,
                                        backend=settings.hash_backend)
        return rows

    rows = [call(ids) for ids in batches[:settings.warm]]
    clock.sync()
    samples = Samples([], [])
    for i, ids in enumerate(batches[settings.warm:]):
        timer, out = (clock.host, samples.host) if i < iters else (clock.device, samples.gpu)
        seconds, result = timer(call, ids)
        out.append(seconds)
        rows.append(result)
    return samples, rows


def time_lookup(plan: GatherPlan, rows: list[torch.Tensor], settings: Settings, clock: Clock,
                iters: int, gpu_loop: bool = True) -> Samples:
    """The same split as time_hashing: warm-up rows, host-timed rows, GPU-timed rows."""
    out = torch.empty(plan.output_shape(rows[0].shape[0]), dtype=torch.bfloat16,
                      device=plan.device)

    def call(ids: torch.Tensor) -> torch.Tensor:
        return plan(ids, out, **settings.gather_kwargs)

    for ids in rows[:settings.warm]:
        call(ids)
    clock.sync()
    samples = Samples([], [])
    for i, ids in enumerate(rows[settings.warm:]):
        if i < iters:
            samples.host.append(clock.host(call, ids)[0])
        elif gpu_loop:
            samples.gpu.append(clock.device(call, ids)[0])
    return samples


def run_size(trace: TextTrace, plan: GatherPlan, tokens: int, settings: Settings,
             clock: Clock) -> dict:
    geometry, device = trace.geometry, trace.device
    iters = settings.iterations[tokens]
    requests = max(1, tokens // settings.chunk_tokens)
    lengths = chunk_lengths(tokens, requests)
    cu = cu_seqlens(lengths, device)
    batches = token_batches(trace.token_ids, lengths, settings.warm + 2 * iters)
    verify_hashing(trace.hasher, batches, cu)
    hashed, rows = time_hashing(trace.hasher, batches, cu, settings, clock, iters)
    lookup = time_lookup(plan, rows, settings, clock, iters)
    uniform = uniform_batches(geometry, tokens, settings.warm + iters, device, seed=tokens)
    uniform_lookup = time_lookup(plan, uniform, settings, clock, iters, gpu_loop=False)
    n_rows = tokens * geometry.n_layers * geometry.heads
    result = {"tokens": tokens, "requests": requests, "chunk_tokens": lengths[0], "iters": iters,
              "rows": n_rows, **hashed.summary("hash", tokens, "tokens"),
              **lookup.summary("lookup", n_rows, "rows")}
    result["uniform_lookup_host_p50_us"], result["uniform_lookup_host_p99_us"] = \
        percentiles(uniform_lookup.host)
    result["uniform_lookup_rows_per_s"] = n_rows / result["uniform_lookup_host_p50_us"] * 1e6
    result["hash_over_lookup_host"] = result["hash_host_p50_us"] / result["lookup_host_p50_us"]
    result["hash_over_lookup_gpu"] = (result["hash_gpu_p50_us"] / result["lookup_gpu_p50_us"]
                                      if clock.cuda else None)
    result["batch_distinct_fraction"] = trace.stats(tokens).distinct_fraction_mean
    return result


# ----------------------------------------------------------------------------------------------
# Report


def _cell(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "" if value is None else f"{value * scale:,.{digits}f}"


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [
        f"# Hashing throughput vs lookup on {meta['device']} ({meta['date']})", "",
        f"Real text: {meta['trace_tokens']:,} tokens of {meta['trace_texts']} texts in "
        f"{meta['doc_tokens']}-token documents, shuffled (seed {meta['seed']}); B = max(1, T // "
        f"{meta['chunk_tokens']}) requests per batch with carried look-back; fresh batches every "
        f"iteration. Lookup: in-process Triton gather+dequant of the same hashed rows from a "
        f"{meta['table_gib']:.2f} GiB pinned host table; uniform: the same gather of uniform "
        f"random IDs. Host time from call to stream sync; GPU time from CUDA events. "
        f"Command: `{meta['command']}`.", "",
        "| T | B | hash p50 us | hash p99 us | hash GPU p50 us | M tokens/s | lookup p50 us "
        "| lookup GPU p50 us | M rows/s | uniform lookup p50 us | hash/lookup | distinct rows/batch |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['tokens']} | {r['requests']} | {_cell(r['hash_host_p50_us'], digits=1)} "
            f"| {_cell(r['hash_host_p99_us'], digits=1)} | {_cell(r['hash_gpu_p50_us'], digits=1)} "
            f"| {_cell(r['hash_tokens_per_s'], 1e-6, 2)} | {_cell(r['lookup_host_p50_us'])} "
            f"| {_cell(r['lookup_gpu_p50_us'])} | {_cell(r['lookup_rows_per_s'], 1e-6, 2)} "
            f"| {_cell(r['uniform_lookup_host_p50_us'])} "
            f"| {_cell(r['hash_over_lookup_host'], 100, 1)}% "
            f"| {_cell(r['batch_distinct_fraction'], 100, 1)}% |")
    whole = meta["trace_stats"]
    lines += ["", f"Whole trace: {whole['trace_lookups']:,} lookups of "
              f"{whole['trace_distinct_rows']:,} distinct (layer, row) pairs; the hottest "
              + ", ".join(f"{whole['rows_for_share'][s]:,} take {s}%" for s in ("50", "80", "90"))
              + f". GPU samples whose sleep ended before the work was queued: "
              f"{meta['gpu_time_late_samples']}.", ""]
    return "\n".join(lines)


def metadata(args: argparse.Namespace, settings: Settings, trace: TextTrace, device: torch.device,
             clock: Clock) -> dict:
    import triton

    command = "python benchmarks/hashing_throughput.py --traces TRACES --out DIR"
    command += " --smoke" if args.smoke else f" --table-gib {settings.table_gib:g}"
    g = trace.geometry
    whole = trace.stats(1).to_dict()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)",
        "torch": torch.__version__, "triton": triton.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d"), "command": command, "smoke": args.smoke,
        "hash_backend_timed": settings.hash_backend, "chunk_tokens": settings.chunk_tokens,
        "table_gib": g.total_bytes / 2**30, "rows": list(g.rows),
        "trace_tokens": len(trace), "trace_texts": len({d.name for d in trace.documents}),
        "documents": len(trace.documents), "doc_tokens": trace.doc_tokens, "seed": trace.seed,
        "trace_stats": {k: whole[k] for k in ("trace_lookups", "trace_distinct_rows",
                                               "rows_for_share")},
        "gpu_time_late_samples": clock.late, "gpu_sleep_cycles": SLEEP_CYCLES,
    }


# ----------------------------------------------------------------------------------------------


def restart_interpreted() -> None:
    """triton.jit picks the interpreter when a kernel is defined, i.e. at import: so a smoke run
    restarts itself with TRITON_INTERPRET=1 before anything is imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=str(default_traces_dir()),
                        help="folder written by `python benchmarks/traces.py build`")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--table-gib", type=float, default=FULL.table_gib)
    parser.add_argument("--seed", type=int, default=0, help="document shuffle")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the script")
    args = parser.parse_args()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        restart_interpreted()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; use --smoke to check the script on CPU")
    settings = SMOKE if args.smoke else replace(FULL, table_gib=args.table_gib)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    started = time.monotonic()
    geometry = geometry_for(settings.table_gib)
    trace = TextTrace.load(args.traces, geometry, device, seed=args.seed,
                           max_tokens=settings.trace_tokens)
    print(f"trace: {len(trace):,} tokens, {len(trace.documents)} documents hashed "
          f"({time.monotonic() - started:.1f} s)", flush=True)
    clock = Clock(device)
    results = []
    with HostTables(geometry, device) as tables:
        print(f"table: {geometry.total_bytes / 2**30:.2f} GiB filled "
              f"({time.monotonic() - started:.1f} s)", flush=True)
        plan = GatherPlan(tables.layer_tables(), geometry.shard(0, 1), device)
        plan.warm_up()
        for tokens in settings.tokens:
            results.append(run_size(trace, plan, tokens, settings, clock))
            print(json.dumps(results[-1]), f"({time.monotonic() - started:.1f} s)", flush=True)
        clock.sync()
        del plan
    meta = metadata(args, settings, trace, device, clock)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{RESULTS}.json").write_text(json.dumps({"meta": meta, "results": results},
                                                    indent=2) + "\n")
    report = markdown(meta, results)
    (out / f"{RESULTS}.md").write_text(report)
    print(report)
    print(f"total {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
