"""GPU lookup: UVA row-rate ceiling vs in-process gather vs engramd end to end (H200).

    python benchmarks/gpu_lookup.py [--table-gib 33] [--out DIR]
    python benchmarks/gpu_lookup.py --mps both --out DIR     # without, then with MPS, merged

One run, one host table of at least 32 GiB (V4.1 row width: 2 layers x 24 heads x 264 B rows,
synthetic random bytes in /dev/shm), fresh random IDs every iteration and every column (drawn on
the GPU before timing), T in {1, 16, 256, 4096, 16384} tokens x 2 layers x 24 heads. Columns:
  (a) torch index_select on the UVA view of the raw rows (the row-rate ceiling, no dequant),
  (b) the Triton gather+dequant kernel in-process on the pinned table (what engines do today),
  (b2) the same with sort=True (rows read in sorted order, as the daemon does from its
       sort_min_tokens, 1,024, on): the best in-process path at large T, shown at every T,
  (c) engramd: daemon process + this process as its served client (mode="served": the daemon
      gathers), submit -> rows ready on our stream, once per --dispatch mode (a fresh daemon each),
  (d) engramd mapped: this process as a mapped client of the same daemon (mode="mapped": it maps
      the daemon's tables read-only and gathers on a side stream of its own), timed as (c); run
      once, beside the first --dispatch mode's column (dispatch is the daemon's, mapped lookups
      never reach it).
Each sample is host wall time from submit to `stream.synchronize()` returning. For (c) and (d)
also, per lookup, the client's host time of lookup() + wait() (from before lookup() to after
wait() returns, nothing synchronised in between), and for (c) after each T the daemon's own
request-received -> gather-enqueued p50 (`client.stats()["dispatch_us"]`). The daemon keeps its
last 4,096 lookups, so that figure covers this T and the smaller ones before it;
meta["daemon_dispatch_us"] holds it for the whole column. meta["mapped"] says how long the mapped
client took to attach. A markdown table of all of it is printed last.

--mps on|both (benchmarks/mps.py): each mode runs in a fresh child process, a private MPS server
around the `on` one, which the daemon and the benchmark process then share. One mode writes
DIR/gpu_lookup.json as without --mps (meta["mps"] says which); both write each mode's file to
DIR/mps_off/ and DIR/mps_on/ (`report_gpu.py --results` renders either) and merge them into
DIR/gpu_lookup.json under the keys "mps_off" and "mps_on" of "modes".

The checkpoint the daemon opens is sparse (headers only): the daemon re-attaches the shared-memory
tables this script fills, so no 35 GB file is written.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engramd.client.geometry import TableGeometry
from engramd.kernels.gather_triton import GatherPlan

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, open_client, running_daemon  # noqa: E402
from common.ids import scaled_rows  # noqa: E402
from common.report import machine  # noqa: E402
from common.tables import INSTANCE, geometry_for, random_tables, reattach_flags  # noqa: E402
from mps import (  # noqa: E402
    child_reports,
    gpu_processes,
    mps_argument,
    mps_modes,
    needs_children,
    require_mps_state,
    run_children,
)

TOKENS = (1, 16, 256, 4096, 16384)
LABELS = {
    "a_index_select_uva": "(a) index_select over UVA (raw rows)",
    "b_triton_in_process": "(b) Triton gather+dequant, in-process",
    "b2_triton_in_process_sorted": "(b2) in-process sorted",
    "c_engramd_worker": "(c) engramd end to end (worker dispatch)",
    "c_engramd_inline": "(c') engramd end to end (inline dispatch)",
    "d_engramd_mapped": "(d) engramd mapped",
}
MAPPED_COLUMN = "d_engramd_mapped"


def iterations(tokens: int) -> int:
    return {1: 300, 16: 300, 256: 200, 4096: 60, 16384: 30}[tokens]


def summarize(name: str, tokens: int, rows: int, seconds: list[float]) -> dict:
    lat = np.array(seconds) * 1e6
    return {"column": name, "tokens": tokens, "rows": rows, "iters": len(lat),
            "p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99)),
            "rows_per_s": float(rows / np.percentile(lat, 50) * 1e6)}


def timed(fn, batches: list[torch.Tensor], warm: int = 3) -> list[float]:
    stream = torch.cuda.current_stream()
    for ids in batches[:warm]:
        fn(ids)
    stream.synchronize()
    out = []
    for ids in batches[warm:]:
        start = time.perf_counter()
        fn(ids)
        stream.synchronize()
        out.append(time.perf_counter() - start)
    return out


def in_process_columns(geometry: TableGeometry, tables, results: list[dict]) -> None:
    """(a) and (b): this process registers the same shared-memory pages and reads them over UVA."""
    from engramd.server.cuda_backend import PinnedTables

    pinned = PinnedTables(tables)
    try:
        uva = pinned.row_views(torch.device("cuda"))
        plan = GatherPlan(pinned.layer_tables(), geometry.shard(0, 1), torch.device("cuda"))
        plan.warm_up()
        time_in_process(geometry, uva, plan, results)
        torch.cuda.synchronize()
    finally:
        pinned.close()


def time_in_process(geometry: TableGeometry, uva: list[torch.Tensor], plan: GatherPlan,
                    results: list[dict]) -> None:
    def index_select(ids: torch.Tensor) -> None:
        for layer, view in enumerate(uva):
            torch.index_select(view, 0, ids[:, layer].reshape(-1))

    for tokens in TOKENS:
        rows = tokens * geometry.n_layers * geometry.heads
        out = torch.empty(plan.output_shape(tokens), dtype=torch.bfloat16, device="cuda")
        columns = (("a_index_select_uva", index_select),
                   ("b_triton_in_process", lambda ids, out=out: plan(ids, out)),
                   ("b2_triton_in_process_sorted", lambda ids, out=out: plan(ids, out, sort=True)))
        for name, fn in columns:
            # IDs of their own per column: repeated rows would find warm address translations.
            batches = scaled_rows(geometry, tokens, iterations(tokens) + 3)
            results.append(summarize(name, tokens, rows, timed(fn, batches)))
            print(results[-1], flush=True)


def engramd_column(geometry: TableGeometry, socket: Path, dispatch: str, results: list[dict],
                   mode: str = "served") -> dict:
    """Column (c) for one daemon (mode "served"), or (d) (mode "mapped", same timing); returns
    what the daemon reported after the whole column."""
    name = f"c_engramd_{dispatch}" if mode == "served" else MAPPED_COLUMN
    client, attach_s = open_client(socket, "cuda", max(TOKENS), mode)
    with client:
        stream = torch.cuda.current_stream()
        processes = gpu_processes()  # while the daemon and this process both hold the GPU
        for tokens in TOKENS:
            batches = scaled_rows(geometry, tokens, iterations(tokens) + 3)
            rows = tokens * geometry.n_layers * geometry.heads
            host: list[float] = []  # lookup() + wait(), per lookup

            def submit(ids: torch.Tensor, host=host) -> None:
                start = time.perf_counter()
                client.lookup(ids, stream).wait(stream)
                host.append(time.perf_counter() - start)

            samples = timed(submit, batches)
            row = summarize(name, tokens, rows, samples)
            lat = np.array(host[3:]) * 1e6  # the warm-up lookups of timed() left out
            row["client_enqueue_us_p50"] = float(np.percentile(lat, 50))  # report_gpu.py reads it
            row["client_lookup_wait_us"] = {"p50": row["client_enqueue_us_p50"],
                                            "p99": float(np.percentile(lat, 99))}
            if mode == "served":  # mapped lookups never reach the daemon
                row["daemon_dispatch_us"] = client.stats().get("dispatch_us")
            results.append(row)
            print(row, flush=True)
        return {"dispatch_us": client.stats().get("dispatch_us") if mode == "served" else None,
                "gpu_processes": processes, "mode": client.mode, "attach_s": round(attach_s, 3),
                "engramd_mps": getattr(client, "mps", None)}  # the daemon's verdict, if it sends one


def markdown(results: list[dict]) -> list[str]:
    """The results as a table: p50/p99, rows/s against (b2), and (c)'s host and daemon times."""
    by = {(r["column"], r["tokens"]): r for r in results}
    lines = ["| T | column | p50 us | p99 us | M rows/s | rows/s vs (b2) | "
             "client lookup+wait p50 us | daemon dispatch p50 us |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for tokens in sorted({r["tokens"] for r in results}):
        best = by.get(("b2_triton_in_process_sorted", tokens))
        for column, label in LABELS.items():
            r = by.get((column, tokens))
            if r is None:
                continue
            ratio = f"{r['rows_per_s'] / best['rows_per_s']:.3f}" if best else ""
            client = f"{r['client_enqueue_us_p50']:.0f}" if "client_enqueue_us_p50" in r else ""
            daemon = (r.get("daemon_dispatch_us") or {}).get("p50")
            lines.append(f"| {tokens} | {label} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | "
                         f"{r['rows_per_s'] / 1e6:.2f} | {ratio} | {client} | "
                         f"{'' if daemon is None else f'{daemon:.0f}'} |")
    return lines


def print_table(data: dict, heading: str) -> None:
    meta = data["meta"]
    print(f"\n## {heading}: {meta['gpu']}, {meta['table_gib']} GiB table, MPS "
          f"{'on' if meta.get('mps') else 'off'} ({meta.get('mps_server', 'not recorded')})")
    dispatch = {k: v for k, v in meta.get("daemon_dispatch_us", {}).items() if v}
    if dispatch:
        print("daemon dispatch (request received -> gather enqueued) over each whole column: "
              + ", ".join(f"{k} p50 {v['p50']:.0f} us, p99 {v['p99']:.0f} us (n {v['n']})"
                          for k, v in dispatch.items()))
    mapped = meta.get("mapped")
    if mapped:
        print(f"(d) mapped client: attached in {mapped['attach_s']:.2f} s (granted mode "
              f"{mapped['mode']}), beside the {mapped['dispatch']} daemon")
    print("\n".join(markdown(data["results"])), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=33.0)
    parser.add_argument("--dispatch", nargs="+", default=["inline", "worker"],
                        help="daemon cuda_dispatch modes to run column (c) with")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--daemon-args", default="",
                        help="extra `engramd serve` flags, split like a shell's (write it with '=')")
    mps_argument(parser)
    return parser.parse_args()


def run_modes(args: argparse.Namespace) -> int:
    """--mps on/both: a child process per mode (mps.run_children); with both, merged JSON."""
    out = Path(args.out)
    children = run_children(Path(__file__).resolve(), mps_modes(args), out)
    if len(children) == 1:
        return children[0].returncode  # it wrote DIR/gpu_lookup.json and printed its table
    modes = {}
    for child, report in child_reports(children, "gpu_lookup.json"):
        report["meta"]["mps_log_tail"] = child.mps_log
        modes[child.key] = report
    meta = {"command": "python benchmarks/gpu_lookup.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "mps": "both"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_lookup.json").write_text(json.dumps({"meta": meta, "modes": modes}, indent=2) + "\n")
    for key, data in modes.items():
        print_table(data, key)
    complete = len(modes) == len(children)
    return max([c.returncode for c in children] + [0 if complete else 1])


def main() -> int:
    args = parse_args()
    if needs_children(args):
        return run_modes(args)  # this process never touches CUDA: MPS starts around a child
    mps = require_mps_state(args.mps == "on")
    geometry = geometry_for(args.table_gib)
    results: list[dict] = []
    daemon: dict[str, dict] = {}
    mapped: dict | None = None
    with bench_folders() as (work, shm):
        with random_tables(geometry, work / "ckpt", shm, INSTANCE) as tables:
            in_process_columns(geometry, tables, results)
        for index, dispatch in enumerate(args.dispatch):
            flags = [*reattach_flags(work / "ckpt", shm, INSTANCE), "--backend", "cuda",
                     "--max-tokens", str(max(TOKENS)), "--cuda-dispatch", dispatch,
                     *shlex.split(args.daemon_args)]
            with running_daemon(work, flags, timeout=300) as socket:
                daemon[dispatch] = engramd_column(geometry, socket, dispatch, results)
                if index == 0:  # (d) once: the daemon's dispatch mode does not touch it
                    mapped = {"dispatch": dispatch,
                              **engramd_column(geometry, socket, dispatch, results, "mapped")}
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "table_gib": round(geometry.total_bytes / 2**30, 2), "rows": list(geometry.rows),
            "machine": machine(),
            "command": "python benchmarks/gpu_lookup.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), **mps,
            "gpu_processes": {k: v["gpu_processes"] for k, v in daemon.items()},
            "engramd_mps": {k: v["engramd_mps"] for k, v in daemon.items()},
            "daemon_dispatch_us": {k: v["dispatch_us"] for k, v in daemon.items()},
            "mapped": mapped}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "results": results}
    (out / "gpu_lookup.json").write_text(json.dumps(data, indent=2) + "\n")
    print_table(data, "gpu_lookup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
