"""Soak: client processes against one daemon for a long time, every row verified.

    python benchmarks/soak.py [--seconds 600] [--clients 8] [--vocab 100000 | --tables DIR]
                              [--sample-s 5] [--report benchmarks/results/soak.md]

Starts `engramd serve --backend cpu` on a synthetic checkpoint (V4.1 shape, buckets of about
`--vocab` rows; or an existing checkpoint with `--tables`) and runs `--clients` client processes
until `--seconds` have passed. Each client loops: register with a random TP rank / size, slot
count and token budget; run a random number of lookups (up to `slots` in flight, random T,
int32 or int64 IDs including DEAD, negative and past-the-table IDs); verify every returned row
against an independent reference; now and then ask health and stats; release; reconnect with a
fresh connection and registration.

The reference decodes rows straight from the checkpoint's safetensors bytes (header parsed here,
tensors memory-mapped), FP8 and UE8M0 decoded in float64 by tests/reference.py; it shares no
code with engramd's reader or kernels. A row is wrong when any of its values differs.

Every `--sample-s` seconds the daemon's open file descriptors and memory (/proc/<pid>/status:
VmRSS, RssAnon, RssShmem) are sampled. The run passes when no row was wrong, no client saw an
unexpected error, the daemon stopped cleanly with no slab left, its descriptor count came back to
where it started, and its anonymous memory (the heap; table and slab pages are shared memory)
stayed flat. Exit status 0 when it passes, 1 otherwise.

`run(SoakConfig(...))` is the same thing as a function (tests/reliability/test_soak_short.py).
What this is not: a throughput benchmark (benchmarks/cpu_lookup.py measures latency and rate).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TESTS))
from reference import ReferenceTables, decode_e4m3, random_ids  # noqa: E402

# The daemon's fd count may differ by this much from its start after every client has gone
# (ZeroMQ's own sockets come and go); a leak of one fd per registration shows far above it.
FD_SLACK = 4
# Heap growth allowed over the run, from the first sample under full load to the end: the
# allocator's high-water mark settles in the first minute; a leak per lookup grows without end.
RSS_ANON_SLACK_KIB = 32 * 1024
RSS_ANON_SLACK_FRACTION = 0.10
WORKER_GRACE_S = 120.0  # a worker finishes its lookups in flight after the deadline


@dataclass
class SoakConfig:
    seconds: float = 600.0
    clients: int = 8
    tables: str | None = None  # checkpoint folder; None: write a synthetic one of `vocab`
    vocab: int = 100_000
    sample_s: float = 5.0
    gather_workers: int = 2
    heartbeat_s: float = 1.0
    seed: int = 0
    workdir: str | None = None  # where the checkpoint, socket and logs go (default: a temp folder)


# -- the independent reference ----------------------------------------------------------------


class _CheckpointRows:
    """One layer's rows decoded to float64 on demand, from memory-mapped safetensors bytes."""

    def __init__(self, weight: np.ndarray, scale: np.ndarray):
        self.weight, self.scale = weight, scale
        self.shape = (weight.shape[0], weight.shape[1])
        self.block = weight.shape[1] // scale.shape[1]

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        factors = np.exp2(self.scale[rows].astype(np.float64) - 127.0)
        return decode_e4m3(self.weight[rows]) * np.repeat(factors, self.block, axis=1)


def _tensor_map(path: Path, name: str) -> np.ndarray:
    """A read-only uint8 [rows, width] map of one tensor of a safetensors file."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[name]
    begin, end = entry["data_offsets"]
    rows, width = entry["shape"]
    assert end - begin == rows * width, f"{path}: {name} is not one byte per element"
    return np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len + begin,
                     shape=(rows, width))


class LazyReference(ReferenceTables):
    """tests/reference.py's expected rows, without dequantizing whole tables up front."""

    def _layer_values(self, checkpoint_dir: Path, index: dict[str, str], layer_id: int):
        names = [f"layers.{layer_id}.engram.embed.{part}" for part in ("weight", "scale")]
        weight, scale = (_tensor_map(checkpoint_dir / index[n], n) for n in names)
        return _CheckpointRows(weight, scale)


# -- one client process -----------------------------------------------------------------------


def draw_registration(rng: np.random.Generator) -> dict[str, int]:
    """A registration's random shape: TP rank and size, token budget, slots."""
    shards = int(rng.choice([1, 1, 2, 3, 4, 8]))
    return {"tp_rank": int(rng.integers(0, shards)), "tp_size": shards,
            "max_tokens": int(rng.choice([16, 64, 256])), "slots": int(rng.integers(1, 5))}


def draw_ids(rng: np.random.Generator, max_tokens: int, ref: ReferenceTables) -> np.ndarray:
    """One lookup's IDs: a random T up to `max_tokens` (small ones most often), int64 or int32,
    with DEAD, negative and past-the-table IDs among them (tests/reference.py random_ids)."""
    tokens = int(min(max_tokens, rng.choice([1, 4, 16, 64, 256])))
    tokens = int(rng.integers(1, tokens + 1))
    ids = random_ids(rng, tokens, ref.rows, ref.heads)
    if rng.random() < 0.5:
        ids = np.where(np.abs(ids) < 2**31 - 1, ids, ref.rows[0] + 11).astype(np.int32)
    return ids


def same_rows(rows: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """[n_layers, T, heads]: whether each row equals the expected one in every value (a NaN
    never does)."""
    return (rows == expected).all(axis=-1)


def _session(client, ref: LazyReference, rng: np.random.Generator, rank: int, shards: int,
             deadline: float, counts: Counter, wrong: list[str]) -> None:
    """One registration's worth of lookups, `slots` in flight at a time, each verified."""
    import torch

    lookups = int(rng.integers(5, 200))
    while lookups > 0 and time.time() < deadline:
        wave = []
        for _ in range(min(client.slots, lookups)):
            ids = draw_ids(rng, client.max_tokens, ref)
            wave.append((ids, client.lookup(torch.from_numpy(ids))))
        for ids, future in wave:
            rows = future.result().double().numpy()
            bad = ~same_rows(rows, ref.expected(ids, rank, shards))
            counts["lookups"] += 1
            counts["rows_verified"] += bad.size
            counts["wrong_rows"] += int(bad.sum())
            if bad.any() and len(wrong) < 5:
                where = np.argwhere(bad)[:3].tolist()
                wrong.append(f"tp {rank}/{shards}, T={len(ids)}: wrong rows at [layer, t, head] {where}")
        lookups -= len(wave)
    if rng.random() < 0.3:
        assert client.health()["ready"]
        client.stats()
        counts["stats_calls"] += 1


def worker(socket: str, tables: str, seed: int, seconds: float) -> dict[str, Any]:
    """A client process's whole life: sessions for `seconds` once its imports are done."""
    import torch

    from engramd.client import EngramClient, EngramError

    torch.set_num_threads(1)
    ref = LazyReference(Path(tables))
    deadline = time.time() + seconds  # the clock starts after start-up, which many processes slow
    rng = np.random.default_rng(seed)
    counts: Counter = Counter()
    wrong: list[str] = []
    errors: list[str] = []
    while time.time() < deadline and len(errors) < 5:
        shape = draw_registration(rng)
        try:
            with EngramClient(socket, **shape, timeout=120, name=f"soak-{seed}") as client:
                counts["registrations"] += 1
                _session(client, ref, rng, shape["tp_rank"], shape["tp_size"], deadline, counts, wrong)
        except EngramError as exc:
            errors.append(f"client {seed}: {type(exc).__name__}: {exc}")
    return {"seed": seed, **counts, "wrong": wrong, "errors": errors}


# -- the daemon, sampled ----------------------------------------------------------------------


def sample_process(pid: int) -> dict[str, int]:
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            status[key] = int(value.split()[0])  # kB
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "rss_kib": status["VmRSS"],
            "rss_anon_kib": status["RssAnon"], "rss_shmem_kib": status["RssShmem"]}


def _prepare_tables(cfg: SoakConfig, work: Path) -> Path:
    if cfg.tables:
        return Path(cfg.tables).resolve()
    from common.tables import v41_geometry

    from engramd.server.synthetic import write_synthetic_checkpoint

    geometry = v41_geometry(cfg.vocab, source="soak")
    print(f"writing a {geometry.total_bytes / 1e9:.2f} GB synthetic checkpoint", file=sys.stderr)
    return write_synthetic_checkpoint(geometry, work / "ckpt", seed=cfg.seed)


def _start_workers(cfg: SoakConfig, socket: Path, tables: Path, work: Path) -> list[subprocess.Popen]:
    procs = []
    for i in range(cfg.clients):
        args = json.dumps({"socket": str(socket), "tables": str(tables), "seed": cfg.seed * 1000 + i,
                           "seconds": cfg.seconds})
        with open(work / f"client{i}.log", "ab") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", args],
                                          stdout=subprocess.PIPE, stderr=log))
    return procs


def _collect(procs: list[subprocess.Popen], work: Path) -> list[dict[str, Any]]:
    results = []
    for i, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=WORKER_GRACE_S)
        if proc.returncode != 0:
            log = (work / f"client{i}.log").read_text(errors="replace")[-2000:]
            results.append({"seed": i, "errors": [f"client process {i} exited {proc.returncode}: {log}"]})
        else:
            results.append(json.loads(out))
    return results


def _monitor(pid: int, procs: list[subprocess.Popen], socket: Path, cfg: SoakConfig,
             started: float) -> list[dict[str, Any]]:
    from engramd.client.shared.connection import probe

    samples = []
    while any(p.poll() is None for p in procs):
        stats = probe(socket, "stats", 30.0).body.encode()
        samples.append({"t": round(time.monotonic() - started, 1), **sample_process(pid),
                        "clients": len(stats["clients"]), "lookups": stats["lookups"]})
        deadline = time.monotonic() + cfg.sample_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    return samples


def run(cfg: SoakConfig) -> dict[str, Any]:
    """Run the soak; returns the summary (see `judge` for what passes), its folder kept only
    after a failing run (run_kept_on_failure)."""
    return run_kept_on_failure("soak", cfg.workdir, lambda work: _run_in(cfg, work))


def run_kept_on_failure(kind: str, workdir: str | None,
                        body: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """`body(work folder)`'s summary. A work folder made here (checkpoints, socket, logs) is
    removed after a passing run and kept, with its path printed, after a failing one."""
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"engramd-{kind}-"))
    work.mkdir(parents=True, exist_ok=True)
    summary = body(work)
    if workdir is None and summary["ok"]:
        shutil.rmtree(work, ignore_errors=True)
    elif not summary["ok"]:
        print(f"{kind} failed; logs and checkpoints kept in {work}", file=sys.stderr)
    return summary


def _run_in(cfg: SoakConfig, work: Path) -> dict[str, Any]:
    from common.daemon import shm_scratch, start_daemon

    from engramd.client.shared.connection import probe

    shm = shm_scratch("engramd-soak-")
    proc = None
    try:
        tables = _prepare_tables(cfg, work)
        proc, socket = start_daemon(work, ["--tables", str(tables), "--shm-dir", str(shm),
                                           "--instance", "soak", "--backend", "cpu",
                                           "--workers", str(cfg.gather_workers),
                                           "--heartbeat-interval", str(cfg.heartbeat_s)])
        before = sample_process(proc.pid)
        started = time.monotonic()
        procs = _start_workers(cfg, socket, tables, work)
        samples = _monitor(proc.pid, procs, socket, cfg, started)
        duration = time.monotonic() - started
        results = _collect(procs, work)
        time.sleep(2 * cfg.heartbeat_s)  # anything a client left is reaped by now
        after = sample_process(proc.pid)
        stats = probe(socket, "stats", 30.0).body.encode()
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(60)
        proc = None
        leftover = sorted(p.name for p in shm.rglob("*") if p.is_file() and p.suffix not in (".tbl", ".lock"))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(shm, ignore_errors=True)
    summary = judge(cfg, results, samples, before, after, stats, exit_code, leftover, duration)
    summary["table_rows"] = json.loads((tables / "config.json").read_text())["engram_num_embeddings"]
    return summary


def judge(cfg: SoakConfig, results: list[dict[str, Any]], samples: list[dict[str, Any]],
          before: dict[str, int], after: dict[str, int], stats: dict[str, Any], exit_code: int,
          leftover: list[str], duration: float) -> dict[str, Any]:
    totals: Counter = Counter()
    for r in results:
        totals.update({k: v for k, v in r.items() if isinstance(v, int) and k != "seed"})
    loaded = [s for s in samples if s["clients"] > 0] or samples or [after]
    warm = loaded[min(len(loaded) - 1, max(1, len(loaded) // 10))]  # about 10% into the run
    anon_limit = warm["rss_anon_kib"] * (1 + RSS_ANON_SLACK_FRACTION) + RSS_ANON_SLACK_KIB
    summary = {
        "config": asdict(cfg), "duration_s": round(duration, 1),
        "lookups": totals["lookups"], "rows_verified": totals["rows_verified"],
        "wrong_rows": totals["wrong_rows"], "registrations": totals["registrations"],
        "daemon_lookups": stats.get("lookups"), "daemon_registrations": stats.get("registrations"),
        "daemon_errors": stats.get("errors", {}), "clients_left": len(stats.get("clients", [])),
        "wrong": [w for r in results for w in r.get("wrong", [])],
        "errors": [e for r in results for e in r.get("errors", [])],
        "exit_code": exit_code, "leftover_slabs": leftover,
        "fds": {"start": before["fds"], "end": after["fds"],
                "max": max(s["fds"] for s in samples + [after])},
        "rss_anon_kib": {"start": before["rss_anon_kib"], "warm": warm["rss_anon_kib"],
                         "end": after["rss_anon_kib"],
                         "max": max(s["rss_anon_kib"] for s in samples + [after])},
        "rss_kib": {"start": before["rss_kib"], "end": after["rss_kib"],
                    "max": max(s["rss_kib"] for s in samples + [after])},
        "samples": samples, "machine": machine(),
    }
    summary["checks"] = {
        "no wrong rows": summary["wrong_rows"] == 0 and summary["lookups"] > 0,
        "no client errors": not summary["errors"],
        "daemon counted every lookup": stats.get("lookups") == totals["lookups"],
        "clean stop, no slab left": exit_code == 0 and not leftover and summary["clients_left"] == 0,
        "fds back to start": after["fds"] <= before["fds"] + FD_SLACK,
        "heap flat": max(s["rss_anon_kib"] for s in loaded[loaded.index(warm):] + [after]) <= anon_limit,
    }
    summary["ok"] = all(summary["checks"].values())
    return summary


def machine() -> str:
    import torch
    from common.report import cpu_model

    return (f"{platform.machine()} {cpu_model() or ''}, {os.cpu_count()} CPUs, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


# -- report -----------------------------------------------------------------------------------


def report(summary: dict[str, Any], command: str) -> str:
    fds, anon, rss = summary["fds"], summary["rss_anon_kib"], summary["rss_kib"]
    mib = 1 / 1024
    lines = [
        f"# Soak: {summary['config']['clients']} client processes, CPU backend "
        f"({time.strftime('%Y-%m-%d')})", "",
        f"Machine: {summary['machine']}.", f"Command: `{command}`",
        f"Tables: {len(summary['table_rows'])} layers x {summary['table_rows']} rows x 264 B = "
        f"{sum(summary['table_rows']) * 264 / 1e9:.2f} GB "
        f"({'synthetic, --vocab ' + str(summary['config']['vocab']) if not summary['config']['tables'] else 'given checkpoint'}).",
        "",
        f"Result: **{'pass' if summary['ok'] else 'FAIL'}** "
        f"({', '.join(k for k, v in summary['checks'].items() if v) or 'no check passed'}"
        f"{'; failed: ' + ', '.join(k for k, v in summary['checks'].items() if not v) if not summary['ok'] else ''}).",
        "", "| figure | value |", "|---|---:|",
        f"| duration | {summary['duration_s']:.0f} s |",
        f"| lookups (verified) | {summary['lookups']:,} |",
        f"| rows verified | {summary['rows_verified']:,} |",
        f"| wrong rows | {summary['wrong_rows']} |",
        f"| registrations (each released, then a new connection) | {summary['registrations']:,} |",
        f"| client errors | {len(summary['errors'])} |",
        f"| daemon error replies | {sum(summary['daemon_errors'].values())} |",
        f"| daemon exit status after SIGTERM / slabs left | {summary['exit_code']} / {len(summary['leftover_slabs'])} |",
        f"| daemon fds: start / end / max | {fds['start']} / {fds['end']} / {fds['max']} |",
        f"| daemon heap (RssAnon): start / warm / end / max | {anon['start'] * mib:.0f} / "
        f"{anon['warm'] * mib:.0f} / {anon['end'] * mib:.0f} / {anon['max'] * mib:.0f} MiB |",
        f"| daemon RSS (incl. shared tables and slabs): start / end / max | {rss['start'] * mib:.0f} / "
        f"{rss['end'] * mib:.0f} / {rss['max'] * mib:.0f} MiB |", "",
        "Start is before any client connected, end after every client had released and the "
        "daemon had idled two heartbeats; warm is the first sample about 10% into the run, from "
        "which the heap must not grow by more than "
        f"{RSS_ANON_SLACK_FRACTION:.0%} + {RSS_ANON_SLACK_KIB // 1024} MiB.", "",
        "Samples (t s: fds, RssAnon MiB, RSS MiB, clients, daemon lookups):", "",
        "```",
    ]
    step = max(1, len(summary["samples"]) // 40)
    lines += [f"{s['t']:7.1f}: {s['fds']:4d} {s['rss_anon_kib'] * mib:7.1f} {s['rss_kib'] * mib:8.1f} "
              f"{s['clients']:3d} {s['lookups']:9d}" for s in summary["samples"][::step]]
    lines += ["```", ""]
    lines += problems_section(summary["wrong"] + summary["errors"])
    return "\n".join(lines)


def problems_section(problems: list[str]) -> list[str]:
    """A report's list of what went wrong (nothing when nothing did)."""
    return ["Problems:", "", *[f"- {p}" for p in problems], ""] if problems else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tables", help="checkpoint folder (default: write a synthetic one)")
    parser.add_argument("--vocab", type=int, default=100_000, help="synthetic buckets' base size")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="write the result as markdown here")
    parser.add_argument("--json", help="write the full summary (with every sample) here")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return 0
    cfg = SoakConfig(seconds=args.seconds, clients=args.clients, tables=args.tables,
                     vocab=args.vocab, sample_s=args.sample_s, seed=args.seed)
    summary = run(cfg)
    command = "python benchmarks/soak.py " + " ".join(a for a in sys.argv[1:])
    return publish(summary, report(summary, command), args.report, args.json)


def publish(summary: dict[str, Any], text: str, report_path: str | None, json_path: str | None) -> int:
    """Print the report, write it and the summary where asked; the exit status of the run."""
    print(text)
    if report_path:
        Path(report_path).write_text(text)
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
