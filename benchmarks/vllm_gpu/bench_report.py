"""bench_lookup.py's report: the JSON it writes (a header, one entry per run, every cell) and the
markdown made from it, printed last. One run per MPS mode; merge() joins the children's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench_timing import MODES
from bench_variants import LOOKUP_VARIANTS, STEP_VARIANTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import cpu_model, run_header, write_report  # noqa: E402

JSON_NAME, MD_NAME = "bench_lookup.json", "bench_lookup.md"
KEYS = ("runs", "lookups", "steps")


def header() -> dict:
    """Command line, date, machine (common/report.run_header) and its CPU model."""
    return {"benchmark": "vllm_gpu/bench_lookup", **run_header(), "cpu": cpu_model()}


def merge(reports: list[dict]) -> dict:
    return {"meta": header(), **{key: [item for r in reports for item in r[key]] for key in KEYS}}


def write(out: Path, report: dict) -> None:
    write_report(out, report, JSON_NAME, MD_NAME, markdown(report))


def markdown(report: dict) -> str:
    runs, meta = report["runs"], report["meta"]
    first = runs[0] if runs else {}
    lines = [f"# vLLM's Engram lookup and engramd's on {first.get('gpu') or first.get('device')} "
             f"({meta['date']})", "", _setup(first, meta), ""]
    lines += [f"- MPS {_on(run['mps'])} ({run['mps_server']}): rows {_rows_verdict(run)}; "
              f"{_phases(run['phases'])}; {run['seconds']} s in all" for run in runs]
    lines += ["", *_lookup_table(report["lookups"]), "", *_step_table(report["steps"])]
    return "\n".join(lines) + "\n"


def _setup(run: dict, meta: dict) -> str:
    return (f"Table: {run.get('geometry')}, {run.get('table_gib')} GiB, rows {run.get('rows')}, "
            f"seed {run.get('seed')}. IDs: {_ids_note(run)}. Each cell: {run.get('warm')} untimed "
            f"then {run.get('steps')} timed steps, a fresh pool of IDs. gpu: CUDA events on the "
            "current stream before and after the call (its rows then ready in that stream's "
            "order), median; host: the call, p50; step: pipelined, wall time / steps; synced, "
            "call + synchronize, p50. Times in us. Model step: "
            f"{json.dumps(run.get('model'))}. Machine: {meta['machine']}, {meta.get('cpu')}. "
            f"Command: `{meta['command']}`.")


def _lookup_table(cells: list[dict]) -> list[str]:
    if not cells:
        return []
    by = {(c["mps"], c["variant"], c["tokens"], c["mode"]): c for c in cells}
    variants = [v for v in LOOKUP_VARIANTS if any(c["variant"] == v for c in cells)]
    lines = ["## Lookup alone (us)", "",
             "| MPS | T | variant | pipelined gpu | pipelined host | pipelined step | synced gpu "
             "| synced host | synced step | synced gpu / vllm_bg |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mps, tokens in sorted({(c["mps"], c["tokens"]) for c in cells}):
        for variant in variants:
            row = [_on(mps), str(tokens), variant]
            for mode in MODES:
                cell = by.get((mps, variant, tokens, mode), {})
                row += [_num(cell.get(key)) for key in ("gpu_us", "host_us", "step_us")]
            base = by.get((mps, "vllm_bg", tokens, "synced"), {}).get("gpu_us")
            own = by.get((mps, variant, tokens, "synced"), {}).get("gpu_us")
            lines.append("| " + " | ".join([*row, _ratio(own, base)]) + " |")
    return lines


def _step_table(cells: list[dict]) -> list[str]:
    if not cells:
        return []
    by = {(c["mps"], c["variant"], c["tokens"], c["lead"], c["mode"]): c["step_us"] for c in cells}
    variants = [v for v in STEP_VARIANTS if any(c["variant"] == v for c in cells)]
    plugins = [v for v in variants if v != "vllm"]
    header = ["MPS", "T", "lead"]
    for mode in MODES:
        header += [f"{mode} {v}" for v in variants] + [f"{mode} {v} / vllm" for v in plugins]
    lines = ["## Model step: prepare_embeddings -> LEAD matmuls -> forward (us per step)", "",
             "| " + " | ".join(header) + " |", "|---|---:|---:|" + "---:|" * (len(header) - 3)]
    for mps, tokens, lead in sorted({(c["mps"], c["tokens"], c["lead"]) for c in cells}):
        row = [_on(mps), str(tokens), str(lead)]
        for mode in MODES:
            values = {v: by.get((mps, v, tokens, lead, mode)) for v in variants}
            row += [_num(values[v]) for v in variants]
            row += [_ratio(values[v], values.get("vllm")) for v in plugins]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _ids_note(run: dict) -> str:
    if run.get("ids") == "text":
        return (f"real text, a trace of {run['trace_tokens']:,} tokens (its first half the "
                "daemon's hot-row cache warm file, the pools walk the second)")
    return "uniform in each head's bucket, fresh every step"


def _rows_verdict(run: dict) -> str:
    wrong = [c for c in run["checks"] if c["mismatches"]]
    if wrong:
        return "DIFFER (engramd's timing skipped): " + json.dumps(wrong)
    names = ", ".join(dict.fromkeys(c["variant"] for c in run["checks"]))
    return f"exact ({names} = vllm_fg, at every T)"


def _phases(phases: dict) -> str:
    return "; ".join(f"{name} phase {phase.get('seconds')} s" for name, phase in phases.items())


def _on(mps: bool) -> str:
    return "on" if mps else "off"


def _num(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or not b else f"{a / b:.2f}"
