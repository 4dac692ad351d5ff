"""bench_lookup.py's report: the JSON it writes (a header, one entry per run, every cell of every
round) and the markdown made from it, printed last. One run per MPS mode; merge() joins the
children's. With --rounds N a markdown value is the median of a cell's N rounds, with the
spread (half their range, % of the median) beside it; ratios are ratios of medians."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from bench_variants import GRAPH_VARIANTS, LOOKUP_VARIANTS, STEP_VARIANTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import cpu_use  # noqa: E402
from common.engine_bench import mps_text, phases_text, ratio  # noqa: E402
from common.report import describe_paired, median_and_range  # noqa: E402
from common.timing import MODES  # noqa: E402


def markdown(report: dict) -> str:
    runs, meta = report["runs"], report["meta"]
    first = runs[0] if runs else {}
    lines = [f"# vLLM's Engram lookup and engramd's on {first.get('gpu') or first.get('device')} "
             f"({meta['date']})", "", _setup(first, meta), ""]
    lines += [f"- MPS {mps_text(run['mps'])} ({run['mps_server']}): rows {_rows_verdict(run)}; "
              f"{_replays(run)}{_failures(run)}{phases_text(run['phases'])}; "
              f"{run['seconds']} s in all"
              for run in runs]
    steps = [cell for cell in report["steps"] if _in_own_grid(cell)]
    lines += ["", *_lookup_table(report["lookups"]), "",
              *_step_table(steps, "step_us", "Model step: prepare_embeddings -> LEAD matmuls -> "
                           "forward (us per step)"), "",
              *_step_table(steps, "host_us", "Model step, the host's time per step (us, p50 of "
                           "the step's call: for a graph, the input write and the replay)")]
    for metric in ("step_us", "host_us"):
        if table := paired_table(report["steps"], metric):
            lines += ["", *table]
    if table := vllm_through_the_run(report["steps"]):
        lines += ["", *table]
    if table := cpu_use.table(runs):
        lines += ["", *table]
    if table := keeper_table(runs):
        lines += ["", *table]
    return "\n".join(lines) + "\n"


def keeper_table(runs: list[dict]) -> list[str]:
    """Each plugin setting's client cache keeper over the setting's cells: its refreshes, their
    wall time and its thread's CPU time in them (near equal: its waits spin), the hit rate."""
    rows = [(run["mps"], name, stats) for run in runs
            for name, stats in run["phases"].get("engramd", {}).get("hot_cache", {}).items() if stats]
    if not rows:
        return []
    lines = ["## The client's hot-row cache keeper over each setting's cells", "",
             "| MPS | variant | refreshes | their wall time (ms) | the keeper's CPU in them (ms) | "
             "hit rate per layer |", "|---|---|---:|---:|---:|---|"]
    for mps, name, stats in rows:
        rates = ", ".join(f"{rate:.3f}" for rate in stats["hit_rate"])
        lines.append(f"| {mps_text(mps)} | {name} | {stats['refreshes']} | "
                     f"{stats['refresh_ms_total']:.0f} | {stats['refresh_cpu_ms_total']:.0f} | {rates} |")
    return lines


def _setup(run: dict, meta: dict) -> str:
    return (f"Table: {run.get('geometry')}, {run.get('table_gib')} GiB, rows {run.get('rows')}, "
            f"seed {run.get('seed')}. IDs: {_ids_note(run)}. Each cell: {run.get('warm')} untimed "
            f"then {run.get('steps')} timed steps, a fresh pool of IDs. gpu: CUDA events on the "
            "current stream before and after the call (its rows then ready in that stream's "
            "order), median; host: the call, p50; step: pipelined, wall time / steps; synced, "
            f"call + synchronize, p50. Times in us. {_rounds_note(run.get('rounds', 1))} "
            f"Model step: {json.dumps(run.get('model'))}{_graphs_note(run)}. "
            f"Machine: {meta['machine']}, {meta.get('cpu')}. Command: `{meta['command']}`.")


def _graphs_note(run: dict) -> str:
    graphs = ", ".join(("vllm_graph", *GRAPH_VARIANTS))
    return f"; {graphs}: {run['graphs']}" if run.get("graphs") else ""


def _rounds_note(rounds: int) -> str:
    if rounds <= 1:
        return "One round."
    return (f"{rounds} rounds (each variant's grid of cells run {rounds} times over): a value is "
            "the median of the rounds, ± half their range as % of it; ratios of medians.")


def summarize(cells: list[dict], keys: tuple[str, ...]) -> dict[tuple, dict[str, tuple]]:
    """The rounds of each cell (cells equal in `keys`): per metric, (median, spread), spread
    being half the range as a fraction of the median (None for one round)."""
    groups: dict[tuple, list[dict]] = {}
    for cell in cells:
        groups.setdefault(tuple(cell[key] for key in keys), []).append(cell)
    out: dict[tuple, dict[str, tuple]] = {}
    for key, group in groups.items():
        out[key] = {}
        for metric in ("gpu_us", "host_us", "step_us"):
            values = [c[metric] for c in group if c.get(metric) is not None]
            if values:
                median = float(np.median(values))
                spread = (max(values) - min(values)) / 2 / median if len(values) > 1 and median \
                    else None
                out[key][metric] = (median, spread)
    return out


def _lookup_table(cells: list[dict]) -> list[str]:
    if not cells:
        return []
    by = summarize(cells, ("mps", "variant", "tokens", "mode"))
    variants = [v for v in LOOKUP_VARIANTS if any(c["variant"] == v for c in cells)]
    lines = ["## Lookup alone (us)", "",
             "| MPS | T | variant | pipelined gpu | pipelined host | pipelined step | synced gpu "
             "| synced host | synced step | synced gpu / vllm_bg |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mps, tokens in sorted({(c["mps"], c["tokens"]) for c in cells}):
        for variant in variants:
            row = [mps_text(mps), str(tokens), variant]
            for mode in MODES:
                cell = by.get((mps, variant, tokens, mode), {})
                row += [_value(cell.get(key)) for key in ("gpu_us", "host_us", "step_us")]
            base = _median(by.get((mps, "vllm_bg", tokens, "synced"), {}).get("gpu_us"))
            own = _median(by.get((mps, variant, tokens, "synced"), {}).get("gpu_us"))
            lines.append("| " + " | ".join([*row, ratio(own, base)]) + " |")
    return lines


def _step_table(cells: list[dict], metric: str, title: str) -> list[str]:
    """One row per (MPS, T, lead, mode): each variant's `metric`, then each one's ratio to vllm
    (vLLM alone, eager) and plugin_captured's to vllm_graph (vLLM's step captured alike). The
    host table adds plugin_captured less compute_graph: the captured lookup's host time in the
    step."""
    if not cells:
        return []
    by = summarize(cells, ("mps", "variant", "tokens", "lead", "mode"))
    variants = [v for v in STEP_VARIANTS if any(c["variant"] == v for c in cells)]
    others = [v for v in variants if v != "vllm"]
    lookup_host = metric == "host_us" and all(v in variants for v in GRAPH_VARIANTS)
    both_graphs = all(v in variants for v in ("plugin_captured", "vllm_graph"))
    header = ["MPS", "T", "lead", "mode", *variants, *[f"{v} / vllm" for v in others]]
    header += ["plugin_captured / vllm_graph"] if both_graphs else []
    header += ["plugin_captured - compute_graph"] if lookup_host else []
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |",
             "|---|---:|---:|---|" + "---:|" * (len(header) - 4)]
    for mps, tokens, lead in sorted({(c["mps"], c["tokens"], c["lead"]) for c in cells}):
        for mode in MODES:
            stats = {v: by.get((mps, v, tokens, lead, mode), {}).get(metric) for v in variants}
            medians = {v: _median(stats[v]) for v in variants}
            row = [mps_text(mps), str(tokens), str(lead), mode,
                   *[_value(stats[v]) for v in variants]]
            row += [ratio(medians[v], medians.get("vllm")) for v in others]
            if both_graphs:
                row.append(ratio(medians["plugin_captured"], medians["vllm_graph"]))
            if lookup_host:
                captured, floor = medians["plugin_captured"], medians["compute_graph"]
                row.append("" if None in (captured, floor) else _num(captured - floor))
            lines.append("| " + " | ".join(row) + " |")
    return lines


PAIRED_TITLES = {
    "step_us": "Model step beside vLLM's own (--paired): each variant's step time / vLLM's",
    "host_us": "Model step beside vLLM's own (--paired): each variant's host time a step / vLLM's",
}
# Where a column's partner is not vLLM's eager step (plugin_captured's, since --paired held it
# against vLLM's graph).
PARTNER_NOTE = ("A column names its partner where it is not vLLM's eager step (`vllm`): "
                "plugin_captured's is vLLM's graph, recorded again beside it.")


def paired_ratios(cells: list[dict], metric: str) -> tuple[dict[tuple, list[float]], dict[str, set[str]]]:
    """--paired: per (mps, variant, tokens, lead, mode), each round's ratio of the variant's cell
    to vLLM's cell timed next to it (the `beside` cells); and each variant's partners' names."""
    partner: dict[tuple, dict] = {}
    for c in cells:
        if "beside" in c:
            key = (c["mps"], c["beside"], c["tokens"], c["lead"], c["mode"], c["round"])
            if key in partner:
                raise ValueError(f"two vLLM cells beside one cell: {key}")
            partner[key] = c
    ratios: dict[tuple, list[float]] = {}
    partner_of: dict[str, set[str]] = {}
    for cell in cells:
        key = (cell["mps"], cell["variant"], cell["tokens"], cell["lead"], cell["mode"])
        theirs = partner.get((*key, cell["round"])) if _own(cell) else None
        if theirs is not None:
            ratios.setdefault(key, []).append(cell[metric] / theirs[metric])
            partner_of.setdefault(cell["variant"], set()).add(theirs["variant"])
    return ratios, partner_of


def reference_ratios(cells: list[dict], metric: str) -> dict[tuple, float]:
    """Per (mps, variant, tokens, lead, mode) of a plugin variant's own grid, the ratio of its
    median to its reference's over the same cell: vLLM's eager step (`vllm`, phase 1), or for
    plugin_captured vLLM's graph (`vllm_graph`). What a run without --paired can say."""
    by = summarize([c for c in cells if _in_own_grid(c)], ("mps", "variant", "tokens", "lead", "mode"))
    out: dict[tuple, float] = {}
    for (mps, variant, tokens, lead, mode), stats in by.items():
        if not variant.startswith("plugin_") or metric not in stats:
            continue
        reference = "vllm_graph" if variant in GRAPH_VARIANTS else "vllm"
        base = by.get((mps, reference, tokens, lead, mode), {}).get(metric)
        if base is not None and base[0]:
            out[(mps, variant, tokens, lead, mode)] = stats[metric][0] / base[0]
    return out


def paired_table(cells: list[dict], metric: str) -> list[str]:
    """--paired: each round's ratio of a variant's cell to vLLM's cell timed next to it (the
    `beside` cells), their median (range) and the rounds over 1.00; then, per MPS mode and
    variant, the decode cells (T <= 256) whose median is over 1.00."""
    ratios, partner_of = paired_ratios(cells, metric)
    if not ratios:
        return []
    variants = [v for v in STEP_VARIANTS if any(key[1] == v for key in ratios)]
    other_partners = {v: sorted(partner_of[v]) for v in variants if partner_of[v] != {"vllm"}}
    headers = [f"{v} / {' or '.join(other_partners[v])}" if v in other_partners else v
               for v in variants]
    lines = [f"## {PAIRED_TITLES[metric]}", "",
             "Each round's ratio of the two cells timed next to each other on the same IDs: the "
             "median of the rounds (their range), and in how many the variant was slower."
             + (" " + PARTNER_NOTE if other_partners else ""), "",
             "| MPS | T | lead | mode | " + " | ".join(headers) + " |",
             "|---|---:|---:|---|" + "---|" * len(variants)]
    for mps, tokens, lead, mode in sorted({(k[0], k[2], k[3], k[4]) for k in ratios}):
        row = [describe_paired(ratios[(mps, v, tokens, lead, mode)])
               if (mps, v, tokens, lead, mode) in ratios else "" for v in variants]
        lines.append(f"| {mps_text(mps)} | {tokens} | {lead} | {mode} | " + " | ".join(row) + " |")
    lines.append("")
    for mps in sorted({key[0] for key in ratios}):
        counts = []
        for variant in variants:
            decode = [float(np.median(r)) for k, r in ratios.items()
                      if k[0] == mps and k[1] == variant and k[2] <= 256]
            if decode:
                counts.append(f"{variant} {sum(m > 1.0 for m in decode)} of {len(decode)}"
                              f" (most {max(decode):.3f})")
        lines.append(f"- MPS {mps_text(mps)}, decode cells (T <= 256) with the median over "
                     f"1.00: {', '.join(counts)}")
    return lines


def vllm_through_the_run(cells: list[dict]) -> list[str]:
    """--paired: vLLM's own step in phase 2 (alone before the first client and after the last,
    and next to each plugin variant; its graph next to plugin_captured) over its phase-1 cell of
    the same T, lead, mode and round: the median and range over the decode cells (T <= 256) and
    rounds, host time and step time. Next to a variant above both brackets: the open client
    slowed vLLM's step too, a cost the paired ratios do not show."""
    def key(c: dict) -> tuple:
        return c["mps"], c["variant"], c["tokens"], c["lead"], c["mode"], c["round"]

    vllms = ("vllm", "vllm_graph")
    first = {key(c): c for c in cells if c["variant"] in vllms and _in_own_grid(c)}
    later: dict[tuple, dict[str, list[float]]] = {}
    for c in cells:
        if c["variant"] not in vllms or c["tokens"] > 256 or _in_own_grid(c):
            continue
        base = first.get(key(c))
        if base is None:
            continue
        where = c.get("when") or f"beside {c['beside']}"
        entry = later.setdefault((c["mps"], c["variant"], where), {"host_us": [], "step_us": []})
        for metric in entry:
            entry[metric].append(c[metric] / base[metric])
    if not later:
        return []
    lines = ["## vLLM's own step through phase 2 (--paired), over its phase-1 cell", "",
             "The same T, lead, mode and round; decode cells (T <= 256): median (range).", "",
             "| MPS | vLLM's step | host / phase 1 | step / phase 1 | cells |", "|---|---|---|---|---:|"]
    for (mps, variant, where), entry in later.items():  # in the order they ran
        host, step = entry["host_us"], entry["step_us"]
        name = where if variant == "vllm" else f"{variant} {where}"
        lines.append(f"| {mps_text(mps)} | {name} | {median_and_range(host, 2)} | {median_and_range(step, 2)} | {len(host)} |")
    return lines


def _own(cell: dict) -> bool:
    """A variant's own cell: not vLLM's timed beside another."""
    return "beside" not in cell


def _in_own_grid(cell: dict) -> bool:
    """A cell of its variant's own grid (phase 1's for vLLM): neither vLLM's timed beside a
    variant nor one of its brackets in phase 2 (`when`)."""
    return _own(cell) and "when" not in cell


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


def _replays(run: dict) -> str:
    """The captured lookup's check() after its cells, if the run had one."""
    return "".join(f"{entry['variant']} replays {json.dumps(entry['counts'])}, check() "
                   f"{'passed' if entry['passed'] else 'FAILED: ' + entry['error']}; "
                   for entry in run.get("replays", []))


def _failures(run: dict) -> str:
    return "".join(f"{entry['variant']} FAILED ({entry['error']}), not timed; "
                   for entry in run.get("failures", []))


def _median(stats: tuple | None) -> float | None:
    return None if stats is None else stats[0]


def _value(stats: tuple | None) -> str:
    """A median, and its spread where there were rounds."""
    if stats is None:
        return ""
    median, spread = stats
    return _num(median) + ("" if spread is None else f" ±{spread * 100:.0f}%")


def _num(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.1f}"
