"""How soon a killed client is retired and its slab freed (CPU backend, real processes).

    python benchmarks/reap_latency.py [--kills 30] [--heartbeat 0.2] [--out benchmarks/results]

The daemon promises (README, "Client death") that a client whose process died is retired within
two heartbeat periods and that its slab goes as soon as its in-flight lookups finish. The tests
assert that promise with a margin for a loaded machine; this script measures the tight figure:
for `--kills` client processes, each killed with SIGKILL either idle or in the middle of a
4,096-token lookup, the time from the kill to (a) the client leaving `stats` (retired) and
(b) its slab (a memfd the daemon holds) being gone (freed). Reports p50 / p99 / max in milliseconds and in heartbeat
periods. Polling every 2 ms adds up to 2 ms to each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from engramd.client.shared.connection import probe

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, running_daemon  # noqa: E402
from common.report import run_header  # noqa: E402
from common.tables import cpu_demo_flags  # noqa: E402

POLL_S = 0.002
# A client process: registers, says its id, then idles or looks up 4,096 tokens back to back.
CLIENT = """
import sys, numpy as np, torch
from engramd.client import EngramClient
mode = sys.argv[2]
client = EngramClient(sys.argv[1], max_tokens=4096, slots=2)
print(client.client_id, flush=True)
rng = np.random.default_rng(0)
rows, heads = client.geometry.rows, client.geometry.heads
while True:
    if mode == "idle":
        sys.stdin.readline()
    ids = np.stack([rng.integers(0, r, size=(4096, heads)) for r in rows], axis=1)
    client.lookup(torch.from_numpy(ids)).result()
"""


def wait_for(condition, timeout: float = 60.0) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise SystemExit(f"not reached within {timeout} s")
        time.sleep(POLL_S)
    return time.monotonic() - start


def slab_descriptors(pid: int) -> set[str]:
    """The daemon's slabs: memfd descriptors named engramd-slab-c<id> (server/cpu_backend.py)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:engramd-slab-c"):
            found.add(target.split(" ")[0])
    return found


def in_flight(socket: Path, client_id: int) -> bool:
    return any(c["client_id"] == client_id and c["in_flight"]
               for c in probe(socket, "stats", 5.0).body.clients)


def one_kill(socket: Path, shm: Path, mode: str) -> tuple[float, float]:
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(socket), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client_id = int(proc.stdout.readline())
    daemon_pid = probe(socket, "health", 5.0).body.pid
    slab = f"/memfd:engramd-slab-c{client_id}"
    assert slab in slab_descriptors(daemon_pid), slab
    if mode == "busy":
        wait_for(lambda: in_flight(socket, client_id))
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: all(c["client_id"] != client_id
                         for c in probe(socket, "stats", 5.0).body.clients))
    retired = time.monotonic() - killed
    wait_for(lambda: slab not in slab_descriptors(daemon_pid))
    freed = time.monotonic() - killed
    proc.wait()
    return retired, freed


def summary(samples: list[float], heartbeat: float) -> dict:
    ms = np.array(samples) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1), "max_ms": round(float(ms.max()), 1),
            "max_periods": round(float(ms.max()) / 1e3 / heartbeat, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=30, help="killed clients per mode")
    parser.add_argument("--heartbeat", type=float, default=0.2, help="daemon heartbeat interval (s)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    results = {**run_header(), "heartbeat_s": args.heartbeat, "modes": {}}
    with bench_folders() as (work, shm):
        flags = [*cpu_demo_flags(work, shm), "--heartbeat-interval", str(args.heartbeat)]
        with running_daemon(work, flags) as socket:
            for mode in ("idle", "busy"):
                kills = [one_kill(socket, shm, mode) for _ in range(args.kills)]
                results["modes"][mode] = {"retired": summary([k[0] for k in kills], args.heartbeat),
                                          "freed": summary([k[1] for k in kills], args.heartbeat)}
                print(mode, json.dumps(results["modes"][mode]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reap_latency.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
