"""A reload while clients look up (CPU backend): how long it takes, and what it costs them.

    python benchmarks/reload.py [--table-gib 1] [--seconds 4] [--out benchmarks/results]

Two synthetic checkpoints of a V4.1-shaped geometry of about `--table-gib` GiB (other seeds,
so other rows). The daemon serves `tables/current`, a symlink to the first. A served and a
mapped client (processes of their own) look up 64 tokens at a time, one lookup after the other,
recording when each finished, how long it took and which tables it read. After `--seconds`
the symlink is flipped and `engramd reload` run; the clients go on for `--seconds` after the
reload is done.

Reports the reload's time and rate (checkpoint -> shared memory, with the self-check), each
client's lookup p50 / p99 before, during and after it, how long after the switch each client
knew it read the new tables (a served client's rows are new at once; it learns from a notice), and the daemon's peak RSS and the shared memory held
(both copies live for a while).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, start_daemon, stop_process  # noqa: E402
from common.report import run_header  # noqa: E402
from common.tables import geometry_for  # noqa: E402

from engramd.server.synthetic import write_synthetic_checkpoint  # noqa: E402

CLIENT = """
import json, sys, time, numpy as np, torch
from engramd.client import EngramClient
client = EngramClient(sys.argv[1], max_tokens=64, slots=2, mode=sys.argv[2])
rng = np.random.default_rng(1)
rows, heads = client.geometry.rows, client.geometry.heads
stop = sys.argv[3]
log = []
import os
while not os.path.exists(stop):
    ids = np.stack([rng.integers(0, r, size=(64, heads)) for r in rows], axis=1)
    start = time.perf_counter()
    client.lookup(torch.from_numpy(ids)).result()
    log.append((time.time(), time.perf_counter() - start, client.tables_id))
client.close()
print(json.dumps(log))
"""


def shm_used(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def rss_peak(pid: int, stop: threading.Event, peak: list[float], shm: Path, held: list[int]) -> None:
    while not stop.wait(0.05):
        status = Path(f"/proc/{pid}/status").read_text()
        kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        peak[0] = max(peak[0], kib / 1024)
        held[0] = max(held[0], shm_used(shm))


def percentiles(took: list[float]) -> dict[str, float]:
    if not took:
        return {"lookups": 0}
    ms = np.array(took) * 1e3
    return {"lookups": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2), "max_ms": round(float(ms.max()), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table-gib", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    geometry = geometry_for(args.table_gib)
    results = {**run_header(), "table_bytes": geometry.total_bytes}
    with bench_folders() as (work, shm):
        for seed in (1, 2):
            started = time.monotonic()
            write_synthetic_checkpoint(geometry, work / f"ckpt{seed}", seed=seed)
            print(f"checkpoint {seed} written in {time.monotonic() - started:.1f} s", flush=True)
        current = work / "current"
        current.symlink_to(work / "ckpt1")
        proc, socket = start_daemon(work, ["--tables", str(current), "--shm-dir", str(shm),
                                           "--backend", "cpu", "--metrics-address", "127.0.0.1:0"])
        stop_file = work / "stop"
        stop, peak, held = threading.Event(), [0.0], [0]
        sampler = threading.Thread(target=rss_peak, args=(proc.pid, stop, peak, shm, held), daemon=True)
        try:
            clients = {mode: subprocess.Popen([sys.executable, "-c", CLIENT, str(socket), mode, str(stop_file)],
                                              stdout=subprocess.PIPE, text=True)
                       for mode in ("served", "mapped")}
            time.sleep(args.seconds)
            sampler.start()
            (work / "next").symlink_to(work / "ckpt2")
            os.replace(work / "next", current)
            began = time.time()
            done = subprocess.run([sys.executable, "-m", "engramd.server.cli", "reload", "--socket",
                                   str(socket), "--json"], capture_output=True, text=True, timeout=1800)
            ended = time.time()
            status = json.loads(done.stdout)
            time.sleep(args.seconds)
            stop_file.touch()
            logs = {mode: json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1])
                    for mode, p in clients.items()}
        finally:
            stop.set()
            stop_process(proc, 60)
    results["reload"] = {**status, "wall_s": round(ended - began, 2),
                         "gb_per_s": round(geometry.total_bytes / 1e9 / status["seconds"], 2)}
    results["daemon_rss_peak_mib"] = round(peak[0], 1)
    results["shm_held_peak_bytes"] = held[0]
    results["clients"] = {}
    switched = began + status["seconds"]  # the reload's own clock: asked -> switched
    for mode, log in logs.items():
        new = status["tables"]
        first_new = next((t for t, _, tables in log if tables == new), None)
        results["clients"][mode] = {
            "before": percentiles([d for t, d, _ in log if t < began]),
            "during": percentiles([d for t, d, _ in log if began <= t <= switched]),
            "after": percentiles([d for t, d, _ in log if t > switched]),
            "knows_new_tables_after_switch_s": None if first_new is None else round(first_new - switched, 3),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reload.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
