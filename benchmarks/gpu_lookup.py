"""GPU lookup: UVA row-rate ceiling vs in-process gather vs engramd end to end (H200).

    python benchmarks/gpu_lookup.py [--table-gib 33] [--out DIR]

One run, one host table of at least 32 GiB (V4.1 row width: 2 layers x 24 heads x 264 B rows,
synthetic random bytes in /dev/shm), fresh random IDs every iteration (drawn on the GPU before
timing), T in {1, 16, 256, 4096, 16384} tokens x 2 layers x 24 heads. Columns:
  (a) torch index_select on the UVA view of the raw rows (the row-rate ceiling, no dequant),
  (b) the Triton gather+dequant kernel in-process on the pinned table (what engines do today),
  (c) engramd: daemon process + this process as client, submit -> rows ready on our stream.
Each sample is host wall time from submit to `stream.synchronize()` returning.

The checkpoint the daemon opens is sparse (headers only): the daemon re-attaches the shared-memory
tables this script fills, so no 35 GB file is written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engramd.client import EngramClient
from engramd.client.geometry import V41_FLASH_CONFIG, TableGeometry
from engramd.kernels.gather_triton import GatherPlan
from engramd.server.checkpoint import EngramCheckpoint, scale_name, weight_name
from engramd.server.table_store import TableStore

sys.path.insert(0, str(Path(__file__).parent))
from daemon_process import bench_folders, running_daemon  # noqa: E402

TOKENS = (1, 16, 256, 4096, 16384)
INSTANCE = "bench"


def geometry_for(table_gib: float) -> TableGeometry:
    rows_per_bucket = int(table_gib * 2**30 / 264 / 48) + 1
    config = {k: v for k, v in V41_FLASH_CONFIG.items() if k != "engram_num_embeddings"}
    return TableGeometry.from_config({**config, "engram_vocab_size": rows_per_bucket})


def write_sparse_checkpoint(geometry: TableGeometry, out: Path) -> None:
    """A valid checkpoint whose tensor bytes are holes: enough to open and fingerprint."""
    out.mkdir(parents=True)
    weight_map = {}
    for i, layer_id in enumerate(geometry.layer_ids):
        for name, dtype, width in ((weight_name(layer_id), "F8_E4M3", geometry.head_dim),
                                   (scale_name(layer_id), "F8_E8M0", geometry.scale_bytes)):
            nbytes = geometry.rows[i] * width
            header = json.dumps({name: {"dtype": dtype, "shape": [geometry.rows[i], width],
                                        "data_offsets": [0, nbytes]}}).encode()
            header += b" " * (-len(header) % 8)
            path = out / f"{name}.safetensors"
            with open(path, "wb") as f:
                f.write(len(header).to_bytes(8, "little") + header)
                f.truncate(8 + len(header) + nbytes)
            weight_map[name] = path.name
    (out / "config.json").write_text(json.dumps(geometry.to_config()))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


class RandomRows:
    """Table source for TableStore: random bytes made on the GPU (fast), fingerprint of the ckpt."""

    def __init__(self, checkpoint: EngramCheckpoint):
        self.geometry = checkpoint.geometry
        self._fingerprint = checkpoint.fingerprint()

    def fingerprint(self) -> str:
        return self._fingerprint

    def read_packed(self, layer_index: int, row_start: int, out: np.ndarray) -> None:
        data = torch.randint(0, 256, out.shape, dtype=torch.uint8, device="cuda")
        torch.from_numpy(out).copy_(data.cpu())


def random_ids(geometry: TableGeometry, tokens: int, count: int) -> list[torch.Tensor]:
    rows = torch.tensor(geometry.rows, device="cuda").view(1, -1, 1)
    return [(torch.rand((tokens, geometry.n_layers, geometry.heads), device="cuda") * rows).long()
            for _ in range(count)]


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
        batches = random_ids(geometry, tokens, iterations(tokens) + 3)
        rows = tokens * geometry.n_layers * geometry.heads
        out = torch.empty(plan.output_shape(tokens), dtype=torch.bfloat16, device="cuda")
        results.append(summarize("a_index_select_uva", tokens, rows, timed(index_select, batches)))
        results.append(summarize("b_triton_in_process", tokens, rows,
                                 timed(lambda ids, out=out: plan(ids, out), batches)))
        print(results[-2], results[-1], flush=True)


def engramd_column(geometry: TableGeometry, socket: Path, dispatch: str, results: list[dict]) -> None:
    name = f"c_engramd_{dispatch}"
    with EngramClient(socket, device="cuda", max_tokens=max(TOKENS), slots=2, timeout=120) as client:
        stream = torch.cuda.current_stream()
        for tokens in TOKENS:
            batches = random_ids(geometry, tokens, iterations(tokens) + 3)
            rows = tokens * geometry.n_layers * geometry.heads
            enqueue: list[float] = []

            def submit(ids: torch.Tensor, enqueue=enqueue) -> None:
                start = time.perf_counter()
                client.lookup(ids, stream).wait(stream)
                enqueue.append(time.perf_counter() - start)

            samples = timed(submit, batches)
            row = summarize(name, tokens, rows, samples)
            row["client_enqueue_us_p50"] = float(np.percentile(np.array(enqueue[3:]) * 1e6, 50))
            row["daemon_dispatch_us"] = client.stats().get("dispatch_us")
            results.append(row)
            print(row, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=33.0)
    parser.add_argument("--dispatch", nargs="+", default=["inline", "worker"],
                        help="daemon cuda_dispatch modes to run column (c) with")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    geometry = geometry_for(args.table_gib)
    results: list[dict] = []
    with bench_folders() as (work, shm):
        write_sparse_checkpoint(geometry, work / "ckpt")
        started = time.monotonic()
        with TableStore(shm, INSTANCE) as store:
            tables = store.open(RandomRows(EngramCheckpoint.open(work / "ckpt")))
            print(f"filled {geometry.total_bytes / 2**30:.1f} GiB in {time.monotonic() - started:.1f} s",
                  flush=True)
            in_process_columns(geometry, tables, results)
            del tables
        for dispatch in args.dispatch:
            with running_daemon(work, ["--tables", str(work / "ckpt"), "--shm-dir", str(shm),
                                       "--instance", INSTANCE, "--backend", "cuda",
                                       "--max-tokens", str(max(TOKENS)),
                                       "--cuda-dispatch", dispatch,
                                       # random tables over a sparse checkpoint
                                       "--self-check", "false"], timeout=300) as socket:
                engramd_column(geometry, socket, dispatch, results)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "table_gib": round(geometry.total_bytes / 2**30, 2), "rows": list(geometry.rows),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "command": "python benchmarks/gpu_lookup.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_lookup.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
