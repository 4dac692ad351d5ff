"""Host time of one lookup on a GPU: mapped and served clients against the in-process gather.

    python benchmarks/lookup_host.py [--tokens 1 16 256] [--calls 2000] [--out DIR]

One daemon (`--backend cuda`, the demo table: a gather's GPU time is a few us) and, in this
process, a mapped client, a served client and the in-process gather of model_step.py's
`inproc` variant (a GatherPlan on a side stream: wait_stream, the plan's call, an event, the
consumer's wait_event), here over the mapped client's own registration of the daemon's tables.
Each call (lookup + wait for the clients) is timed alone with perf_counter; every 16 calls the
stream is synchronised outside the timing, so the host never runs far ahead. In a synced model
step the lookup's part of it comes before the first matmul is queued (model_step.md). A served
client's time is not host time alone: its lookup() may wait for the slot's previous IDs to be
handed to the daemon (without MPS, behind the daemon's time-sliced gathers). Then the
mapped calls once more under cProfile, whose top entries by own time are printed.

Writes DIR/lookup_host.json and DIR/lookup_host.md.

    python benchmarks/lookup_host.py --compare DIR

Two trees' runs, taken in turn (gpu_session.sh's lookup-host-base: DIR/base_N and
DIR/current_N, N = 1, 2, ...): per cell, each round's p50 and the median of the rounds' ratios
current / base. One run of each, one after the other, is not a comparison: in two such runs
on an H200, minutes apart, the own time of calls neither tree changed (torch's event record,
Triton's kernel launch, under cProfile) differed by 37-45%.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramd.client import EngramClient
from engramd.kernels.gather_triton import GatherPlan

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, start_daemon, stop_process  # noqa: E402
from common.report import machine  # noqa: E402

SYNC_EVERY = 16
WARM_CALLS = 64


class InProcess:
    """model_step.py's inproc step minus the matmuls, over the mapped client's registration."""

    def __init__(self, client: EngramClient, sort_min_tokens: int):
        self.plan = GatherPlan(client.mapped_tables.layer_tables(), client.shard, client.device)
        self.plan.warm_up(dedupe=(False,))
        self.side = torch.cuda.Stream()
        self.ready = torch.cuda.Event()
        self.sort_min_tokens = sort_min_tokens
        self.outs: dict[int, torch.Tensor] = {}

    def __call__(self, ids: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tokens = ids.shape[0]
        out = self.outs.get(tokens)
        if out is None:
            out = self.outs[tokens] = torch.empty(self.plan.output_shape(tokens), dtype=torch.bfloat16,
                                                  device=ids.device)
        self.side.wait_stream(stream)
        self.plan(ids, out, stream=self.side, sort=tokens >= self.sort_min_tokens)
        self.ready.record(self.side)
        stream.wait_event(self.ready)


def timed_calls(call, ids: torch.Tensor, calls: int, stream: torch.cuda.Stream) -> np.ndarray:
    for _ in range(WARM_CALLS):
        call(ids, stream)
    stream.synchronize()
    times = np.empty(calls)
    for n in range(calls):
        started = time.perf_counter()
        call(ids, stream)
        times[n] = time.perf_counter() - started
        if n % SYNC_EVERY == SYNC_EVERY - 1:
            stream.synchronize()
    stream.synchronize()
    return times * 1e6


def profiled(call, ids: torch.Tensor, calls: int, stream: torch.cuda.Stream, top: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for n in range(calls):
        call(ids, stream)
        if n % SYNC_EVERY == SYNC_EVERY - 1:
            stream.synchronize()
    profile.disable()
    stream.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def client_call(client: EngramClient):
    def call(ids: torch.Tensor, stream: torch.cuda.Stream) -> None:
        client.lookup(ids, stream).wait(stream)
    return call


def measure(args: argparse.Namespace, work: Path, shm: Path) -> dict[str, Any]:
    daemon, socket = start_daemon(work, ["--backend", "cuda", "--shm-dir", str(shm),
                                         "--cache-dir", str(work)], timeout=180)
    rows: list[dict[str, Any]] = []
    try:
        max_tokens = max(args.tokens)
        mapped = EngramClient(socket, device="cuda", mode="mapped", max_tokens=max_tokens)
        served = EngramClient(socket, device="cuda", mode="served", max_tokens=max_tokens)
        try:
            sort_min = int(mapped._gather_policy.get("sort_min_tokens", 0)) or max_tokens + 1
            variants = {"inproc": InProcess(mapped, sort_min), "mapped": client_call(mapped),
                        "served": client_call(served)}
            stream = torch.cuda.current_stream()
            geometry = mapped.geometry
            for tokens in args.tokens:
                ids = torch.randint(0, min(geometry.rows), (tokens, geometry.n_layers, geometry.heads),
                                    device="cuda")
                for name, call in variants.items():
                    us = timed_calls(call, ids, args.calls, stream)
                    rows.append({"tokens": tokens, "variant": name, "p50_us": round(float(np.median(us)), 1),
                                 "p90_us": round(float(np.percentile(us, 90)), 1)})
                    print(rows[-1], flush=True)
            ids = torch.randint(0, min(geometry.rows), (1, geometry.n_layers, geometry.heads), device="cuda")
            profile = profiled(variants["mapped"], ids, args.calls, stream, args.top)
        finally:
            mapped.close()
            served.close()
    finally:
        stop_process(daemon, 60)
    return {"meta": {"benchmark": "lookup_host", "gpu": torch.cuda.get_device_name(),
                     "torch": torch.__version__, "calls": args.calls, "machine": machine(),
                     "command": "python benchmarks/lookup_host.py " + " ".join(sys.argv[1:]),
                     "date": time.strftime("%Y-%m-%d %H:%M")},
            "rows": rows, "mapped_profile_t1": profile}


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"# Lookup host time on {meta['gpu']} ({meta['date']})", "",
             f"Host time of one call, {meta['calls']} calls per cell (us; p50 / p90). inproc: the "
             "in-process gather of model_step.py; mapped, served: `lookup(ids, stream).wait(stream)` "
             f"of a client of each mode. Command: `{meta['command']}`.", "",
             "| T | variant | p50 | p90 |", "|---:|---|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['variant']} | {r['p50_us']} | {r['p90_us']} |" for r in report["rows"]]
    lines += ["", "cProfile of the mapped calls at T=1 (by own time):", "", "```",
              report["mapped_profile_t1"].strip(), "```"]
    return "\n".join(lines) + "\n"


def compare(folder: Path) -> str:
    """Markdown: per (T, variant), the p50 of every round of each tree and the median ratio."""
    def runs(tree: str) -> dict[int, dict[tuple[int, str], float]]:
        found = {}
        for report in folder.glob(f"{tree}_*/lookup_host.json"):
            found[int(report.parent.name.split("_")[-1])] = {
                (r["tokens"], r["variant"]): r["p50_us"] for r in json.loads(report.read_text())["rows"]}
        return found

    base_runs, current_runs = runs("base"), runs("current")
    paired = sorted(set(base_runs) & set(current_runs))  # a round one tree failed in: left out
    if not paired:
        raise SystemExit(f"{folder}: no round with both base_N/ and current_N/ runs to compare")
    lines = [f"Host time p50 (us), {len(paired)} rounds of each tree, taken in turn (rounds "
             f"{', '.join(map(str, paired))}); ratio: the median of the rounds' current / base.", "",
             "| T | variant | base, each round | current, each round | ratio |", "|---:|---|---|---|---:|"]
    cells = set.intersection(*(set(base_runs[n]) & set(current_runs[n]) for n in paired))
    for cell in sorted(cells):
        base = [base_runs[n][cell] for n in paired]
        current = [current_runs[n][cell] for n in paired]
        ratio = float(np.median([c / b for b, c in zip(base, current, strict=True)]))
        lines.append(f"| {cell[0]} | {cell[1]} | {' / '.join(map(str, base))} | "
                     f"{' / '.join(map(str, current))} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, metavar="DIR",
                        help="summarise DIR's base_N/ and current_N/ runs instead of measuring")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25, help="cProfile entries to print")
    parser.add_argument("--out", help="folder for the results (default: a new temporary folder)")
    args = parser.parse_args()
    if args.compare is not None:
        table = compare(args.compare)
        (args.compare / "comparison.md").write_text(table)
        print(table)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("lookup_host needs a CUDA GPU")
    with bench_folders(show_log=False) as (work, shm):  # removed however the run ends
        report = measure(args, work, shm)
    out = Path(args.out or tempfile.mkdtemp(prefix="engramd-host-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "lookup_host.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "lookup_host.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
