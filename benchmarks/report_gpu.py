"""Render benchmarks/results/h200/gpu_lookup.json as a markdown table and a latency plot (PNG).

    python benchmarks/report_gpu.py [--results benchmarks/results/h200]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

LABELS = {
    "a_index_select_uva": "(a) index_select over UVA (raw rows)",
    "b_triton_in_process": "(b) Triton gather+dequant, in-process",
    "c_engramd_worker": "(c) engramd end to end (worker dispatch)",
    "c_engramd_inline": "(c') engramd end to end (inline dispatch)",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(Path(__file__).parent / "results" / "h200"))
    args = parser.parse_args()
    folder = Path(args.results)
    data = json.loads((folder / "gpu_lookup.json").read_text())
    by = defaultdict(dict)
    for row in data["results"]:
        by[row["column"]][row["tokens"]] = row
    tokens = sorted(by["b_triton_in_process"])
    meta = data["meta"]
    lines = [f"# GPU lookup on {meta['gpu']} ({meta['date']})", "",
             f"Host table {meta['table_gib']} GiB (rows per layer {meta['rows']}), fresh random IDs every "
             f"iteration, 2 layers x 24 heads per token. Command: `{meta['command']}`.", "",
             "| T | column | p50 us | p99 us | M rows/s | c/b rows/s | c - b p50 us |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for t in tokens:
        b = by["b_triton_in_process"][t]
        for column in LABELS:
            if t not in by.get(column, {}):
                continue
            r = by[column][t]
            ratio = diff = ""
            if column.startswith("c_"):
                ratio = f"{r['rows_per_s'] / b['rows_per_s']:.3f}"
                diff = f"{r['p50_us'] - b['p50_us']:.0f}"
            lines.append(f"| {t} | {LABELS[column]} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | "
                         f"{r['rows_per_s'] / 1e6:.2f} | {ratio} | {diff} |")
    lines += ["", "Where engramd's time goes (p50, us): client host time for lookup()+wait(), and the "
              "daemon's request-received to gather-enqueued time.", "",
              "| T | dispatch | client lookup+wait | daemon dispatch |", "|---:|---|---:|---:|"]
    for column in ("c_engramd_worker", "c_engramd_inline"):
        for t in tokens:
            r = by.get(column, {}).get(t)
            if r and "client_enqueue_us_p50" in r:
                lines.append(f"| {t} | {column.split('_')[-1]} | {r['client_enqueue_us_p50']:.0f} | "
                             f"{r['daemon_dispatch_us']['p50']:.0f} |")
    (folder / "gpu_lookup.md").write_text("\n".join(lines) + "\n")
    plot(by, tokens, folder / "gpu_lookup.png", meta)
    print("\n".join(lines))
    return 0


def plot(by: dict, tokens: list[int], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for column, label in LABELS.items():
        if column in by:
            ts = [t for t in tokens if t in by[column]]
            ax.plot(ts, [by[column][t]["p50_us"] for t in ts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per lookup (x 48 rows)")
    ax.set_ylabel("p50 latency, us (submit to rows ready)")
    ax.set_title(f"Engram lookup, {meta['table_gib']} GiB pinned host table, {meta['gpu']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
