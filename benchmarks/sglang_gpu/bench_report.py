"""bench_lookup.py's report: the JSON it writes (a header, one entry per run, every cell) and the
markdown made from it, printed last. One run per MPS mode; merge() joins the children's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench_variants import LOOKUP_VARIANTS, REFERENCES, STEP_VARIANTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import cpu_use  # noqa: E402
from common.engine_bench import mps_text, phases_text, ratio  # noqa: E402
from common.timing import MODES  # noqa: E402


def markdown(report: dict) -> str:
    runs, meta = report["runs"], report["meta"]
    first = runs[0] if runs else {}
    lines = [f"# SGLang's Engram lookup and engramd's on {first.get('gpu') or first.get('device')} "
             f"({meta['date']})", "", _setup(first, meta), ""]
    lines += [f"- MPS {mps_text(run['mps'])} ({run['mps_server']}): rows {_rows_verdict(run)}; "
              f"{_setup_seconds(run.get('setup', {}))}; {phases_text(run['phases'])}; "
              f"{run['seconds']} s in all" for run in runs]
    lines += ["", *_memory_table(runs), "", *_lookup_table(report["lookups"]), "",
              *_step_table(report["steps"])]
    if table := cpu_use.table(runs):
        lines += ["", *table]
    return "\n".join(lines) + "\n"


def _setup(run: dict, meta: dict) -> str:
    return (f"SGLang {run.get('sglang')}, TP=1. Table: {run.get('geometry')}, "
            f"{run.get('table_gib')} GiB, rows {run.get('rows')}, seed {run.get('seed')}. "
            f"Lookup IDs: uniform in each head's bucket, int64, fresh every step; model step: "
            f"{run.get('tokens_note')}. Each cell: {run.get('warm')} untimed then "
            f"{run.get('steps')} timed steps, a fresh pool. gpu: CUDA events on the current "
            "stream before and after the call (its result then ready in that stream's order), "
            "median; host: the call, p50; step: pipelined, wall time / steps; synced, call + "
            f"synchronize, p50. Times in us. Model step: {json.dumps(run.get('model'))}. "
            f"Machine: {meta['machine']}, {meta.get('cpu')}. Command: `{meta['command']}`.")


def _memory_table(runs: list[dict]) -> list[str]:
    lines = ["## Table and hot-row cache bytes in GPU memory", "",
             "| MPS | variant | table on the GPU (GiB) | where the table is | hot-row cache on the "
             "GPU (GiB) | whose |", "|---|---|---:|---|---:|---|"]
    for run in runs:
        for variant, memory in run.get("memory", {}).items():
            lines.append(f"| {mps_text(run['mps'])} | {variant} | "
                         f"{_gib(memory['table_gpu_bytes'])} | "
                         f"{memory['table_at']} | {_gib(memory['cache_gpu_bytes'])} | "
                         f"{memory['cache_of']} |")
    return lines


def _lookup_table(cells: list[dict]) -> list[str]:
    if not cells:
        return []
    by = {(c["mps"], c["variant"], c["tokens"], c["mode"]): c for c in cells}
    variants = [v for v in LOOKUP_VARIANTS if any(c["variant"] == v for c in cells)]
    references = [v for v in REFERENCES if v in variants]
    header = ["MPS", "T", "variant", "pipelined gpu", "pipelined host", "pipelined step",
              "synced gpu", "synced host", "synced step"]
    header += [f"synced {key} / {ref}" for ref in references for key in ("gpu", "step")]
    lines = ["## Lookup alone, both layers (us)", "", "| " + " | ".join(header) + " |",
             "|---|---:|---|" + "---:|" * (len(header) - 3)]
    for mps, tokens in sorted({(c["mps"], c["tokens"]) for c in cells}):
        for variant in variants:
            row = [mps_text(mps), str(tokens), variant]
            for mode in MODES:
                cell = by.get((mps, variant, tokens, mode), {})
                row += [_num(cell.get(key)) for key in ("gpu_us", "host_us", "step_us")]
            own = by.get((mps, variant, tokens, "synced"), {})
            for ref in references:
                base = by.get((mps, ref, tokens, "synced"), {})
                row += [ratio(own.get(key), base.get(key)) for key in ("gpu_us", "step_us")]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _step_table(cells: list[dict]) -> list[str]:
    if not cells:
        return []
    by = {(c["mps"], c["variant"], c["tokens"], c["lead"], c["mode"]): c["step_us"] for c in cells}
    variants = [v for v in STEP_VARIANTS if any(c["variant"] == v for c in cells)]
    # Each variant against each of SGLang's own that is not itself (sglang_host / sglang too).
    pairs = [(v, ref) for ref in REFERENCES if ref in variants for v in variants
             if v != ref and not (ref == "sglang_host" and v == "sglang")]
    header = ["MPS", "T", "lead"]
    for mode in MODES:
        header += [f"{mode} {v}" for v in variants] + [f"{mode} {v} / {ref}" for v, ref in pairs]
    lines = ["## Model step: hash -> LEAD matmuls -> each layer's Engram.forward (us per step)",
             "", "| " + " | ".join(header) + " |", "|---|---:|---:|" + "---:|" * (len(header) - 3)]
    for mps, tokens, lead in sorted({(c["mps"], c["tokens"], c["lead"]) for c in cells}):
        row = [mps_text(mps), str(tokens), str(lead)]
        for mode in MODES:
            values = {v: by.get((mps, v, tokens, lead, mode)) for v in variants}
            row += [_num(values[v]) for v in variants]
            row += [ratio(values[v], values[ref]) for v, ref in pairs]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _rows_verdict(run: dict) -> str:
    wrong = [c for c in run["checks"] if c["mismatches"]]
    if wrong:
        return "DIFFER (what differs is not timed): " + json.dumps(wrong)
    seen: dict[str, list[str]] = {}
    for check in run["checks"]:
        seen.setdefault(check["what"], [])
        if check["variant"] not in seen[check["what"]]:
            seen[check["what"]].append(check["variant"])
    said = "; ".join(f"{what} of {', '.join(names)} = sglang's" for what, names in seen.items())
    return f"exact ({said}, at every T)"


def _setup_seconds(setup: dict) -> str:
    return f"imports {setup.get('import_s')} s, SGLang's hasher {setup.get('hasher_s')} s"


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.3f}"


def _num(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"
