"""Mapped attach: how long a mapped client takes to attach, and a daemon restart to ready (H200).

    python benchmarks/mapped_attach.py [--table-gib 16] [--repeat 3] [--restarts 1] [--out DIR]

A host table of --table-gib (V4.1 row width, random bytes in /dev/shm or --shm-root, over a sparse checkpoint)
is filled by common/tables.py, as for gpu_lookup.py, and one `engramd serve --backend cuda
--self-check false` re-attaches it (plus --daemon-args). Then, --repeat times:
  attach   `EngramClient(sock, device="cuda:0", mode="mapped", max_tokens=256)` constructed, end
           to end (register over ZeroMQ, descriptors over the handle socket, mmap +
           cudaHostRegister(ReadOnly) of every table, local slots, gather plan and warm-up, side
           stream, watchdog); then its first lookup (1 token, lookup + wait + synchronize) and
           its close() (synchronize, cudaHostUnregister, release)
  split    the pieces of the same, timed one by one on a registration of their own, the way
           client.py makes them: register (mode "mapped", this GPU's UUID) on a Connection,
           attach (client/shared/handles.py), a separate mmap of the granted descriptors (mmap
           alone), MappedTables (client/shared/mapped.py: mmap + cudaHostRegister ReadOnly),
           mapped_gather (GatherPlan + warm-up), MappedTables.close (unregister), release
The first repeat also loads the gather kernels into this process (later ones find them loaded).
Registration GB/s = table bytes / MappedTables time; the projection to the V4.1-Flash tables (2
layers x 94.4 GiB, 189 GiB) scales that part and keeps the rest.

Then --restarts times: the daemon is stopped (SIGTERM, waited for) and started again on the same
shm folder and instance; timed from the start to the first `health` answer (live) and to
`health` ready, polled every POLL_S with engramd.client.shared.connection.probe (as `engramd health`
does). The daemon's log gives its own split (re-attach verification, pinning and its GB/s, kernel
warm-up), and whether it re-attached. GB/s = table bytes / start-to-ready. The daemon here is
started by this script (the command of common.daemon.start_daemon, polled more finely) so it can
be stopped and restarted in the middle. Through every restart a mapped client (attached before
the stop) looks up 16 tokens in a loop on a thread of its own (lookup + result, 1 ms apart): it
rides through on its mapping (client/rejoin.py), so the table says how many lookups it made
while no daemon was ready, the longest gap between two of them, whether every one returned the
rows of its first lookup (bit for bit, NaN by position: benchmarks/common/rows.py), when it had registered with the restarted daemon (after its ready),
and whether it kept its mapping.

Writes DIR/mapped_attach.json and DIR/mapped_attach.md; the tables are printed last. About 1-2
minutes at 16 GiB on an H200 (filling the table is 10-20 s of it).
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramd.client import EngramClient
from engramd.client.errors import EngramError
from engramd.client.geometry import V41_FLASH_CONFIG, TableGeometry
from engramd.client.shared.connection import Connection, probe
from engramd.client.shared.handles import attach, handle_socket_path
from engramd.client.shared.mapped import MappedTables, mapped_gather

sys.path.insert(0, str(Path(__file__).parent))
from common.daemon import LOG_NAME, SOCKET_NAME, bench_folders, serve_command, stop_process  # noqa: E402
from common.ids import scaled_rows  # noqa: E402
from common.report import cell, machine, mount_type, write_report  # noqa: E402
from common.rows import bitwise_mismatches  # noqa: E402
from common.tables import INSTANCE, fill_tables, geometry_for, reattach_flags  # noqa: E402
from mps import mps_state  # noqa: E402

POLL_S = 0.01  # health probes while the daemon starts
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
MAX_TOKENS = 256
DEVICE = "cuda:0"
JSON_NAME, MD_NAME = "mapped_attach.json", "mapped_attach.md"
V41 = TableGeometry.from_config(V41_FLASH_CONFIG)  # 2 layers x 384 M rows x 264 B: 189 GiB

# The daemon's log lines (server/cli.py: "%(asctime)s %(levelname)s %(name)s: %(message)s").
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: (.*)$")
LOG_EVENTS = {
    "listening": re.compile(r"listening on"),
    "reattached": re.compile(r"re-attached .*, ([\d.]+) GB, verified in ([\d.]+) s"),
    "loading": re.compile(r"loading ([\d.]+) GB into"),
    "mapped": re.compile(r"tables (re-attached|loaded) in"),  # pinning starts (the preload)
    "pinned": re.compile(r"pinned ([\d.]+) GB of host tables in ([\d.]+) s"),
    "imported": re.compile(r"daemon modules imported in"),
    "kernels": re.compile(r"gather kernels warmed"),
    "ready": re.compile(r"ready: .* ([\d.]+) GB of tables (re-attached|loaded)"),
}


# -- the daemon ----------------------------------------------------------------------------------


def daemon_flags(work: Path, shm: Path, extra: str) -> list[str]:
    return [*reattach_flags(work / "ckpt", shm, INSTANCE), "--backend", "cuda",
            "--metrics-address", "127.0.0.1:0",  # no port that another run could hold
            *shlex.split(extra)]  # last: the caller's flags win


class Daemon:
    """`engramd serve` started, timed to live and ready, and stopped, again and again."""

    def __init__(self, work: Path, flags: list[str]):
        self.work = work
        self.flags = flags
        self.socket = work / SOCKET_NAME
        self.log_path = work / LOG_NAME
        self.proc: subprocess.Popen | None = None

    def start(self) -> dict[str, Any]:
        """Start it (the command of common.daemon.start_daemon); returns the timings."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        command = serve_command(self.socket, self.flags)
        wall = time.time()
        started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        live_s = None
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"daemon exited with {self.proc.returncode}:\n"
                                 f"{self.log_path.read_text()[-4000:]}")
            try:
                fields = probe(self.socket, "health", 1.0).body.encode()
            except EngramError:
                fields = None
            now = time.perf_counter() - started
            if fields is not None:
                if live_s is None:
                    live_s = now
                if fields.get("ready"):
                    break
            if now > START_TIMEOUT_S:
                self.kill()
                raise SystemExit(f"daemon not ready in {START_TIMEOUT_S:.0f} s:\n"
                                 f"{self.log_path.read_text()[-4000:]}")
            time.sleep(POLL_S)
        return {"live_s": round(live_s, 3), "ready_s": round(now, 3), "pid": self.proc.pid,
                "log": parse_log(self.log_path, offset, wall)}

    def stop(self) -> float:
        """SIGTERM and wait for the exit; returns the seconds it took."""
        started = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(STOP_TIMEOUT_S)
        self.proc = None
        if code != 0:
            raise SystemExit(f"daemon exited with {code} on SIGTERM:\n"
                             f"{self.log_path.read_text()[-4000:]}")
        return time.perf_counter() - started

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, STOP_TIMEOUT_S)
        self.proc = None


def parse_log(path: Path, offset: int, popen_wall: float) -> dict[str, Any]:
    """The daemon's own account of one start: seconds after the spawn at which each step was
    logged (the log's clock, millisecond stamps), GB and seconds it says it re-attached/pinned."""
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out: dict[str, Any] = {"at_s": {}, "verify_s": 0.0, "reattached_gb": 0.0}
    for line in text.splitlines():
        match = LOG_LINE.match(line)
        if not match:
            continue
        stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        message = match.group(2)
        for name, pattern in LOG_EVENTS.items():
            found = pattern.search(message)
            if not found:
                continue
            out["at_s"].setdefault(name, round(stamp - popen_wall, 3))
            if name == "reattached":
                out["reattached_gb"] += float(found.group(1))
                out["verify_s"] += float(found.group(2))
            elif name == "pinned":
                out["pinned_gb"], out["pin_s"] = float(found.group(1)), float(found.group(2))
                out["pin_gb_s"] = round(out["pinned_gb"] / max(out["pin_s"], 1e-9), 2)
            elif name == "ready":
                out["tables_gb"], out["how"] = float(found.group(1)), found.group(2)
    out["verify_s"] = round(out["verify_s"], 3)
    out["reattached_gb"] = round(out["reattached_gb"], 2)
    return out


def timed_restart(daemon: Daemon, timed: dict[str, Any]) -> tuple[float, float]:
    """Stop and start `daemon`, its timings into `timed`; the perf_counter of SIGTERM and ready."""
    sigterm = time.perf_counter()
    timed["stop_s"] = daemon.stop()
    timed["socket_left"] = daemon.socket.exists()
    timed["timing"] = daemon.start()
    return sigterm, time.perf_counter()


class RideThrough:
    """A mapped client that looks up on a thread of its own while the daemon restarts."""

    def __init__(self, socket: Path, geometry: TableGeometry):
        self.client = EngramClient(socket, device=DEVICE, mode="mapped", max_tokens=MAX_TOKENS,
                                   reconnect_timeout=START_TIMEOUT_S)
        self.ids = scaled_rows(geometry, 16, 1)[0]
        self.expected = self.client.lookup(self.ids).result(copy=True)
        self.done: list[float] = []  # perf_counter of every finished lookup
        self.wrong = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ride-through", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.001):
                rows = self.client.lookup(self.ids).result()
                self.wrong += bitwise_mismatches(rows, self.expected)[0] != 0
                self.done.append(time.perf_counter())
        except BaseException as exc:  # reported in the restart's row
            self.error = exc

    def through(self, restart: Any) -> dict[str, Any]:
        """Run `restart()` (returns the perf_counter of SIGTERM and of ready); the lookups made
        from SIGTERM until the client has registered with the restarted daemon (rows: those
        made since the last restart)."""
        epoch, mapping = self.client.epoch, self.client.mapped_tables
        wrong, done = self.wrong, len(self.done)
        sigterm, ready = restart()
        deadline = time.perf_counter() + 60
        while self.client.epoch == epoch and self.error is None and time.perf_counter() < deadline:
            time.sleep(0.001)
        rejoined = time.perf_counter()
        time.sleep(0.2)  # some lookups after it
        times = [t for t in self.done if t >= sigterm]
        gaps = np.diff([sigterm, *times]) if times else np.array([])
        return {"lookups_until_ready": sum(sigterm <= t <= ready for t in times),
                "longest_gap_ms": round(float(gaps.max()) * 1e3, 2) if gaps.size else None,
                "rows_exact": self.wrong == wrong, "lookups": len(self.done) - done,
                "wrong": self.wrong - wrong,
                "error": repr(self.error) if self.error else None,
                "rejoined_after_ready_s": round(rejoined - ready, 3)
                if self.client.epoch != epoch else None,
                "kept_mapping": self.client.mapped_tables is mapping}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


# -- the attach ----------------------------------------------------------------------------------


def attach_end_to_end(socket: Path, geometry: TableGeometry) -> dict[str, Any]:
    """One EngramClient(mode="mapped") constructed, used once and closed, each step timed."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    client = EngramClient(socket, device=DEVICE, mode="mapped", max_tokens=MAX_TOKENS)
    attach_s = time.perf_counter() - started
    try:
        if client.mode != "mapped":
            raise SystemExit(f"asked for mode 'mapped', the daemon granted {client.mode!r}")
        ids = scaled_rows(geometry, 1, 1)[0]
        torch.cuda.synchronize()
        started = time.perf_counter()
        client.lookup(ids).wait()
        torch.cuda.synchronize()
        first_lookup_ms = (time.perf_counter() - started) * 1e3
    finally:
        started = time.perf_counter()
        client.close()
        close_s = time.perf_counter() - started
    return {"attach_s": attach_s, "first_lookup_ms": first_lookup_ms, "close_s": close_s,
            "granted_mode": client.mode}


def attach_split(socket: Path) -> dict[str, Any]:
    """The pieces of a mapped attach, as client.py makes them, on a registration of their own."""
    from engramd.client.shared.cuda import device_uuid
    from engramd.client.shared.mps import mps_state as client_mps_state

    device = torch.device(DEVICE)
    out: dict[str, Any] = {}
    conn = Connection(socket)
    tables = None
    try:
        started = time.perf_counter()
        reply = conn.call("register", 30.0, pid=os.getpid(), device=f"cuda:{device_uuid(0)}",
                          tp_rank=0, tp_size=1, max_tokens=MAX_TOKENS, slots=2,
                          name="mapped_attach", mps=client_mps_state(0).to_wire(), mode="mapped")
        out["register_ms"] = (time.perf_counter() - started) * 1e3
        f = reply.body
        if f.mode != "mapped":
            raise SystemExit(f"raw registration: asked for mode 'mapped', got {f.mode!r}")
        client_id = f.client_id
        try:
            geometry = TableGeometry.from_config(f.geometry, source="daemon register reply")
            started = time.perf_counter()
            attached = attach(handle_socket_path(socket), client_id, f.token)
            grants = attached.tables
            out["fetch_ms"] = (time.perf_counter() - started) * 1e3
            out["tables_bytes"] = sum(g.rows * g.row_bytes for g in grants)
            out["mmap_ms"] = mmap_alone(grants) * 1e3
            started = time.perf_counter()
            tables = MappedTables(grants, geometry, device)
            attached.close_descriptors()  # the mappings keep the files
            out["map_register_s"] = time.perf_counter() - started
            out["register_gb_s"] = out["tables_bytes"] / 1e9 / out["map_register_s"]
            started = time.perf_counter()
            mapped_gather(geometry.shard(0, 1), tables, device,
                          int((f.gather or {}).get("sort_min_tokens", 0)))
            torch.cuda.synchronize()
            out["gather_prep_s"] = time.perf_counter() - started
            started = time.perf_counter()
            tables.close()
            tables = None
            out["unregister_s"] = time.perf_counter() - started
        finally:
            if tables is not None:
                tables.close()
            try:
                conn.call("release", 5.0, client_id=client_id)
            except EngramError as exc:  # e.g. reaped: a PID the daemon cannot see, no heartbeats
                out["release_error"] = str(exc)
    finally:
        conn.close()
    return out


def mmap_alone(grants: list) -> float:
    """Seconds to map the granted files read-only as MappedTables does, on duplicates of the
    descriptors (the mappings are dropped at once; nothing is registered)."""
    fds = [os.dup(g.fd) for g in grants]
    maps = []
    try:
        started = time.perf_counter()
        for fd, g in zip(fds, grants, strict=True):
            maps.append(mmap.mmap(fd, g.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ))
        return time.perf_counter() - started
    finally:
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)


# -- the run -------------------------------------------------------------------------------------


def shm_kind(root: str | None) -> str:
    """Where the tables lay, for the report: /dev/shm, or the file system type of --shm-root."""
    if root is None:
        return "/dev/shm"
    return f"{root} ({mount_type(Path(root).resolve()) or 'not a mount point'})"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    started_run = time.monotonic()
    if not torch.cuda.is_available():
        raise SystemExit("mapped_attach needs a CUDA GPU")
    geometry = geometry_for(args.table_gib)
    attach, restarts = [], []
    with bench_folders(shm_root=args.shm_root) as (work, shm):
        started = time.monotonic()
        fill_tables(geometry, work / "ckpt", shm, INSTANCE)  # prints how long it took
        fill_s = time.monotonic() - started
        daemon = Daemon(work, daemon_flags(work, shm, args.daemon_args))
        try:
            first = daemon.start()
            print(f"daemon ready in {first['ready_s']:.2f} s (first start): {first['log']}",
                  flush=True)
            for repeat in range(args.repeat):
                row = {"repeat": repeat + 1, **attach_end_to_end(daemon.socket, geometry),
                       **attach_split(daemon.socket)}
                attach.append(row)
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                      flush=True)
            rider = RideThrough(daemon.socket, geometry) if args.restarts else None
            for repeat in range(args.restarts):
                timed: dict[str, Any] = {}
                ride = rider.through(functools.partial(timed_restart, daemon, timed))
                stop_s, timing = timed["stop_s"], timed["timing"]
                restart_row = {"repeat": repeat + 1, "stop_s": round(stop_s, 3),
                               "socket_left_after_stop": timed["socket_left"], **timing,
                               "sigterm_to_ready_s": round(stop_s + timing["ready_s"], 3),
                               "gb_s": round(geometry.total_bytes / 1e9 / timing["ready_s"], 2),
                               "ride": ride}
                restarts.append(restart_row)
                print(restart_row, flush=True)
            if rider is not None:
                rider.close()
        finally:
            daemon.kill()
    return {"meta": {"benchmark": "mapped_attach", "gpu": torch.cuda.get_device_name(),
                     "torch": torch.__version__, "table_gib": round(geometry.total_bytes / 2**30, 2),
                     "table_bytes": geometry.total_bytes, "rows": list(geometry.rows),
                     "max_tokens": MAX_TOKENS, "daemon_args": args.daemon_args,
                     "shm": shm_kind(args.shm_root),
                     "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "(unset)"),
                     "machine": machine(),
                     **mps_state(False),
                     "command": "python benchmarks/mapped_attach.py " + shlex.join(sys.argv[1:]),
                     "date": time.strftime("%Y-%m-%d %H:%M"), "fill_s": round(fill_s, 1),
                     "seconds": round(time.monotonic() - started_run, 1)},
            "first_start": first, "attach": attach, "restarts": restarts,
            "projection": projection(geometry, attach, restarts)}


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return float(np.median(values)) if values else None


def projection(geometry: TableGeometry, attach: list[dict], restarts: list[dict]) -> dict:
    """V4.1-Flash's 189 GiB: the registration (and the daemon's pinning) at the measured GB/s,
    the rest of each figure as measured (independent of the table's size)."""
    out: dict[str, Any] = {"table_gib": round(V41.total_bytes / 2**30, 2),
                           "table_bytes": V41.total_bytes,
                           "scale": round(V41.total_bytes / geometry.total_bytes, 3)}
    rate, register_s, attach_s = (_median(attach, k) for k in
                                  ("register_gb_s", "map_register_s", "attach_s"))
    if rate:
        out["register_s"] = round(V41.total_bytes / 1e9 / rate, 2)
        out["attach_s"] = round(attach_s - register_s + out["register_s"], 2)
    pins = [r["log"] for r in restarts if r["log"].get("pin_gb_s")]
    if pins:
        pin_rate = float(np.median([p["pin_gb_s"] for p in pins]))
        out["daemon_pin_s"] = round(V41.total_bytes / 1e9 / pin_rate, 2)
        # The pin overlaps the daemon's imports, so a longer pin can hide behind them (lower
        # bound) or push back all that followed it here (upper bound).
        ready_s = _median(restarts, "ready_s")
        pin_end = float(np.median([p["at_s"]["mapped"] for p in pins])) + out["daemon_pin_s"]
        after_pin = max(0.0, ready_s - float(np.median([p["at_s"]["pinned"] for p in pins])))
        out["restart_ready_low_s"] = round(max(ready_s, pin_end), 2)
        out["restart_ready_s"] = round(pin_end + after_pin, 2)
    return out


# -- report --------------------------------------------------------------------------------------

ATTACH_ROWS = (  # key, label, digits
    ("attach_s", "EngramClient(mode=\"mapped\") constructed, end to end, s", 3),
    ("first_lookup_ms", "first lookup (1 token, lookup + wait + synchronize), ms", 2),
    ("close_s", "close() (synchronize, unregister, release), s", 3),
    ("register_ms", "split: register over ZeroMQ, ms", 2),
    ("fetch_ms", "split: attach (handle socket), ms", 2),
    ("mmap_ms", "split: mmap of the granted files alone, ms", 3),
    ("map_register_s", "split: MappedTables (mmap + cudaHostRegister ReadOnly), s", 3),
    ("register_gb_s", "split: registration GB/s (table bytes / MappedTables)", 2),
    ("gather_prep_s", "split: mapped_gather (plan + warm-up), s", 3),
    ("unregister_s", "split: MappedTables.close (cudaHostUnregister), s", 3),
)
RESTART_ROWS = (
    ("stop_s", "SIGTERM -> exited, s"),
    ("live_s", "start -> first health answer (live), s"),
    ("ready_s", "start -> health ready, s"),
    ("sigterm_to_ready_s", "SIGTERM -> ready again, s"),
    ("gb_s", "GB/s of the tables (bytes / start -> ready)"),
    ("log.at_s.imported", "daemon log: modules imported (torch included), s after the spawn"),
    ("log.at_s.listening", "daemon log: listening, s after the spawn"),
    ("log.verify_s", "daemon log: re-attach verification (all layers), s"),
    ("log.at_s.mapped", "daemon log: tables mapped, pinning starts, s after the spawn"),
    ("log.at_s.pinned", "daemon log: pinned, s after the spawn"),
    ("log.pin_s", "daemon log: pinning, s"),
    ("log.pin_gb_s", "daemon log: pinning GB/s"),
    ("log.at_s.kernels", "daemon log: gather kernels warmed, s after the spawn"),
    ("log.at_s.ready", "daemon log: ready, s after the spawn"),
    ("log.how", "tables (daemon log)"),
    ("ride.lookups_until_ready", "mapped client: lookups from SIGTERM to ready"),
    ("ride.longest_gap_ms", "mapped client: longest gap between lookups, ms"),
    ("ride.rows_exact", "mapped client: every lookup's rows those of its first"),
    ("ride.rejoined_after_ready_s", "mapped client: registered with the new daemon, s after ready"),
    ("ride.kept_mapping", "mapped client: kept its mapping (not mapped again)"),
    ("ride.error", "mapped client: error"),
)


def _get(row: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(row, dict):
            return None
        row = row.get(part)
    return row


def markdown(report: dict) -> str:
    meta, attach, restarts = report["meta"], report["attach"], report["restarts"]
    proj, first = report["projection"], report["first_start"]
    lines = [f"# Mapped attach on {meta['gpu']} ({meta['date']})", "",
             f"Host table {meta['table_gib']} GiB ({meta['table_bytes'] / 1e9:.2f} GB, rows per "
             f"layer {meta['rows']}) in {meta.get('shm', '/dev/shm')}, one daemon (`--backend cuda --self-check false "
             f"{meta['daemon_args']}`), MPS {'on' if meta.get('mps') else 'off'}, "
             f"CUDA_MODULE_LOADING {meta.get('cuda_module_loading', '?')}; filled in "
             f"{meta['fill_s']} s; run {meta['seconds']} s. Command: `{meta['command']}`. The "
             "first repeat also loads the gather kernels into this process.", "",
             "| mapped client attach | " + " | ".join(f"#{r['repeat']}" for r in attach)
             + " | median |", "|---|" + "---:|" * (len(attach) + 1)]
    for key, label, digits in ATTACH_ROWS:
        values = [r.get(key) for r in attach]
        lines.append(f"| {label} | " + " | ".join(cell(v, digits) for v in values)
                     + f" | {cell(_median(attach, key), digits)} |")
    lines += ["", f"Daemon first start (tables already in {meta.get('shm', '/dev/shm')}): live {first['live_s']} s, "
              f"ready {first['ready_s']} s ({first['log'].get('how', '?')}).", ""]
    if restarts:
        lines += ["| daemon restart, same shm folder and instance | "
                  + " | ".join(f"#{r['repeat']}" for r in restarts) + " |",
                  "|---|" + "---:|" * len(restarts)]
        for key, label in RESTART_ROWS:
            lines.append(f"| {label} | " + " | ".join(cell(_get(r, key), 2) for r in restarts)
                         + " |")
        lines.append("")
    lines += [f"Projection to {proj['table_gib']} GiB (V4.1-Flash, 2 layers x "
              f"{V41.table_bytes(0) / 2**30:.1f} GiB; x{proj['scale']} the bytes here), the "
              "size-bound part scaled at the measured GB/s, the rest as measured:", "",
              "| figure | seconds |", "|---|---:|",
              f"| mapped client: registration (MappedTables) | {cell(proj.get('register_s'), 1)} |",
              f"| mapped client: attach end to end | {cell(proj.get('attach_s'), 1)} |",
              f"| daemon: pinning | {cell(proj.get('daemon_pin_s'), 1)} |",
              f"| daemon: restart to ready, at least (the longer pin hidden by the imports) | "
              f"{cell(proj.get('restart_ready_low_s'), 1)} |",
              f"| daemon: restart to ready, at most (all that followed the pin still after it) | "
              f"{cell(proj.get('restart_ready_s'), 1)} |"]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=16.0)
    parser.add_argument("--repeat", type=int, default=3, help="mapped attaches (each: end to end, "
                        "then split)")
    parser.add_argument("--restarts", type=int, default=1, help="daemon restarts to time")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--shm-root", default=None, help="where the table folder is made "
                        "(default /dev/shm; a hugetlbfs mount for 2 MiB pages)")
    parser.add_argument("--daemon-args", default="",
                        help="extra `engramd serve` flags, split like a shell's (write it with '=')")
    args = parser.parse_args()
    if args.repeat < 1 or args.restarts < 0 or args.table_gib <= 0:
        parser.error("--repeat must be >= 1, --restarts >= 0, --table-gib > 0")
    return args


def main() -> int:
    args = parse_args()
    report = measure(args)
    write_report(Path(args.out), report, JSON_NAME, MD_NAME, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
