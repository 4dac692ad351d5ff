"""Captured model step: the whole step in one CUDA graph, engramd's captured lookup against an
in-process gather captured the same way (H200).

    python benchmarks/captured_step.py --out DIR                 # without MPS
    python benchmarks/captured_step.py --mps both --out DIR      # without, then with MPS, merged
    python benchmarks/captured_step.py --mps both --rounds 3 --out DIR   # each cell 3x, medians
    python benchmarks/captured_step.py --ids text --traces .traces --out DIR  # real text's IDs
    python benchmarks/captured_step.py --render DIR...           # reports of earlier runs, again

The step is model_step.py's (lookup of T tokens on a side stream -> LEAD bf16 matmuls -> the
main stream waits for the rows -> consume them into the next matmul's operand -> 4 more
matmuls), recorded once per (T, LEAD) in a CUDA graph and replayed. Before each replay the host
writes the step's row IDs into the persistent IDs buffer the graph reads (a device-to-device
copy from a pool drawn beforehand), as an engine writes its inputs. Variants:
  compute_graph  the matmuls alone, captured: the floor
  inproc_graph   GatherPlan (kernels/gather_triton.py) over this process's own registration of
                 the table, sorted from 1,024 tokens, captured in the step
  mapped_graph   engramd's captured lookup (EngramClient.capturable_lookup, client/captured.py)
                 of a mapped client of its own of one `engramd serve`, on all SMs as the
                 in-process plan, recorded in the step
  mapped         the same client's eager lookup()+wait() in an uncaptured step (model_step.py's
                 mapped variant): what the graph saves
Reported per cell: step time (pipelined: replays back to back, one synchronize; synced: p50 of
per-step wall times), and the host's issue time per step (p50 of the time to write the IDs and
replay, or to run the eager step's calls): the lookup's host cost is mapped_graph's issue time
less compute_graph's. Rows: after each T's cells, the captured lookup's rows after a replay must
equal the in-process gather's and gather_ref's bit for bit; exits 1 otherwise. Writes
DIR/captured_step.json and DIR/captured_step.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, open_client, running_daemon  # noqa: E402
from common.ids import layer_rows  # noqa: E402
from common.report import describe_paired, machine  # noqa: E402
from common.rows import bitwise_mismatches  # noqa: E402
from common.tables import INSTANCE, fill_tables, geometry_for  # noqa: E402
from model_step import (  # noqa: E402
    LEADS,
    SORT_MIN_TOKENS,
    TAIL,
    TOKENS,
    WARM_STEPS,
    Bench,
    UniformIds,
    daemon_flags,
    rotated,
    step_ids,
)
from mps import (  # noqa: E402
    child_reports,
    mps_argument,
    mps_modes,
    needs_children,
    require_mps_state,
    run_children,
)
from traces import TextIds  # noqa: E402

from engramd.kernels import gather_ref  # noqa: E402

VARIANTS = ("compute_graph", "inproc_graph", "mapped_graph", "mapped")
MODES = ("pipelined", "synced")
DEFAULT_STEPS = 60
JSON_NAME, MD_NAME = "captured_step.json", "captured_step.md"


class CapturedBench:
    """model_step's Bench (matmuls, consumer, in-process plan, the mapped client) and, per
    (T, LEAD), a graph of each captured variant over one persistent IDs buffer."""

    def __init__(self, bench: Bench, socket: Path, max_tokens: int):
        self.bench = bench
        # A client of its own: the eager variant's keeps both its slots.
        self.client, _ = open_client(socket, "cuda:0", max_tokens, mode="mapped")
        geometry = bench.geometry
        self.ids = torch.full((max_tokens, geometry.n_layers, geometry.heads), -1, dtype=torch.int64,
                              device="cuda")
        # One program per SM, as the in-process plan's default grid.
        self.captured = self.client.capturable_lookup(self.ids, sm_fraction=1.0)
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self.rows: dict[tuple[str, int, int], Tensor] = {}
        self.fork, self.join = torch.cuda.Event(), torch.cuda.Event()

    def graph(self, variant: str, tokens: int, lead: int) -> torch.cuda.CUDAGraph:
        key = (variant, tokens, lead)
        if key not in self.graphs:
            graph = torch.cuda.CUDAGraph()
            self._step(variant, tokens, lead)  # warm: the consumer's kernels load outside capture
            torch.cuda.synchronize()
            # thread_local: the client's threads (keeper, upkeep) call CUDA while this captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.rows[key] = self._step(variant, tokens, lead)
            self.graphs[key] = graph
        return self.graphs[key]

    def _step(self, variant: str, tokens: int, lead: int) -> Tensor | None:
        """One step on the current stream (the capture's), its lookup forked to the side stream."""
        bench, main = self.bench, torch.cuda.current_stream()
        if variant == "compute_graph":
            bench.matmuls(lead + TAIL)
            return None
        self.fork.record(main)
        bench.side.wait_event(self.fork)
        if variant == "mapped_graph":
            rows = self.captured.record(tokens, stream=bench.side)
        else:
            rows = bench.plan(self.ids[:tokens], bench.out(tokens), stream=bench.side,
                              sort=tokens >= SORT_MIN_TOKENS)
        self.join.record(bench.side)
        bench.matmuls(lead)
        main.wait_event(self.join)
        bench.consume(rows)
        bench.matmuls(TAIL)
        return rows

    def step_fn(self, variant: str, tokens: int, lead: int) -> Callable[[Tensor], None]:
        if variant == "mapped":
            return lambda ids: self.bench.step_mapped(ids, lead)
        graph = self.graph(variant, tokens, lead)

        def replay(ids: Tensor) -> None:
            self.ids[:tokens].copy_(ids, non_blocking=True)
            graph.replay()
        return replay

    def check_rows(self, tokens: int) -> dict:
        """The captured lookup's rows after a replay against the in-process gather and gather_ref."""
        ids = layer_rows(self.bench.geometry, tokens, 1)[0]
        ids.masked_fill_(torch.rand(ids.shape, device="cuda") < 0.05, -1)
        self.step_fn("mapped_graph", tokens, 1)(ids)
        torch.cuda.synchronize()
        got = self.rows[("mapped_graph", tokens, 1)].cpu()
        local = self.bench.plan(ids, sort=tokens >= SORT_MIN_TOKENS).cpu()
        reference = [torch.from_numpy(t.array) for t in self.bench.mapped]
        want, _ = gather_ref.gather(reference, ids.cpu(), self.bench.shard)
        result = {"tokens": tokens}
        for name, expected in (("vs_inproc", local), ("vs_ref", want)):
            result[name], first = bitwise_mismatches(got, expected)
            if first:
                result[f"{name}_first"] = first
        result["exact"] = result["vs_inproc"] == 0 and result["vs_ref"] == 0
        print(f"T={tokens}: captured rows {'exact' if result['exact'] else 'DIFFER'} {result}", flush=True)
        return result


def time_cell(step: Callable[[Tensor], None], pool: list[Tensor], mode: str) -> dict:
    """Step time (pipelined: total / N; synced: p50) and the host's issue time per step (p50)."""
    for ids in pool[:WARM_STEPS]:
        step(ids)
    torch.cuda.synchronize()
    issue, walls = [], []
    start = time.perf_counter()
    for ids in pool[WARM_STEPS:]:
        began = time.perf_counter()
        step(ids)
        issue.append(time.perf_counter() - began)
        if mode == "synced":
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    steps = len(pool) - WARM_STEPS
    step_us = ((time.perf_counter() - start) / steps if mode == "pipelined"
               else float(np.percentile(walls, 50))) * 1e6
    return {"step_us": step_us, "issue_us": float(np.percentile(issue, 50)) * 1e6, "steps": steps}


def run_grid(captured: CapturedBench, ids: UniformIds | TextIds, tokens: Sequence[int],
             leads: Sequence[int], steps: int, mps: bool,
             rounds: int = 1) -> tuple[list[dict], list[dict]]:
    """Every (T, lead, mode, variant) cell, `rounds` times, the variants interleaved with their
    order rotated every round (as model_step.py's), so that drift hits them alike; a cell's step
    and issue times are the medians of its rounds, every round's step time kept."""
    cells, checks = [], []
    captured.bench.spin_up()
    for t in tokens:
        captured.bench.warm_consumers(t)
        for lead in leads:
            line = []
            for mode in MODES:
                timed: dict[str, list[dict]] = {v: [] for v in VARIANTS}
                for r in range(rounds):
                    for variant in rotated(VARIANTS, r):
                        step = captured.step_fn(variant, t, lead)
                        pool = ids.pool(t, steps + WARM_STEPS)
                        torch.cuda.synchronize()
                        timed[variant].append(time_cell(step, pool, mode))
                for variant, runs in timed.items():
                    cell = {"steps": runs[0]["steps"],
                            "step_us": float(np.median([c["step_us"] for c in runs])),
                            "issue_us": float(np.median([c["issue_us"] for c in runs])),
                            "rounds_us": [round(c["step_us"], 1) for c in runs]}
                    cells.append({"mps": mps, "mode": mode, "variant": variant, "tokens": t,
                                  "lead": lead, **cell})
                    line.append(f"{mode[:4]} {variant} {cell['step_us']:.0f}/{cell['issue_us']:.1f}")
            print(f"{'MPS' if mps else 'no MPS'} T={t} lead={lead}: " + ", ".join(line)
                  + " us (step/issue)", flush=True)
        checks.append(captured.check_rows(t))
    return cells, checks


def measure(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    mps = require_mps_state(args.mps == "on")
    tokens, leads = sorted(set(args.tokens)), sorted(set(args.lead))
    geometry = geometry_for(args.table_gib)
    with bench_folders() as (work, shm):
        specs = fill_tables(geometry, work / "ckpt", shm, INSTANCE)
        ids, extra = step_ids(args, geometry, work)
        with running_daemon(work, daemon_flags(work, shm, max(tokens), extra),
                            timeout=300) as socket:
            bench = Bench(geometry, specs, socket, max(tokens), ("compute", "inproc", "mapped"))
            captured = None
            try:
                captured = CapturedBench(bench, socket, max(tokens))
                cells, checks = run_grid(captured, ids, tokens, leads, args.steps, mps["mps"],
                                         args.rounds)
                counts = captured.captured.counts()
                captured.captured.check()  # no replay wrote NaN rows
            finally:
                if captured is not None:
                    captured.client.close()
                bench.close()
    run = {**mps, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "table_gib": round(geometry.total_bytes / 2**30, 2), "steps": args.steps, "rounds": args.rounds, "ids": ids.name,
           "daemon_args": args.daemon_args, "machine": machine(), "captured_counts": counts,
           "seconds": round(time.monotonic() - started, 1),
           "rows_exact": all(c["exact"] for c in checks), "checks": checks}
    return {"meta": _meta(), "runs": [run], "cells": cells}


def _meta() -> dict:
    return {"benchmark": "captured_step", "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/captured_step.py " + " ".join(sys.argv[1:])}


def markdown(report: dict) -> str:
    cells, runs = report["cells"], report["runs"]
    lines = [f"# Captured model step on {runs[0]['gpu'] if runs else '?'} ({report['meta']['date']})",
             "", "Step time / host issue time per step, us; ratio: mapped_graph / inproc_graph step "
             "time; lookup host: mapped_graph issue less compute_graph issue. "
             f"Command: `{report['meta']['command']}`.", ""]
    if runs and runs[0].get("rounds", 1) > 1:
        lines.insert(-1, f"Each cell timed {runs[0]['rounds']} times, the variants' order rotated "
                         "every round; the medians are reported (every round's step time is in "
                         "the JSON, `rounds_us`). Rounds' ratios: mapped_graph / inproc_graph "
                         "within each round (the two timed next to each other), their median "
                         "(range), and in how many rounds it was over 1.00.")
    for run in runs:
        lines.append(f"- MPS {'on' if run['mps'] else 'off'}, {run.get('ids', 'uniform')} IDs: rows "
                     f"{'exact' if run['rows_exact'] else 'DIFFER'}; captured lookup counts "
                     f"{run['captured_counts']}; {run['seconds']} s")
    header = ["MPS", "mode", "T", "lead", *VARIANTS, "ratio", "rounds' ratios", "lookup host"]
    lines += ["", "| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    by = {(c["mps"], c["mode"], c["variant"], c["tokens"], c["lead"]): c for c in cells}
    for mps, mode, t, lead in sorted({(c["mps"], c["mode"], c["tokens"], c["lead"]) for c in cells}):
        got = {v: by.get((mps, mode, v, t, lead)) for v in VARIANTS}
        row = ["on" if mps else "off", mode, str(t), str(lead)]
        row += [f"{g['step_us']:.0f} / {g['issue_us']:.1f}" if g else "-" for g in got.values()]
        graph, inproc, floor = got["mapped_graph"], got["inproc_graph"], got["compute_graph"]
        row.append(f"{graph['step_us'] / inproc['step_us']:.3f}" if graph and inproc else "-")
        row.append(describe_paired(paired_ratios(graph, inproc)) if graph and inproc else "-")
        row.append(f"{graph['issue_us'] - floor['issue_us']:.1f}" if graph and floor else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def paired_ratios(graph: dict, inproc: dict) -> list[float]:
    """mapped_graph / inproc_graph of each round: the two were timed next to each other, so
    drift between rounds (the reference alone moves several percent) leaves the ratio alone."""
    return [g / i for g, i in zip(graph["rounds_us"], inproc["rounds_us"], strict=True)]


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / MD_NAME).write_text(text)
    print(text, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=16.0)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--ids", choices=("uniform", "text"), default="uniform",
                        help="the timed steps' row IDs: uniform, or a real-text trace (--traces)")
    parser.add_argument("--traces", default=".traces",
                        help="the trace folder for --ids text (python benchmarks/traces.py build)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time each cell this many times, variants rotated; medians reported")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--lead", type=int, nargs="+", default=list(LEADS))
    parser.add_argument("--daemon-args", default="")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--render", type=Path, nargs="+", metavar="DIR",
                        help="time nothing: print the report of each DIR/captured_step.json again, "
                             "as this version writes it")
    mps_argument(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or min(args.tokens) < 1 or min(args.lead) < 0:
        parser.error("--steps and --tokens must be >= 1, --lead >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        for folder in args.render:
            print(f"<!-- {folder / JSON_NAME} -->\n" + markdown(json.loads((folder / JSON_NAME).read_text())))
        return 0
    if needs_children(args):  # a child per MPS mode, their reports merged
        out = Path(args.out)
        children = run_children(Path(__file__).resolve(), mps_modes(args), out)
        reports = [report for _, report in child_reports(children, JSON_NAME)]
        if reports:
            write_report(out, {"meta": _meta(), "runs": [r for rep in reports for r in rep["runs"]],
                               "cells": [c for rep in reports for c in rep["cells"]]})
        ok = len(reports) == len(children) and all(c.returncode == 0 for c in children)
        return 0 if ok and all(r["rows_exact"] for rep in reports for r in rep["runs"]) else 1
    report = measure(args)
    write_report(Path(args.out), report)
    return 0 if report["runs"][0]["rows_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
