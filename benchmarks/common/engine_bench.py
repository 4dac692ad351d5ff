"""The frame the two engine benchmarks share (benchmarks/vllm_gpu/bench_lookup.py and
benchmarks/sglang_gpu/bench_lookup.py): their common command line and its checks, the parent
process of --mps on|both, main(), the report's files (a header, one entry per run, every cell;
the markdown made from it), and the small pieces of their markdown that read alike.

What this is not: anything of an engine (its layers, variants, table fill, markdown tables):
each benchmark keeps its own.
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from mps import child_reports, mps_argument, mps_modes, needs_children, run_children
from torch import Tensor

from common.cell_profile import parse_cells, profile_cell
from common.report import cpu_model, run_header, write_report

JSON_NAME, MD_NAME = "bench_lookup.json", "bench_lookup.md"
KEYS = ("runs", "lookups", "steps")
PARTS = ("lookup", "step")
CLIENT_MODES = ("mapped", "served")
Markdown = Callable[[dict], str]
PROFILE_STEPS = 20  # a profiled cell's steps: a trace of a few MB at most


def header(benchmark: str) -> dict:
    """Command line, date, machine (common/report.run_header) and its CPU model."""
    return {"benchmark": benchmark, **run_header(), "cpu": cpu_model()}


def merge(benchmark: str, reports: list[dict]) -> dict:
    """The MPS modes' reports (one run each) as one."""
    return {"meta": header(benchmark),
            **{key: [item for report in reports for item in report[key]] for key in KEYS}}


def write(out: Path, report: dict, markdown: Markdown) -> None:
    write_report(out, report, JSON_NAME, MD_NAME, markdown(report))


def add_arguments(parser: argparse.ArgumentParser, engine: str, table_gib: float) -> None:
    """The options both benchmarks take; those left None get the benchmark's DEFAULTS
    (finish_arguments)."""
    parser.add_argument("--dry-run", action="store_true",
                        help=f"on a CPU machine, in {engine}'s CPU environment: the demo geometry "
                             "and tiny settings, every path but CUDA's (--mps off only)")
    parser.add_argument("--table-gib", type=float, default=table_gib)
    parser.add_argument("--seed", type=int, default=1, help="of the table's bytes and the IDs")
    parser.add_argument("--tokens", type=int, nargs="+", help="T per lookup (1 16 256 4096)")
    parser.add_argument("--lead", type=int, nargs="+",
                        help="model step: matmuls between the lookup and the layers (1 4 12)")
    parser.add_argument("--steps", type=int, help="timed steps per cell (50)")
    parser.add_argument("--warm", type=int, help="untimed steps before each cell's (5)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="the lookups alone, the model step, or both")
    parser.add_argument("--matmul-n", type=int, help="the model step's square matmuls (4096)")
    parser.add_argument("--hidden", type=int, help="the Engram layers' hidden size (4096)")
    parser.add_argument("--hc-mult", type=int, help="their hyper-connection copies (4)")
    parser.add_argument("--daemon-args", default="",
                        help="extra `engramd serve` flags, one string (write it with '=')")
    parser.add_argument("--out", required=True)
    parser.add_argument("--profile", nargs="+", metavar="T:LEAD", default=[],
                        help="after each model-step variant's cells, profile these cells of it "
                             f"({PROFILE_STEPS} steps; common/cell_profile.py): files in OUT/profile/. "
                             "In a run of its own: the profiler may stay attached and slow what is "
                             "timed after it")
    mps_argument(parser)


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     defaults: dict[bool, dict]) -> argparse.Namespace:
    """Fill what was not given from `defaults[args.dry_run]`, then refuse what cannot run."""
    for name, value in defaults[args.dry_run].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dry_run and args.mps != "off":
        parser.error("--dry-run runs without MPS (--mps off)")
    if args.steps < 1 or args.warm < 0 or min(args.tokens) < 1 or min(args.lead) < 0:
        parser.error("--steps and --tokens must be >= 1, --warm and --lead >= 0")
    try:
        args.profile_cells = sorted(parse_cells(args.profile))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def profile_steps(args: argparse.Namespace, clock, model,
                  pool: Callable[[int, int], Sequence[Tensor]], timed: Sequence[str] = ()) -> None:
    """The --profile cells of one model-step variant (`model.step(lead)`, `pool(tokens, n)`: n
    batches of T), each written to OUT/profile/<variant>_T<T>_lead<LEAD>.*, its head printed;
    `timed`: functions whose wall time a third pass adds (common/wall_timers.py). A profile that
    fails is printed and skipped: the run's cells and report go on."""
    for tokens, lead in args.profile_cells:
        name = f"{model.name}_T{tokens}_lead{lead}"
        try:
            head = profile_cell(clock, model.step(lead), pool(tokens, args.warm + PROFILE_STEPS),
                                args.warm, Path(args.out) / "profile" / name, timed=timed)
        except Exception:
            traceback.print_exc()
            print(f"profile {name} FAILED", flush=True)
            continue
        print(head, flush=True)


def run_parent(script: Path, args: argparse.Namespace, benchmark: str, markdown: Markdown) -> int:
    """--mps on|both: a child process per MPS mode (mps.run_children), their reports merged.
    GPU only: MPS needs NVIDIA's control daemon."""
    out = Path(args.out)
    children = run_children(script, mps_modes(args), out)
    reports = [report for _, report in child_reports(children, JSON_NAME)]
    if reports:
        write(out, merge(benchmark, reports), markdown)
    ok = len(reports) == len(children) and all(child.returncode == 0 for child in children)
    return 0 if ok else 1


def main(script: Path, args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict],
         benchmark: str, markdown: Markdown) -> int:
    """One MPS mode in this process, or (needs_children) a child per mode; 1 unless rows were
    exact."""
    if needs_children(args):
        # This process never touches CUDA: MPS starts around a child.
        return run_parent(script, args, benchmark, markdown)
    report = measure(args)
    write(Path(args.out), report, markdown)
    return 0 if report["runs"][0]["rows_exact"] else 1


# -- pieces of the markdown

def phases_text(phases: dict) -> str:
    return "; ".join(f"{name} phase FAILED: {phase['error']}" if "error" in phase
                     else f"{name} phase {phase.get('seconds')} s" for name, phase in phases.items())


def mps_text(mps: bool) -> str:
    return "on" if mps else "off"


def ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or not b else f"{a / b:.2f}"
