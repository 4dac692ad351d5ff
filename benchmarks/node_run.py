"""Multi-GPU node run: one daemon, one client process per GPU, checked and timed together.

    python benchmarks/node_run.py --table-gib 33 --out DIR [--tokens 4096] [--seconds 10]
                                  [--machine-kind nvidia-h200] [--tp 2 4] [--max-gpus N]
                                  [--daemon-args "--flag value ..."] [--mode auto|served|mapped]

What engramd is for: one host copy of the tables per node, serving every GPU. This script fills one
table in /dev/shm (V4.1 row width, random bytes, common/tables.py: the daemon re-attaches it
from a sparse checkpoint), starts one daemon (--backend cuda) and one client process per GPU
(benchmarks/node_client.py), each with CUDA_VISIBLE_DEVICES set to its GPU's UUID, so device
indices differ between the processes and only UUIDs match. Steps, in order:

 1. Correctness: every client looks up hash IDs (bucket-consistent, with -1, repeated tokens and
    IDs past the table) and must get rows bit-exact with a CPU reference (engramd's reference
    kernel, gather_ref, over the same /dev/shm bytes), as a view of the daemon's slab in its own
    GPU's memory. --mode picks how the clients are served (default auto: the daemon decides,
    mapped on a GPU): mapped clients gather themselves from their read-only mappings of the
    daemon's tables, into slot memory of their own.
 2. Throughput, all GPUs at once: each client loops lookups of --tokens tokens for --seconds
    through the daemon (fresh IDs from a pool pre-drawn on its GPU, at most --depth in flight).
    Host memory (PSS from /proc/<pid>/smaps_rollup of the daemon and the clients) is sampled
    mid-run.
 3. TP views: for each --tp size, a group of client processes (ranks placed round-robin over the
    GPUs, so with one GPU they share it) looks up the same IDs; each rank must get its own heads
    (checked against the reference for its shard), and all-gathered over the heads they must
    equal the TP-1 rows.
 4. In-process comparison, all GPUs at once: the daemon is stopped; every client maps the same
    table file itself, pins it (cudaHostRegister) and runs the same Triton gather in-process on
    the same IDs (what engines with their own tables do, each GPU reading host memory over its
    own PCIe link). First its rows must equal the daemon's; then the same timed loop; PSS again.

Host memory, measured vs computed: PSS splits a shared page among the processes that map it, so
the sum over all processes is the node's resident memory. Both measured phases map ONE shared
file (in the in-process phase each client maps it itself), so both show about one table. What
per-process tables as engines hold them today would cost (a private copy per GPU) is computed:
N x table bytes; it is not allocated.

Writes node_run.json and node_run.md to --out. Exits 1 if any check failed (after writing the
results), 2 if a step could not run (a process died or did not answer in time; no results).
`--backend cpu --clients N` runs every step against a CPU daemon with CPU clients (the CPU
reference kernel stands in for the in-process gather): a smoke test of the orchestration on a
machine without GPUs; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramd.client.geometry import ShardView, TableGeometry
from engramd.kernels import gather_ref

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common.daemon import start_daemon, stop_process  # noqa: E402
from common.report import cpu_model  # noqa: E402
from common.rows import bitwise_mismatches  # noqa: E402
from common.tables import fill_tables, geometry_for, reattach_flags  # noqa: E402

CLIENT_SCRIPT = HERE / "node_client.py"
REPO = HERE.parent
INSTANCE = "node"

# How long the parent waits for each step; a step that takes longer fails the run (exit 2) with
# the client's log. Generous: CUDA start, 33 GiB cudaHostRegister and kernel compiles are slow.
HELLO_S = 180.0
CONNECT_S = 180.0
LOOKUP_S = 180.0
DRAW_S = 120.0
TIMED_EXTRA_S = 120.0  # on top of --seconds
MAP_S = 420.0  # map + pin the table + compile and warm the gather, in every client at once
EXIT_S = 60.0
DAEMON_START_S = 420.0
DAEMON_STOP_S = 120.0
START_DELAY_S = 2.0  # timed loops start this long after the command: time to warm up first

DEAD_FRACTION = 0.05  # of the check IDs: -1
PAST_FRACTION = 0.01  # past the end of the layer's table (zeros, counted as out of range)
REPEAT_FRACTION = 0.125  # tokens that repeat another token's IDs
CHECK_SEEDS = 1000


class NodeRunError(Exception):
    """A step could not run: which process, which step, why (with its log)."""


# -- processes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    index: int  # as this process and the daemon see it
    uuid: str
    name: str


def visible_gpus(limit: int | None) -> list[Gpu]:
    from engramd.client.shared.cuda import device_uuid

    if not torch.cuda.is_available():
        raise NodeRunError("no CUDA device is visible (use --backend cpu for a smoke run)")
    count = torch.cuda.device_count()
    count = min(count, limit) if limit else count
    return [Gpu(i, device_uuid(i), torch.cuda.get_device_name(i)) for i in range(count)]


class ClientProcess:
    """A node_client.py process: JSON commands on its stdin, JSON replies on a pipe of its own."""

    def __init__(self, name: str, gpu: Gpu, device: str, workdir: Path):
        self.name = name
        self.gpu = gpu
        self.log_path = workdir / f"{name}.log"
        env = dict(os.environ)
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = gpu.uuid  # this process sees only its GPU, as cuda:0
        read_fd, write_fd = os.pipe()
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, str(CLIENT_SCRIPT), "--reply-fd", str(write_fd),
                     "--device", device],
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                    pass_fds=(write_fd,), text=True)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.hello: dict[str, Any] = {}
        self.mode = ""  # granted at connect
        self._replies: queue.Queue[dict | None] = queue.Queue()
        reader = threading.Thread(target=self._read, args=(os.fdopen(read_fd),),
                                  name=f"replies-{name}", daemon=True)
        reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, replies) -> None:
        with replies:
            for line in replies:
                self._replies.put(json.loads(line))
        self._replies.put(None)  # the process closed its end: it exited

    def send(self, op: str, **fields: Any) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise NodeRunError(f"{self.name} exited (status {self.proc.poll()}) before {op!r}"
                               f"\n{self.log_tail()}") from None

    def reply(self, op: str, timeout: float) -> dict[str, Any]:
        try:
            message = self._replies.get(timeout=max(timeout, 1.0))
        except queue.Empty:
            raise NodeRunError(f"{self.name}: no reply to {op!r} within {timeout:.0f} s (the step "
                               f"limits are constants at the top of node_run.py)"
                               f"\n{self.log_tail()}") from None
        if message is None:
            try:
                status = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                status = "unknown"
            raise NodeRunError(f"{self.name} exited (status {status}) during {op!r}"
                               f"\n{self.log_tail()}")
        if not message["ok"]:
            raise NodeRunError(f"{self.name} {op}: {message['error']}\n{message['traceback']}")
        return message

    def call(self, op: str, timeout: float, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.reply(op, timeout)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        return f"--- {self.name} log (last {chars} chars) ---\n{text[-chars:]}"

    def close(self) -> None:
        """Ask it to exit; kill it if it does not within EXIT_S."""
        if self.proc.poll() is None:
            try:
                self.call("exit", EXIT_S)
                self.proc.wait(EXIT_S)
            except (NodeRunError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def call_all(clients: list[ClientProcess], op: str, timeout: float,
             fields: dict[str, dict[str, Any]] | None = None, **common: Any) -> list[dict]:
    """Send `op` to every client at once, then collect every reply within `timeout` overall."""
    for client in clients:
        client.send(op, **common, **(fields or {}).get(client.name, {}))
    deadline = time.monotonic() + timeout
    return [client.reply(op, deadline - time.monotonic()) for client in clients]


def spawn(names_gpus: list[tuple[str, Gpu]], device: str, workdir: Path,
          running: list[ClientProcess]) -> list[ClientProcess]:
    """Start clients and check each sees exactly its own GPU (index 0 there, by UUID)."""
    clients = []
    for name, gpu in names_gpus:
        clients.append(ClientProcess(name, gpu, device, workdir))
        running.append(clients[-1])
    for client, hello in zip(clients, call_all(clients, "hello", HELLO_S), strict=True):
        if device == "cuda" and (hello["device_count"] != 1 or hello["uuid"] != client.gpu.uuid):
            raise NodeRunError(f"{client.name} was given {client.gpu.uuid} but sees "
                               f"{hello['device_count']} device(s), device 0 = {hello['uuid']}")
        client.hello = hello
    return clients


# -- tables and the reference -----------------------------------------------------------------


class ReferenceTables:
    """The table files mapped read-only; expected rows come from gather_ref on the CPU.

    Read-only rather than copy-on-write: a private writable mapping of tens of GiB would be
    charged against the commit limit. gather_ref only indexes the tables, never writes them.
    """

    def __init__(self, specs: list[dict]):
        self._maps: list[mmap.mmap] = []
        self.tables: list[torch.Tensor] = []
        for spec in specs:
            nbytes = spec["rows"] * spec["row_bytes"]
            with open(spec["path"], "rb") as f:
                mapping = mmap.mmap(f.fileno(), spec["data_offset"] + nbytes,
                                    access=mmap.ACCESS_READ)
            self._maps.append(mapping)
            array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=spec["data_offset"])
            with warnings.catch_warnings():  # torch warns that the array is not writable: known
                warnings.simplefilter("ignore", UserWarning)
                table = torch.from_numpy(array.reshape(spec["rows"], spec["row_bytes"]))
            self.tables.append(table)

    def expected(self, ids: torch.Tensor, shard: ShardView) -> torch.Tensor:
        return gather_ref.gather(self.tables, ids, shard)[0]

    def close(self) -> None:
        self.tables = []
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:
                pass  # a tensor still views it; unmapped when that goes
        self._maps = []


def check_ids(geometry: TableGeometry, tokens: int, seed: int) -> torch.Tensor:
    """[T, n_layers, heads] int64 as hashing makes them (head h's ID in bucket h), plus -1,
    IDs past the table and tokens that repeat another token's IDs."""
    rng = np.random.default_rng(seed)
    ids = np.empty((tokens, geometry.n_layers, geometry.heads), dtype=np.int64)
    for layer in range(geometry.n_layers):
        offsets = np.array(geometry.offsets[layer], dtype=np.int64)
        sizes = np.array(geometry.primes[layer], dtype=np.int64)
        ids[:, layer] = offsets + rng.integers(0, sizes, size=(tokens, geometry.heads))
    roll = rng.random(ids.shape)
    ids[roll < DEAD_FRACTION] = -1
    past = (roll >= DEAD_FRACTION) & (roll < DEAD_FRACTION + PAST_FRACTION)
    ends = np.broadcast_to(np.array(geometry.rows, dtype=np.int64)[None, :, None], ids.shape)
    ids[past] = ends[past] + rng.integers(0, 1000, size=int(past.sum()))
    repeats = int(tokens * REPEAT_FRACTION)
    if repeats:
        ids[rng.choice(tokens, repeats, replace=False)] = ids[rng.integers(0, tokens, repeats)]
    return torch.from_numpy(ids)


# -- host memory ------------------------------------------------------------------------------

PSS_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def process_memory(pid: int) -> dict[str, int | None]:
    """Bytes of PSS_FIELDS from /proc/<pid>/smaps_rollup (None where the kernel lacks a field)."""
    path = Path(f"/proc/{pid}/smaps_rollup")
    try:
        text = path.read_text()
    except OSError as exc:
        raise NodeRunError(f"cannot read {path}: {exc.strerror}") from exc
    found: dict[str, int] = {}
    for line in text.splitlines()[1:]:  # the first line is the address range
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            found[key.strip()] = int(parts[0]) * 1024
    if "Pss" not in found:
        raise NodeRunError(f"{path} has no Pss line")
    return {field: found.get(field) for field in PSS_FIELDS}


def memory_snapshot(roles: dict[str, int]) -> dict[str, Any]:
    """PSS of each process (role -> pid) and the sums, with the system's Shmem at that time."""
    processes = [{"role": role, "pid": pid, **process_memory(pid)} for role, pid in roles.items()]
    sums = {}
    for field in PSS_FIELDS:
        values = [p[field] for p in processes]
        sums[field] = None if any(v is None for v in values) else sum(values)
    return {"processes": processes, "sum": sums, "meminfo_shmem": meminfo().get("Shmem"),
            "harness": process_memory(os.getpid())}


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return out


def sample_memory_mid_run(roles: dict[str, int], start_at: float, seconds: float) -> dict:
    time.sleep(max(0.0, start_at + seconds / 2 - time.time()))
    return memory_snapshot(roles)


def memory_summary(engramd: dict, in_process: dict, table_bytes: int, replicas: int) -> dict:
    def copies(snapshot: dict) -> float | None:
        shmem = snapshot["sum"]["Pss_Shmem"]
        return None if shmem is None else shmem / table_bytes

    return {"table_bytes": table_bytes, "replicas": replicas,
            "engramd": {**engramd, "table_copies": copies(engramd)},
            "in_process_shared_file": {**in_process, "table_copies": copies(in_process)},
            "per_process_private_tables_computed": {
                "bytes": replicas * table_bytes, "table_copies": replicas,
                "note": "computed (N x table bytes), not allocated"}}


# -- steps ------------------------------------------------------------------------------------


class Checks:
    """Pass/fail results; a failure is reported at once and makes the run exit 1 at the end."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.items.append({"name": name, "passed": bool(passed), "detail": detail})
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)

    def failed(self) -> list[dict[str, Any]]:
        return [c for c in self.items if not c["passed"]]


def rows_check(checks: Checks, name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    wrong, first = bitwise_mismatches(actual, expected)
    checks.add(name, wrong == 0, "bit-exact" if wrong == 0 else
               f"{wrong} values differ, first at {first}" if wrong > 0 else first[0])


def correctness_step(clients: list[ClientProcess], geometry: TableGeometry, tokens: int,
                     workdir: Path, reference: ReferenceTables, checks: Checks) -> dict:
    """Each client looks up its own IDs; rows must be in its slab on its GPU and bit-exact."""
    sizes = sorted({tokens, 1, min(333, tokens)}, reverse=True)
    files: dict[str, dict[str, list[str]]] = {}
    for i, client in enumerate(clients):
        ids_paths, rows_paths = [], []
        for k, t in enumerate(sizes):
            ids_paths.append(str(workdir / f"{client.name}.ids{k}.pt"))
            rows_paths.append(str(workdir / f"{client.name}.rows{k}.pt"))
            torch.save(check_ids(geometry, t, CHECK_SEEDS * i + k), ids_paths[-1])
        files[client.name] = {"ids_paths": ids_paths, "rows_paths": rows_paths}
    replies = call_all(clients, "lookup", LOOKUP_S, fields=files)
    full = geometry.shard(0, 1)
    result = {"lookup_tokens": sizes, "clients": []}
    for client, reply in zip(clients, replies, strict=True):
        where = f"{client.name} (daemon's cuda:{client.gpu.index}, {client.gpu.uuid})"
        checks.add(f"{client.name} ({client.mode}): rows are a view of its slot memory on its device",
                   all(reply["in_slab"]), f"in_slab {reply['in_slab']}, devices {reply['devices']}")
        paths = files[client.name]
        for ids_path, rows_path in zip(paths["ids_paths"], paths["rows_paths"], strict=True):
            ids = torch.load(ids_path, weights_only=True)
            rows = torch.load(rows_path, weights_only=True)
            rows_check(checks, f"{where}: {ids.shape[0]} tokens vs CPU reference", rows,
                       reference.expected(ids, full))
        result["clients"].append({"name": client.name, "mode": client.mode,
                                  "daemon_index": client.gpu.index,
                                  "uuid": client.gpu.uuid, "hello": client.hello,
                                  "devices": reply["devices"], "in_slab": reply["in_slab"]})
    result["first_files"] = {c.name: (files[c.name]["ids_paths"][0], files[c.name]["rows_paths"][0])
                             for c in clients}
    return result


def timed_step(clients: list[ClientProcess], op: str, args: argparse.Namespace,
               roles: dict[str, int]) -> tuple[list[dict], dict]:
    """Every client runs `op` from the same wall-clock instant; PSS is sampled mid-run."""
    start_at = time.time() + START_DELAY_S
    for client in clients:
        client.send(op, seconds=args.seconds, start_at=start_at, depth=args.depth)
    memory, memory_error = None, None
    try:
        memory = sample_memory_mid_run(roles, start_at, args.seconds)
    except NodeRunError as exc:  # a client that died is explained by its reply, raised first
        memory_error = exc
    deadline = time.monotonic() + START_DELAY_S + args.seconds + TIMED_EXTRA_S
    runs = [{"client": c.name, "gpu": c.gpu.index, **c.reply(op, deadline - time.monotonic())}
            for c in clients]
    if memory_error is not None:
        raise memory_error
    for run in runs:
        del run["ok"], run["op"]
    return runs, memory


def throughput_summary(engramd: list[dict], in_process: list[dict]) -> dict:
    per_gpu = []
    for e, p in zip(engramd, in_process, strict=True):
        per_gpu.append({"client": e["client"], "gpu": e["gpu"],
                        "engramd_rows_per_s": e["rows_per_s"],
                        "in_process_rows_per_s": p["rows_per_s"],
                        "ratio": e["rows_per_s"] / p["rows_per_s"]})
    total_e = sum(r["rows_per_s"] for r in engramd)
    total_p = sum(r["rows_per_s"] for r in in_process)
    return {"per_gpu": per_gpu, "aggregate_engramd_rows_per_s": total_e,
            "aggregate_in_process_rows_per_s": total_p, "aggregate_ratio": total_e / total_p,
            "overlap_engramd": overlap(engramd), "overlap_in_process": overlap(in_process)}


def overlap(runs: list[dict]) -> float:
    """Fraction of the mean run time during which all clients were running at once."""
    common = min(r["wall_end"] for r in runs) - max(r["wall_start"] for r in runs)
    return max(0.0, common) / (sum(r["seconds"] for r in runs) / len(runs))


def tp_step(tp: int, gpus: list[Gpu], args: argparse.Namespace, socket: Path, workdir: Path,
            first: tuple[str, str], reference: ReferenceTables, geometry: TableGeometry,
            checks: Checks, running: list[ClientProcess]) -> dict:
    """A TP group looks up the TP-1 client's first IDs; its own heads each, together the rows."""
    ids_path, full_rows_path = first
    ranks = [(f"tp{tp}-rank{r}", gpus[r % len(gpus)]) for r in range(tp)]
    group = spawn(ranks, args.backend, workdir, running)
    connected = call_all(group, "connect", CONNECT_S, fields={
        c.name: {"tp_rank": r, "name": c.name} for r, c in enumerate(group)},
        socket=str(socket), tp_size=tp, max_tokens=args.tokens, slots=2, mode=args.mode)
    rows_paths = [str(workdir / f"{c.name}.rows.pt") for c in group]
    replies = call_all(group, "lookup", LOOKUP_S, fields={
        c.name: {"ids_paths": [ids_path], "rows_paths": [path]}
        for c, path in zip(group, rows_paths, strict=True)})
    for client in group:
        client.close()
    ids = torch.load(ids_path, weights_only=True)
    parts, ranks_out = [], []
    for r, (client, info, reply) in enumerate(zip(group, connected, replies, strict=True)):
        shard = geometry.shard(r, tp)
        heads = (info["head_start"], info["head_end"])
        checks.add(f"TP {tp} rank {r}: registered for heads [{shard.head_start}, "
                   f"{shard.head_end}), rows in its slab",
                   heads == (shard.head_start, shard.head_end) and all(reply["in_slab"]),
                   f"registered shard heads [{heads[0]}, {heads[1]}) "
                   f"(local_heads {info['local_heads']}), in_slab {reply['in_slab']}, "
                   f"devices {reply['devices']}")
        rows = torch.load(rows_paths[r], weights_only=True)
        rows_check(checks, f"TP {tp} rank {r} ({client.gpu.uuid}) vs CPU reference of its shard",
                   rows, reference.expected(ids, shard))
        parts.append(rows[:, :, :shard.head_end - shard.head_start])
        ranks_out.append({"rank": r, "client": client.name, "daemon_index": client.gpu.index,
                          "heads": list(heads), "local_heads": info["local_heads"]})
    gathered = torch.cat(parts, dim=2)
    rows_check(checks, f"TP {tp}: ranks all-gathered over heads vs the TP-1 rows", gathered,
               torch.load(full_rows_path, weights_only=True))
    return {"tp": tp, "tokens": int(ids.shape[0]), "ranks": ranks_out}


def stop_daemon(proc: subprocess.Popen, checks: Checks) -> None:
    status = stop_process(proc, DAEMON_STOP_S)
    checks.add("daemon stopped cleanly on SIGTERM", status == 0, f"exit status {status}")


# -- the run ----------------------------------------------------------------------------------


def start_node_daemon(args: argparse.Namespace, work: Path, shm: Path,
                      daemon: list[subprocess.Popen]) -> tuple[subprocess.Popen, Path]:
    flags = [*reattach_flags(work / "ckpt", shm, INSTANCE), "--backend", args.backend,
             "--max-tokens", str(args.tokens), "--metrics-address", "127.0.0.1:0"]
    if args.cuda_dispatch:
        flags += ["--cuda-dispatch", args.cuda_dispatch]
    flags += shlex.split(args.daemon_args)
    try:
        proc, socket = start_daemon(work, flags, timeout=DAEMON_START_S)
    except SystemExit as exc:  # start_daemon's way of saying the daemon died or never got ready
        raise NodeRunError(f"the daemon did not start: {exc}") from None
    daemon.append(proc)
    return proc, socket


def connect_replicas(args: argparse.Namespace, gpus: list[Gpu], socket: Path, work: Path,
                     geometry: TableGeometry, running: list[ClientProcess]) -> list[ClientProcess]:
    """One TP-1 client process per GPU, registered with the daemon."""
    clients = spawn([(f"gpu{g.index}", g) for g in gpus], args.backend, work, running)
    connected = call_all(clients, "connect", CONNECT_S, socket=str(socket), tp_rank=0, tp_size=1,
                         max_tokens=args.tokens, slots=args.slots, mode=args.mode,
                         fields={c.name: {"name": c.name} for c in clients})
    for client, info in zip(clients, connected, strict=True):
        client.mode = info["mode"]
        if args.mode != "auto" and info["mode"] != args.mode:
            raise NodeRunError(f"{client.name} asked for mode {args.mode!r}, the daemon granted "
                               f"{info['mode']!r}")
        if info["rows"] != list(geometry.rows):
            raise NodeRunError(f"{client.name} got rows {info['rows']} from the daemon, "
                               f"expected {list(geometry.rows)}")
    return clients


def engramd_phase(args: argparse.Namespace, gpus: list[Gpu], geometry: TableGeometry,
                  specs: list[dict], work: Path, shm: Path, running: list[ClientProcess],
                  daemon: list[subprocess.Popen], checks: Checks) -> tuple[list, dict]:
    """Steps 1-3 with the daemon up; returns the TP-1 clients (still running) and results."""
    proc, socket = start_node_daemon(args, work, shm, daemon)
    clients = connect_replicas(args, gpus, socket, work, geometry, running)
    reference = ReferenceTables(specs)
    try:
        result = {"correctness": correctness_step(clients, geometry, args.tokens, work,
                                                  reference, checks)}
    finally:
        reference.close()  # the harness maps no table while memory is sampled
    first = result["correctness"].pop("first_files")[clients[0].name]
    call_all(clients, "draw", DRAW_S, tokens=args.tokens, count=args.pool,
             fields={c.name: {"seed": 7 + i} for i, c in enumerate(clients)})
    roles = {"daemon": proc.pid, **{c.name: c.pid for c in clients}}
    result["engramd_runs"], result["engramd_memory"] = timed_step(clients, "time_engramd", args,
                                                                  roles)
    call_all(clients, "disconnect", CONNECT_S)
    reference = ReferenceTables(specs)
    try:
        result["tp"] = [tp_step(tp, gpus, args, socket, work, first, reference, geometry, checks,
                                running) for tp in args.tp]
    finally:
        reference.close()
    stop_daemon(proc, checks)
    daemon.clear()
    return clients, result


def in_process_phase(args: argparse.Namespace, clients: list[ClientProcess], specs: list[dict],
                     checks: Checks) -> tuple[list[dict], dict, list[float]]:
    """Step 4, daemon stopped: every client maps, pins and gathers from the table itself."""
    mapped = call_all(clients, "map_tables", MAP_S, tables=specs)
    for client, reply in zip(clients, mapped, strict=True):
        wrong = reply["mismatches_vs_daemon"]
        checks.add(f"{client.name}: in-process gather returns the daemon's rows", wrong == 0,
                   "bit-exact" if wrong == 0 else
                   f"{wrong} differ, first at {reply['first_wrong']}")
    runs, memory = timed_step(clients, "time_in_process", args, {c.name: c.pid for c in clients})
    call_all(clients, "unmap", MAP_S)
    for client in clients:
        client.close()
    return runs, memory, [r["pin_and_warm_s"] for r in mapped]


def run_node(args: argparse.Namespace, work: Path, shm: Path, gpus: list[Gpu],
             running: list[ClientProcess], daemon: list[subprocess.Popen], checks: Checks) -> dict:
    geometry = geometry_for(args.table_gib)
    specs = fill_tables(geometry, work / "ckpt", shm, INSTANCE, args.backend)
    clients, result = engramd_phase(args, gpus, geometry, specs, work, shm, running, daemon,
                                    checks)
    engramd_runs = result.pop("engramd_runs")
    engramd_memory = result.pop("engramd_memory")
    in_process_runs, in_process_memory, ready_s = in_process_phase(args, clients, specs, checks)
    result["throughput"] = {"engramd": engramd_runs, "in_process": in_process_runs,
                            "summary": throughput_summary(engramd_runs, in_process_runs),
                            "in_process_pin_and_warm_s": ready_s}
    result["memory"] = memory_summary(engramd_memory, in_process_memory, geometry.total_bytes,
                                      len(clients))
    return {"table_bytes": geometry.total_bytes, "rows": list(geometry.rows), **result}


def cleanup(running: list[ClientProcess], daemon: list[subprocess.Popen], work: Path,
            shm: Path, failed: bool) -> None:
    for client in running:
        if client.proc.poll() is None:
            client.proc.kill()  # only our own children, by their handles
            client.proc.wait()
    for proc in daemon:
        stop_process(proc, DAEMON_STOP_S)
    if failed and (work / "daemon.log").exists():
        print("--- daemon log (tail) ---\n" + (work / "daemon.log").read_text()[-4000:])
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)


# -- report -----------------------------------------------------------------------------------


def machine_info(gpus: list[Gpu], args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.backend == "cuda"
    names = [g.name for g in gpus]
    kind = args.machine_kind or (f"{len(gpus)} x {names[0]}" if cuda and gpus else "cpu")
    shm = os.statvfs(args.shm_dir)
    return {"machine_kind": kind, "backend": args.backend,
            "gpus_visible": torch.cuda.device_count() if cuda else 0, "gpus_used": names,
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model() or platform.processor() or platform.machine(),
            "ram_gib": round(meminfo().get("MemTotal", 0) / 2**30, 1),
            "shm_gib": round(shm.f_blocks * shm.f_frsize / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "date": time.strftime("%Y-%m-%d")}


def portable_command(argv: list[str]) -> str:
    """The command as run, with --out shown relative to the repository (or as DIR)."""
    def where(path: str) -> str:
        resolved = Path(path).resolve()
        return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else "DIR"

    words, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--out" and i + 1 < len(argv):
            words += [arg, where(argv[i + 1])]
            i += 2
            continue
        words.append(f"--out={where(arg[6:])}" if arg.startswith("--out=") else arg)
        i += 1
    return shlex.join(["python", "benchmarks/node_run.py", *words])


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def _md_memory(memory: dict) -> list[str]:
    table = memory["table_bytes"]
    lines = ["| phase | process | PSS GiB | of it shmem GiB | RSS GiB |",
             "|---|---|---:|---:|---:|"]
    for phase, key in (("engramd", "engramd"), ("in-process", "in_process_shared_file")):
        snap = memory[key]
        for p in snap["processes"]:
            lines.append(f"| {phase} | {p['role']} | {gib(p['Pss'])} | {gib(p['Pss_Shmem'])} | "
                         f"{gib(p['Rss'])} |")
        s = snap["sum"]
        lines.append(f"| {phase} | **sum** | **{gib(s['Pss'])}** | **{gib(s['Pss_Shmem'])}** | |")
    private = memory["per_process_private_tables_computed"]
    copies = {k: memory[k]["table_copies"] for k in ("engramd", "in_process_shared_file")}

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    lines += ["", f"Table: {gib(table)} GiB. Table copies resident (sum of PSS shmem / table "
              "bytes):",
              f"- engramd, measured: **{fmt(copies['engramd'])}** (daemon + "
              f"{memory['replicas']} client process(es))",
              f"- in-process on one shared file, measured: {fmt(copies['in_process_shared_file'])} "
              "(each client maps and pins the same /dev/shm file itself)",
              f"- per-process private tables (what engines that load their own tables hold), "
              f"computed, not allocated: **{private['table_copies']}** copies = "
              f"{gib(private['bytes'])} GiB",
              "", "PSS divides a shared page among the processes that map it, so a sum over "
              "all of them counts each page once. Shmem is every shared-memory page the "
              "processes map: the table (and on the CPU backend the slabs too). The harness "
              "process maps no table while "
              "memory is sampled and is not in the sums. System-wide Shmem at the samples: "
              f"{gib(memory['engramd']['meminfo_shmem'])} GiB (engramd), "
              f"{gib(memory['in_process_shared_file']['meminfo_shmem'])} GiB (in-process)."]
    return lines


def _md_throughput(thr: dict) -> list[str]:
    summary = thr["summary"]
    lines = ["| client | GPU (daemon's index) | engramd M rows/s | in-process M rows/s | ratio |",
             "|---|---:|---:|---:|---:|"]
    for row in summary["per_gpu"]:
        lines.append(f"| {row['client']} | {row['gpu']} | {row['engramd_rows_per_s'] / 1e6:.1f} | "
                     f"{row['in_process_rows_per_s'] / 1e6:.1f} | {row['ratio']:.3f} |")
    lines.append(f"| **all at once** | | **{summary['aggregate_engramd_rows_per_s'] / 1e6:.1f}** | "
                 f"**{summary['aggregate_in_process_rows_per_s'] / 1e6:.1f}** | "
                 f"**{summary['aggregate_ratio']:.3f}** |")
    lines += ["", f"All clients running at once for {summary['overlap_engramd']:.0%} (engramd) and "
              f"{summary['overlap_in_process']:.0%} (in-process) of the mean run. Lookups: "
              + ", ".join(f"{r['client']} {r['lookups']} engramd / {p['lookups']} in-process"
                          for r, p in zip(thr["engramd"], thr["in_process"], strict=True))]
    return lines


def _md_tp(tp_runs: list[dict]) -> list[str]:
    lines = ["| TP | rank | GPU (daemon's index) | heads | local heads |",
             "|---:|---:|---:|---|---:|"]
    for run in tp_runs:
        for rank in run["ranks"]:
            lines.append(f"| {run['tp']} | {rank['rank']} | {rank['daemon_index']} | "
                         f"[{rank['heads'][0]}, {rank['heads'][1]}) | {rank['local_heads']} |")
    return lines


def _md_correctness(correctness: dict) -> list[str]:
    lines = ["| client | mode | daemon sees it as | client sees it as | UUID | rows a view of its slot memory |",
             "|---|---|---|---|---|---|"]
    for c in correctness["clients"]:
        lines.append(f"| {c['name']} | {c.get('mode', 'served')} | cuda:{c['daemon_index']} | "
                     f"{c['devices'][0]} | {c['uuid']} | {all(c['in_slab'])} |")
    sizes = ", ".join(str(t) for t in correctness["lookup_tokens"])
    lines += ["", f"Each client looked up {len(correctness['lookup_tokens'])} batches ({sizes} "
              "tokens) of bucket-consistent hash IDs with 5% -1, 1% past the table and 12.5% "
              "repeated tokens; rows compared bit for bit (NaN = NaN) with gather_ref on the "
              "CPU over the same /dev/shm bytes."]
    return lines


def markdown_report(report: dict) -> str:
    meta, settings = report["meta"], report["settings"]
    failed = [c for c in report["checks"] if not c["passed"]]
    clients = len(report["correctness"]["clients"])
    if meta["backend"] == "cuda":
        gpus = (f"GPUs used: {clients} of {meta['gpus_visible']} "
                f"({', '.join(sorted(set(meta['gpus_used'])))})")
    else:
        gpus = f"CPU smoke run ({clients} CPU client processes; timings mean nothing)"
    lines = [f"# Node run: one engramd, {clients} client process(es) at TP 1", "",
             f"- Machine: {meta['machine_kind']}; {gpus}; {meta['cpus']} CPUs "
             f"({meta['cpu_model']}); {meta['ram_gib']} GiB RAM; {meta['shm_gib']} GiB /dev/shm",
             f"- Software: torch {meta['torch']}, CUDA {meta['cuda']}, Python {meta['python']}, "
             f"kernel {meta['kernel']}; {meta['date']}",
             f"- Command: `{settings['command']}`",
             f"- Table: {gib(report['table_bytes'])} GiB, 2 layers x {report['rows']} rows x 264 B "
             f"(random bytes); {settings['tokens']} tokens per lookup "
             f"({settings['tokens'] * 48} rows); {settings['seconds']} s per timed loop, at most "
             f"{settings['depth']} lookups in flight, IDs from a pool of {settings['pool']} "
             "batches pre-drawn on each GPU",
             f"- Clients' mode: asked {settings.get('mode', 'auto')}, granted "
             f"{', '.join(sorted({c.get('mode', 'served') for c in report['correctness']['clients']}))}",
             f"- Daemon: `engramd serve --backend {meta['backend']}` with its defaults"
             + (f" and `{settings['daemon_args']}`" if settings["daemon_args"] else "")
             + "; the in-process side runs GatherPlan with its defaults",
             f"- Checks: {len(report['checks']) - len(failed)} of {len(report['checks'])} passed",
             "", "## 1. Rows on every GPU through one daemon", "",
             *_md_correctness(report["correctness"]),
             "", "## 2. Host memory", "", *_md_memory(report["memory"]),
             "", "## 3. Throughput, all GPUs at once", "",
             *_md_throughput(report["throughput"]),
             "", "## 4. TP views", "", *_md_tp(report["tp"]),
             "", "Each rank was checked against the CPU reference of its own shard, and the "
             "ranks' rows concatenated over heads against the TP-1 client's rows for the same "
             "IDs.", "", "## Checks", "", "| check | result | detail |", "|---|---|---|"]
    for c in report["checks"]:
        lines.append(f"| {c['name']} | {'pass' if c['passed'] else '**FAIL**'} | {c['detail']} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "node_run.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "node_run.md").write_text(markdown_report(report))
    print(f"wrote {out / 'node_run.json'} and {out / 'node_run.md'}", flush=True)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=33.0, help="host table size")
    parser.add_argument("--out", required=True, help="folder for node_run.json and node_run.md")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per lookup")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each timed loop")
    parser.add_argument("--depth", type=int, default=4, help="lookups in flight per client")
    parser.add_argument("--pool", type=int, default=64, help="ID batches pre-drawn per GPU")
    parser.add_argument("--slots", type=int, default=2, help="slots of each TP-1 client")
    parser.add_argument("--tp", type=int, nargs="*", default=[2, 4], help="TP group sizes")
    parser.add_argument("--max-gpus", type=int, default=None, help="use at most this many GPUs")
    parser.add_argument("--machine-kind", default="", help="machine label for the report")
    parser.add_argument("--cuda-dispatch", choices=("inline", "worker"), default=None,
                        help="daemon cuda_dispatch (default: the daemon's)")
    parser.add_argument("--daemon-args", default="",
                        help="more `engramd serve` flags, one string (e.g. to switch off daemon "
                             "features the in-process gather does not have)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the table file goes")
    parser.add_argument("--mode", choices=("auto", "served", "mapped"), default="auto",
                        help="the clients' mode (auto: the daemon picks, mapped on a GPU)")
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: smoke test of the orchestration without GPUs")
    parser.add_argument("--clients", type=int, default=2, help="--backend cpu: client processes")
    args = parser.parse_args(argv)
    for name in ("tokens", "depth", "pool", "slots", "clients"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.seconds <= 0 or args.table_gib <= 0:
        parser.error("--seconds and --table-gib must be > 0")
    if any(tp < 1 or tp > 24 for tp in args.tp):
        parser.error(f"--tp sizes must be in 1..24, got {args.tp}")
    if args.pool < 4:
        parser.error("--pool must be >= 4 (the timed loops warm up on the first batches)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    checks = Checks()
    running: list[ClientProcess] = []
    daemon: list[subprocess.Popen] = []
    work = Path(tempfile.mkdtemp(prefix="engramd-node-"))
    shm = Path(tempfile.mkdtemp(prefix="engramd-node-", dir=args.shm_dir))
    failed = True
    try:
        gpus = (visible_gpus(args.max_gpus) if args.backend == "cuda"
                else [Gpu(i, "cpu", "cpu") for i in range(args.clients)])
        result = run_node(args, work, shm, gpus, running, daemon, checks)
        failed = False
    except NodeRunError as exc:
        print(f"node_run: a step could not run: {exc}", file=sys.stderr)
        return 2
    finally:
        cleanup(running, daemon, work, shm, failed)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "shm_dir")}
    settings["command"] = portable_command(argv)
    report = {"meta": machine_info(gpus, args), "settings": settings, **result,
              "checks": checks.items}
    write_report(Path(args.out), report)
    bad = checks.failed()
    if bad:
        print(f"node_run: {len(bad)} check(s) failed:\n" +
              "\n".join(f"  {c['name']}: {c['detail']}" for c in bad), file=sys.stderr)
        return 1
    print(markdown_report(report).split("## Checks")[0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
