"""New clients while another process floods the handle socket with short connections.

A peer that connects to the handle socket, asks `hello` and closes before the answer, in a tight
loop from a few threads, keeps the daemon's queue of connections not yet accepted full, and a
Unix socket refuses a connect to a full queue at once (EAGAIN). Before client/shared/handles.py's
`connect` waited for room, 292 of 300 new clients failed so. This starts a daemon on the demo
table (CPU backend), the flood in a process of its own, then makes CLIENTS clients one after the
other, each one lookup, and reports how many attached, how long each took (construction and
lookup), and how many of the flood's connects the full queue refused meanwhile. With
--plain-connect the clients connect as they did before (a refused connect fails the request).

    python benchmarks/experiments/handle_flood.py [--clients 100] [--threads 2] [--plain-connect] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engramd.client import EngramClient, EngramError
from engramd.client.shared import handles
from engramd.client.shared.connection import probe

REPO = Path(__file__).resolve().parents[2]

FLOOD = REPO / "benchmarks" / "common" / "hello_flood.py"  # the flood, a process of its own


def _plain_connect(sock, path, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.connect(str(path))


def wait_ready(socket_path: Path, deadline: float) -> None:
    while True:
        try:
            probe(socket_path, "health", 1.0)
            return
        except EngramError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2, help="the flood's threads")
    parser.add_argument("--plain-connect", action="store_true",
                        help="the clients do not wait for room in a full queue (as before)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.plain_connect:
        handles.connect = _plain_connect
    work = Path(tempfile.mkdtemp(prefix="engramd-flood-"))
    socket_path, counter = work / "engramd.sock", work / "refused"
    daemon = subprocess.Popen([sys.executable, "-m", "engramd.server.cli", "serve", "--config",
                               str(REPO / "configs/demo.toml"), "--socket", str(socket_path)],
                              stdout=subprocess.DEVNULL, stderr=(work / "daemon.log").open("w"))
    flood = None
    try:
        wait_ready(socket_path, time.monotonic() + 120)
        flood = subprocess.Popen([sys.executable, str(FLOOD), str(socket_path.parent / "engramd.handles"),
                                  str(counter), str(args.threads)])
        while not counter.exists():
            time.sleep(0.05)
        refused_before, times, failures = int(counter.read_text()), [], []
        ids = torch.zeros((4, 2, 24), dtype=torch.int64)
        started = time.monotonic()
        for _ in range(args.clients):
            begun = time.monotonic()
            try:
                with EngramClient(socket_path, max_tokens=4) as client:
                    client.lookup(ids).result()
                times.append(time.monotonic() - begun)
            except EngramError as exc:
                failures.append(f"{type(exc).__name__}: {exc}".replace(str(work), "DIR"))
        elapsed = time.monotonic() - started
        result = {"clients": args.clients, "attached": len(times), "failed": len(failures),
                  "failures": failures[:5], "clients_per_s": round(args.clients / elapsed, 2),
                  "seconds_p50": round(statistics.median(times), 3) if times else None,
                  "seconds_max": round(max(times), 3) if times else None,
                  "flood_threads": args.threads, "plain_connect": args.plain_connect,
                  "flood_connects_refused_meanwhile": int(counter.read_text()) - refused_before}
    finally:
        if flood is not None:
            flood.kill()
        daemon.terminate()
        daemon.wait(30)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
