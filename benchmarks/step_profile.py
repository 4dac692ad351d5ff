"""Where a model step's time goes, kernel by kernel: model_step.py's synced steps under torch's
profiler (CUPTI), for the cells where two variants' step times differ and the totals do not say why.

    python benchmarks/model_step.py --profile --tokens 16 --lead 1 12 --variants inproc mapped \
        --ids text --traces .traces --out DIR
    python benchmarks/step_profile.py DIR   # the tables again from DIR's traces

Every cell (T, lead) and variant runs model_step's warm steps, then `--steps` synced steps under
the profiler, each inside a "step" annotation that ends after its synchronize. From the trace,
per step, in us from the step's start on the host:
  wall          the step annotation's length (submission, GPU, synchronize)
  submitted     the end of the step's last kernel launch on the host
  first kernel  when the first kernel started on the GPU
  gather        the gather kernel's start and length
  matmul 1      the first matmul's length (the one the gather runs beside), and the median of
                the others
  rows wait     from the end of the matmul before the rows' consumer to the consumer's start:
                what the main stream's event wait held it (a matmul that could not start beside
                a gather on every SM shows as a later matmul, not here)
  consume       the rows' consumer kernels (model_step's sums), their lengths added up
  GPU end       the last kernel's end
Reported: each metric's median over the steps. DIR/model_step_profile.json holds every step's
metrics; DIR/model_step_profile.md the table; DIR/traces/ one Chrome trace per cell and variant.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common.cell_profile import annotated_steps, read_trace

STEP = "step"
METRICS = ("wall", "submitted", "first_kernel", "gather_start", "gather", "matmul_first",
           "matmul_rest", "rows_wait", "consume", "gpu_end")
HEADERS = ("wall", "submitted", "first kernel", "gather at", "gather", "matmul 1", "matmuls 2+",
           "rows wait", "consume", "GPU end")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
JSON_NAME, MD_NAME = "model_step_profile.json", "model_step_profile.md"


def kind(kernel_name: str) -> str:
    """matmul, gather, consume (the rows' sum) or other, by the kernel's name."""
    name = kernel_name.lower()
    if "gather_kernel" in name:
        return "gather"
    if any(word in name for word in ("gemm", "nvjet", "cutlass", "xmma")):
        return "matmul"
    if "reduce" in name:
        return "consume"
    return "other"


def step_metrics(events: list[dict]) -> list[dict[str, float]]:
    """Per "step" annotation of a Chrome trace's events: the metrics above (us; absent where a
    step had no such kernel)."""
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and e.get("name") in LAUNCHES]
    out = []
    for step, mine in annotated_steps(events, STEP, ("kernel",)):
        start, end = step["ts"], step["ts"] + step["dur"]
        if not mine:
            continue
        metrics = {"wall": step["dur"], "first_kernel": mine[0]["ts"] - start,
                   "gpu_end": max(k["ts"] + k["dur"] for k in mine) - start}
        submitted = [e["ts"] + e["dur"] for e in launches if start <= e["ts"] < end]
        if submitted:
            metrics["submitted"] = max(submitted) - start
        gathers = [k for k in mine if kind(k["name"]) == "gather"]
        if gathers:
            metrics["gather_start"] = gathers[0]["ts"] - start
            metrics["gather"] = sum(k["dur"] for k in gathers)
        matmuls = [k for k in mine if kind(k["name"]) == "matmul"]
        if matmuls:
            metrics["matmul_first"] = matmuls[0]["dur"]
        if len(matmuls) > 1:
            metrics["matmul_rest"] = statistics.median(k["dur"] for k in matmuls[1:])
        consumers = [k for k in mine if kind(k["name"]) == "consume"]
        if consumers:
            metrics["consume"] = sum(k["dur"] for k in consumers)
            before = [k for k in matmuls if k["ts"] < consumers[0]["ts"]]
            if before:
                metrics["rows_wait"] = consumers[0]["ts"] - (before[-1]["ts"] + before[-1]["dur"])
        out.append(metrics)
    return out


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    return {m: statistics.median(s[m] for s in steps if m in s)
            for m in METRICS if any(m in s for s in steps)}


def profile_grid(bench: Any, ids: Any, tokens: Sequence[int], leads: Sequence[int], steps: int,
                 out: Path, warm_steps: int) -> tuple[list[dict], list[dict]]:
    """Every cell and variant of `bench` (model_step.Bench), profiled, its traces into
    out/traces; and the row checks of every T."""
    from torch.profiler import ProfilerActivity, profile, record_function

    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    cells, checks = [], []
    bench.spin_up()
    for t in tokens:
        bench.warm_consumers(t)
        checks.append(bench.check_rows(t))  # also loads every kernel launched behind a wait
        for lead in leads:
            for variant in bench.variants:
                step = bench.steps[variant]
                pool = ids.pool(t, steps + warm_steps)
                for batch in pool[:warm_steps]:
                    step(batch, lead)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for batch in pool[warm_steps:]:
                        with record_function(STEP):
                            step(batch, lead)
                            torch.cuda.synchronize()
                path = trace_path(out, t, lead, variant)
                raw = path.with_suffix("")  # the profiler writes plain JSON: kept gzipped
                prof.export_chrome_trace(str(raw))
                trace = raw.read_bytes()
                raw.unlink()
                path.write_bytes(gzip.compress(trace))
                per_step = step_metrics(json.loads(trace)["traceEvents"])
                cell = {"tokens": t, "lead": lead, "variant": variant, "steps": per_step,
                        "median_us": medians(per_step)}
                cells.append(cell)
                print(f"T={t} lead={lead} {variant}: " + ", ".join(
                    f"{m} {v:.0f}" for m, v in cell["median_us"].items()), flush=True)
    return cells, checks


def trace_path(out: Path, tokens: int, lead: int, variant: str) -> Path:
    return out / "traces" / f"T{tokens}_lead{lead}_{variant}.json.gz"


def reread(out: Path) -> str:
    """DIR's tables again from its traces (a metric added since the run, say); cells whose trace
    is gone keep their steps."""
    report = json.loads((out / JSON_NAME).read_text())
    for cell in report["cells"]:
        path = trace_path(out, cell["tokens"], cell["lead"], cell["variant"])
        if path.exists():
            cell["steps"] = step_metrics(read_trace(path))
            cell["median_us"] = medians(cell["steps"])
    return write(out, report["run"], report["cells"])


def write(out: Path, run: dict, cells: list[dict]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps({"run": run, "cells": cells}, indent=2) + "\n")
    text = markdown(run, cells)
    (out / MD_NAME).write_text(text)
    return text


def markdown(run: dict, cells: list[dict]) -> str:
    lines = [f"# Model step, profiled ({run.get('gpu', '?')}, {run.get('date', '?')})", "",
             "Synced steps under torch's profiler (which adds its own host time to every launch: "
             "compare variants, not these walls with model_step.md's). Medians over the steps, "
             "us from the step's start on the host. See benchmarks/step_profile.py for each "
             f"column. Command: `{run.get('command', '?')}`; daemon args "
             f"`{run.get('daemon_args', '')}`.", "",
             "| T | lead | variant | " + " | ".join(HEADERS) + " |",
             "|---:|---:|---|" + "---:|" * len(HEADERS)]
    for cell in cells:
        values = cell["median_us"]
        row = [str(cell["tokens"]), str(cell["lead"]), cell["variant"]]
        row += [f"{values[m]:.1f}" if m in values else "" for m in METRICS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("dir", nargs="?", type=Path,
                        help="a model_step.py --profile output folder: its tables again")
    args = parser.parse_args()
    print(reread(args.dir) if args.dir is not None else __doc__)


if __name__ == "__main__":
    main()
