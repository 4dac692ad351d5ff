"""Restart to ready, plain against a standby's takeover (server/standby.py), tables in shared memory.

    python benchmarks/standby_takeover.py --backend cpu --table-gib 1 --out DIR     # any machine
    python benchmarks/standby_takeover.py --backend cuda --table-gib 64 \\
        --shm-root /mnt/huge --out DIR                                             # a GPU node

The tables (--table-gib of V4.1-width rows, random bytes, benchmarks/common/tables.py) are filled
into shared memory once; a daemon serves them. Then, --restarts times for each way (--end sigterm
or kill; kill is a crash, SIGKILL):

  plain    the daemon is ended; a new `engramd serve` is started on the same socket and tables
           (what systemd's Restart= does); timed from the end to the new daemon's ready
  standby  an `engramd serve --standby` on the same socket has done its imports (and its CUDA
           start), has mapped (and pinned) the tables ahead and waits for the lock; the daemon
           is ended; timed from the end to the standby's ready (it then serves, and the next
           standby is started for the next round)

"ready" is the first `health` answer with ready true from a daemon of another pid, polled every
10 ms. Reported per restart: end -> exited (SIGTERM's drain; 0 for kill), end -> ready; for a
standby, how long it took to map (and pin) the tables ahead and whether the takeover adopted
them (its log); and the median of each way. Writes DIR/standby_takeover.json and .md (printed last).

With --client, a served client in this process looks up and waits for its rows in a loop all
along, and each restart also reports end -> the client's first rows from the successor (it
re-registers with backoff, client/rejoin.py; --longest-pause sets the longest pause between its
attempts, for comparing). Mapped clients do not wait at all (benchmarks/mapped_attach.py). Not a
load from a checkpoint: the tables are re-attached every time.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import (  # noqa: E402
    LOG_NAME,
    SOCKET_NAME,
    bench_folders,
    ready_pid,
    serve_command,
    stop_process,
    wait_for,
)
from common.report import machine, write_report  # noqa: E402
from common.tables import INSTANCE, fill_tables, geometry_for, reattach_flags  # noqa: E402

from engramd.client import rejoin  # noqa: E402

POLL_S = 0.01
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
WAYS = ("plain", "standby")
JSON_NAME, MD_NAME = "standby_takeover.json", "standby_takeover.md"
AHEAD = re.compile(r"standby: tables \S+ \(.*?\) mapped(?: and pinned)? ahead in ([0-9.]+) s")
ADOPTED = "mapped ahead by the standby"  # the store's re-attach log line of an adopted table
PINNED_AGAIN = "of host tables in"  # pin_tables' log line: the takeover pinned the tables itself


class LoopingClient:
    """A served client looking up rows in a loop on a thread of its own; when rows came back."""

    def __init__(self, socket: Path, geometry):
        import torch

        from engramd.client import EngramClient

        self.client = EngramClient(socket, mode="served", max_tokens=16, reconnect_timeout=START_TIMEOUT_S)
        self.ids = torch.zeros((16, geometry.n_layers, geometry.heads), dtype=torch.int64)
        self.last_rows = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="looping-client", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from engramd.client.errors import EngramError

        while not self._stop.is_set():
            try:
                self.client.lookup(self.ids).result(timeout=5.0)
                self.last_rows = time.perf_counter()
            except EngramError:
                time.sleep(0.001)

    def rows_after(self, moment: float) -> float:
        """Seconds from `moment` to the first rows after it (waits for them)."""
        while self.last_rows <= moment:
            time.sleep(0.001)
        return self.last_rows - moment

    def close(self) -> None:
        self._stop.set()
        self._thread.join(START_TIMEOUT_S)
        self.client.close()


class Node:
    """The serving daemon and, in the standby way, the standby waiting behind it."""

    def __init__(self, work: Path, flags: list[str]):
        self.client: LoopingClient | None = None
        self.socket = work / SOCKET_NAME
        self.log_path = work / LOG_NAME
        self.flags = flags
        self.serving: subprocess.Popen | None = None
        self.standby: subprocess.Popen | None = None

    def spawn(self, *extra: str) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(serve_command(self.socket, [*self.flags, *extra]), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def serve(self) -> None:
        self.serving = self.spawn()
        self.wait_ready(self.serving)

    def stand_by(self) -> float:
        """A standby, returned once it says it waits with the tables ready (its imports, CUDA
        start and tables done): seconds it took to map (and pin) the tables ahead."""
        offset = self.log_path.stat().st_size
        self.standby = self.spawn("--standby")
        self._wait(lambda: f"(served by pid {self.serving.pid})" in self._log_since(offset)
                   and AHEAD.search(self._log_since(offset)), self.standby, "standing by")
        return float(AHEAD.search(self._log_since(offset))[1])

    def restart(self, way: str, end: str) -> dict[str, float]:
        """End the serving daemon; the way's successor serves. Seconds from the end."""
        old = self.serving
        ahead = {"ahead_s": round(self.stand_by(), 3)} if way == "standby" else {}
        offset = self.log_path.stat().st_size
        started = time.perf_counter()
        old.send_signal(signal.SIGKILL if end == "kill" else signal.SIGTERM)
        code = old.wait(STOP_TIMEOUT_S)
        exited = time.perf_counter() - started
        if end == "sigterm" and code != 0:
            raise SystemExit(f"the daemon exited with {code} on SIGTERM:\n"
                             f"{self.log_path.read_text(errors='replace')[-4000:]}")
        successor = self.spawn() if way == "plain" else self.standby
        self.standby = None
        self.wait_ready(successor)
        ready = time.perf_counter() - started
        self.serving = successor
        if self.client is not None:
            ahead["client_rows_s"] = round(self.client.rows_after(started), 3)
        if way == "standby":
            text = self._log_since(offset)
            ahead["adopted"] = ADOPTED in text and PINNED_AGAIN not in text
        return {"exited_s": round(exited, 3), "ready_s": round(ready, 3), **ahead}

    def wait_ready(self, proc: subprocess.Popen) -> None:
        self._wait(lambda: ready_pid(self.socket) == proc.pid, proc, "ready")

    def _wait(self, done, proc: subprocess.Popen, what: str) -> None:
        wait_for(proc, done, what, self.log_path, START_TIMEOUT_S, POLL_S)

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for proc in (self.standby, self.serving):
            if proc is not None and proc.poll() is None:
                stop_process(proc, STOP_TIMEOUT_S)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    started_run = time.monotonic()
    geometry = geometry_for(args.table_gib)
    rows: list[dict[str, Any]] = []
    with bench_folders(shm_root=args.shm_root) as (work, shm):
        fill_tables(geometry, work / "ckpt", shm, INSTANCE, backend=args.backend)
        flags = [*reattach_flags(work / "ckpt", shm, INSTANCE), "--backend", args.backend,
                 "--metrics-address", "127.0.0.1:0", *shlex.split(args.daemon_args)]
        node = Node(work, flags)
        try:
            node.serve()
            if args.client:
                rejoin.LONGEST_PAUSE_S = args.longest_pause
                node.client = LoopingClient(node.socket, geometry)
            for repeat in range(args.restarts):
                for way in WAYS if repeat % 2 == 0 else WAYS[::-1]:  # neither always goes first
                    row = {"way": way, "end": args.end, "repeat": repeat + 1,
                           **node.restart(way, args.end)}
                    rows.append(row)
                    print(row, flush=True)
        finally:
            node.close()
    medians = {way: float(np.median([r["ready_s"] for r in rows if r["way"] == way])) for way in WAYS}
    if args.client:
        medians.update({f"{way} client rows": float(np.median(
            [r["client_rows_s"] for r in rows if r["way"] == way])) for way in WAYS})
    return {"meta": {"benchmark": "standby_takeover", "backend": args.backend,
                     "table_gib": round(geometry.total_bytes / 2**30, 2), "end": args.end,
                     "shm_root": args.shm_root or "/dev/shm", "daemon_args": args.daemon_args,
                     "client": args.client, "longest_pause_s": args.longest_pause,
                     "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
                     "command": "python benchmarks/standby_takeover.py " + shlex.join(sys.argv[1:]),
                     "seconds": round(time.monotonic() - started_run, 1)},
            "restarts": rows, "median_ready_s": medians}


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"# Restart to ready, plain against a standby ({meta['date']})", "",
             f"{meta['backend']} backend, {meta['table_gib']} GiB of tables in {meta['shm_root']} "
             f"(re-attached every time), the daemon ended by {meta['end']}. Command: "
             f"`{meta['command']}`.", "",
             "| way | repeat | end -> exited, s | end -> ready, s | standby: tables ahead, s "
             "| standby: adopted | end -> a served client's rows, s |", "|---|---:|---:|---:|---:|---|---:|"]
    for r in report["restarts"]:
        ahead = f"{r['ahead_s']:.2f} | {'yes' if r['adopted'] else 'no'}" if "ahead_s" in r else "- | -"
        rows = f"{r['client_rows_s']:.3f}" if "client_rows_s" in r else "-"
        lines.append(f"| {r['way']} | {r['repeat']} | {r['exited_s']:.3f} | {r['ready_s']:.3f} | {ahead} "
                     f"| {rows} |")
    lines += ["", "Median end -> ready: " + ", ".join(
        f"{way} {s:.3f} s" for way, s in report["median_ready_s"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--table-gib", type=float, default=1.0)
    parser.add_argument("--restarts", type=int, default=3, help="restarts of each way")
    parser.add_argument("--end", choices=("sigterm", "kill"), default="sigterm")
    parser.add_argument("--shm-root", help="where the tables go (default /dev/shm)")
    parser.add_argument("--daemon-args", default="", help="extra `engramd serve` flags, one string")
    parser.add_argument("--client", action="store_true",
                        help="a served client looks up all along: end -> its first rows")
    parser.add_argument("--longest-pause", type=float, default=rejoin.LONGEST_PAUSE_S,
                        help="the client's longest pause between attempts to re-register, s")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if args.restarts < 1 or args.table_gib <= 0:
        parser.error("--restarts must be >= 1 and --table-gib > 0")
    report = measure(args)
    write_report(Path(args.out), report, JSON_NAME, MD_NAME, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
