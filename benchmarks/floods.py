"""A good client's lookup latency beside floods, and the daemon's memory (CPU backend).

    python benchmarks/floods.py [--seconds 8] [--out benchmarks/results]

One daemon on the demo tables. A good client (its own process) looks up 64 tokens, one lookup
at a time, and records each lookup's wall time; first alone (idle), then beside each flood, one
at a time, each from processes of its own:

- heavy:   another client looking up 4,096 tokens back to back, both its slots in flight;
- stats:   a peer sending `stats` requests as fast as it reads the replies;
- unread:  a peer sending heartbeats and never reading a reply (its send queue fills);
- connect: a peer opening and closing connections as fast as it can.

Reports p50 / p99 of the good client's lookups in each phase, the ratio of each p99 to the idle
one (the target: within 3x), and the daemon's peak RSS per phase (VmHWM is process-wide, so the
peak after each phase; VmRSS sampled every 50 ms during it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from engramd.client.connection import probe

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import bench_folders, start_daemon  # noqa: E402
from common.report import run_header  # noqa: E402
from common.tables import cpu_demo_flags  # noqa: E402

GOOD = """
import json, sys, time, numpy as np, torch
from engramd.client import EngramClient
client = EngramClient(sys.argv[1], max_tokens=64, slots=2)
rng = np.random.default_rng(1)
rows, heads = client.geometry.rows, client.geometry.heads
end = time.monotonic() + float(sys.argv[2])
took = []
while time.monotonic() < end:
    ids = np.stack([rng.integers(0, r, size=(64, heads)) for r in rows], axis=1)
    start = time.perf_counter()
    client.lookup(torch.from_numpy(ids)).result()
    took.append(time.perf_counter() - start)
client.close()
print(json.dumps(took))
"""

FLOODS = {
    "heavy": """
import sys, numpy as np, torch
from engramd.client import EngramClient
client = EngramClient(sys.argv[1], max_tokens=4096, slots=2)
rng = np.random.default_rng(2)
rows, heads = client.geometry.rows, client.geometry.heads
ids = [torch.from_numpy(np.stack([rng.integers(0, r, size=(4096, heads)) for r in rows], axis=1))
       for _ in range(2)]
pending = [client.lookup(ids[0])]
while True:
    pending.append(client.lookup(ids[len(pending) % 2]))
    pending.pop(0).result()
""",
    "stats": """
import sys
from engramd.client.connection import Connection
conn = Connection(sys.argv[1])
while True:
    conn.call("stats", 30.0)
""",
    "unread": """
import sys, msgpack, zmq
from engramd.client.protocol import PROTOCOL_VERSION
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.SNDHWM, 0)
sock.connect("ipc://" + sys.argv[1])
frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": "heartbeat", "rid": 1, "client_id": None, "token": ""})
while True:
    sock.send(frame)
""",
    "connect": """
import sys, zmq
ctx = zmq.Context()
while True:
    sock = ctx.socket(zmq.DEALER)
    sock.connect("ipc://" + sys.argv[1])
    sock.close(0)
""",
}


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field))) / 1024


def phase(socket: Path, daemon_pid: int, seconds: float, flood: str | None) -> dict:
    floods = [subprocess.Popen([sys.executable, "-c", FLOODS[flood], str(socket)])] if flood else []
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], rss_mib(daemon_pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        time.sleep(1.0 if flood else 0.0)  # the flood is under way
        good = subprocess.run([sys.executable, "-c", GOOD, str(socket), str(seconds)],
                              capture_output=True, text=True, timeout=seconds + 120)
        if good.returncode != 0:
            raise SystemExit(f"good client failed beside {flood}: {good.stderr[-2000:]}")
        took = np.array(json.loads(good.stdout.strip().splitlines()[-1])) * 1e3
    finally:
        for proc in floods:
            proc.kill()
            proc.wait()
        stop.set()
        sampler.join()
    health = probe(socket, "health", 30.0).body.encode()
    return {"lookups": len(took), "p50_ms": round(float(np.percentile(took, 50)), 2),
            "p99_ms": round(float(np.percentile(took, 99)), 2), "max_ms": round(float(took.max()), 2),
            "rss_peak_mib": round(peak[0], 1), "rss_after_mib": round(rss_mib(daemon_pid), 1),
            "ready_after": health["ready"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="good client's time per phase")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--floods", nargs="*", choices=list(FLOODS), default=list(FLOODS),
                        help="which floods to run beside the good client (default: all)")
    args = parser.parse_args()
    results = {**run_header(), "phases": {}}
    with bench_folders() as (work, shm):
        proc, socket = start_daemon(work, cpu_demo_flags(work, shm))
        try:
            for flood in (None, *args.floods):
                name = flood or "idle"
                results["phases"][name] = phase(socket, proc.pid, args.seconds, flood)
                print(name, json.dumps(results["phases"][name]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    idle = results["phases"]["idle"]["p99_ms"]
    for row in results["phases"].values():
        row["p99_vs_idle"] = round(row["p99_ms"] / idle, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "floods.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'phase':8} {'p50 ms':>8} {'p99 ms':>8} {'x idle':>7} {'RSS peak MiB':>13}")
    for name, row in results["phases"].items():
        print(f"{name:8} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['p99_vs_idle']:7.2f} "
              f"{row['rss_peak_mib']:13.1f}")


if __name__ == "__main__":
    main()
