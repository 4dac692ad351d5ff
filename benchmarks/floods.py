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

Where the time goes: the daemon's own lookup histogram (request received by its loop -> rows
written; Prometheus `engramd_lookup_dispatch_seconds`), read before and after each phase, gives
the phase's daemon-side p50 / p99 (the upper bound of the bucket they fall in). Its window is
the whole phase (the flood's first second included). Beside the heavy client it holds that
client's lookups too; beside the other floods only the good client's.
Its stage histogram (`engramd_lookup_stage_seconds`) splits that time: submit (received ->
pieces queued), queue (-> a gather thread starts), gather (-> rows written), completion (-> the
loop answers).
The rest of the good client's time is spent before the loop reads its request and after the
rows are written (the reply's way back). The daemon's garbage collections per phase come from
its `engramd_gc_pause_seconds` histogram.

`--py-spy PATH` attaches that py-spy binary to the daemon during each phase's good client
(`record --idle --threads --native`, raw collapsed stacks in OUT/stacks_<phase>.txt, which
benchmarks/stack_summary.py reads): where each of the daemon's threads spends that phase.
py-spy pauses the daemon for every sample: profiled lookups are slower, compare them only with
each other.
"""

from __future__ import annotations

import argparse
import json
import socket as sockets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from engramd.client.shared.connection import probe

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
from engramd.client.shared.connection import Connection
conn = Connection(sys.argv[1])
while True:
    conn.call("stats", 30.0)
""",
    "unread": """
import sys, msgpack, zmq
from engramd.client.shared.protocol import PROTOCOL_VERSION
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


def free_port() -> int:
    with sockets.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()


def histogram(text: str, name: str, **labels: str) -> dict[float, float]:
    """A histogram of a scrape, the series with `labels`: cumulative count per bucket bound (s)."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and all(
                    sample.labels.get(key) == value for key, value in labels.items()):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


STAGES = ("submit", "queue", "gather", "completion")


def stages(before: str, after: str) -> dict[str, list]:
    """Per stage of the daemon's CPU lookups: [p50, p99] bucket bounds (ms) in the phase."""
    split = {}
    for stage in STAGES:
        was, now = (histogram(text, "engramd_lookup_stage_seconds", stage=stage)
                    for text in (before, after))
        split[stage] = [bucket_percentile(was, now, 50), bucket_percentile(was, now, 99)]
    return split


def gc_pauses(before: str, after: str) -> dict[str, dict]:
    """Per generation: the phase's collections and the bucket bound (ms) of its longest one."""
    pauses = {}
    for generation in range(3):
        was = histogram(before, "engramd_gc_pause_seconds", generation=str(generation))
        now = histogram(after, "engramd_gc_pause_seconds", generation=str(generation))
        bounds = sorted(now)
        counts = [now[b] - was.get(b, 0.0) for b in bounds]
        longest = next((b for b, c in zip(bounds, counts, strict=True) if c == counts[-1]), None)
        pauses[str(generation)] = {"count": int(counts[-1]) if counts else 0,
                                   "longest_ms_at_most": round(longest * 1e3, 3) if counts and counts[-1] else None}
    return pauses


def bucket_percentile(before: dict[float, float], after: dict[float, float], q: float) -> float | str | None:
    """The upper bound (ms) of the bucket holding the q-th percentile of what was observed
    between the two readings ("+Inf" past the last bound); None if nothing was."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    for bound, count in zip(bounds, counts, strict=True):
        if count >= q / 100 * counts[-1]:
            return round(bound * 1e3, 3) if bound != float("inf") else "+Inf"
    return None


def profiler(py_spy: str | None, daemon_pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    if py_spy is None:
        return None
    return subprocess.Popen([py_spy, "record", "--pid", str(daemon_pid), "--duration", str(int(seconds) + 2),
                             "--idle", "--threads", "--native", "--rate", "200", "--format", "raw",
                             "--output", str(out)], stdout=subprocess.DEVNULL)


def phase(socket: Path, daemon_pid: int, port: int, seconds: float, flood: str | None,
          py_spy: str | None, out: Path) -> dict:
    floods = [subprocess.Popen([sys.executable, "-c", FLOODS[flood], str(socket)])] if flood else []
    peak, stop, sampling = [0.0], threading.Event(), None
    before = scrape(port)

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], rss_mib(daemon_pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        time.sleep(1.0 if flood else 0.0)  # the flood is under way
        sampling = profiler(py_spy, daemon_pid, seconds, out / f"stacks_{flood or 'idle'}.txt")
        good = subprocess.run([sys.executable, "-c", GOOD, str(socket), str(seconds)],
                              capture_output=True, text=True, timeout=seconds + 120)
        if good.returncode != 0:
            raise SystemExit(f"good client failed beside {flood}: {good.stderr[-2000:]}")
        took = np.array(json.loads(good.stdout.strip().splitlines()[-1])) * 1e3
        if sampling is not None and sampling.wait(60) != 0:
            print(f"py-spy exited with {sampling.returncode} in phase {flood or 'idle'}", flush=True)
    finally:
        if sampling is not None and sampling.poll() is None:
            sampling.kill()
            sampling.wait()
        for proc in floods:
            proc.kill()
            proc.wait()
        stop.set()
        sampler.join()
    health = probe(socket, "health", 30.0).body.encode()
    after = scrape(port)
    lookups = [histogram(text, "engramd_lookup_dispatch_seconds") for text in (before, after)]
    return {"lookups": len(took), "p50_ms": round(float(np.percentile(took, 50)), 2),
            "p99_ms": round(float(np.percentile(took, 99)), 2), "max_ms": round(float(took.max()), 2),
            "daemon_p50_ms_at_most": bucket_percentile(*lookups, 50),
            "daemon_p99_ms_at_most": bucket_percentile(*lookups, 99),
            "stages_ms_at_most": stages(before, after),
            "gc_pauses": gc_pauses(before, after),
            "rss_peak_mib": round(peak[0], 1), "rss_after_mib": round(rss_mib(daemon_pid), 1),
            "ready_after": health["ready"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="good client's time per phase")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--py-spy", help="run the daemon under this py-spy binary (see above)")
    parser.add_argument("--floods", nargs="*", choices=list(FLOODS), default=list(FLOODS),
                        help="which floods to run beside the good client (default: all)")
    args = parser.parse_args()
    results = {**run_header(), "phases": {}}
    with bench_folders() as (work, shm):
        port = free_port()
        args.out.mkdir(parents=True, exist_ok=True)
        proc, socket = start_daemon(work, [*cpu_demo_flags(work, shm), "--metrics-address",
                                           f"127.0.0.1:{port}"])
        try:
            for flood in (None, *args.floods):
                name = flood or "idle"
                results["phases"][name] = phase(socket, proc.pid, port, args.seconds, flood,
                                                args.py_spy, args.out)
                print(name, json.dumps(results["phases"][name]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    idle = results["phases"]["idle"]["p99_ms"]
    for row in results["phases"].values():
        row["p99_vs_idle"] = round(row["p99_ms"] / idle, 2)
    (args.out / "floods.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'phase':8} {'p50 ms':>8} {'p99 ms':>8} {'x idle':>7} {'daemon p50/p99 <= ms':>21} "
          f"{'full GCs (longest <= ms)':>25} {'RSS peak MiB':>13}")
    for name, row in results["phases"].items():
        daemon = f"{row['daemon_p50_ms_at_most']} / {row['daemon_p99_ms_at_most']}"
        full = row["gc_pauses"]["2"]
        collections = f"{full['count']} ({full['longest_ms_at_most']})"
        print(f"{name:8} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['p99_vs_idle']:7.2f} "
              f"{daemon:>21} {collections:>25} {row['rss_peak_mib']:13.1f}")
    print("daemon's stages, p50 / p99 <= ms: " + ", ".join(STAGES))
    for name, row in results["phases"].items():
        split = row["stages_ms_at_most"]
        print(f"{name:8} " + "  ".join(f"{split[stage][0]} / {split[stage][1]}" for stage in STAGES))


if __name__ == "__main__":
    main()
